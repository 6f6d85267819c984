"""What makes a comparison of synchronisation strategies fair: the learning rate each strategy gets, and the seed
noise a difference must exceed before it means anything.

Learning rate. An averaging strategy (local, allreduce, ps-bsp, ps-ssp-agg) folds G = K gradients into one step; ASP
and Ho's SSP apply each gradient as its own step. At one shared step lr the averaging strategies learn about K times
less per gradient, and a table made that way says "asynchrony wins" for the wrong reason. Two rules, both stated in
the report:

    linear scaling (default, train.lr_rule = linear; Goyal et al. 2017): lr_step = G * lr_per_gradient. For SGD,
        BSP(G lr) takes exactly the steps of SSP(0)(lr) -- the same distance per gradient.
    tuned (`pslab compare --tune-lr`): each strategy's per-gradient lr picked from a grid lr0 * 2^k that brackets the
        optimum -- the grid is widened by a factor 2 at whichever edge wins, until an interior point wins (or
        MAX_WIDEN widenings) -- by the lowest final training loss without a straggler (runs that diverge lose).
        The straggler runs then reuse each strategy's tuned lr.

Seed noise. The band is the single-process reference (`local`; the simulated `ps-bsp` under --simulate) trained with
seeds seed, seed+1, ..., seed+n-1 (model init and batch order change, nothing else): mean +- 2 sd of its final
training loss and test accuracy. A strategy "agrees" with synchronous training when its no-straggler final loss and
accuracy lie in the band. The band runs drop the compute padding (it changes timing, not the arithmetic).
"""

from __future__ import annotations

import copy
import math
import statistics
from pathlib import Path
from typing import Any, Callable

from pslab.experiments.config import RunConfig
from pslab.experiments.results.rundir import RunDir

MAX_WIDEN = 3
GRID = (0.25, 0.5, 1.0, 2.0, 4.0)       # multiples of the configured lr tried first


def _final(run: dict[str, Any]) -> tuple[float | None, float | None]:
    s = run.get("summary") or {}
    return s.get("final_train_loss"), s.get("final_test_acc")


def seed_band(cfg: RunConfig, out: Path, run: Callable[..., Any], seeds: int, simulate: bool) -> dict[str, Any]:
    """Train the reference at `seeds` seeds; {"strategy", "seeds", "loss": (mean, sd), "acc": (mean, sd), "runs"}."""
    ref = "ps-bsp" if simulate else "local"
    rows = []
    for k in range(seeds):
        c = copy.deepcopy(cfg)
        c.train.strategy, c.train.base_step_s = ref, 0.0
        c.stragglers.factors = {}
        c.workload.seed = cfg.workload.seed + k
        if ref == "local":
            c.parallel = c.parallel.unsplit()
        c.validate()
        rd = run(c, out, label=f"band-{ref}-seed{c.workload.seed}")
        rows.append(_final(RunDir(rd.path).load()))
    losses = [l for l, _ in rows if l is not None and math.isfinite(l)]
    accs = [a for _, a in rows if a is not None]

    def stats(v: list[float]) -> tuple[float, float] | None:
        return (statistics.fmean(v), statistics.stdev(v) if len(v) > 1 else 0.0) if v else None
    return {"strategy": ref, "seeds": [cfg.workload.seed + k for k in range(seeds)], "loss": stats(losses),
            "acc": stats(accs), "values": rows}


def in_band(value: float | None, band: tuple[float, float] | None) -> bool | None:
    """True if value lies within mean +- 2 sd; None if either is unknown."""
    if value is None or band is None:
        return None
    mean, sd = band
    return abs(value - mean) <= 2 * sd + 1e-12


