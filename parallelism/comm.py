"""Per-engine communication accounting by kind and by site, plus one background thread for overlapped collectives.

Every collective an engine issues goes through `Comm`, which records (kind, site, payload bytes, wire bytes):

    kind     all_reduce | reduce_scatter | all_gather | all_to_all | broadcast | p2p
    site     where in the model it happened ("layers.0.mlp.fc2", "stage 1 -> 2", "bucket 3") — so a test can show
             tensor parallelism talking in every layer and pipeline parallelism only at stage boundaries
    payload  bytes of the tensor handed to the collective (S; the full output for all_gather)
    wire     bytes this rank sent for it, as the backend counted them (`collectives.tally`: the zmq backend's slices,
             the kernel's count on gloo's connections); which algorithm the backend chose decides the figure: the
             zmq ring all-reduce 2(N−1)/N·S, its direct exchange of ≤ 32 KiB (N−1)·S, gloo's ring 2(N−1)/N·S plus
             48 B a message, reduce-scatter and all-gather (N−1)/N·S (the torch backend's: rings over gloo's p2p),
             all-to-all (N−1)/N·S, broadcast S·(N−1) from the root (gloo: a tree), p2p S. The formulas live in
             experiments/results/bytes.py and parallelism/comm_model.py, not here.

A p2p send is recorded when its wait returns (the torch backend counts its bytes then); a receive adds a record of
payload 0 with what the backend counted while it waited, if anything (gloo: the 48-byte "ready" message every
receive writes, and sends of the same group still in flight, whose own waits then claim less).

`CommThread` runs collectives on one worker thread in submission order, so gradient buckets (DP) and ZeRO-3
prefetches overlap computation while every rank still issues the same collectives in the same order.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from pslab.collectives import ProcessGroup, tally

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "p2p")


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class CommLog:
    """Thread-safe list of (kind, site, payload bytes, wire bytes counted by the backend)."""

    records: list[tuple[str, str, int, float]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, kind: str, site: str, payload: int, wire: float) -> None:
        with self._lock:
            self.records.append((kind, site, payload, wire))

    def reset(self) -> None:
        with self._lock:
            self.records.clear()

    def by_kind(self, wire: bool = True) -> dict[str, float]:
        """Bytes per kind (wire bytes by default, payload bytes with wire=False); every kind present, 0 if unused."""
        out: dict[str, float] = {k: 0 for k in KINDS}
        with self._lock:
            for kind, _, payload, w in self.records:
                out[kind] += w if wire else payload
        return out

    def by_site(self, kind: str | None = None) -> dict[str, int]:
        """Payload bytes per site (optionally of one kind), in first-seen order."""
        out: dict[str, int] = defaultdict(int)
        with self._lock:
            for k, site, payload, _ in self.records:
                if (kind is None or k == kind) and payload:
                    out[site] += payload
        return dict(out)

    def calls(self, kind: str | None = None) -> int:
        with self._lock:
            return sum(1 for k, _, payload, _ in self.records if (kind is None or k == kind) and payload)


class Comm:
    """A process group plus accounting. Methods mirror `ProcessGroup` and take a `site` label."""

    def __init__(self, group: ProcessGroup, log: CommLog | None = None) -> None:
        self.group = group
        self.log = log if log is not None else CommLog()

    @property
    def size(self) -> int:
        return self.group.world_size

    @property
    def rank(self) -> int:
        return self.group.rank

    def all_reduce(self, t: torch.Tensor, op: str = "sum", site: str = "") -> torch.Tensor:
        if self.size > 1:
            with tally() as sent:
                self.group.all_reduce(t, op=op)
            self.log.add("all_reduce", site, nbytes(t), sent[0])
        return t

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: str = "sum", site: str = "") -> torch.Tensor:
        if self.size == 1:
            out.copy_(inp.view(-1))
            return out
        with tally() as sent:
            self.group.reduce_scatter(out, inp, op=op)
        self.log.add("reduce_scatter", site, nbytes(inp), sent[0])
        return out

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, site: str = "") -> torch.Tensor:
        if self.size == 1:
            out.view(-1).copy_(inp.view(-1))
            return out
        with tally() as sent:
            self.group.all_gather(out, inp)
        self.log.add("all_gather", site, nbytes(out), sent[0])
        return out

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, site: str = "") -> torch.Tensor:
        """Chunk j of `inp` (split along dim 0 into N equal chunks) goes to rank j; chunk i of `out` came from i."""
        if self.size == 1:
            out.copy_(inp)
            return out
        with tally() as sent:
            self.group.all_to_all(out, inp)
        self.log.add("all_to_all", site, nbytes(inp), sent[0])
        return out

    def broadcast(self, t: torch.Tensor, src: int = 0, site: str = "") -> torch.Tensor:
        if self.size > 1:
            with tally() as sent:
                self.group.broadcast(t, src)
            self.log.add("broadcast", site, nbytes(t), sent[0])
        return t

    def isend(self, t: torch.Tensor, dst: int, tag: int = 0, site: str = "") -> Any:
        with tally() as sent:
            work = self.group.isend(t, dst, tag)
        return _LoggedSend(work, self.log, site, nbytes(t), sent[0])

    def recv(self, t: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        with tally() as sent:
            self.group.recv(t, src, tag)  # received bytes are the sender's record
        if sent[0]:
            self.log.add("p2p", "", 0, sent[0])
        return t


class _LoggedSend:
    """A send's work handle that records the send in the CommLog when its wait returns."""

    def __init__(self, work: Any, log: CommLog, site: str, payload: int, sent: int) -> None:
        self._work, self._log, self._site, self._payload, self._sent = work, log, site, payload, sent
        self._logged = False

    def wait(self, timeout: float | None = None) -> Any:
        with tally() as sent:
            out = self._work.wait(timeout)
        if not self._logged:
            self._logged = True
            self._log.add("p2p", self._site, self._payload, self._sent + sent[0])
        return out

    def is_completed(self) -> bool:
        return self._work.is_completed()


class CommThread:
    """One worker thread; `submit` returns a Future. Collectives keep their submission order on every rank."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pslab-comm")
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
