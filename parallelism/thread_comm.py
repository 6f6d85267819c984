"""A data-parallel group of D threads in one process: the collectives the compressors use (parallelism/compress.py),
for the simulator's compressed all-reduce (experiments/sim/allreduce.py) and the compressors' unit tests.

Each collective waits at a barrier until all D members have handed in their tensor, then every member reads the
combined result: all_reduce(sum) adds the D tensors in rank order (the same sum on every member), all_gather
concatenates them in rank order. Besides the result, each member counts what the textbook algorithm would cost
its rank on a link of `latency` seconds and `bandwidth` bytes/s (the simulator's network model, no contention):

    all_reduce  (ring)    bytes 2 (D − 1)/D · S      seconds 2 (D − 1) · (latency + S/D / bandwidth)
    all_gather  (ring)    bytes (D − 1) · s          seconds (D − 1) · (latency + s / bandwidth)

S = the all-reduced tensor's bytes, s = one member's input bytes. `lockstep(fns)` runs one callable per member on a
pool of D threads (kept for the group's life) and returns their results in rank order; the first exception wins
and breaks the barrier, so no member waits for ever.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch


class ThreadGroup:
    """D members, one barrier, one slot per member; `lockstep` runs them."""

    def __init__(self, size: int, latency: float = 0.0, bandwidth: float = float("inf"), timeout: float = 120.0):
        if size < 1:
            raise ValueError(f"a thread group needs at least one member, got {size}")
        self.size, self.latency, self.bandwidth = size, latency, bandwidth
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.slots: list[torch.Tensor | None] = [None] * size
        self.comms = [ThreadComm(self, r) for r in range(size)]
        self._pool: ThreadPoolExecutor | None = None

    def lockstep(self, fns: Sequence[Callable[["ThreadComm"], Any]]) -> list[Any]:
        """fns[r](comm of member r) for every r at once; their results in rank order."""
        if len(fns) != self.size:
            raise ValueError(f"lockstep needs one callable per member ({self.size}), got {len(fns)}")
        if self.size == 1:
            return [fns[0](self.comms[0])]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.size, thread_name_prefix="pslab-dp")

        def run(r: int) -> Any:
            try:
                return fns[r](self.comms[r])
            except BaseException:
                self.barrier.abort()                   # the others' waits raise instead of hanging
                raise
        futures = [self._pool.submit(run, r) for r in range(self.size)]
        results, first = [], None
        for f in futures:
            try:
                results.append(f.result())
            except threading.BrokenBarrierError as e:
                first = first or e
            except BaseException as e:                 # noqa: BLE001 - re-raised below, the root cause first
                first = e if first is None or isinstance(first, threading.BrokenBarrierError) else first
        if first is not None:
            self.barrier.reset()
            raise first
        return results

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class ThreadComm:
    """Member `rank`'s view: all_reduce / all_gather (the Comm calls the compressors make), with its bytes and
    link seconds counted (`sent`, `seconds`)."""

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank, self.size = group, rank, group.size
        self.sent, self.seconds = 0, 0.0

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        g = self.group
        g.slots[self.rank] = t.clone()
        g.barrier.wait()
        got = list(g.slots)
        g.barrier.wait()                               # nobody overwrites a slot before everyone has read it
        return got  # type: ignore[return-value]

    def all_reduce(self, t: torch.Tensor, op: str = "sum", site: str = "") -> torch.Tensor:
        if op != "sum":
            raise ValueError(f"ThreadComm.all_reduce supports op='sum', got {op!r}")
        got = self._exchange(t)
        total = got[0].clone()
        for x in got[1:]:
            total += x
        t.copy_(total)
        D, S = self.size, t.numel() * t.element_size()
        if D > 1:
            self.sent += int(round(2 * (D - 1) / D * S))
            self.seconds += 2 * (D - 1) * (self.group.latency + S / D / self.group.bandwidth)
        return t

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, site: str = "") -> torch.Tensor:
        got = self._exchange(inp)
        out.copy_(torch.cat([x.reshape(-1) for x in got]).view_as(out))
        D, s = self.size, inp.numel() * inp.element_size()
        if D > 1:
            self.sent += (D - 1) * s
            self.seconds += (D - 1) * (self.group.latency + s / self.group.bandwidth)
        return out