def band_section(band: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    """The report block: the band, and for each no-straggler run whether its final loss and accuracy lie in it."""
    from pslab.experiments.results.plots import run_label
    lo, ac = band["loss"], band["acc"]
    fmt = (lambda b, scale=1.0: f"{scale * b[0]:.3g} ± {2 * scale * b[1]:.2g}" if b else "—")  # noqa: E731
    lines = ["## Seed noise", "",
             f"Reference `{band['strategy']}` trained with seeds {', '.join(map(str, band['seeds']))} (model init and "
             f"batch order change, nothing else): final train loss {fmt(lo)}, test accuracy {fmt(ac, 100)} % "
             "(mean ± 2 sd). A difference inside this band is seed noise, not an effect of the strategy.", "",
             "| run (no straggler) | final train loss | in band | test acc (%) | in band |", "|---|---|---|---|---|"]
    yes = {True: "yes", False: "**no**", None: "—"}
    for r in runs:
        if (r.get("summary") or {}).get("straggler"):
            continue
        loss, acc = _final(r)
        lines.append(f"| {run_label(r)} | {loss if loss is None else f'{loss:.3g}'} | {yes[in_band(loss, lo)]} | "
                     f"{acc if acc is None else f'{100 * acc:.3g}'} | {yes[in_band(acc, ac)]} |")
    return "\n".join(lines)


def bracket_lr(lr0: float, score: Callable[[float], float | None]) -> tuple[float, list[tuple[float, float | None]]]:
    """Minimise score(lr) (None = diverged) over lr0 x GRID, then widen by 2x past a winning edge until an interior
    point wins or MAX_WIDEN widenings are spent. Returns (best lr, [(lr, score), ...] sorted by lr)."""
    tried: dict[float, float | None] = {}

    def trial(lr: float) -> None:
        if lr not in tried:
            v = score(lr)
            tried[lr] = v if v is not None and math.isfinite(v) else None

    def best() -> float:
        ok = {lr: v for lr, v in tried.items() if v is not None}
        return min(ok, key=lambda k: ok[k]) if ok else min(tried)
    for m in GRID:
        trial(lr0 * m)
    for _ in range(MAX_WIDEN):
        b = best()
        nxt = min(tried) / 2 if tried[b] is None else widen_past_edge(sorted(tried), b)   # all diverged: lower
        if nxt is None:
            break
        trial(nxt)
    return best(), sorted(tried.items())


def widen_past_edge(tried: list[float], best: float, factor: float = 2.0) -> float | None:
    """The next lr of a bracketing search: one step of `factor` beyond the winner if it sits at an edge of the
    sorted `tried` values, else None (the optimum is bracketed)."""
    if best == tried[0]:
        return best / factor
    if best == tried[-1]:
        return best * factor
    return None


def tune_lr(cfg: RunConfig, strategy: str, out: Path, run: Callable[..., Any],
            progress: Callable[[str], None] | None = None) -> tuple[float, list[tuple[float, float | None]]]:
    """`bracket_lr` for `strategy` (no straggler): the score of an lr is the run's final training loss."""
    from pslab.experiments.errors import DivergedError
    from pslab.ps.errors import NonFiniteGradientError

    def score(lr: float) -> float | None:
        c = copy.deepcopy(cfg)
        c.train.strategy, c.train.lr = strategy, lr
        c.stragglers.factors = {}
        c.validate()
        try:
            loss = _final(RunDir(run(c, out, label=f"tune-{strategy}-lr{lr:.6g}").path).load())[0]
        except (DivergedError, NonFiniteGradientError):   # the simulator's shard refuses a NaN gradient
            loss = None
        if progress:
            progress(f"{strategy} lr {lr:.4g}: final train loss {'diverged' if loss is None else f'{loss:.4f}'}")
        return loss
    return bracket_lr(cfg.train.lr, score)


def tuning_section(results: dict[str, tuple[float, list[tuple[float, float | None]]]]) -> str:
    lines = ["## Learning rates (tuned)", "",
             "Each strategy's per-gradient lr was picked by the lowest final training loss without a straggler "
             "from a grid that brackets the optimum (widened by 2x at a winning edge); the straggler runs reuse it. "
             "`diverged` = the loss became non-finite.", "",
             "| strategy | chosen lr / gradient | tried: lr → final train loss |", "|---|---|---|"]
    for s, (lr, tried) in results.items():
        cells = ", ".join(f"{a:.4g} → {'diverged' if v is None else f'{v:.4f}'}" for a, v in tried)
        lines.append(f"| {s} | {lr:.4g} | {cells} |")
    return "\n".join(lines)
