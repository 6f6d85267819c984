"""The worker side: one DEALER socket per shard; every call sends at once and returns a Future.

There is no background I/O thread (each thread hop costs latency on a busy machine): requests are sent from the
calling thread, and replies are received by whichever thread waits on a future (`result()`/`exception()`), which
dispatches every reply that arrives to its own future. Progress therefore happens inside client calls, as in MPI.
Thread-safe: socket access is serialised by a lock that a waiting thread releases between polls.

    client = connect(addresses, worker=0, params=model.state_dict())    # registers with every shard
    client.init(model.state_dict()).result()      # one owner; the others' first pull waits for it
    for step in ...:
        params = client.pull().result().params     # fan-out to all shards in parallel, reassembled by name
        ...
        client.push(grads)                         # non-blocking: Future; several may be in flight per shard

Authentication: each socket proves the user "worker:<w>" at the ZeroMQ handshake with a credential derived from
the job's secret (`secret=`, else that of shards this process started at these addresses, else PSLAB_JOB_SECRET /
PSLAB_JOB_SECRET_FILE): PLAIN, or CURVE with `curve_keys_dir`;
a refused handshake is an AuthenticationError at connect. The register request carries a random token of this
client, so that it (and only it) may re-register on a new connection while the old one is still known.

The client computes the same `Partition` as every other worker (pure function of names, shapes, shard count),
splits gradients into per-shard flat slices (zero-copy views: do not modify the tensors until the push's future is
done), and remembers, per shard, its clock and the version its last pull returned (sent with the next push).

A refused push leaves both sides where they were. The clock for a shard moves when a push is sent to it; a push
that is never sent (a lost shard, a send error) moves nothing, and one the shard refuses before changing anything
(non-finite, wrong shape or key, wrong clock, not a member, not registered: the error reply says `refused_push`)
moves it back; a push larger than a shard's max_message_bytes is refused here, before sending (ZeroMQ would drop
the connection), so the same client pulls and pushes on at its clock without `resync()`. With several shards a
non-finite gradient is refused here, before any shard sees it (the shards say at register whether they reject
NaN/Inf): otherwise the other shards would apply their slices of a push one shard refused. A push's future fails on
a refusal once every shard has answered (no refusal of it is then still unread), at once when its fate is unknown.
Only a push whose fate is unknown (timed out, its shard dropped, an internal error) needs `resync()`.

Shard restarts. Each socket's monitor is read together with the replies (before them, so the order holds): a
"disconnected" event after a successful handshake means the shard died or is being restarted; every request in
flight to it fails at once with ShardLostError (it may never be answered; it is not resent, since the shard may
have applied it), and so does every later request to it until `resync()`. The DEALER reconnects by itself to the
same address; `resync()` queues a register that the new incarnation answers, re-negotiates shared memory and adopts
the restored clocks and versions. A register reply naming another `incarnation` than before is a restart: it is
appended to `restarts` ({shard, restored_version, lost_updates, restored_from}; lost_updates = the highest version
this client saw from that shard minus the restored one: a lower bound, the shard's parent knows it exactly). A push
on a connection the shard does not know (a request queued before the reconnect) is answered NotRegisteredError.
A push ack carrying `checkpoint_error` (the shard's periodic checkpoint failed) warns once per shard
(CheckpointWarning) and is kept in `checkpoint_errors[shard]` until an ack without it.
"""

from __future__ import annotations

import itertools
import math
import secrets
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch
import zmq

from pslab.collectives import flight
from pslab.collectives.errors import WireError
from pslab.collectives.traffic import TrafficCounter
from pslab.collectives.wire import decode, encode, frame_payload

from .admission import ADMIN, secret_for, worker_user
from .errors import (CheckpointWarning, ConfigError, NonFiniteGradientError, ProtocolError, PSError,
                     RequestTimeoutError, ShardLostError, error_from_reply)
from .futures import Fanout, reply_metas
from .handshake import HANDSHAKE_FAILED, SEND_TIMEOUT_MS, open_sockets, read_events, refused, stop_monitors
from .partition import Partition, make_partition
from . import compression, shm_arena, shm_path
from .protocol import CLIENT_LIMITS, EVENTS, NOBLOCK, POLLIN, POLLOUT
from .shm_arena import PullArena, PushArena
from .shm_path import ClientLink
from .lane import ClientLane, ClientLanes

LANE_OPS = frozenset({"push", "pull"})          # the hot requests; the rest always go through ZeroMQ


@dataclass
class PullResult:
    params: dict[str, np.ndarray]      # full tensors by name, in their original shapes
    versions: list[int]                # per shard
    clocks: list[int]                  # per shard (the worker's clock there after the read)


@dataclass
class _Pending:
    future: Fanout                     # the call's one future; this request fills its slot `shard`
    deadline: float
    shard: int
    keep: Any = None                   # tensors that must outlive a zero-copy send
    lane: ClientLane | None = None     # the shard's lane (ps.lane) it was sent through, or None: ZeroMQ
    push: bool = False                 # a push: it moved this client's clock for the shard when it was sent


def _np(t: Any) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        return t.detach().cpu().numpy()
    return np.asarray(t)


class _ShardPeer:
    """What a PS request is recorded against in the flight recorder: a shard, not a process group."""

    backend, ranks, rank = "ps", (), -1

    def __init__(self, shard: int) -> None:
        self.shard = shard


