"""Peer-to-peer ZeroMQ transport: every rank binds one PULL socket and keeps one PUSH socket per peer.

Rendezvous goes through a `torch.distributed` store: rank r publishes `addr/r` (its host id and its ipc and tcp
endpoints), signed with the job's secret (`auth.sign`: a record written by anyone else is refused, so a rank never
connects, nor hands its credential, to a stranger); a sender connects over ipc:// when both ranks share a host,
else over tcp://.

Authentication (auth.py): the PULL socket is a PLAIN server (CURVE where keys are configured) admitting the users
"rank:0" .. "rank:N-1", each with its credential derived from the job secret; every PUSH socket authenticates as
its own rank. The handshake does it once per connection; then every message carries the ZeroMQ frame property
User-Id, and a message whose header claims another `src` than the connection's User-Id is dropped. A multi-rank
group without a secret is refused (AuthError: set PSLAB_JOB_SECRET), except under CURVE keys without a secret,
where the cluster key pair authenticates membership but not the rank (the src check is then off).

Messages are `collectives.wire` messages. Each carries a routing key in its header meta `k` (a short list, e.g.
[group, seq, step, segment]); the receiver files messages that arrive early under (sender, key) in a `Mailbox`
(byte budget, known groups, sequence window: mailbox.py) and hands them out when asked. Sends are zero-copy
(`copy=False`): `send` returns a zmq MessageTracker that says when ZeroMQ is done with the buffer, and `flush()`
waits for all of them, so a caller may reuse its buffers afterwards.

Malformed messages (anything `wire.decode_header`, the identity check, the mailbox's routes, the shared-memory
inbox or the caller's `expect` rejects) are dropped and counted in `dropped`; the rank keeps working. Every wait
has a timeout that raises `PeerTimeoutError`.

Interrupting a wait (elastic groups, elastic.py): when `interrupt` is set, every wait (`recv`, `flush`, a peer's
address in the store) calls it at least every `interrupt_every` seconds, and whatever it raises ends the wait (the
collective's buffers are then undefined). Unset (None, the default), the waits are what they were. `realm` prefixes
the role names ("<realm>rank:<r>"), so the credentials of one realm (an elastic generation) open no socket of
another, even one that reuses a port.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from . import auth, cleanup, shm, wire
from .curve import connect_curve, load_keys, serve_curve
from .errors import AuthError, CollectivesError, PeerTimeoutError, RendezvousError, WireError
from .mailbox import MAILBOX_BYTES, SEQ_WINDOW, Key, Mailbox, routing_key


@dataclass(frozen=True)
class CurveKeys:
    """CURVE encryption + authentication: `keys_dir` holds `pslab.key_secret` (this cluster's key pair, made by
    `collectives.curve.generate_keys`) and the public `*.key` files of every client allowed to connect."""

    keys_dir: str


class Transport:
    """Tagged point-to-point messaging between the `world_size` ranks of one job."""

    def __init__(self, rank: int, world_size: int, store: Any, *, timeout: float = 60.0,
                 bind_host: str = "127.0.0.1", use_ipc: bool = True, curve: CurveKeys | None = None,
                 limits: wire.WireLimits = wire.DEFAULT_LIMITS, use_shm: bool = True, secret: str | None = None,
                 mailbox_bytes: int = MAILBOX_BYTES, seq_window: int = SEQ_WINDOW, namespace: str = "",
                 realm: str = "") -> None:
        if secret is None and curve is None:
            if world_size > 1:
                raise AuthError(f"rank {rank}: a {world_size}-rank zmq group listens on tcp://{bind_host} and needs "
                                f"the job's secret: {auth.HOW}")
            secret = auth.new_job_secret()       # alone in the world: nobody else needs to know it
        self.rank, self.world_size, self.timeout, self.limits = rank, world_size, timeout, limits
        self.store, self.namespace = store, namespace
        self.interrupt: Callable[[], None] | None = None   # called by every wait when set (see the module docstring)
        self.interrupt_every = 0.05
        self.links: Any = None      # a topology.LinkEmulator (set by ZmqGroup(topology=)): emulated link delays
        self.mailbox = Mailbox(rank, mailbox_bytes, seq_window)
        self.dropped = 0
        self.last_drop_reason = ""
        self._push: dict[int, zmq.Socket] = {}
        self._trackers: list[zmq.MessageTracker] = []
        self.use_shm = use_shm and shm.available()
        self._job = uuid.uuid4().hex[:12]
        self._same_host: dict[int, bool] = {}
        self._outbox: dict[int, shm.Outbox] = {}
        self._inbox = shm.Inbox(rank)
        self._peer_job: dict[int, str] = {}     # the shm job id each peer published: its segments' names
        self._secret = secret
        self.user = f"{realm}rank:{rank}"
        users = [f"{realm}rank:{r}" for r in range(world_size)]
        self._uid_rank = {u: r for r, u in enumerate(users)}
        self.authenticated = secret is not None  # False only under CURVE keys without a secret: src unchecked
        self._curve = load_keys(curve.keys_dir) if curve else None
        self.ctx = zmq.Context(io_threads=1)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.setsockopt(zmq.RCVHWM, 0)
        self.socket_buffer = 4 << 20  # kernel socket buffers: fewer wake-ups per large message
        self.pull.setsockopt(zmq.RCVBUF, self.socket_buffer)
        self._auth: Any = None
        self.ipc_dir: str | None = None
        try:
            self._bind(rank, bind_host, use_ipc, curve, users)
        except BaseException:
            self.close(0)             # a failed bind leaks no context, handler thread or ipc directory
            raise

    def _bind(self, rank: int, bind_host: str, use_ipc: bool, curve: CurveKeys | None, users: list[str]) -> None:
        if curve is not None and self._secret is None:
            self._auth = serve_curve(self.ctx, self.pull, curve.keys_dir)
        elif self._curve is not None:
            self._auth = auth.curve_server(self.ctx, self.pull, self._curve, self._secret, users)
        else:
            self._auth = auth.plain_server(self.ctx, self.pull, self._secret, users)
        endpoints = []
        if use_ipc and hasattr(zmq, "IPC_PATH_MAX_LEN"):
            # mode 0700: other accounts cannot connect. Inside the launcher's sweep directory if any; removed by
            # close(), or at interpreter exit if a failing program never closes the group
            self.ipc_dir = cleanup.temp_dir("pslab-")
            self._rm_ipc = weakref.finalize(self, shutil.rmtree, self.ipc_dir, True)
            ep = f"ipc://{self.ipc_dir}/r{rank}"
            if len(ep) - len("ipc://") < zmq.IPC_PATH_MAX_LEN:
                self.pull.bind(ep)
                endpoints.append(ep)
            else:      # a long TMPDIR: a socket path is at most ~107 bytes; peers on this host use tcp loopback
                self._rm_ipc()
                self.ipc_dir = None
        try:
            port = self.pull.bind_to_random_port(f"tcp://{bind_host}")
        except zmq.ZMQError as e:
            raise RendezvousError(f"rank {rank}: cannot bind tcp://{bind_host}: {e}") from None
        endpoints.append(f"tcp://{bind_host}:{port}")
        self.endpoints = endpoints
        self.host = host_identity()        # equal ids: ipc sockets + shared memory between the two ranks
        record = "|".join([self.host, *endpoints, f"shm://{self._job}"])
        if self._secret is not None:
            record += "#" + auth.sign(self._secret, f"{self.namespace}addr/{rank}", record)
        self.store.set(f"addr/{rank}", record)

    def _address(self, dst: int) -> tuple[str, list[str]]:
        """(host id, endpoints) that rank `dst` published, checked against its signature."""
        try:
            self._wait_key(f"addr/{dst}")
            record = self.store.get(f"addr/{dst}").decode()
        except CollectivesError:
            raise                     # raised by `interrupt`: e.g. a newer elastic membership
        except Exception as e:
            raise RendezvousError(f"rank {self.rank}: no address published by rank {dst} ({e})") from None
        if self._secret is not None:
            record, _, tag = record.rpartition("#")
            if not auth.verify(self._secret, f"{self.namespace}addr/{dst}", record, tag):
                raise AuthError(f"rank {self.rank}: the address of rank {dst} in the store is not signed with this "
                                "job's secret (do all ranks have the same PSLAB_JOB_SECRET? or someone else wrote it)")
        host, *eps = record.split("|")
        self._peer_job[dst] = next((e[6:] for e in eps if e.startswith("shm://")), "")
        return host, eps

    def _wait_key(self, key: str) -> None:
        """Wait until `key` is in the store (the store's own timeout; polled, and interruptible, under `interrupt`)."""
        if self.interrupt is None:
            self.store.wait([key])
            return
        deadline = time.monotonic() + self.timeout
        pause = 0.001
        while not self.store.check([key]):
            self.interrupt()
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{key} not in the store after {self.timeout:g}s")
            time.sleep(pause)
            pause = min(2 * pause, self.interrupt_every)

    # ---- sending ------------------------------------------------------------------------------------------------
    def _peer_socket(self, dst: int) -> zmq.Socket:
        sock = self._push.get(dst)
        if sock is None:
            if not 0 <= dst < self.world_size:
                raise ValueError(f"peer rank {dst} is outside the world of {self.world_size} ranks")
            host, eps = self._address(dst)
            ipc = [e for e in eps if e.startswith("ipc://")]
            tcp = [e for e in eps if e.startswith("tcp://")]
            self._same_host[dst] = host == self.host
            ep = ipc[0] if ipc and host == self.host else tcp[0]
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.SNDBUF, self.socket_buffer)
            if self._curve is not None and self._secret is None:
                connect_curve(sock, self._curve)
            elif self._curve is not None:
                auth.curve_client(sock, self._curve, self._secret, self.user)
            else:
                auth.plain_client(sock, self._secret, self.user)
            sock.connect(ep)
            self._push[dst] = sock
        return sock

    def send(self, dst: int, op: str, key: Sequence[Any], tensors: Sequence[wire.Tensor] = (), seq: int = 0,
             meta: dict | None = None, mode: str = "zerocopy", shm_offset: int = 0) -> None:
        """Queue a message for `dst`; returns at once.

        mode "copy": ZeroMQ copies the tensors now, the caller may reuse them at once.
        mode "track": zero-copy, and `flush()` waits until ZeroMQ has released the buffers.
        mode "zerocopy": zero-copy and untracked (cheapest); the caller must know by other means that the buffer
        is no longer needed (e.g. the receiver acknowledged it) before writing to it.
        mode "shm": one tensor, written at byte `shm_offset` of the shared-memory outbox for `dst` (see shm.py and
        `shm_reserve`); falls back to "zerocopy" for a peer on another host."""
        m = {"k": list(key)}
        if meta:
            m.update(meta)
        if self.links is not None:                 # emulated topology: stamp when it may be delivered
            m.update(self.links.stamp(dst, tensors))
        if mode == "shm":
            box = self._outbox.get(dst)
            if box is not None and box.size:
                m["shm"] = box.write(shm_offset, tensors[0])
                self._peer_socket(dst).send_multipart(wire.encode(op, (), seq=seq, src=self.rank, meta=m))
                return
            mode = "zerocopy"
        frames = wire.encode(op, tensors, seq=seq, src=self.rank, meta=m)
        tracker = self._peer_socket(dst).send_multipart(frames, copy=(mode == "copy"), track=(mode == "track"))
        if tracker is not None and not tracker.done:
            self._trackers.append(tracker)

    def shm_reserve(self, dst: int, nbytes: int) -> bool:
        """Between collectives: make `dst`'s outbox hold `nbytes`. False when `dst` is not reachable by shm."""
        if not self.use_shm:
            return False
        self._peer_socket(dst)
        if not self._same_host.get(dst):
            return False
        box = self._outbox.get(dst)
        if box is None:
            box = self._outbox[dst] = shm.Outbox(self._job, self.rank, dst)
        try:
            box.reserve(nbytes)
        except OSError:                      # /dev/shm full: this collective's payloads go through the socket
            return False
        return True

    def flush(self, op: str = "send", seq: int = 0, peer: int = -1) -> None:
        """Wait until ZeroMQ no longer needs any buffer passed to `send`."""
        deadline = time.monotonic() + self.timeout
        for t in self._trackers:
            while True:
                remaining = max(0.0, deadline - time.monotonic())
                try:
                    t.wait(remaining if self.interrupt is None else min(remaining, self.interrupt_every))
                    break
                except zmq.NotDone:
                    if time.monotonic() >= deadline:
                        raise PeerTimeoutError(op, seq, peer, self.timeout, "send buffer still held by ZeroMQ") \
                            from None
                    if self.interrupt is not None:
                        self.interrupt()
        self._trackers.clear()

    # ---- receiving ----------------------------------------------------------------------------------------------
    def drop(self, reason: str) -> None:
        """Count a message that was refused (and remember why: PeerTimeoutError quotes it)."""
        self.dropped += 1
        self.last_drop_reason = reason

    def recv(self, src: int, key: Sequence[Any], op: str, seq: int = 0, *,
             check: Callable[[int, dict], None] | None = None,
             expect: Callable[[wire.Message], Any] | None = None,
             idle: Callable[[], None] | None = None) -> Any:
        """Block until the message from `src` with routing key `key` arrives; other arrivals are filed for later.

        `check(sender, header)` is called on every accepted arrival (to spot ranks that run a different collective);
        `expect(message)` validates the awaited message against what the caller needs and returns what `recv`
        returns (the message itself without it); a WireError from it drops the message and the wait goes on.
        `idle()`, when given, is called every 50 ms of waiting, the first time 50 ms in (e.g. to spot a diverging
        peer elsewhere; not on every pass, since it may scan)."""
        want = (src, tuple(key))
        deadline = time.monotonic() + self.timeout
        dropped = self.dropped
        while (hit := self.mailbox.take(*want)) is not None:
            if check is not None:
                check(src, hit[1])
            if self.links is not None:
                self.links.hold(hit[1])
            try:
                return expect(hit[0]) if expect is not None else hit[0]
            except WireError as e:
                self.drop(str(e))
        next_idle = time.monotonic() + 0.05      # idle() is a scan: not on every pass of a busy receive
        while True:
            now = time.monotonic()
            remaining = deadline - now
            if self.interrupt is not None:
                self.interrupt()
                remaining = min(remaining, self.interrupt_every)
            if idle is not None:
                if now >= next_idle:
                    idle()
                    next_idle = now + 0.05
                remaining = min(remaining, next_idle - now)
            if remaining <= 0 or not self.pull.poll(int(remaining * 1000) + 1):
                if time.monotonic() >= deadline:
                    detail = (f"{self.dropped - dropped} message(s) dropped meanwhile, the last: "
                              f"{self.last_drop_reason}") if self.dropped > dropped else ""
                    raise PeerTimeoutError(op, seq, src, self.timeout, detail)
                continue
            frames = self.pull.recv_multipart(copy=False)
            try:  # validate the whole message on arrival: a bad one is dropped here and never reaches a caller
                got, h, msg = self._admit(frames, want)
                if check is not None:
                    check(got[0], h)
                if got == want:
                    if self.links is not None:
                        self.links.hold(h)
                    return expect(msg) if expect is not None else msg
                self.mailbox.file(got[0], got[1], msg, h, sum(len(f) for f in frames))
            except WireError as e:
                self.drop(str(e))

    def poll_arrivals(self, check: Callable[[int, dict], None] | None = None) -> None:
        """File whatever has arrived, without blocking, as `recv` does with arrivals it does not wait for (a rank
        waiting elsewhere, e.g. on a shared-memory channel, still sees a diverging peer through `check`)."""
        while self.pull.poll(0):
            frames = self.pull.recv_multipart(copy=False)
            try:
                got, h, msg = self._admit(frames, (-1, ()))
                if check is not None:
                    check(got[0], h)
                self.mailbox.file(got[0], got[1], msg, h, sum(len(f) for f in frames))
            except WireError as e:
                self.drop(str(e))

    def _admit(self, frames: list[Any], want: tuple[int, Key]) -> tuple[tuple[int, Key], dict, wire.Message]:
        """Decode one arrival: header, identity (User-Id == claimed src), routing key and route, tensors, shm."""
        h = wire.decode_header(frames[0], self.limits)
        src = h["src"]
        if self.authenticated:
            try:
                uid = frames[0].get("User-Id")
            except (zmq.ZMQError, AttributeError):
                uid = None
            if self._uid_rank.get(uid) != src:
                raise WireError(f"message claims to come from rank {src!r:.20} but its connection authenticated as "
                                f"{uid!r:.40}")
        elif not 0 <= src < self.world_size:
            raise WireError(f"message from unknown rank {src}")
        k = routing_key(h["meta"].get("k"))
        got = (src, k)
        self.mailbox.route(src, k, h, got == want)
        msg = wire.decode(frames, self.limits, as_torch=True, header=h)
        if "shm" in h["meta"]:
            if msg.tensors:
                raise WireError("message carries both tensor frames and a shared-memory payload")
            if src not in self._peer_job:
                self._address(src)
            msg.tensors["0"] = self._inbox.view(src, h["meta"]["shm"], self._peer_job[src])
        return got, h, msg

    def close(self, linger: float = 5.0, lingers: dict[int, float] | None = None) -> None:
        """Close all sockets; messages still queued get up to `linger` seconds to reach live peers (`lingers`: per
        peer rank, e.g. 0 for a dead one, whose queue would otherwise hold the close for `linger`)."""
        for dst, s in self._push.items():
            s.close(int((lingers or {}).get(dst, linger) * 1000))
        for box in self._outbox.values():
            box.close()
        self._inbox.close()
        self.pull.close(0)
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()
        if self.ipc_dir:
            self._rm_ipc()


def host_identity() -> str:
    """Which ranks may use ipc:// and /dev/shm with each other: PSLAB_HOST_ID if set, else the hostname, the boot id,
    and the identities of this process's network namespace, temp directory and /dev/shm (two containers or
    namespaces that share a hostname but not these get different ids, and talk over tcp)."""
    forced = os.environ.get("PSLAB_HOST_ID")
    if forced:
        return forced
    parts = [socket.gethostname()]
    try:
        parts.append(open("/proc/sys/kernel/random/boot_id").read().strip())
    except OSError:
        pass
    for path in ("/proc/self/ns/net", tempfile.gettempdir(), "/dev/shm"):
        try:
            st = os.stat(path)
            parts.append(f"{st.st_dev}.{st.st_ino}")
        except OSError:
            parts.append("-")
    return "/".join(parts).replace("|", "_")


def unique_prefix() -> str:
    return uuid.uuid4().hex[:12]
