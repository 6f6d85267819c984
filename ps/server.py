"""One shard's server: a ZeroMQ ROUTER loop around a `ShardState` (its `ServerConfig` lives in ps.config, shard
processes in ps.processes; both stay importable from here).

The loop is single-threaded: receive -> who sent it (the handshake's User-Id, ps.admission) -> validate (wire
limits, op, seq, identity and role, fields) -> act on the ShardState -> reply. The socket is a PLAIN server (CURVE
with `curve_keys_dir`) that admits only the job's users: a socket without the credential never gets a message
through. A pull that the consistency gate (or a missing init) holds back is parked (ps.parking) and
retried after every push/init. Every `sweep_interval` quiet connections are probed; a vanished one's registration,
parked reads and shared-memory link are freed, and idle links give back their reply segment. Any exception while
handling one message becomes an error reply to that sender; the loop itself never stops on a bad message.

Failures. Each loop iteration (at most every 50 ms: the poll timeout) calls `heartbeat(now, version)` if set, so a
parent can tell a hung shard from a busy one without zmq (ps.processes gives it a shared double array); the version
is also written after every push. `incarnation` (random per process) is in the register and stats replies: a
client that sees it change knows the shard restarted. `request_stop()` (the SIGTERM/SIGINT handlers call it) ends
the loop after the current message and writes a final checkpoint when a checkpoint_dir is set, so a stopped and
restarted shard loses no update. A periodic checkpoint that fails is counted (counters["checkpoint_failures"]),
kept in `checkpoint_error` and carried by every push ack (meta "checkpoint_error") until one succeeds; it is retried
at the next multiple of checkpoint_every. The admin op "members" sets the versioned membership (ShardState
.set_members), drops removed workers' registrations (their shm links and parked reads) and releases the reads that
waited only for them.
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any, Callable

import numpy as np
import torch
import zmq

from pslab.collectives import trace
from pslab.collectives.curve import load_keys
from pslab.collectives.errors import WireError
from pslab.collectives.shm_channel import Waiter
from pslab.collectives.wire import decode, encode

from . import compression
from .admission import Admission, curve_server, plain_server, shard_users
from .checkpoint import save_checkpoint
from .config import ServerConfig
from .lane import Bell, ServerLane, enabled as lane_enabled
from .errors import (AccessDeniedError, AlreadyInitializedError, ConfigError, DuplicateRequestError,
                     NotInitializedError, ProtocolError, PSError, ShmLimitError)
from .parking import Parked, Parking
from .protocol import EVENTS, NOBLOCK, POLLIN, meta_int, meta_list, server_limits, wire_safe
from .restore import restore
from .shard import ShardState, _all_finite
from .shm_path import ServerLink

log = logging.getLogger("pslab.ps.server")


class ShardServer(Parking):
    """Serve one shard on a ROUTER socket (call `bind()` then `serve_forever()`)."""

    def __init__(self, config: ServerConfig, context: zmq.Context | None = None) -> None:
        config.validate()
        self.config = config
        # the authenticator owns its context's ZAP endpoint: a shard gets a context of its own unless given one
        self._own_ctx = context is None
        self.ctx = zmq.Context() if context is None else context
        self.limits = server_limits(config.max_message_bytes)
        self.state: ShardState | None = None
        self.admission = Admission(config.num_workers)
        self.parked: list[Parked] = []
        self.links: dict[bytes, ServerLink] = {}   # same-host connections that negotiated the shm path
        self.lanes: dict[bytes, ServerLane] = {}   # ... and the doorbell lane (ps.lane) for their headers
        self.bell: Bell | None = None               # the lanes' doorbell (made at bind, same-host shards only)
        self._spin = Waiter(0.0)                    # its spin: a few µs of looking at the lanes before poll
        self._applied = False                 # whether the request being handled changed the shard (a push applied)
        self.counters = {"messages": 0, "malformed": 0, "errors": 0, "pulls": 0, "pushes": 0, "checkpoints": 0,
                         "internal_errors": 0, "nonfinite_refused": 0, "nonfinite_skipped": 0, "refused": 0, "lane": 0,
                         "peers_gone": 0, "replies_released": 0, "checkpoint_failures": 0,
                         "membership_changes": 0,
                         "push_bytes": 0, "pull_bytes": 0}   # tensor payload received in pushes, sent in reads
        self.address = ""
        self.restored_from: str | None = None
        self.rejected_checkpoints: list[list[str]] = []
        self._last_ckpt_version = -1
        self._ckpt_attempt_version = -1     # the version of the last periodic attempt (failed or not)
        self.checkpoint_error: str | None = None   # why the last periodic checkpoint failed (None: it did not)
        self.last_checkpoint: str | None = None
        self.incarnation = secrets.token_hex(8)
        self.heartbeat: Callable[[float, int], None] | None = None
        self.stop_reason: str | None = None
        self._stop = False
        self._inflight: list[Any] = []      # trackers of zero-copy pull replies that still reference the params
        self._gone: set[bytes] = set()      # connections a reply could not be routed to
        self._last_sweep = time.monotonic()
        self._notice = encode("ok", seq=0, src=config.shard_id, meta={"notice": "liveness probe (ignore)"})
        self._auth: Any = None              # the ZAP authenticator (PLAIN or CURVE)
        self.sock: zmq.Socket | None = None
        found = restore(config)             # newest valid checkpoint; older ones while newer are rejected
        if found is not None:
            path, self.state, self.rejected_checkpoints = found
            self.restored_from = str(path)
            self._last_ckpt_version = self._ckpt_attempt_version = self.state.version

    def request_stop(self, reason: str = "stop requested") -> None:
        """End the loop after the current message (signal-safe); a final checkpoint follows if configured."""
        self.stop_reason = self.stop_reason or reason
        self._stop = True

    def _beat(self, now: float) -> None:
        if self.heartbeat is not None:
            self.heartbeat(now, self.state.version if self.state is not None else -1)

    @property
    def registered(self) -> dict[bytes, int]:
        """identity -> worker id of every registered connection."""
        return self.admission.registered

    # ------------------------------------------------------------------ socket
    def bind(self) -> str:
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)   # an unroutable reply raises: its peer is gone
        try:
            users = shard_users(self.config.num_workers)
            if self.config.curve_keys_dir:    # cluster key pair as the shard's identity, role keys from the secret
                self._auth = curve_server(self.ctx, self.sock, load_keys(self.config.curve_keys_dir),
                                          self.config.secret, users)
            else:
                self._auth = plain_server(self.ctx, self.sock, self.config.secret, users)
            self.sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes + (1 << 20))
            b = self.config.bind
            if b.startswith("tcp://") and b.endswith(":0"):
                port = self.sock.bind_to_random_port(b[: b.rindex(":")])
                self.address = f"{b[: b.rindex(':')]}:{port}"
            else:
                self.sock.bind(b)
                self.address = b
            if self.config.shm and lane_enabled():
                try:
                    self.bell = Bell(f"s{self.config.shard_id}")
                except OSError:                   # no FIFO in /dev/shm: headers go through ZeroMQ only
                    self.bell = None
        except BaseException as e:             # e.g. address in use: leave no socket or ZAP thread behind
            self._close()
            if isinstance(e, zmq.ZMQError):
                raise ConfigError(f"cannot bind to {self.config.bind}: {e.strerror}; choose another port") from None
            raise
        return self.address

    def _close(self) -> None:
        for link in self.links.values():
            link.close()
        self.links.clear()
        for lane in self.lanes.values():
            lane.close()
        self.lanes.clear()
        if self.bell is not None:
            self.bell.close()
            self.bell = None
        if self.sock is not None:
            self.sock.close(0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._own_ctx:
            self.ctx.term()
            self._own_ctx = False

    def serve_forever(self) -> None:
        if self.sock is None:
            self.bind()
        assert self.sock is not None
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        bell = self.bell.fd if self.bell is not None else None
        if bell is not None:
            poller.register(bell, zmq.POLLIN)
        last_msg = time.monotonic()
        try:
            while not self._stop:
                self._beat(time.monotonic())
                if self.lanes and self._spin.spin(self._lane_or_zmq):
                    events = {self.sock: POLLIN} if self.sock.getsockopt(EVENTS) & POLLIN else {}
                else:
                    events = dict(poller.poll(50))  # <= the heartbeat interval
                now = time.monotonic()
                if bell in events:
                    self.bell.drain()               # first: a ring after this wakes the next poll
                if self.lanes:                      # every pass (a few words to read): no ring can be missed
                    for identity in list(self.lanes):
                        if self._serve_lane(identity, now):
                            last_msg = now
                        if self._stop:
                            break
                if self.sock in events and not self._stop:
                    for _ in range(64):   # drain a burst, then check timeouts
                        if not self.sock.getsockopt(EVENTS) & POLLIN:   # ~1 µs; a failing recv ~10 µs
                            break
                        try:
                            frames = self.sock.recv_multipart(NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        last_msg = now = time.monotonic()
                        identity = frames[0].bytes
                        if self.lanes and identity in self.lanes:   # its lane first: order per connection
                            self._serve_lane(identity, now)
                        self.handle(identity, frames[1:], now, _user_id(frames[0]))
                        if self._stop:
                            break
                self._expire_parked(now)
                self._sweep(now)
                if self.config.idle_timeout and now - last_msg > self.config.idle_timeout:
                    log.warning("shard %d idle for %.0fs: exiting", self.config.shard_id, self.config.idle_timeout)
                    break
        finally:
            if self.state is not None and self.config.checkpoint_dir and self._stop:
                try:                                 # the final checkpoint: nothing applied is lost
                    self._checkpoint()
                except (OSError, PSError) as e:
                    log.error("shard %d: final checkpoint failed: %s", self.config.shard_id, e)
                    self.checkpoint_error = f"final checkpoint failed: {e}"
            self._close()

    def _lane_or_zmq(self) -> bool:
        """A request is waiting in a lane, or a ZeroMQ message in the socket (the spin's condition)."""
        return any(lane.waiting() for lane in self.lanes.values()) or bool(
            self.sock is not None and self.sock.getsockopt(EVENTS) & POLLIN)

    def _serve_lane(self, identity: bytes, now: float) -> bool:
        """Handle the request waiting in `identity`'s lane, if any; whether there was one."""
        lane = self.lanes.get(identity)
        if lane is None:
            return False
        try:
            frame = lane.take()
        except WireError as e:                     # a torn or impossible slot: dropped, like an unreadable frame
            self.counters["malformed"] += 1
            log.debug("lane of %r: %s", identity, e)
            return False
        if frame is None:
            return False
        self.counters["lane"] += 1
        self.handle(identity, [frame], now, lane.user)
        return True

    def _send(self, identity: bytes, op: str, seq: int, meta: dict[str, Any] | None = None,
              tensors: Any = None, track: bool = False) -> None:
        assert self.sock is not None
        frames = encode(op, tensors, seq=seq, src=self.config.shard_id, meta=meta or {})
        lane = self.lanes.get(identity) if self.lanes else None
        if lane is not None and lane.inflight == seq:  # the request came by the lane: so does its answer
            if len(frames) == 1 and not track and lane.answer(seq, frames[0]):
                return
            lane.inflight = None                       # (too large, or tensor frames: through ZeroMQ)
        try:
            tracker = self.sock.send_multipart([identity, *frames], copy=False, flags=NOBLOCK, track=track)
        except zmq.ZMQError as e:  # peer gone (freed at the next sweep) or its queue full: drop the reply
            if e.errno == zmq.EHOSTUNREACH:
                self._gone.add(identity)
            log.debug("reply to %r dropped: %s", identity, e)
            return
        if track:
            self._inflight.append(tracker)

    def _before_update(self) -> None:
        """Copy-on-write: if a zero-copy pull reply may still be reading the parameters, move them to new storage."""
        if self._inflight:
            if any(not t.done for t in self._inflight) and self.state is not None:
                self.state.unshare_params()
            self._inflight.clear()

    def _error(self, identity: bytes, seq: int, exc: BaseException, refused_push: bool = False) -> None:
        """An error reply; `refused_push`: the request was a push and nothing of it was applied (no clock moved),
        so its client takes its clock back (ps.client) and both sides stay where they were."""
        self.counters["errors"] += 1
        self.counters["nonfinite_refused"] += type(exc).__name__ == "NonFiniteGradientError"
        self.counters["refused"] += isinstance(exc, AccessDeniedError)
        kind = type(exc).__name__ if isinstance(exc, PSError) else "ProtocolError"
        meta: dict[str, Any] = {"kind": kind, "error": str(exc)[:2000]}
        if refused_push:
            meta["refused_push"] = True
        self._send(identity, "error", seq, meta)

    # ------------------------------------------------------------------ liveness
    def _alive(self, identity: bytes) -> bool:
        """Whether a message to `identity` can still be routed (a seq-0 notice that clients ignore)."""
        assert self.sock is not None
        try:
            self.sock.send_multipart([identity, *self._notice], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            return e.errno != zmq.EHOSTUNREACH     # EAGAIN: alive, only slow to read
        return True

    def _forget(self, identity: bytes, keep_lane: bool = False) -> None:
        """Free everything a connection holds: registration, parked reads (nobody to answer), shm link, and its
        lane unless `keep_lane` (a live connection removed from the membership: its next request, which may already
        be in the lane, is still read and answered, with NotRegisteredError, until it registers again)."""
        self.parked = [p for p in self.parked if p.identity != identity]
        link = self.links.pop(identity, None)
        if link is not None:
            link.close()
        if not keep_lane:
            lane = self.lanes.pop(identity, None)
            if lane is not None:
                lane.close()
        self.admission.forget(identity)

    def _sweep(self, now: float) -> None:
        """Free vanished connections; give back the reply segments of idle links."""
        gone, self._gone = self._gone, set()
        if now - self._last_sweep >= self.config.sweep_interval:
            self._last_sweep = now
            gone |= {i for i in self.admission.quiet(now, self.config.sweep_interval) if not self._alive(i)}
            for identity in [i for i in self.lanes if i not in self.admission.peers and not self._alive(i)]:
                self.lanes.pop(identity).close()    # a lane kept past a membership removal, its client gone
            idle = self.config.shm_idle_timeout
            for link in self.links.values():
                if idle and link.last_reply and now - link.last_reply > idle and link.release_reply():
                    link.last_reply = 0.0
                    self.counters["replies_released"] += 1
        for identity in gone:
            if identity in self.admission.peers:
                self.counters["peers_gone"] += 1
                self._forget(identity)

    # ------------------------------------------------------------------ dispatch
    def handle(self, identity: bytes, frames: list[Any], now: float, user: str | None = None) -> None:
        """Handle one request from the connection `identity`, authenticated as `user`; never raises (except
        KeyboardInterrupt/SystemExit)."""
        self.counters["messages"] += 1
        self._applied = False                    # (reset first: every refusal below leaves the shard unchanged)
        peer = self.admission.seen(identity, user, now)
        try:
            msg = decode(frames, self.limits, as_torch=True)
        except WireError as e:
            self.counters["malformed"] += 1
            self._error(identity, 0, ProtocolError(f"malformed message: {e}"))
            return
        if msg.op == "push" and msg.tensors:       # frames: counted as they arrive, refused or not (shm: _on_push)
            self.counters["push_bytes"] += sum(int(t.nbytes) for t in msg.tensors.values())
        try:
            if msg.seq < 1:
                raise ProtocolError(f"request id (seq) must be a positive integer, got {msg.seq}")
            if msg.seq <= peer.last_seq:
                raise DuplicateRequestError(f"request id {msg.seq} is not larger than the last accepted one "
                                            f"({peer.last_seq}) on this connection; duplicate or out of order")
            self.admission.check(identity, msg.op, msg.src)
            handler = getattr(self, f"_on_{msg.op}")
            handler(identity, msg, now)          # raises before changing anything if the request is invalid
            peer.last_seq = msg.seq
        except PSError as e:
            self._error(identity, msg.seq, e, refused_push=msg.op == "push" and not self._applied)
        except Exception as e:  # a bug or an unforeseen input: answer, log, keep serving
            self.counters["internal_errors"] += 1
            log.exception("shard %d: unexpected error on %s", self.config.shard_id, msg.op)
            self._error(identity, msg.seq, ProtocolError(f"server could not handle {msg.op}: "
                                                         f"{type(e).__name__}: {e}"))   # (its fate is unknown)
        if self._gone:
            self._sweep(now)

    def _on_ping(self, identity: bytes, msg: Any, now: float) -> None:
        self._send(identity, "ok", msg.seq, {"shard": self.config.shard_id})

    def _on_register(self, identity: bytes, msg: Any, now: float) -> None:
        worker = meta_int(msg.meta, "worker", 0, self.config.num_workers - 1)
        if msg.tensors:
            raise ProtocolError("register carries no tensors")
        token = msg.meta.get("token")
        evict = self.admission.check_register(identity, worker, msg.src, token, self._alive)
        wants_shm = self.config.shm and "shm_probe" in msg.meta
        if wants_shm:
            self._check_link_cap(identity, evict)
        for other in evict:                  # the same client's old connection, or a vanished one
            self._forget(other)
        self.admission.bind(identity, worker, token)
        lane = self.lanes.pop(identity, None)       # every registration brings a new lane segment (and the
        if lane is not None:                        # cancelled reads below are answered through ZeroMQ)
            lane.close()
        self._cancel_parked(identity, "this connection registered again (resync); read again")
        old = self.links.pop(identity, None)
        if old is not None:
            old.close()
        link = ServerLink.accept_probe(self.config.shard_id, worker, msg.meta) if wants_shm else None
        if link is not None:
            self.links[identity] = link
        offer: dict[str, Any] = dict(link.reply_probe) if link is not None else {}
        if link is not None and self.bell is not None and "lane" in msg.meta:   # (so lanes <= max_shm_links)
            lane = ServerLane.accept(self.config.shard_id, worker, msg.meta, self.admission.peers[identity].user)
            if lane is not None:
                self.lanes[identity] = lane
                offer.update(lane=True, lane_bell=self.bell.name)
        st = self.state
        self._send(identity, "ok", msg.seq, {"shm": link is not None, **offer,
            "shard": self.config.shard_id, "policy": self.config.policy, "num_workers": self.config.num_workers,
            "initialized": st is not None, "version": st.version if st else 0, "incarnation": self.incarnation,
            "restored_from": self.restored_from, "member": st is None or worker in st.members,
            "clock": st.clocks[worker] if st else 0, "nonfinite": self.config.nonfinite,
            "max_message_bytes": self.config.max_message_bytes,
            "keys": {k: list(s) for k, s in st.shapes.items()} if st else {}})

    def _check_link_cap(self, identity: bytes, evict: list[bytes]) -> None:
        """ShmLimitError if a new shm link would exceed max_shm_links (vanished holders are freed first)."""
        cap = self.config.max_shm_links or self.config.num_workers
        others = [i for i in self.links if i != identity and i not in evict]
        if len(others) >= cap:
            for i in others:
                if not self._alive(i):
                    self.counters["peers_gone"] += 1
                    self._forget(i)
            if len([i for i in self.links if i != identity and i not in evict]) >= cap:
                raise ShmLimitError(f"shard {self.config.shard_id} already holds {cap} shared-memory links (its "
                                    "cap, max_shm_links); close idle clients, or register without shm "
                                    "(connect(..., shm=False))")

    def _on_init(self, identity: bytes, msg: Any, now: float) -> None:
        if self.state is not None:
            where = f", restored from {self.restored_from}" if self.restored_from else ""
            raise AlreadyInitializedError(f"already initialised (version {self.state.version}{where}); a second "
                                          "init is refused, the parameters stay as they are")
        if not msg.tensors:
            raise ProtocolError("init must carry this shard's parameters")
        for k, t in msg.tensors.items():
            if t.is_floating_point() and not _all_finite(t):
                raise ProtocolError(f"init parameter {k!r} holds NaN or Inf; refused")
        self.state = ShardState(dict(msg.tensors), self.config.spec, self.config.policy,
                                self.config.num_workers, shard_id=self.config.shard_id)
        if self.config.checkpoint_dir:      # version 0 at once: a shard lost before its first checkpoint_every
            self._periodic_checkpoint()     # interval comes back holding the initial parameters, not empty
        self._send(identity, "ok", msg.seq, {"initialized": True, "version": 0})
        self._retry_parked(now)

    def _on_unregister(self, identity: bytes, msg: Any, now: float) -> None:
        """A client closing: forget the connection (its shared-memory link, parked reads). No reply."""
        self._forget(identity)

    def _on_push(self, identity: bytes, msg: Any, now: float) -> None:
        worker = self.admission.peers[identity].worker
        grads = msg.tensors
        if "shm" in msg.meta:                              # the gradients lie in the client's segment
            link = self.links.get(identity)
            if link is None or msg.tensors:
                raise ProtocolError("push names shared-memory gradients but this connection did not negotiate "
                                    "the shm path at register (or also sent frames)")
            try:
                grads = link.grads(msg.meta["shm"])
            except (WireError, OSError, ValueError) as e:
                raise ProtocolError(f"bad shared-memory push: {e}") from None
            self.counters["push_bytes"] += sum(int(g.nbytes) for g in grads.values())   # mapped from its segment
        if self.state is None:
            raise NotInitializedError(f"shard {self.config.shard_id} has no parameters yet: the owner must call "
                                      "init before anyone pushes")
        if "compress" in msg.meta:                         # topk / sign: decoded (and validated) to whole gradients
            if "shm" in msg.meta:
                raise ProtocolError("a compressed push travels as frames, not through shared memory")
            grads = {k: torch.from_numpy(g) for k, g in compression.decode(msg.meta, grads, self._layout()).items()}
        self._before_update()
        clock = meta_int(msg.meta, "clock")
        with trace.span("apply push", "ps", worker=worker, clock=clock):     # (the end of a push's flow)
            res = self.state.push(worker, clock, meta_int(msg.meta, "version"), grads, now,
                                  skip_nonfinite=self.config.nonfinite == "skip")
        self._applied = True                               # (an error from here on: the push stands)
        self.counters["pushes"] += 1
        self.counters["nonfinite_skipped"] += res.status == "skipped"
        if self.heartbeat is not None:                     # the parent learns every applied version at once
            self.heartbeat(now, self.state.version)
        every = self.config.checkpoint_every
        if every and self.state.version // every > max(self._ckpt_attempt_version, 0) // every:
            self._periodic_checkpoint()
        ack = {"status": res.status, "version": res.version, "clock": res.clock,
               "staleness": [list(x) for x in res.staleness]}
        if self.checkpoint_error is not None:
            ack["checkpoint_error"] = self.checkpoint_error
        if msg.meta.get("pull") is True:                   # push_pull: read at the new clock, then answer once
            p = Parked(identity, msg.seq, worker, self.state.clocks[worker], now,
                       self._shm_reply(identity, msg.meta), ack)
            if not self._try_pull(p, now):
                self.parked.append(p)
        else:
            self._send(identity, "ok", msg.seq, ack)
        if self.parked:
            self._retry_parked(now)

    def _layout(self) -> dict[str, tuple[int, np.dtype]]:
        """{key: (numel, numpy dtype)} of this shard's parameters: what a compressed push must decode to."""
        return {k: (p.numel(), torch.empty(0, dtype=p.dtype).numpy().dtype) for k, p in self.state.params.items()}

    def _on_stats(self, identity: bytes, msg: Any, now: float) -> None:
        st = self.state
        meta = {"shard": self.config.shard_id, "counters": dict(self.counters), "parked": len(self.parked),
                "restored_from": self.restored_from, "connections": len(self.admission.peers),
                "links": len(self.links), "nonfinite": self.config.nonfinite, "incarnation": self.incarnation,
                "checkpoint_error": self.checkpoint_error, "last_checkpoint": self.last_checkpoint}
        if st is not None:
            meta.update(version=st.version, clocks=list(st.clocks), committed=st.committed_clock,
                        policy=str(st.policy), stats=st.stats.summary(), members=list(st.members),
                        membership_version=st.membership_version, membership_log=st.membership_log)
            if msg.meta.get("series") is True:
                meta["series"] = [list(x) for x in st.stats.series]
        self._send(identity, "ok", msg.seq, wire_safe(meta))

    def _checkpoint(self) -> str:
        if not self.config.checkpoint_dir or self.state is None:
            raise ConfigError("this server has no checkpoint directory (start it with --checkpoint-dir) or no "
                              "parameters yet")
        tensors, meta = self.state.state_dict()
        path = save_checkpoint(self.config.checkpoint_dir, tensors, meta)
        self._last_ckpt_version = self._ckpt_attempt_version = self.state.version
        self.counters["checkpoints"] += 1
        self.checkpoint_error = None
        self.last_checkpoint = str(path)
        return str(path)

    def _periodic_checkpoint(self) -> None:
        """A checkpoint_every checkpoint; a failure (unwritable directory, disk full) is counted and reported in
        the push acks, never raised: the push that triggered it was applied."""
        assert self.state is not None
        self._ckpt_attempt_version = self.state.version
        try:
            self._checkpoint()
        except (OSError, PSError) as e:
            self.counters["checkpoint_failures"] += 1
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            self.checkpoint_error = (f"shard {self.config.shard_id}: checkpoint at version {self.state.version} "
                                     f"into {self.config.checkpoint_dir} failed ({type(e).__name__}: {why}); the "
                                     f"last good one is {self.last_checkpoint or self.restored_from or 'none'}")
            log.error("%s", self.checkpoint_error)

    def _on_checkpoint(self, identity: bytes, msg: Any, now: float) -> None:
        path = self._checkpoint()
        self._send(identity, "ok", msg.seq, {"path": path, "version": self.state.version if self.state else 0})

    def _on_members(self, identity: bytes, msg: Any, now: float) -> None:
        """Admin: set the versioned membership; forget removed workers' connections; release what waited for them."""
        if self.state is None:
            raise NotInitializedError(f"shard {self.config.shard_id} has no parameters yet: set members after init")
        alive = meta_list(msg.meta, "alive")
        version = meta_int(msg.meta, "version")
        before = list(self.state.members)
        self._before_update()
        self.state.set_members(alive, version, now)
        if self.state.members != before:
            self.counters["membership_changes"] += 1
            gone = [i for i, w in self.admission.registered.items() if w not in self.state.members]
            for identity_ in gone:                 # their shm links and parked reads go with them
                self._forget(identity_, keep_lane=True)
        self._send(identity, "ok", msg.seq, wire_safe({
            "members": list(self.state.members), "version": self.state.membership_version,
            "committed": self.state.committed_clock, "clocks": list(self.state.clocks),
            "shard_version": self.state.version}))
        if self.parked:
            self._retry_parked(now)

    def _on_shutdown(self, identity: bytes, msg: Any, now: float) -> None:
        self._send(identity, "ok", msg.seq, {})
        self.request_stop("shutdown by admin")


def _user_id(frame: Any) -> str | None:
    """The user the connection proved at the handshake (ZAP's User-Id), or None."""
    try:
        return frame.get("User-Id")
    except (zmq.ZMQError, AttributeError):
        return None


def serve(config: ServerConfig, ready: Callable[[str], None] | None = None,
          context: zmq.Context | None = None) -> None:
    """Run one shard until shutdown (or idle timeout); `ready(address)` is called once bound."""
    server = ShardServer(config, context)
    address = server.bind()
    if ready is not None:
        ready(address)
    server.serve_forever()


def __getattr__(name: str) -> Any:
    """`from pslab.ps.server import start_servers` keeps working: process management lives in pslab.ps.processes."""
    if name in ("start_servers", "ServerGroup"):
        from . import processes
        return getattr(processes, name)
    raise AttributeError(f"module 'pslab.ps.server' has no attribute {name!r}")
