"""One shard's server: a ZeroMQ ROUTER loop around a `ShardState` (its `ServerConfig` lives in ps.config, shard
processes in ps.processes; both stay importable from here).

The loop is single-threaded: receive -> validate (wire limits, op, registration, seq, fields) -> act on the
ShardState -> reply. A pull that the consistency gate (or a missing init) holds back is parked and retried after
every push/init; a parked pull older than `request_timeout` gets a GateTimeoutError reply. Any exception while
handling one message becomes an error reply to that sender; the loop itself never stops on a bad message.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import zmq

from collectives.curve import serve_curve
from collectives.errors import WireError
from collectives.wire import decode, encode

from .checkpoint import latest_checkpoint, save_checkpoint
from .config import ServerConfig
from .errors import ConfigError, DuplicateRequestError, GateTimeoutError, NotInitializedError, ProtocolError, PSError
from .protocol import NEEDS_REGISTRATION, meta_int, server_limits, wire_safe
from .shard import ShardState
from .shm_path import ServerLink

log = logging.getLogger("ps.server")


@dataclass
class _Parked:
    identity: bytes
    seq: int
    worker: int
    clock: int
    since: float
    shm: bool = False                     # answer through the connection's shared-memory segment
    ack: dict[str, Any] | None = None     # push_pull: the push's ack, sent with the read


class ShardServer:
    """Serve one shard on a ROUTER socket (call `bind()` then `serve_forever()`)."""

    def __init__(self, config: ServerConfig, context: zmq.Context | None = None) -> None:
        config.validate()
        self.config = config
        # CURVE's authenticator owns the context's ZAP endpoint: a CURVE shard gets a context of its own
        self._own_ctx = context is None and bool(config.curve_keys_dir)
        self.ctx = zmq.Context() if self._own_ctx else (context or zmq.Context.instance())
        self.limits = server_limits(config.max_message_bytes)
        self.state: ShardState | None = None
        self.registered: dict[bytes, int] = {}
        self.last_seq: dict[bytes, int] = {}
        self.parked: list[_Parked] = []
        self.links: dict[bytes, ServerLink] = {}   # same-host connections that negotiated the shm path
        self.counters = {"messages": 0, "malformed": 0, "errors": 0, "pulls": 0, "pushes": 0, "checkpoints": 0,
                         "internal_errors": 0, "nonfinite_refused": 0}
        self.address = ""
        self.restored_from: str | None = None
        self._last_ckpt_version = -1
        self._stop = False
        self._inflight: list[Any] = []      # trackers of zero-copy pull replies that still reference the params
        self._auth: Any = None              # CURVE authenticator, if configured
        self.sock: zmq.Socket | None = None
        if config.checkpoint_dir:
            found = latest_checkpoint(config.checkpoint_dir)
            if found is not None:
                path, tensors, meta = found
                config.check_checkpoint(path, meta)
                self.state = ShardState.from_state_dict(tensors, meta)
                self.restored_from = str(path)
                self._last_ckpt_version = self.state.version
                for p, why in meta.get("_rejected", []):
                    log.warning("rejected checkpoint %s: %s", p, why)

    # ------------------------------------------------------------------ socket
    def bind(self) -> str:
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        try:
            if self.config.curve_keys_dir:
                self._auth = serve_curve(self.ctx, self.sock, self.config.curve_keys_dir)
            self.sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes + (1 << 20))
            b = self.config.bind
            if b.startswith("tcp://") and b.endswith(":0"):
                port = self.sock.bind_to_random_port(b[: b.rindex(":")])
                self.address = f"{b[: b.rindex(':')]}:{port}"
            else:
                self.sock.bind(b)
                self.address = b
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
        last_msg = time.monotonic()
        try:
            while not self._stop:
                events = dict(poller.poll(50))
                now = time.monotonic()
                if self.sock in events:
                    for _ in range(64):   # drain a burst, then check timeouts
                        try:
                            frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        last_msg = now = time.monotonic()
                        self.handle(frames[0].bytes, frames[1:], now)
                        if self._stop:
                            break
                self._expire_parked(now)
                if self.config.idle_timeout and now - last_msg > self.config.idle_timeout:
                    log.warning("shard %d idle for %.0fs: exiting", self.config.shard_id, self.config.idle_timeout)
                    break
        finally:
            if self.state is not None and self.config.checkpoint_dir and self._stop:
                self._checkpoint()
            self._close()

    def _send(self, identity: bytes, op: str, seq: int, meta: dict[str, Any] | None = None,
              tensors: Any = None, track: bool = False) -> None:
        assert self.sock is not None
        frames = encode(op, tensors, seq=seq, src=self.config.shard_id, meta=meta or {})
        try:
            tracker = self.sock.send_multipart([identity, *frames], copy=False, flags=zmq.NOBLOCK, track=track)
        except zmq.ZMQError as e:  # peer gone or its queue full: drop the reply, keep serving
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

    def _error(self, identity: bytes, seq: int, exc: BaseException) -> None:
        self.counters["errors"] += 1
        self.counters["nonfinite_refused"] += type(exc).__name__ == "NonFiniteGradientError"
        kind = type(exc).__name__ if isinstance(exc, PSError) else "ProtocolError"
        self._send(identity, "error", seq, {"kind": kind, "error": str(exc)[:2000]})

    # ------------------------------------------------------------------ dispatch
    def handle(self, identity: bytes, frames: list[Any], now: float) -> None:
        """Handle one request; never raises (except KeyboardInterrupt/SystemExit)."""
        self.counters["messages"] += 1
        try:
            msg = decode(frames, self.limits, as_torch=True)
        except WireError as e:
            self.counters["malformed"] += 1
            self._error(identity, 0, ProtocolError(f"malformed message: {e}"))
            return
        try:
            if msg.seq < 1:
                raise ProtocolError(f"request id (seq) must be a positive integer, got {msg.seq}")
            last = self.last_seq.get(identity, 0)
            if msg.seq <= last:
                raise DuplicateRequestError(f"request id {msg.seq} is not larger than the last accepted one "
                                            f"({last}) on this connection; duplicate or out of order")
            if msg.op in NEEDS_REGISTRATION and identity not in self.registered:
                raise ProtocolError(f"{msg.op} from an unregistered connection; send 'register' with your worker "
                                    "id first")
            handler = getattr(self, f"_on_{msg.op}")
            handler(identity, msg, now)          # raises before changing anything if the request is invalid
            if msg.op != "unregister":
                self.last_seq[identity] = msg.seq
        except PSError as e:
            self._error(identity, msg.seq, e)
        except Exception as e:  # a bug or an unforeseen input: answer, log, keep serving
            self.counters["internal_errors"] += 1
            log.exception("shard %d: unexpected error on %s", self.config.shard_id, msg.op)
            self._error(identity, msg.seq, ProtocolError(f"server could not handle {msg.op}: "
                                                         f"{type(e).__name__}: {e}"))

    def _on_ping(self, identity: bytes, msg: Any, now: float) -> None:
        self._send(identity, "ok", msg.seq, {"shard": self.config.shard_id})

    def _on_register(self, identity: bytes, msg: Any, now: float) -> None:
        worker = meta_int(msg.meta, "worker", 0, self.config.num_workers - 1)
        if msg.tensors:
            raise ProtocolError("register carries no tensors")
        self.registered[identity] = worker
        self._cancel_parked(identity, "this connection registered again (resync); read again")
        old = self.links.pop(identity, None)
        if old is not None:
            old.close()
        link = ServerLink.accept_probe(self.config.shard_id, worker, msg.meta) if self.config.shm else None
        if link is not None:
            self.links[identity] = link
        st = self.state
        self._send(identity, "ok", msg.seq, {"shm": link is not None, **(link.reply_probe if link else {}),
            "shard": self.config.shard_id, "policy": self.config.policy, "num_workers": self.config.num_workers,
            "initialized": st is not None, "version": st.version if st else 0,
            "clock": st.clocks[worker] if st else 0,
            "keys": {k: list(s) for k, s in st.shapes.items()} if st else {}})

    def _on_init(self, identity: bytes, msg: Any, now: float) -> None:
        if self.state is not None:
            self._send(identity, "ok", msg.seq, {"initialized": False, "version": self.state.version})
            return
        if not msg.tensors:
            raise ProtocolError("init must carry this shard's parameters")
        self.state = ShardState(dict(msg.tensors), self.config.spec, self.config.policy,
                                self.config.num_workers, shard_id=self.config.shard_id)
        self._send(identity, "ok", msg.seq, {"initialized": True, "version": 0})
        self._retry_parked(now)

    def _on_pull(self, identity: bytes, msg: Any, now: float) -> None:
        worker = self.registered[identity]
        clock = meta_int(msg.meta, "clock")
        if msg.tensors:
            raise ProtocolError("pull carries no tensors")
        if self.state is not None:
            self.state._check_clock(worker, clock, "pull")
        p = _Parked(identity, msg.seq, worker, clock, now, self._shm_reply(identity, msg.meta))
        if not self._try_pull(p, now):
            self.parked.append(p)

    def _shm_reply(self, identity: bytes, meta: Any) -> bool:
        """A read asked to be answered through shared memory, and this connection negotiated it."""
        return meta.get("shm_reply") is True and identity in self.links

    def _try_pull(self, p: _Parked, now: float) -> bool:
        st = self.state
        if st is None or not st.may_read(p.worker, p.clock, now):
            return False
        r = st.read(p.worker, p.clock, now, copy=False)   # zero-copy; _before_update protects it (copy-on-write)
        self.counters["pulls"] += 1
        meta = {"version": r.version, "clock": r.clock, "committed": r.committed_clock}
        if p.ack is not None:                              # push_pull: the ack, with the read under "read"
            meta = dict(p.ack, read=meta)
        flat = {k: t.reshape(-1) for k, t in r.params.items()}
        link = self.links.get(p.identity) if p.shm else None
        entries = None
        if link is not None:                               # one memcpy into the client's view; nothing to track
            try:
                entries = link.reply(flat)
            except OSError:                                # /dev/shm full: this answer goes as frames
                entries = None
        if entries is not None:
            self._send(p.identity, "ok", p.seq, dict(meta, shm=entries))
        else:
            self._send(p.identity, "ok", p.seq, meta, flat, track=True)
        return True

    def _retry_parked(self, now: float) -> None:
        still = []
        for p in self.parked:
            try:
                if not self._try_pull(p, now):
                    still.append(p)
            except Exception as e:             # answered with the error, never retried (nor answered twice)
                if not isinstance(e, PSError):
                    self.counters["internal_errors"] += 1
                    log.exception("shard %d: unexpected error answering a parked read", self.config.shard_id)
                self._error(p.identity, p.seq, e if isinstance(e, PSError) else
                            ProtocolError(f"server could not answer the read: {type(e).__name__}: {e}"))
        self.parked = still

    def _cancel_parked(self, identity: bytes, why: str) -> None:
        keep = []
        for p in self.parked:
            if p.identity == identity:
                self._error(p.identity, p.seq, ProtocolError(f"read at clock {p.clock} cancelled: {why}"))
            else:
                keep.append(p)
        self.parked = keep

    def _on_unregister(self, identity: bytes, msg: Any, now: float) -> None:
        """A client closing: forget the connection (its shared-memory link, parked reads). No reply."""
        self._cancel_parked(identity, "the client unregistered")
        link = self.links.pop(identity, None)
        if link is not None:
            link.close()
        self.registered.pop(identity, None)
        self.last_seq.pop(identity, None)

    def _expire_parked(self, now: float) -> None:
        t = self.config.request_timeout
        if not t or not self.parked:
            return
        keep = []
        for p in self.parked:
            if now - p.since > t:
                who = self.state.blocking_workers(p.clock) if self.state else "the owner's init"
                pushed = (f" (its push was applied: {p.ack['status']}, shard version {p.ack['version']})"
                          if p.ack is not None else "")
                self._error(p.identity, p.seq, GateTimeoutError(
                    f"pull at clock {p.clock} from worker {p.worker} waited {now - p.since:.1f}s (> request timeout "
                    f"{t:g}s) under {self.config.policy}; still waiting for {who}{pushed}"))
            else:
                keep.append(p)
        self.parked = keep

    def _on_push(self, identity: bytes, msg: Any, now: float) -> None:
        if self.state is None:
            raise NotInitializedError(f"shard {self.config.shard_id} has no parameters yet: the owner must call "
                                      "init before anyone pushes")
        worker = self.registered[identity]
        grads = msg.tensors
        if "shm" in msg.meta:                              # the gradients lie in the client's segment
            link = self.links.get(identity)
            if link is None or msg.tensors:
                raise ProtocolError("push names shared-memory gradients but this connection did not negotiate "
                                    "the shm path at register (or also sent frames)")
            try:
                grads = link.grads(msg.meta["shm"])
            except WireError as e:
                raise ProtocolError(f"bad shared-memory push: {e}") from None
        self._before_update()
        res = self.state.push(worker, meta_int(msg.meta, "clock"), meta_int(msg.meta, "version"), grads, now)
        self.counters["pushes"] += 1
        ack = {"status": res.status, "version": res.version, "clock": res.clock,
               "staleness": [list(x) for x in res.staleness]}
        if msg.meta.get("pull") is True:                   # push_pull: read at the new clock, then answer once
            p = _Parked(identity, msg.seq, worker, self.state.clocks[worker], now,
                        self._shm_reply(identity, msg.meta), ack)
            if not self._try_pull(p, now):
                self.parked.append(p)
        else:
            self._send(identity, "ok", msg.seq, ack)
        every = self.config.checkpoint_every
        if every and self.state.version // every > max(self._last_ckpt_version, 0) // every:
            self._checkpoint()
        if self.parked:
            self._retry_parked(now)

    def _on_stats(self, identity: bytes, msg: Any, now: float) -> None:
        st = self.state
        meta = {"shard": self.config.shard_id, "counters": dict(self.counters), "parked": len(self.parked),
                "restored_from": self.restored_from}
        if st is not None:
            meta.update(version=st.version, clocks=list(st.clocks), committed=st.committed_clock,
                        policy=str(st.policy), stats=st.stats.summary())
            if msg.meta.get("series") is True:
                meta["series"] = [list(x) for x in st.stats.series]
        self._send(identity, "ok", msg.seq, wire_safe(meta))

    def _checkpoint(self) -> str:
        if not self.config.checkpoint_dir or self.state is None:
            raise ConfigError("this server has no checkpoint directory (start it with --checkpoint-dir) or no "
                              "parameters yet")
        tensors, meta = self.state.state_dict()
        path = save_checkpoint(self.config.checkpoint_dir, tensors, meta)
        self._last_ckpt_version = self.state.version
        self.counters["checkpoints"] += 1
        return str(path)

    def _on_checkpoint(self, identity: bytes, msg: Any, now: float) -> None:
        path = self._checkpoint()
        self._send(identity, "ok", msg.seq, {"path": path, "version": self.state.version if self.state else 0})

    def _on_shutdown(self, identity: bytes, msg: Any, now: float) -> None:
        self._send(identity, "ok", msg.seq, {})
        self._stop = True


def serve(config: ServerConfig, ready: Callable[[str], None] | None = None,
          context: zmq.Context | None = None) -> None:
    """Run one shard until shutdown (or idle timeout); `ready(address)` is called once bound."""
    server = ShardServer(config, context)
    address = server.bind()
    if ready is not None:
        ready(address)
    server.serve_forever()


def __getattr__(name: str) -> Any:
    """`from ps.server import start_servers` keeps working: process management lives in ps.processes."""
    if name in ("start_servers", "ServerGroup"):
        from . import processes
        return getattr(processes, name)
    raise AttributeError(f"module 'ps.server' has no attribute {name!r}")
