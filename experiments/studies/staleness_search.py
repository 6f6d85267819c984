"""One cell of the staleness study: exact steps to a target accuracy, medians over seeds with censoring, and a
learning-rate search whose grid brackets the optimum.

**Exact steps to target.** T = min{t : acc(theta_t) >= target}, the first step whose parameters reach the target
test accuracy. Evaluating every step costs about a third of a training step on these models, so `steps_to_target`
evaluates every `every` steps (a *check*) and keeps the parameters of the steps since the last check. A check
whose accuracy is within `margin` of the target (acc >= target - margin) scans the kept steps oldest first, so a
crossing between two checks is found at its exact step, and switches to evaluating every step until the
accuracy falls below target - margin again. The last step of a run is always a check. The result equals
per-step evaluation unless the accuracy rises above the target and falls back below target - margin between two
checks; margin = 1 makes every check scan, i.e. exactly per-step evaluation (`test_staleness_preset` compares
both on real runs).

**Censoring.** A seed that does not reach the target within its step budget (or diverges) is censored at that
budget: we only know T > budget. Over n seeds the cell reports the *lower median*, the ceil(n/2)-th smallest T
with censored seeds sorted last (for odd n the ordinary median). It is itself censored — shown as "> max_steps" —
exactly when more than half of the seeds are censored; otherwise it is an observed T, whatever the censored seeds
would have done.

**Learning-rate search.** Per cell, each lr of a geometric grid is tried on every seed; the winner is the lr with
the smallest median T (ties: the lr tried first, and the grid is tried from its centre outwards, so a tie never
favours an edge). If the winner is the smallest or largest lr tried, the grid is widened by one point beyond it
(lr / factor or lr * factor) and the search continues, at most `widen` times; a winner still at an edge after that
is reported (`lr_edge`). When no lr reaches the target on more than half of the seeds, the winner is the lr with
the highest median best accuracy (so the grid still follows the optimum), and the cell is censored.
Pruning changes no reported winner: once some lr has median M, later lrs run with budget M (a run not at the
target by step M cannot make its lr win) and stop after more than half of their seeds are censored; the winner's
seeds censored below max_steps are then rerun to max_steps, so its per-seed T and censored count are exact.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from pslab.experiments.config import TrainConfig
from pslab.experiments.sim.dai import run_dai
from pslab.experiments.studies.fairness import widen_past_edge


class _Reached(Exception):
    def __init__(self, step: int):
        self.step = step


@dataclass
class RunResult:
    steps: int | None          # exact first step at the target, None: censored at `budget`
    budget: int
    best_acc: float            # the highest test accuracy seen at an evaluation
    evals: int                 # test-set evaluations made
    diverged: bool = False


class _Watcher:
    """The on_step hook of `run_dai`: checks every `every` steps, scans back and goes per-step near the target."""

    def __init__(self, wl: Any, target: float, every: int, margin: float, budget: int):
        self.wl, self.target, self.every, self.margin, self.budget = wl, target, every, margin, budget
        self.fine = False
        self.kept: deque[tuple[int, list[torch.Tensor]]] = deque()
        self.scratch: torch.nn.Module | None = None
        self.best, self.evals = 0.0, 0

    def _acc(self, model: torch.nn.Module) -> float:
        self.evals += 1
        acc = float(self.wl.evaluate(model)["test_acc"])
        self.best = max(self.best, acc)
        return acc

    def _acc_of(self, params: list[torch.Tensor]) -> float:
        if self.scratch is None:
            self.scratch = self.wl.make_model()
        with torch.no_grad():
            for p, q in zip(self.scratch.parameters(), params):
                p.copy_(q)
        return self._acc(self.scratch)

    def __call__(self, step: int, model: torch.nn.Module) -> None:
        t = step + 1
        if self.fine:
            acc = self._acc(model)
            if acc >= self.target:
                raise _Reached(t)
            self.fine = acc >= self.target - self.margin
            return
        if t % self.every and t < self.budget:
            self.kept.append((t, [p.detach().clone() for p in model.parameters()]))
            return
        acc = self._acc(model)
        if acc >= self.target - self.margin:
            for t_kept, params in self.kept:
                if self._acc_of(params) >= self.target:
                    raise _Reached(t_kept)
            if acc >= self.target:
                raise _Reached(t)
            self.fine = True
        self.kept.clear()


def steps_to_target(wl: Any, train: TrainConfig, s: float, budget: int, target: float, seed: int, *,
                    delay: str = "uniform", every: int = 10, margin: float = 0.02) -> RunResult:
    """Train with the staleness emulator (`run_dai`) for at most `budget` steps; the exact first step whose test
    accuracy is >= target (see the module docstring), or None (censored at `budget`)."""
    watcher = _Watcher(wl, target, every, margin, budget)
    try:
        res = run_dai(wl, train, s, budget, math.inf, budget + 1, seed, delay=delay, on_step=watcher)
    except _Reached as hit:
        return RunResult(hit.step, budget, watcher.best, watcher.evals)
    return RunResult(None, budget, watcher.best, watcher.evals, res.diverged)


def lower_median(values: list[int | None]) -> int | None:
    """The ceil(n/2)-th smallest value, None (censored) sorted last: None iff more than half are None."""
    if not values:
        return None
    order = sorted(values, key=lambda v: math.inf if v is None else v)
    return order[(len(order) - 1) // 2]


def _median_float(values: list[float]) -> float:
    order = sorted(values)
    return order[(len(order) - 1) // 2] if order else 0.0


@dataclass
class LrTrial:
    lr: float
    budget: int
    steps: list[int | None] = field(default_factory=list)   # per seed run so far; None = censored at `budget`
    best_acc: list[float] = field(default_factory=list)
    diverged: int = 0

    @property
    def median(self) -> int | None:
        return lower_median(self.steps)

    def to_dict(self) -> dict[str, Any]:
        return {"lr": self.lr, "budget": self.budget, "steps": self.steps, "median": self.median,
                "censored": sum(v is None for v in self.steps), "diverged": self.diverged,
                "best_acc_median": round(_median_float(self.best_acc), 4)}


def centre_out(grid: tuple[float, ...]) -> list[float]:
    """The grid sorted, ordered from its centre outwards: (a, b, c, d, e) -> c, b, d, a, e."""
    g = sorted(set(grid))
    mid = (len(g) - 1) // 2
    out = [g[mid]]
    for k in range(1, len(g)):
        for i in (mid - k, mid + k):
            if 0 <= i < len(g):
                out.append(g[i])
    return out


def search_lr(make_workload: Any, train: TrainConfig, s: float, grid: tuple[float, ...], seeds: tuple[int, ...],
              *, target: float, max_steps: int, delay: str = "uniform", every: int = 10, margin: float = 0.02,
              factor: float = 2.0, widen: int = 4, prune: bool = True) -> dict[str, Any]:
    """Pick the lr with the fewest median steps to `target` (module docstring); `make_workload(seed)` builds the
    workload of one seed. Returns the cell's numbers: chosen lr, per-seed steps, median, censoring, edge hits."""
    trials: dict[float, LrTrial] = {}
    half = len(seeds) / 2

    def run(lr: float, seed: int, budget: int) -> RunResult:
        tc = dataclasses.replace(train, lr=lr)
        return steps_to_target(make_workload(seed), tc, s, budget, target, seed, delay=delay, every=every,
                               margin=margin)

    def better(a: LrTrial, b: LrTrial | None) -> bool:
        if b is None:
            return True
        if a.median is not None or b.median is not None:
            return b.median is None or (a.median is not None and a.median < b.median)
        return _median_float(a.best_acc) > _median_float(b.best_acc)

    best: LrTrial | None = None

    def trial(lr: float) -> None:
        nonlocal best
        budget = best.median if (prune and best is not None and best.median is not None) else max_steps
        tr = trials[lr] = LrTrial(lr, budget)
        for seed in seeds:
            r = run(lr, seed, budget)
            tr.steps.append(r.steps)
            tr.best_acc.append(r.best_acc)
            tr.diverged += r.diverged
            if budget < max_steps and sum(v is None for v in tr.steps) > half:
                break                        # censored on more than half the seeds below a finite best: loses
        if len(tr.steps) == len(seeds) and better(tr, best):
            best = tr

    for lr in centre_out(grid):
        trial(lr)
    added = 0
    while best is not None and added < widen:
        nxt = widen_past_edge(sorted(trials), best.lr, factor)
        if nxt is None:
            break
        added += 1
        trial(float(f"{nxt:.6g}"))
    assert best is not None
    tried = sorted(trials)
    edge = ("low" if best.lr == tried[0] else "high" if best.lr == tried[-1] else None) if len(tried) > 1 else "both"
    steps = list(best.steps)
    for i, seed in enumerate(seeds):          # complete the winner: seeds censored below max_steps, to max_steps
        if steps[i] is None and best.budget < max_steps:
            r = run(best.lr, seed, max_steps)
            steps[i] = r.steps
    med = lower_median(steps)
    return {"lr": best.lr, "seed_steps": steps, "steps": med, "censored": sum(v is None for v in steps),
            "median_censored": med is None, "lr_grid": tried, "widened": added, "lr_edge": edge,
            "tried": [trials[lr].to_dict() for lr in tried]}
