"""Reads that wait: a pull (or push_pull's read) that the consistency gate or a missing init holds back is parked
and retried after every push and init; one older than `request_timeout` is answered with a GateTimeoutError that
names the workers it waits for. A mixin of `ShardServer` (ps.server), which provides the socket, state and links.

A read is answered once: with the values (frames, or through the connection's shared-memory reply segment when it
asked for shm_reply and negotiated the path), or with an error. A re-register cancels the connection's parked
reads with an error reply; a connection that unregistered or vanished loses them silently (nobody to answer).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pslab.collectives import flight, trace

from .errors import GateTimeoutError, ProtocolError, PSError
from .protocol import meta_int

if TYPE_CHECKING:
    from .config import ServerConfig
    from .shard import ShardState
    from .shm_path import ServerLink

log = logging.getLogger("pslab.ps.server")


@dataclass
class Parked:
    identity: bytes
    seq: int
    worker: int
    clock: int
    since: float
    shm: bool = False                     # answer through the connection's shared-memory segment
    ack: dict[str, Any] | None = None     # push_pull: the push's ack, sent with the read


class Parking:
    """Parked reads of a shard server (see the module docstring)."""

    config: "ServerConfig"
    state: "ShardState | None"
    parked: list[Parked]
    links: dict[bytes, "ServerLink"]
    counters: dict[str, int]
    admission: Any

    def _send(self, identity: bytes, op: str, seq: int, meta: dict[str, Any] | None = None,
              tensors: Any = None, track: bool = False) -> None:
        raise NotImplementedError

    def _error(self, identity: bytes, seq: int, exc: BaseException) -> None:
        raise NotImplementedError

    def _on_pull(self, identity: bytes, msg: Any, now: float) -> None:
        worker = self.admission.peers[identity].worker
        clock = meta_int(msg.meta, "clock")
        if msg.tensors:
            raise ProtocolError("pull carries no tensors")
        if self.state is not None:
            self.state._check_clock(worker, clock, "pull")
        p = Parked(identity, msg.seq, worker, clock, now, self._shm_reply(identity, msg.meta))
        if not self._try_pull(p, now):
            self.parked.append(p)

    def _shm_reply(self, identity: bytes, meta: Any) -> bool:
        """A read asked to be answered through shared memory, and this connection negotiated it."""
        return meta.get("shm_reply") is True and identity in self.links

    def _try_pull(self, p: Parked, now: float) -> bool:
        st = self.state
        if st is None or not st.may_read(p.worker, p.clock, now):
            return False
        r = st.read(p.worker, p.clock, now, copy=False)   # zero-copy; _before_update protects it (copy-on-write)
        if now > p.since:                                  # it waited at the gate (monotonic = perf_counter's clock)
            trace.complete("parked at gate", "wait", p.since, now, worker=p.worker, clock=p.clock)
        self.counters["pulls"] += 1
        meta = {"version": r.version, "clock": r.clock, "committed": r.committed_clock}
        if p.ack is not None:                              # push_pull: the ack, with the read under "read"
            meta = dict(p.ack, read=meta)
        flat = st.flat_params()                            # (r.params as 1-D views, the same objects each time)
        link = self.links.get(p.identity) if p.shm else None
        entries, into = None, []
        if link is not None:                               # one memcpy into the client's view; nothing to track
            try:                                           # (split pieces: straight into the client's arena)
                entries, into = link.reply(flat, now)
            except OSError:                                # /dev/shm full: this answer goes as frames
                entries = None
        if entries is not None:
            self._send(p.identity, "ok", p.seq, dict(meta, shm=entries, **({"shm_into": into} if into else {})))
        else:
            self._send(p.identity, "ok", p.seq, meta, flat, track=True)
        self.counters["pull_bytes"] += sum(t.numel() * t.element_size() for t in flat.values())
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

    def gate_waits(self, now: float) -> list[str]:
        """Each parked read in words, naming the workers it waits for (the flight record's context)."""
        out = []
        for p in self.parked:
            who = self.state.blocking_workers(p.clock) if self.state is not None else None
            clocks = ", ".join(f"worker {w} at clock {self.state.clocks[w]}" for w in who) if who else ""
            out.append(f"worker {p.worker}'s read at clock {p.clock} has been parked at shard "
                       f"{self.config.shard_id}'s {self.config.policy} gate for {now - p.since:.1f} s, waiting for "
                       f"{clocks or 'the owner' + chr(39) + 's init'}")
        return out

    def _expire_parked(self, now: float) -> None:
        t = self.config.request_timeout
        if not t or not self.parked:
            return
        if any(now - p.since > t for p in self.parked):   # what it waited for, while it still waits (flight.py)
            flight.dump(f"a read parked at the gate past the request timeout ({t:g} s)")
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
