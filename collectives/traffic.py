"""Traffic accounting: bytes of tensor payload sent and received, per peer and per op.

This is what lets a student check the textbook figure: ring all-reduce moves 2(N-1)/N x tensor bytes through each
rank, independent of N, while gather-to-root + broadcast moves (N-1) x tensor bytes through the root.
Only tensor payload is counted (headers are a few dozen bytes and are counted apart as `header_bytes`); the torch
backend's figure is what the kernel counted on gloo's connections (sockmeter.py), its framing included.

`tally()` lets a caller see what one op counted: inside `with tally() as sent:`, every byte any counter records as
sent *from this thread* is added to `sent[0]` too (parallelism's CommLog records each collective this way: the
backend's count, not a formula). Tallies nest; an inner one's bytes reach the outer one.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any

_local = threading.local()


class tally:
    """Bytes recorded as sent by this thread while the block runs, in the one-element list `with` yields (a class,
    not a generator context manager: it sits on every p2p call's path, where contextlib's costs a few µs)."""

    __slots__ = ("_box",)

    def __enter__(self) -> list[int]:
        self._box = [0]
        _local.__dict__.setdefault("stack", []).append(self._box)
        return self._box

    def __exit__(self, *exc: object) -> None:
        stack = _local.stack
        stack.pop()
        if stack:
            stack[-1][0] += self._box[0]


class untallied:
    """Inside the block, counts reach no open `tally` of this thread (they are not the enclosing op's bytes)."""

    __slots__ = ("_saved",)

    def __enter__(self) -> None:
        self._saved = _local.__dict__.get("stack")
        _local.stack = []

    def __exit__(self, *exc: object) -> None:
        if self._saved is None:
            del _local.stack
        else:
            _local.stack = self._saved


class TrafficCounter:
    """Thread-safe counters: sent[peer][op], recv[peer][op] in bytes, and message counts."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with getattr(self, "_lock", threading.Lock()):
            self._sent: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
            self._recv: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
            self._messages = 0
            self._header_bytes = 0

    def add_sent(self, peer: int, op: str, nbytes: int, header_bytes: int = 0) -> None:
        with self._lock:
            self._sent[peer][op] += nbytes
            self._messages += 1
            self._header_bytes += header_bytes
        stack = getattr(_local, "stack", None)
        if stack:
            stack[-1][0] += nbytes

    def add_both(self, peer: int, op: str, sent: int, received: int) -> None:
        """add_sent(peer, op, sent) and add_recv(peer, op, received) under one lock (a metered op's claim)."""
        with self._lock:
            self._sent[peer][op] += sent
            self._recv[peer][op] += received
            self._messages += 1
        stack = getattr(_local, "stack", None)
        if stack:
            stack[-1][0] += sent

    def add_recv(self, peer: int, op: str, nbytes: int) -> None:
        with self._lock:
            self._recv[peer][op] += nbytes

    def snapshot(self) -> dict[str, Any]:
        """{'sent': {peer: {op: bytes}}, 'recv': ..., 'sent_total', 'recv_total', 'by_op': {op: {'sent','recv'}}}."""
        with self._lock:
            sent = {p: dict(d) for p, d in self._sent.items()}
            recv = {p: dict(d) for p, d in self._recv.items()}
            by_op: dict[str, dict[str, int]] = defaultdict(lambda: {"sent": 0, "recv": 0})
            for p, d in sent.items():
                for op, b in d.items():
                    by_op[op]["sent"] += b
            for p, d in recv.items():
                for op, b in d.items():
                    by_op[op]["recv"] += b
            return {
                "sent": sent,
                "recv": recv,
                "sent_total": sum(sum(d.values()) for d in sent.values()),
                "recv_total": sum(sum(d.values()) for d in recv.values()),
                "by_op": dict(by_op),
                "messages": self._messages,
                "header_bytes": self._header_bytes,
            }
