"""The one record schema: `UpdateRecord`, one line of metrics.jsonl per gradient a worker computed, written by every
runner (the training loop, the PS simulator, the all-reduce simulator) — and the summaries made from them.

    worker      data-parallel worker (0..K-1)             step    its clock when it read (0-based)
    clock       step + 1                                   time_s  seconds since the start barrier (or virtual)
    loss        training loss on batch(worker, step)       batch   digest of that batch's example indices
                (both null in a timing-only simulation: no batch is drawn)
    staleness   τ = (version when applied) − (version read); 0 for all-reduce and local; None if never applied
    bytes_sent / bytes_recv   bytes this update moved on the worker's first rank (pp = tp = 0): its process groups
                as the backend counted them (torch: gloo's framing included), plus PS push / pull payload (all
                ranks: summary.json bytes_by_kind); None where a group could not be observed (NCCL, ...)
    wait_s      time blocked synchronising (PS gate + transfer, or the all-reduce waiting for peers)
    dropped     true for a backup-BSP gradient that arrived after its clock closed (not applied)

Staleness of a PS run comes from the shard's own series (worker, τ, version), in the order it applied each
worker's pushes: `assign_staleness` gives the k-th applied τ of worker w to w's k-th non-dropped record.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Any, Iterable, Sequence


@dataclass
class UpdateRecord:
    worker: int
    step: int
    clock: int
    time_s: float
    loss: float | None
    staleness: int | None
    bytes_sent: int | None           # None: a group of the worker's could not be observed (not_observable)
    bytes_recv: int | None
    wait_s: float
    batch: str | None
    dropped: bool = False

    def to_json(self) -> dict[str, Any]:
        d = dict(self.__dict__)       # flat fields: no deep copy needed
        if not self.dropped:
            del d["dropped"]
        return d


FIELDS = tuple(f.name for f in dataclasses.fields(UpdateRecord))


def bytes_moved(u: dict[str, Any]) -> float:
    """Bytes one update moved on its worker's link, sent + received (a PS worker receives the read, an all-reduce
    worker as much as it sends); a missing count as 0."""
    return (u.get("bytes_sent") or 0) + (u.get("bytes_recv") or 0)


def assign_staleness(records: list[dict[str, Any]], series: Sequence[Sequence[Any]], period: int = 1) -> None:
    """Fill `staleness` of the records in place from a shard's series [[now, worker, tau, version], ...]. With
    `period` H (ps-local / ps-diloco: one push per H local steps), the k-th applied τ of worker w goes to w's
    records kH … kH + H − 1: each local step carries its period's staleness in outer steps."""
    per_worker: dict[int, list[int]] = {}
    for _, w, tau, _ in sorted(series, key=lambda e: e[3]):
        per_worker.setdefault(int(w), []).append(int(tau))
    pos: dict[int, int] = {}
    for r in sorted((r for r in records if not r.get("dropped")), key=lambda r: (r["worker"], r["step"])):
        w = r["worker"]
        i = pos.get(w, 0)
        taus = per_worker.get(w, [])
        r["staleness"] = taus[i // period] if i // period < len(taus) else None
        pos[w] = i + 1


def time_to_accuracy(evals: list[dict[str, Any]], target: float) -> tuple[float, int] | None:
    """(time_s, updates) of the first evaluation whose test accuracy reaches `target`; None if none does."""
    for e in evals:
        if e.get("test_acc") is not None and e["test_acc"] >= target:
            return float(e["time_s"]), int(e["updates"])
    return None


def steady_window_end(updates: list[dict[str, Any]]) -> float | None:
    """End of the steady window -- while every worker is still working: the time the first worker finishes (its
    last applied update); None if nothing was applied."""
    last: dict[int, float] = {}
    for u in updates:
        if not u.get("dropped"):
            last[u["worker"]] = max(last.get(u["worker"], 0.0), u["time_s"])
    return min(last.values()) if last else None


def steady_throughput(updates: list[dict[str, Any]]) -> float | None:
    """Updates per second while every worker is still working: count up to the time the first worker finishes.
    With a straggler this separates BSP (everyone held to the straggler's pace) from ASP (the others run on)."""
    t_end = steady_window_end(updates)
    if t_end is None:
        return None
    n = sum(1 for u in updates if not u.get("dropped") and u["time_s"] <= t_end)
    return n / t_end if t_end > 0 else None


WARMUP_STEPS = 2


def step_time(updates: list[dict[str, Any]], warmup: int = WARMUP_STEPS) -> float | None:
    """`step_time_s`: the median over steps (after each worker's first `warmup`, which warm up) of the max over
    workers of one step's wall time. Step k of worker w lasts time_s of its k-th record minus that of its (k-1)-th
    (the first: since the start barrier, time_s = 0), records in time order; the max over workers is the slowest
    worker's. A worker's record is written by its first rank (pp = tp = 0) after the step's synchronisation, and
    its model-parallel ranks run in lockstep with it, so this is the max over ranks up to that lockstep. A step's
    time includes what ran between two records: an evaluation or a checkpoint at that step (the median leaves the
    few such steps out). None with fewer than warmup + 1 steps."""
    per: dict[int, list[float]] = {}
    for u in sorted(updates, key=lambda u: u["time_s"]):
        per.setdefault(u["worker"], []).append(float(u["time_s"]))
    slowest: dict[int, float] = {}
    for times in per.values():
        for k in range(warmup, len(times)):
            d = times[k] - (times[k - 1] if k else 0.0)
            slowest[k] = max(slowest.get(k, 0.0), d)
    if not slowest:
        return None
    return statistics.median(slowest.values())


def summarize(updates: Iterable[dict[str, Any]], evals: list[dict[str, Any]], wall_s: float,
              label: str, simulated: bool, target_acc: float | None = None) -> dict[str, Any]:
    """Totals a teacher puts on a slide: updates/s, `step_time_s` (see `step_time`), final loss/accuracy, mean/max
    staleness (whole run, and over the steady window of `steady_window_end`, which leaves out a straggler's solo
    tail at tau = 0), waiting, bytes, and with `target_acc` the time and updates to reach it (None if not reached).
    Loss may be None (timing-only runs)."""
    ups = list(updates)
    n = len(ups)
    stal = [u["staleness"] for u in ups if u.get("staleness") is not None]
    t_end = steady_window_end(ups)
    steady = [u["staleness"] for u in ups if u.get("staleness") is not None and u["time_s"] <= (t_end or 0.0)]
    workers = sorted({u["worker"] for u in ups})
    tail = [u["loss"] for u in ups[-max(1, n // 10):] if u.get("loss") is not None] if n else []
    last_eval = evals[-1] if evals else {}
    hit = time_to_accuracy(evals, target_acc) if target_acc is not None else None
    return {
        "label": label, "simulated": simulated, "updates": n, "workers": len(workers), "time_s": wall_s,
        "updates_per_s_total": n / wall_s if wall_s > 0 else None,
        "updates_per_s": steady_throughput(ups), "step_time_s": step_time(ups),
        "dropped": sum(1 for u in ups if u.get("dropped")),
        "final_train_loss": sum(tail) / len(tail) if tail else None,
        "final_test_loss": last_eval.get("test_loss"), "final_test_acc": last_eval.get("test_acc"),
        "staleness_mean": sum(stal) / len(stal) if stal else None, "staleness_max": max(stal) if stal else None,
        "staleness_mean_steady": sum(steady) / len(steady) if steady else None,
        "staleness_max_steady": max(steady) if steady else None,
        "target_acc": target_acc, "time_to_target_s": hit[0] if hit else None,
        "updates_to_target": hit[1] if hit else None,
        "wait_s_total": sum(u.get("wait_s") or 0.0 for u in ups),
        "bytes_per_worker": None if any(u.get("bytes_sent", 0) is None for u in ups) else   # not observable
                            (sum(bytes_moved(u) for u in ups) / len(workers)) if workers else 0,
    }
