"""Staleness bookkeeping: every applied update's tau, per worker, as histogram, percentiles and time series.

    tau = v_apply - v_read

where v_read is the shard version the gradient was computed on (the worker read it) and v_apply the shard version
at the moment the update is applied (before the version is bumped). With one update per push under ASP and K
balanced workers, each push finds the K-1 other workers' pushes applied since its read: E[tau] ~ K - 1.

Also recorded: how long each worker's reads waited on the consistency gate (seconds of the caller's clock, real or
virtual), and how many late gradients were dropped (backup workers). No wall clock is read here.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StalenessStats:
    """Counters a shard keeps; `summary()` is a msgpack/json-able dict."""

    num_workers: int
    hist: Counter = field(default_factory=Counter)                      # tau -> count
    per_worker: dict[int, Counter] = field(default_factory=dict)         # worker -> (tau -> count)
    series: list[tuple[float | None, int, int, int]] = field(default_factory=list)  # (now, worker, tau, version)
    waits: dict[int, list[float]] = field(default_factory=dict)          # worker -> [seconds waited per read]
    wait_total: dict[int, float] = field(default_factory=dict)           # worker -> seconds waited, all reads
    wait_count: dict[int, int] = field(default_factory=dict)             # worker -> reads that waited (> 0 s)
    dropped: dict[int, int] = field(default_factory=dict)                # worker -> late gradients dropped
    max_series: int = 1_000_000

    def __post_init__(self) -> None:
        for w in range(self.num_workers):
            self.per_worker.setdefault(w, Counter())
            self.waits.setdefault(w, [])
            self.wait_total.setdefault(w, 0.0)
            self.wait_count.setdefault(w, 0)
            self.dropped.setdefault(w, 0)

    def record(self, worker: int, tau: int, version: int, now: float | None = None) -> None:
        """One update from `worker` with staleness `tau` applied at shard `version`."""
        if tau < 0:
            raise ValueError(f"negative staleness {tau}: a gradient cannot be computed on a future version")
        self.hist[tau] += 1
        self.per_worker[worker][tau] += 1
        if len(self.series) < self.max_series:
            self.series.append((now, worker, tau, version))

    def record_wait(self, worker: int, seconds: float) -> None:
        """One read's wait on the gate: totals kept for every read, the per-read list for the first max_series
        (a shard serving thousands of reads a second for hours must not grow without bound)."""
        s = float(seconds)
        self.wait_total[worker] = self.wait_total.get(worker, 0.0) + s
        self.wait_count[worker] = self.wait_count.get(worker, 0) + (s > 0)
        w = self.waits.setdefault(worker, [])
        if len(w) < self.max_series:
            w.append(s)

    def record_drop(self, worker: int) -> None:
        self.dropped[worker] += 1

    @property
    def count(self) -> int:
        return sum(self.hist.values())

    def mean(self, worker: int | None = None) -> float:
        h = self.hist if worker is None else self.per_worker[worker]
        n = sum(h.values())
        return sum(t * c for t, c in h.items()) / n if n else math.nan

    def percentile(self, q: float, worker: int | None = None) -> float:
        """The q-th percentile (0..100, nearest-rank) of tau; nan if nothing was recorded."""
        h = self.hist if worker is None else self.per_worker[worker]
        n = sum(h.values())
        if n == 0:
            return math.nan
        rank = max(1, math.ceil(q / 100.0 * n))
        seen = 0
        for tau in sorted(h):
            seen += h[tau]
            if seen >= rank:
                return float(tau)
        return float(max(h))

    def histogram(self, worker: int | None = None) -> dict[int, int]:
        h = self.hist if worker is None else self.per_worker[worker]
        return dict(sorted(h.items()))

    def summary(self) -> dict[str, Any]:
        def stats_of(w: int | None) -> dict[str, Any]:
            return {"count": sum((self.hist if w is None else self.per_worker[w]).values()),
                    "mean": _nan_to_none(self.mean(w)), "p50": _nan_to_none(self.percentile(50, w)),
                    "p90": _nan_to_none(self.percentile(90, w)), "p99": _nan_to_none(self.percentile(99, w)),
                    "max": max((self.hist if w is None else self.per_worker[w]) or [0]),
                    "histogram": self.histogram(w)}
        out = stats_of(None)
        out["per_worker"] = {w: stats_of(w) for w in range(self.num_workers)}
        out["wait_seconds"] = dict(self.wait_total)
        out["waits"] = dict(self.wait_count)
        out["dropped"] = dict(self.dropped)
        return out

    # --- persistence (checkpoints): plain ints/floats only ---
    def state(self) -> dict[str, Any]:
        return {"hist": dict(self.hist), "per_worker": {w: dict(c) for w, c in self.per_worker.items()},
                "wait_seconds": dict(self.wait_total), "dropped": dict(self.dropped)}

    @classmethod
    def from_state(cls, num_workers: int, d: dict[str, Any]) -> "StalenessStats":
        s = cls(num_workers)
        s.hist = Counter({int(k): int(v) for k, v in d.get("hist", {}).items()})
        for w, c in d.get("per_worker", {}).items():
            s.per_worker[int(w)] = Counter({int(k): int(v) for k, v in c.items()})
        for w, x in d.get("wait_seconds", {}).items():
            if x:                                  # (one entry standing for the waits before the checkpoint)
                s.waits[int(w)], s.wait_total[int(w)], s.wait_count[int(w)] = [float(x)], float(x), 1
        for w, x in d.get("dropped", {}).items():
            s.dropped[int(w)] = int(x)
        return s


def _nan_to_none(x: float) -> float | None:
    return None if math.isnan(x) else x