class PSClient:
    """A worker's connection to all shards (see the module docstring for how progress is made)."""

    def __init__(self, addresses: Sequence[str], worker: int, params: Mapping[str, Any], *,
                 timeout: float = 60.0, context: zmq.Context | None = None, shm: bool | None = None,
                 curve_keys_dir: str | None = None, secret: str | None = None, user: str | None = None,
                 lane: bool | None = None, link: tuple[float, float] | None = None,
                 compress: str | None = None, error_feedback: bool = True) -> None:
        if not addresses:
            raise ConfigError("connect needs at least one shard address")
        from .link_delay import EmulatedLink       # link = (latency s, bandwidth B/s): an emulated network
        self._link_out = [EmulatedLink(*link) for _ in addresses] if link is not None else None
        self._link_in = [EmulatedLink(*link) for _ in addresses] if link is not None else None
        self.addresses = list(addresses)
        self._peers = [_ShardPeer(i) for i in range(len(self.addresses))]   # what the flight recorder names
        self.worker = int(worker)
        self.user = user if user is not None else worker_user(self.worker)
        secret = secret if secret is not None else secret_for(list(addresses))
        if secret is None:
            raise ConfigError("no job secret to authenticate with: pass secret= (ServerGroup.secret) or set "
                              "PSLAB_JOB_SECRET / PSLAB_JOB_SECRET_FILE")
        self._token = secrets.token_hex(16)       # proves "the same client" when re-registering elsewhere
        form = compression.parse(compress)        # (ps.compression: validated before anything is opened)
        self._compressor = compression.PushCompressor(form, error_feedback) if form is not None else None
        self._encoded: dict[int, dict[str, np.ndarray]] | None = None   # residuals of the compressed push in flight
        self.timeout = float(timeout)
        self.partition: Partition = make_partition(params, len(self.addresses))
        self.shapes = {n: tuple(_shape(v)) for n, v in params.items()}
        self.dtypes = {n: _np_dtype(v) for n, v in params.items()}   # None where numpy has no such dtype
        self._scratch: dict[str, np.ndarray] = {}                   # reassembly buffers of copy=False reads
        self._split_memo: dict[int, tuple[dict[str, Any], dict[str, np.ndarray]]] = {}   # _split's last answer
        self._keys_of = [self.partition.keys_of(i) for i in range(len(self.addresses))]
        self._slices_of = {n: self.partition.slices_of(n) for n in self.partition.names}
        self.clocks = [0] * len(self.addresses)
        self.versions = [0] * len(self.addresses)
        self._rejects_nonfinite = True                        # (the shards say at register)
        self._max_bytes: list[int | None] = [None] * len(self.addresses)   # each shard's max_message_bytes
        n = len(self.addresses)
        self.incarnations: list[str | None] = [None] * n     # the shard process each register reply came from
        self.restarts: list[dict[str, Any]] = []              # restarts seen at resync (module docstring)
        self.disconnects = [0] * n
        self.checkpoint_errors: list[str | None] = [None] * n
        self._warned = [False] * n
        self._seen = [0] * n                                  # highest shard version any reply named
        self._handshaken = [False] * n                        # a handshake succeeded once (so a drop is a loss)
        self._lost: set[int] = set()                          # dropped since the last register
        self._refused: dict[int, PSError] = {}                # shard -> its refused handshake (until one succeeds)
        self._seq = itertools.count(1)
        self._ctx = context or zmq.Context.instance()
        self._pending: dict[tuple[int, int], _Pending] = {}
        self._lock = threading.RLock()
        self._closed = False
        self.wire = TrafficCounter()   # tensor payload bytes per shard: "push"/"init" sent, "pull" received (below)
        self.pushes_by_path = {"shm": 0, "frames": 0}   # per shard request: the payload's path
        self._socks, self._monitors = open_sockets(self._ctx, self.addresses, self.user, secret, curve_keys_dir)
        self._poller = zmq.Poller()
        for sock in self._socks + self._monitors:
            self._poller.register(sock, zmq.POLLIN)
        self._monitor_of = {m: i for i, m in enumerate(self._monitors)}
        self._arena, self._into = self._arenas([shm_path.wanted(a) if shm is None else bool(shm)
                                                for a in self.addresses])
        self._lanes = ClientLanes(self.worker, n, lane is not False and any(link.enabled for link in self._links))
        if self._lanes.bell is not None:                        # (ps.lane: headers beside the shm payloads)
            self._poller.register(self._lanes.bell.fd, zmq.POLLIN)
        try:
            self.registration = self._register()
        except BaseException:
            self.close()
            raise
        for i, (r, _) in enumerate(self.registration):
            mine = {s.key: s.numel for s in self._keys_of[i]}
            theirs = {k: int(np.prod(v)) for k, v in r.get("keys", {}).items()}
            if r.get("initialized") and theirs != mine:
                self.close()
                raise ConfigError(f"shard {i} ({self.addresses[i]}) holds parameters {sorted(theirs)[:6]}, but this "
                                  f"model's partition puts {sorted(mine)[:6]} there: same model and shard order "
                                  "on every worker, and the servers listed in shard order?")

    def _arenas(self, enabled: list[bool]) -> tuple[PushArena | None, PullArena | None]:
        """The shard links and the client's two arenas (ps.shm_arena): one push segment for all links, laid out
        tensor by tensor, and, if some tensor is split across shards, one pull segment the shards write its pieces
        into. Both are made (and renewed) at register."""
        n = len(self.addresses)
        on = [i for i in range(n) if enabled[i]]
        arena = into = None
        push_at: dict[str, tuple[int, int]] = {}
        into_at: dict[str, tuple[int, int]] = {}
        self._tensor_at: dict[str, int] = {}           # tensor name -> its offset in the push / pull arena
        self._wholes: dict[str, tuple[np.ndarray, int]] = {}
        self._wholes_for = ""
        self._into_at: dict[str, int] = {}
        if on:
            push_at, self._tensor_at, total = shm_arena.places(self.partition.slices, n)
            arena = PushArena(secrets.token_hex(6), self.worker, on, total)
            split = {m for m, sl in self._slices_of.items() if len(sl) > 1 and self.dtypes[m] is not None}
            if split:
                into_at, self._into_at, total = shm_arena.places(self.partition.slices, n, split)
                into = PullArena(secrets.token_hex(6), self.worker, on, total)
        self._links = [ClientLink(self.worker, i, enabled[i], arena=arena,
                                  places={s.key: push_at[s.key] for s in self._keys_of[i]} if arena else None,
                                  into=into, into_places={s.key: into_at[s.key] for s in self._keys_of[i]
                                                          if s.key in into_at},
                                  into_dtypes={s.key: self.dtypes[s.name] for s in self._keys_of[i]
                                               if s.key in into_at})
                       for i in range(n)]
        return arena, into

    def _renew_arenas(self) -> None:
        """Fresh segments (a new generation) for a (re-)register: nothing of a previous incarnation maps them."""
        if self._arena is not None:
            self._arena.close()
        if self._into is not None:
            self._into.close()
            try:
                self._into.reserve_all()         # the shards map it at register: it must not grow afterwards
            except OSError:
                self._into.close()               # split tensors come back through the reply segments

    # ------------------------------------------------------------------ requests
    def _register(self) -> list[tuple[dict[str, Any], Any]]:
        """Register with every shard (offering the shared-memory path where wanted); adopt clocks and versions."""
        self._renew_arenas()
        with self._lock:                     # (other threads may be sending or receiving through the lanes)
            offers = self._lanes.offers([link.enabled for link in self._links])
        per = [(dict({"worker": self.worker, "token": self._token}, **link.probe(), **offers[i]), None)
               for i, link in enumerate(self._links)]
        regs = self._all("register", per_shard=per).result(self.timeout + 1)
        with self._lock:
            self._lane_replies()             # answers the shards wrote into the old lanes before the register
            for i, (r, _) in enumerate(regs):
                self._links[i].accept(r)
                self._lanes.accept(i, r if self._links[i].push_ok else {}, self._links[i].peer)
        self._rejects_nonfinite = any(r.get("nonfinite", "reject") == "reject" for r, _ in regs)
        self._max_bytes = [m if isinstance(m := r.get("max_message_bytes"), int) else None for r, _ in regs]
        for i, (r, _) in enumerate(regs):
            self.clocks[i], self.versions[i] = int(r["clock"]), int(r["version"])
            inc = r.get("incarnation")
            if self.incarnations[i] is not None and inc != self.incarnations[i]:
                self.restarts.append({"shard": i, "restored_version": int(r["version"]),
                                      "lost_updates": max(0, self._seen[i] - int(r["version"])),
                                      "restored_from": r.get("restored_from"), "clock": int(r["clock"])})
            self.incarnations[i] = inc if isinstance(inc, str) else None
            self._seen[i] = int(r["version"])
            self._lost.discard(i)
        return regs

    @property
    def last_restart(self) -> dict[str, Any] | None:
        """The last shard restart this client resynced after ({shard, restored_version, lost_updates, ...})."""
        return self.restarts[-1] if self.restarts else None

    @property
    def lost(self) -> list[int]:
        """Shards whose connection dropped since this client last registered (resync() to use them again)."""
        return sorted(self._lost)

    @property
    def shm(self) -> list[bool]:
        """Per shard: whether pushes and pulls travel through shared memory (negotiated at register)."""
        return [link.push_ok and link.pull_ok for link in self._links]

    def _request(self, fut: Fanout, shard: int, op: str, meta: dict[str, Any], tensors: Any = None,
                 timeout: float | None = None) -> None:
        """Send one request to `shard`; its reply (or error) goes to `fut`'s slot `shard`."""
        if shard in self._refused:           # the handshake failed, maybe before anything was sent: say so at once
            fut.fail(self._refused[shard])
            return
        if shard in self._lost and op != "register" and self.user != ADMIN:
            fut.fail(self._lost_error(shard, op))
            return
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._lock:
            seq = next(self._seq)
            link = self._links[shard]
            copy = meta.pop("_copy", True)                # pull(copy=False): views of the shm reply
            push = op == "push"
            if push:
                meta = dict(meta, clock=self.clocks[shard])
            payload, path = 0, "frames"                       # tensor bytes this request carries, by any path
            try:
                if op == "push" and tensors and "compress" not in meta:
                    entries = link.take_push(seq, tensors)    # one memcpy instead of frames, if the path is free
                    if entries is not None:
                        payload = sum(int(t.nbytes) for t in tensors.values())    # through the shared segment
                        path = "shm"
                        meta, tensors = dict(meta, shm=entries), None
                if (op == "pull" or meta.get("pull") is True) and link.take_pull(seq, copy):
                    meta = dict(meta, shm_reply=True)
                frames = encode(op, tensors, seq=seq, src=self.worker, meta=meta)
                payload += frame_payload(frames)              # tensor frames (ZeroMQ, or a lane's slot)
            except BaseException:
                link.release(seq)                             # never sent: the shm slots stay free
                raise
            if self._link_out is not None:                  # delivered when the emulated link would
                self._link_out[shard].carry(payload)
            lane = self._lanes.free(shard) if op in LANE_OPS and len(frames) == 1 else None
            if lane is not None and not any(p.shard == shard and p.lane is None for p in self._pending.values()):
                self._pending[(shard, seq)] = _Pending(fut, deadline, shard, tensors, lane, push)
                if lane.send(seq, frames[0]):     # (never behind a ZeroMQ request: the order holds)
                    self.clocks[shard] += push
                    self._sent(shard, op, payload, path)
                    return
                self._pending[(shard, seq)].lane = None
            else:
                self._pending[(shard, seq)] = _Pending(fut, deadline, shard, tensors, push=push)
            until = min(deadline, time.monotonic() + SEND_TIMEOUT_MS / 1000)
            while True:
                if not self._await_pipe(shard, seq, until):
                    return                                    # refused or lost meanwhile: `fut` says which
                try:   # never blocking: the pipe can go between the look and the send (a handshake refused then)
                    self._socks[shard].send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
                    break
                except zmq.Again as e:
                    if time.monotonic() < until:              # look again (the monitor says why the pipe went)
                        time.sleep(0.001)
                        continue
                    error: zmq.ZMQError = e
                except zmq.ZMQError as e:
                    error = e
                self._pending.pop((shard, seq))
                link.on_timeout(seq)
                fut.fail(PSError(f"cannot send to shard {shard} ({self.addresses[shard]}): {error}"))
                return
            self.clocks[shard] += push
            self._sent(shard, op, payload, path)

    def _await_pipe(self, shard: int, seq: int, until: float) -> bool:
        """(With the lock held, before a send.) A DEALER whose connection is down (a refused handshake redialling,
        a shard restarting) has no pipe, and its send would block: wait for one while reading the monitors, so that
        a refused handshake fails this request as AuthenticationError at once instead of after the send timeout.
        False when the request was failed meanwhile; True when the socket takes messages (or `until` passed). The
        send that follows never blocks: a pipe can still go between this look and it (the handshake refused in
        that instant), and a blocking send would then wait out SNDTIMEO without reading the monitor that says why
        (seen: 1 run in ~10 of the dp-group mismatch test); so a send the socket does not take comes back here."""
        sock = self._socks[shard]
        while not sock.getsockopt(EVENTS) & POLLOUT:
            if (shard, seq) not in self._pending:
                return False
            if time.monotonic() >= until:
                return True
            self._watch()
            if (shard, seq) not in self._pending:
                return False
            sock.poll(20, POLLOUT)
        return True

    def _sent(self, shard: int, op: str, payload: int, path: str) -> None:
        """Count a request handed to the transport: its payload bytes (`wire`) and, for a push, its path. (A
        request the connection then loses stays counted: it left this process.)"""
        self.wire.add_sent(shard, op, payload)
        if op == "push":
            self.pushes_by_path[path] += 1

    def _all(self, op: str, meta: dict[str, Any] | None = None, per_shard: Any = None,
             timeout: float | None = None, finish: Any = None) -> Fanout:
        """Send to every shard in parallel; one future of finish(list of replies in shard order) (the list itself
        without `finish`), first error wins."""
        if self._closed:
            raise PSError("this client is closed; call ps.connect again")
        fut = Fanout(self._drive, len(self.addresses), finish, wait_all=op == "push")
        with self._lock:
            self._watch()                 # a shard that dropped meanwhile fails fast instead of never answering
            if self._lost and op != "register" and self.user != ADMIN:   # and nothing goes to the others either:
                fut.fail(self._lost_error(min(self._lost), op))          # no clock moves on a surviving shard
                return fut
        self._record(fut, op, meta if per_shard is None else per_shard[0][0])
        for i in range(len(self.addresses)):
            self._request(fut, i, op, dict(meta or {}) if per_shard is None else per_shard[i][0],
                          None if per_shard is None else per_shard[i][1], timeout)
        return fut

    def _record(self, fut: Fanout, op: str, meta: dict[str, Any] | None) -> None:
        """One flight-recorder entry per shard for this request, completed (or failed) with its future: a hang
        in a PS call is named by `pslab diagnose` like a collective's (collectives/flight.py)."""
        rec = flight.RECORDER
        if not rec.enabled:
            return
        if getattr(self._peers[0], "_flight_gi", (None,))[0] is not rec:    # first request (or a new recorder)
            for peer in self._peers:
                rec.name_group(peer, f"ps shard {peer.shard}")
        code = rec.op_code(f"ps.{op}_pull" if op == "push" and (meta or {}).get("pull") else f"ps.{op}")
        marks = [rec.begin(rec.group_index(p), code, 0, 0, p.shard, "") for p in self._peers]

        def done(f: Any) -> None:
            err = f.exception() if not f.cancelled() else None
            for m in marks:
                rec.end(m, err if isinstance(err, Exception) else None)
        fut.add_done_callback(done)

    def init(self, params: Mapping[str, Any]) -> Future:
        """Initialise every shard with this worker's values: only the owner (worker 0, or an admin client) may,
        and only once (a shard already holding parameters answers AlreadyInitializedError)."""
        per = [({"worker": self.worker}, self._split(params, i)) for i in range(len(self.addresses))]
        return self._all("init", per_shard=per, finish=reply_metas)

    def pull(self, timeout: float | None = None, copy: bool = True) -> Future:
        """Future[PullResult]: the current parameters at this worker's clock (may wait on the consistency gate).

        copy=False: the arrays may be read-only views (of the received frames or, on the same-host path, of the
        shard's reply segment for this client) or, for tensors split across shards, one reassembly buffer per
        tensor; this client's NEXT pull or push_pull overwrites both kinds: copy what you keep beyond that, e.g.
        straight into the model's parameters."""
        per = [({"clock": self.clocks[i], "_copy": copy}, None) for i in range(len(self.addresses))]
        return self._all("pull", per_shard=per, timeout=timeout,
                         finish=lambda replies: self._adopt_read([m for m, _ in replies], replies, copy))

    def push(self, grads: Mapping[str, Any], timeout: float | None = None) -> Future:
        """Future[list of per-shard acks {status, version, clock, staleness}]; stamps and advances the clock.
        The gradient tensors are sent zero-copy: do not modify them until the future is done. A push the shards
        refused (NonFiniteGradientError, ShapeError, ...) moved no clock: go on as before. One whose fate is
        unknown (RequestTimeoutError, ShardLostError): call `resync()` to adopt the shards' clocks again."""
        return self._pushing(lambda: self._all("push", per_shard=self._stamp(grads, {}), timeout=timeout,
                                               finish=lambda replies: self._acked(reply_metas(replies))))

    def push_pull(self, grads: Mapping[str, Any], timeout: float | None = None, copy: bool = True) -> Future:
        """Push, then read at the new clock, in one round trip per shard (the shard answers once its gate lets
        the read through): Future[(acks, PullResult)]. Equal to `push(grads)` followed by `pull(copy=copy)`."""
        return self._pushing(lambda: self._all(
            "push", per_shard=self._stamp(grads, {"pull": True, "_copy": copy}), timeout=timeout,
            finish=lambda replies: (self._acked([m for m, _ in replies]),
                                    self._adopt_read([m["read"] for m, _ in replies], replies, copy))))

    def _pushing(self, send: Any) -> Future:
        """`send()`'s future; a compressed push that fails (refused, lost, timed out, or before it went) leaves
        the residuals as they were (ps.compression)."""
        if self._compressor is not None and self._encoded is not None:
            raise PSError("a compressed push is still in flight: wait for its future before the next push (the "
                          "residual of error feedback moves when the shards acknowledge it)")
        try:
            fut = send()
        except BaseException:
            self._encoded = None
            raise
        if self._compressor is not None:
            fut.add_done_callback(lambda f: setattr(self, "_encoded", None)
                                  if f.cancelled() or f.exception() is not None else None)
        return fut

    def _acked(self, acks: list[Any]) -> list[Any]:
        """Every shard acknowledged the push: a compressed one's residuals move now (ps.compression)."""
        encoded, self._encoded = self._encoded, None
        if encoded is not None and self._compressor is not None:
            for shard, residual in encoded.items():
                self._compressor.commit(shard, residual)
        return acks

    def _stamp(self, grads: Mapping[str, Any], extra: dict[str, Any]) -> list[tuple[dict[str, Any], Any]]:
        """Per-shard push requests with this worker's read version (`_request` stamps the clock and moves it,
        under the client's lock, when it sends: two threads pushing at once get consecutive clocks). A push larger
        than a shard's max_message_bytes, and with several shards that reject NaN/Inf a non-finite gradient, are
        refused here, whole, before anything is sent."""
        pieces = [self._split(grads, i) for i in range(len(self.addresses))]   # validates before any change
        for i, piece in enumerate(pieces):      # ZeroMQ would drop the connection (MAXMSGSIZE): say it here
            limit = self._max_bytes[i]
            size = sum(a.nbytes for a in piece.values())
            if limit is not None and size > limit:
                raise ProtocolError(f"a push of {size} bytes to shard {i} exceeds its max_message_bytes ({limit}); "
                                    "start the shards with a larger limit; the push is refused whole, no clock moves")
        comp = self._compressor
        finite = True
        if comp is not None:      # a NaN the compressor did not select would hide in the residual: look at all
            finite = all(np.isfinite(a).all() for piece in pieces for a in piece.values() if a.dtype.kind in "fc")
            if not finite and self._rejects_nonfinite:
                raise NonFiniteGradientError(
                    f"a gradient of worker {self.worker} holds NaN or Inf: the compressed push is refused whole, "
                    "no clock or residual moves: lower the learning rate or look for the divergence")
        if comp is not None and finite:                # (a non-finite push to skipping shards goes dense)
            out, encoded = [], {}
            for i, piece in enumerate(pieces):
                meta, tensors, residual = comp.encode(i, piece)
                out.append((dict(extra, version=self.versions[i], **meta), tensors))
                encoded[i] = residual
            self._encoded = encoded
            return out
        if len(pieces) > 1 and self._rejects_nonfinite:
            for i, piece in enumerate(pieces):
                for name, a in piece.items():
                    if a.dtype.kind in "fc" and not np.isfinite(a).all():
                        raise NonFiniteGradientError(
                            f"gradient {name!r} of worker {self.worker} holds NaN or Inf (its slice on shard {i}); "
                            "the push is refused whole, by every shard, and no clock moves: lower the learning "
                            "rate or look for the divergence")
        return [(dict(extra, version=self.versions[i]), pieces[i]) for i in range(len(pieces))]

    def _adopt_read(self, reads: list[dict[str, Any]], replies: list[tuple[Any, Any]], copy: bool) -> PullResult:
        """Remember each shard's read version and clock; reassemble the values into a PullResult."""
        for i, r in enumerate(reads):
            self.versions[i] = int(r["version"])
            self.clocks[i] = max(self.clocks[i], int(r["clock"]))
        return PullResult(self._assemble([t for _, t in replies], copy), [int(r["version"]) for r in reads],
                          [int(r["clock"]) for r in reads])

    def grad_buffers(self) -> dict[str, np.ndarray]:
        """Writable arrays shaped like the parameters to compute gradients into (e.g. `p.grad =
        torch.from_numpy(buf[name])`, so backward accumulates in place): on the same-host path they are the push
        segment itself (ps.shm_arena: a tensor split across shards too), and a push of them copies nothing. Do not
        write them while a push is in flight. Tensors on a shard without the path get ordinary arrays (pushed
        with a copy), and so does everything if the segment cannot be allocated."""
        out: dict[str, np.ndarray] = {}
        arena = self._arena
        if self._compressor is not None:                     # compressed pushes are encoded, never mapped
            arena = None
        if arena is not None and any(link.push_ok for link in self._links):
            try:
                arena.reserve_all()
            except OSError:                                  # /dev/shm full: pushes go as frames
                for link in self._links:
                    link.push_ok = False
        if arena is not None and arena.bytes is not None:
            raw = arena.bytes.numpy()
            for name, pieces in self._slices_of.items():
                dt = self.dtypes[name]
                if dt is None or not all(self._links[p.shard].push_ok for p in pieces):
                    continue
                off = self._tensor_at[name]
                out[name] = raw[off:off + pieces[0].itemsize * math.prod(self.shapes[name])].view(dt).reshape(
                    self.shapes[name])
        for name in self.partition.names:
            if name not in out:
                out[name] = np.zeros(self.shapes[name], self.dtypes[name] or np.float32)
        return out

    def stats(self, series: bool = False) -> Future:
        """Future[list of per-shard stats dicts: version, clocks, staleness summary, wait seconds, counters];
        `series=True` adds the per-update time series [[now, worker, tau, version], ...]."""
        return self._all("stats", {"series": bool(series)}, finish=reply_metas)

    def resync(self) -> list[int]:
        """Re-register and adopt each shard's clock and version for this worker (after an error or a shard
        restart); returns the clocks. The shards answer this connection's parked reads with an error first (a lost
        shard's requests have failed already: ShardLostError)."""
        with self._lock:
            self._watch()
        self.registration = self._register()
        return list(self.clocks)

    def ping(self) -> Future:
        return self._all("ping", finish=reply_metas)

    # ------------------------------------------------------------------ slicing
    def _split(self, tensors: Mapping[str, Any], shard: int) -> dict[str, np.ndarray]:
        """Shard `shard`'s flat pieces of `tensors` (views). The same numpy arrays (same objects, shapes and
        strides: the same memory) as last time, e.g. a training loop's `grad_buffers()`, get the same pieces back
        without re-slicing; anything else (torch tensors, whose storage `.data =` can swap) is sliced afresh."""
        memo = self._split_memo.get(shard)
        if memo is not None and len(tensors) == len(memo[0]) and all(
                tensors.get(n) is a and a.shape == sh and a.strides == st for n, (a, sh, st) in memo[0].items()):
            return memo[1]
        out = self._slice(tensors, shard)
        if all(isinstance(a, np.ndarray) and a.flags.c_contiguous for a in tensors.values()):
            self._split_memo[shard] = ({n: (a, a.shape, a.strides) for n, a in tensors.items()}, out)
        else:
            self._split_memo.pop(shard, None)
        return out

    def _slice(self, tensors: Mapping[str, Any], shard: int) -> dict[str, np.ndarray]:
        out = {}
        for s in self._keys_of[shard]:
            if s.name not in tensors:
                raise ConfigError(f"tensor {s.name!r} is missing; expected all of {self.partition.names[:8]}")
            a = _np(tensors[s.name])
            if tuple(a.shape) != s.shape:
                raise ConfigError(f"tensor {s.name!r} has shape {tuple(a.shape)}, expected {s.shape}")
            out[s.key] = np.ascontiguousarray(a).reshape(-1)[s.start:s.stop]
        return out

    def _assemble(self, per_shard: list[dict[str, Any]], copy: bool = True) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for name, pieces in self._slices_of.items():
            if len(pieces) == 1:
                a = per_shard[pieces[0].shard][pieces[0].key]    # read-only views (frames, shm) are copied
                out[name] = (a if a.flags.writeable or not copy else np.array(a)).reshape(pieces[0].shape)
                continue
            first = per_shard[pieces[0].shard][pieces[0].key]
            whole = self._in_place(name, pieces, per_shard) if not copy else None
            if whole is not None:                               # the shards wrote it into our pull arena
                out[name] = whole
                continue
            n = sum(p.numel for p in pieces)
            flat = None if copy else self._scratch.get(name)    # copy=False: one buffer, rewritten by each read
            if flat is None or flat.dtype != first.dtype or flat.size != n:
                flat = np.empty(n, dtype=first.dtype)           # (a fresh 4 MB array costs ~1000 page faults)
                if not copy:
                    self._scratch[name] = flat
            for p in pieces:
                flat[p.start:p.stop] = per_shard[p.shard][p.key]
            out[name] = flat.reshape(pieces[0].shape)
        return out

    def _in_place(self, name: str, pieces: list[Any], per_shard: list[dict[str, Any]]) -> np.ndarray | None:
        """The whole of a split tensor as a read-only view of the pull arena, if every piece lies at its place
        there (the shards wrote them in: nothing to reassemble); else None."""
        into = self._into
        if into is None or into.bytes is None or name not in self._into_at:
            return None
        if self._wholes_for != into.name:                  # the views of one generation of the arena
            self._wholes, self._wholes_for = {}, into.name
        got = self._wholes.get(name)
        if got is None:
            off = self._into_at[name]
            flat = into.bytes.numpy()[off:off + pieces[0].itemsize * math.prod(self.shapes[name])]
            whole = flat.view(self.dtypes[name]).reshape(self.shapes[name])
            whole.flags.writeable = False
            got = self._wholes[name] = (whole, whole.__array_interface__["data"][0])
        whole, base = got
        for p in pieces:
            a = per_shard[p.shard][p.key]
            if not (isinstance(a, np.ndarray) and a.dtype == whole.dtype and a.size == p.numel
                    and a.__array_interface__["data"][0] == base + p.start * p.itemsize):
                return None
        return whole

    # ------------------------------------------------------------------ progress
    def _drive(self, fut: Future, timeout: float | None) -> None:
        """Receive and dispatch replies until `fut` is done, its own deadline passes, or `timeout` expires."""
        end = None if timeout is None else time.monotonic() + timeout
        while not fut.done():
            now = time.monotonic()
            if end is not None and now >= end:
                return                       # Future.result then raises concurrent.futures.TimeoutError
            with self._lock:
                if fut.done() or self._closed:
                    break
                wait_ms = 20.0 if end is None else max(0.0, min(20.0, (end - now) * 1000))
                if self._lanes.busy() and self._lanes.spin.spin(self._lanes.answered):
                    self._lane_replies()               # (the bell's byte is swallowed at the next poll)
                    continue
                ready = self._poller.poll(wait_ms)
                if any(sock in self._monitor_of for sock, _ in ready):
                    self._watch()         # first: a drop is noted before any reply of the new incarnation
                for sock, _ in ready:
                    if isinstance(sock, int):              # the lanes' bell
                        self._lanes.bell.drain()           # (before looking: a later ring wakes the next poll)
                    elif sock not in self._monitor_of:
                        self._drain(self._socks.index(sock))
                if self._lanes.bell is not None:
                    self._lane_replies()
                self._expire(time.monotonic())

    def _lane_replies(self, only: int | None = None) -> None:
        """Dispatch the replies the shards wrote into their lanes (those of shard `only`)."""
        for i, frame in self._lanes.replies(only):
            self._on_reply(i, [frame])

    def _drain(self, shard: int) -> None:
        """Dispatch every reply waiting on shard's socket."""
        sock = self._socks[shard]
        while sock.getsockopt(EVENTS) & POLLIN:      # ~1 µs; a recv that fails with Again: ~10 µs
            try:
                frames = sock.recv_multipart(NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._on_reply(shard, frames)

    def _watch(self) -> None:
        """Read every socket monitor: a refused handshake fails that shard's requests (AuthenticationError); a drop
        after a handshake marks the shard lost and fails its requests in flight (ShardLostError)."""
        for mon, i in self._monitor_of.items():
            for event in read_events(mon):
                if event & HANDSHAKE_FAILED:
                    self._refused[i] = refused(i, self.addresses[i], self.user, event)
                    self._fail_shard(i, self._refused[i])
                elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._refused.pop(i, None)
                    self._handshaken[i] = True
                    if self.user == ADMIN:             # nothing to re-register: usable again
                        self._lost.discard(i)
                elif event == zmq.EVENT_DISCONNECTED and self._handshaken[i]:
                    self._handshaken[i] = False
                    self._drain(i)                     # answers that came before the drop are good answers
                    self._lane_replies(i)              # (through the lane too)
                    self._lost.add(i)
                    self.disconnects[i] += 1
                    self._fail_shard(i, None)

    def _lost_error(self, shard: int, op: str, seq: int | None = None) -> ShardLostError:
        what = f"request #{seq} ({op})" if seq is not None else f"{op}"
        return ShardLostError(f"shard {shard} ({self.addresses[shard]}) dropped the connection (it died or is "
                              f"being restarted): {what} not answered; call resync() once it is back")

    def _fail_shard(self, shard: int, exc: Exception | None) -> None:
        for key in [k for k in self._pending if k[0] == shard]:
            p = self._pending.pop(key)
            self._links[shard].on_timeout(key[1])     # a late answer must not write into a segment we reuse
            if p.lane is not None:
                p.lane.done(key[1])
            p.future.fail(exc if exc is not None else self._lost_error(shard, "request", key[1]))

    def _expire(self, now: float) -> None:
        for key in [k for k, p in self._pending.items() if p.deadline < now]:
            p = self._pending.pop(key)
            self._links[key[0]].on_timeout(key[1])
            lane = p.lane if p.lane is not None else self._lanes[key[0]]
            if lane is not None:                       # a late answer would land in the slot; or a ZeroMQ request
                lane.off()                             # still unread at the shard would be overtaken by the lane
            p.future.fail(RequestTimeoutError(
                f"shard {key[0]} ({self.addresses[key[0]]}) did not answer request #{key[1]} within the "
                f"timeout; is the server alive? (a pull may also wait for slow workers under BSP/SSP)"))

    def _on_reply(self, shard: int, frames: list[Any]) -> None:
        try:
            msg = decode(frames, CLIENT_LIMITS)
        except WireError:
            return  # not a reply we can read: nothing to match it to
        pend = self._pending.pop((shard, msg.seq), None)
        if pend is None:
            return
        if pend.lane is not None:
            pend.lane.done(msg.seq)                  # (maybe answered through ZeroMQ: the slot was too small)
        self._note(shard, msg.meta)
        try:
            copied = self._links[shard].on_reply(msg.seq, msg.meta)
            if msg.op == "error" and pend.push and msg.meta.get("refused_push") is True:
                self.clocks[shard] -= 1              # nothing of it was applied: both sides where they were
            if msg.op == "error":
                pend.future.fail(error_from_reply(str(msg.meta.get("kind")), str(msg.meta.get("error")), shard),
                                 pend.shard)
            else:
                got = msg.tensors if copied is None else copied
                nbytes = sum(int(v.nbytes) for v in got.values()) if got else 0
                if got:                              # a read's values: from frames, or the shared segments
                    self.wire.add_recv(shard, "pull", nbytes)
                if self._link_in is not None:        # handed over when the emulated link would deliver it
                    self._link_in[shard].carry(nbytes)
                pend.future.settle(pend.shard, (msg.meta, got))
        except Exception as e:                 # never leave the popped future waiting forever
            pend.future.fail(PSError(f"shard {shard} sent a reply this client cannot use: "
                                     f"{type(e).__name__}: {e} (shared-memory replies are now off)"))

    def _note(self, shard: int, meta: Any) -> None:
        """Remember the highest version a reply named, and a push ack's checkpoint_error (warned once per shard)."""
        if not isinstance(meta, dict):
            return
        for m in (meta, meta.get("read")):
            v = m.get("version") if isinstance(m, dict) else None
            if isinstance(v, int) and not isinstance(v, bool):
                self._seen[shard] = max(self._seen[shard], v)
        if "status" not in meta:
            return
        err = meta.get("checkpoint_error")
        self.checkpoint_errors[shard] = str(err)[:2000] if err is not None else None
        if err is not None and not self._warned[shard]:
            self._warned[shard] = True
            warnings.warn(f"{str(err)[:2000]} (pushes go on; a restart would lose the updates since)",
                          CheckpointWarning, stacklevel=2)

    def _fail_all(self, exc: Exception) -> None:
        for p in self._pending.values():
            p.future.fail(exc)
        self._pending.clear()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._fail_all(PSError("client closed with requests in flight"))
            stop_monitors(self._socks, self._monitors)
            self._monitors, self._monitor_of = [], {}
            for sock in self._socks:           # tell each shard to forget this connection (best effort)
                try:
                    sock.send_multipart(encode("unregister", None, seq=next(self._seq), src=self.worker, meta={}),
                                        flags=zmq.NOBLOCK)
                    sock.close(linger=200)
                except zmq.ZMQError:
                    sock.close(0)
            for link in getattr(self, "_links", []):
                link.close()
            if getattr(self, "_lanes", None) is not None:
                self._lanes.close()
            for arena in (getattr(self, "_arena", None), getattr(self, "_into", None)):
                if arena is not None:
                    arena.close()

    def __enter__(self) -> "PSClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _np_dtype(v: Any) -> np.dtype | None:
    """The numpy dtype of a tensor/array (float32 for a bare shape); None for dtypes numpy lacks (bfloat16)."""
    dt = getattr(v, "dtype", np.float32)
    if isinstance(dt, torch.dtype):
        try:
            return torch.empty(0, dtype=dt).numpy().dtype
        except TypeError:
            return None
    return np.dtype(dt)


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(v.shape) if hasattr(v, "shape") else tuple(v)


def connect(addresses: Sequence[str], worker: int, params: Mapping[str, Any], *, timeout: float = 60.0,
            shm: bool | None = None, curve_keys_dir: str | None = None, secret: str | None = None,
            lane: bool | None = None, link: tuple[float, float] | None = None, compress: str | None = None,
            error_feedback: bool = True) -> PSClient:
    """Connect worker `worker` to the shards at `addresses` (in shard order) and register with each.

    `shm`: carry push/pull payloads through shared memory with shards on this host (None: wherever the address is
    loopback or ipc:// and the shard accepts; see `ps.shm_path`). `curve_keys_dir`: the cluster's CURVE keys, for
    shards started with them (encrypted, authenticated; required for shards bound beyond loopback). `lane`: with
    shared memory, carry push/pull headers through the doorbell lane too (None: where both sides can, ps.lane;
    False: always ZeroMQ). `secret`: the
    job secret (ServerGroup.secret); None: PSLAB_JOB_SECRET / PSLAB_JOB_SECRET_FILE. Admin operations (checkpoint,
    shutdown) need `ps.connect_admin` instead. `link` = (latency s, bandwidth B/s): every request and reply to a
    shard crosses an emulated link (`ps.link_delay`; the shards on one machine, as `pslab run` with [topology]).
    `compress`: "topk:<fraction>" or "sign" sends each push compressed, with error feedback unless
    `error_feedback=False` (ps.compression; reads stay whole); None or "none": whole gradients."""
    return PSClient(addresses, worker, params, timeout=timeout, shm=shm, curve_keys_dir=curve_keys_dir,
                    secret=secret, lane=lane, link=link, compress=compress, error_feedback=error_feedback)
