"""`pslab sweep --preset ssp-straggler`: Ho et al.'s SSP under a persistent straggler, in the simulator -- time to a
target accuracy T(s) against the staleness bound s, with its mechanism.

Setting: `pslab compare`'s default workload (digits-mlp, K = 4 workers, batch 32; experiments/configs/
compare_default.toml), simulated in virtual time, worker K-1 persistently `factor` = 4x slower (T_fast =
simulate.compute_s = 10 ms, T_slow = 40 ms), strategies ps-ssp:s for s in {0, 1, 2, 4} and ps-asp (s = inf) as the
reference. Test accuracy is evaluated after *every* applied update and the run stops at the first one >= target
(train.target_acc): T is the virtual time of that update, resolved to one update. Each seed (model init and batch
order) gives one T per strategy; cells report the median over seeds with a 95 % bootstrap interval, the quartiles
and the mean with its 95 % interval; a seed that misses the target within `steps` clocks per worker is censored
(T = inf: it sorts last in the median, and the mean is then not reported).

Learning rate, by a stated rule. Ho's SSP and ASP apply every gradient as its own step, so the linear rule
(train.lr_rule) gives each of them the same lr per gradient, `lr` (0.2, the compare default). With `tune`, each
strategy gets its own lr instead: lr x {1/2, 1/sqrt 2, 1, sqrt 2, 2} tried on the first half of the seeds, widened by
sqrt 2 past a winning edge (at most `widen` times), the winner = the smallest median T; T is then reported on the
*other* half (held out, so the reported T carries no selection bias).

Mechanism. With a persistent straggler the SSP gate binds at every finite s: in steady state each fast worker
completes one clock per straggler clock, so the throughput is K / T_slow for every s (ASP: (K-1)/T_fast +
1/T_slow). What s buys is a one-off lead: the K-1 fast workers run s clocks ahead of the straggler, so from then on
the model has (K-1) s more updates at any time, worth

    lead(s) = (K-1) s / (K / T_slow) = (K-1) s T_slow / K        (= 30 ms x s here)

of time. Its price is staler gradients (tau <= (K-1)(2s+1)): more updates U(s) to reach the target. So
T(s) ~ U(s) T_slow / K - lead(s) is non-increasing in s exactly when the staleness cost per s stays below
(K-1) updates per unit of s. The report measures both sides: the lead, from timing-only runs (the time of the n-th
update against s = 0, n = 100..200), next to the formula; U(s) per seed next to T(s). Updates arrive in bursts once
per straggler clock, so per-seed T sits on a lattice with spacing T_slow and medians move in steps of 40 ms; the
lead of s = 1 (30 ms) is below that, which is why the mean is reported next to the median.

The verdict: "T non-increasing in s" holds if the median T is non-increasing along s = 0, 1, 2, 4, each adjacent
step quoted with the share of paired (same seeds for every strategy) bootstrap replicates in which T(s) >= T(s').
"""

from __future__ import annotations

import json
import math
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from pslab.experiments.errors import ConfigError

STRATEGIES = ("ps-ssp:0", "ps-ssp:1", "ps-ssp:2", "ps-ssp:4", "ps-asp")
TUNE_GRID = (0.5, 2 ** -0.5, 1.0, 2 ** 0.5, 2.0)     # multiples of lr tried first with `tune`
BOOT = 2000


@dataclass
class SSPSpec:
    strategies: tuple[str, ...] = STRATEGIES        # ps-ssp:s in increasing s, then anything else (reference)
    seeds: tuple[int, ...] = tuple(range(400))      # resolves the 30 ms lead of s = 1 (about +-16 ms at 95 %)
    target_acc: float = 0.9
    factor: float = 4.0                             # the straggler's slowdown (worker K-1, the whole run)
    lr: float = 0.2                                 # per gradient; the compare default
    steps: int = 150                                # clocks per worker: the censoring budget
    tune: bool = False
    widen: int = 3
    overrides: tuple[str, ...] = ()                 # --set options for the compare default (workload, K, ...)

    def validate(self) -> None:
        if not self.strategies or not self.seeds:
            raise ConfigError("the ssp-straggler study needs at least one strategy and one seed")
        if self.tune and len(self.seeds) < 4:
            raise ConfigError(f"--tune-lr tunes on half of the seeds and reports on the other half: give >= 4 "
                              f"seeds, got {len(self.seeds)}")
        if not 0 < self.target_acc <= 1 or self.factor <= 0 or self.lr <= 0 or self.steps < 1:
            raise ConfigError("the ssp-straggler study needs a target in (0, 1], factor > 0, lr > 0, steps >= 1")
        from pslab.experiments.strategies.spec import parse_strategy
        for s in self.strategies:
            if not parse_strategy(s).uses_ps:
                raise ConfigError(f"the ssp-straggler study simulates parameter-server strategies, not {s!r}")


def staleness_bound(strategy: str) -> float:
    """s of ps-ssp:s; inf for ps-asp."""
    return float(strategy.split(":")[1]) if strategy.startswith("ps-ssp:") else math.inf


def _config(spec: SSPSpec, strategy: str, lr: float, seed: int, timing: bool = False) -> Any:
    from pslab.experiments.studies.compare import default_config
    o = [f"train.strategy={strategy}", f"train.steps={spec.steps}", f"workload.seed={seed}", f"train.lr={lr}",
         "train.eval_every=1", f'stragglers.factors={{"{_last_worker(spec)}" = {spec.factor}}}', *spec.overrides]
    if not timing:
        o.append(f"train.target_acc={spec.target_acc}")
    cfg = default_config(None, o)
    cfg.simulate.timing_only = timing
    return cfg.validate()


def _last_worker(spec: SSPSpec) -> int:
    from pslab.experiments.studies.compare import default_config
    return default_config(None, list(spec.overrides)).train.workers - 1


def one_run(spec: SSPSpec, strategy: str, lr: float, seed: int) -> tuple[float, int | None]:
    """(T, U): virtual time and applied updates at the first evaluation >= target; (inf, None) if censored."""
    from pslab.experiments.runner import execute
    with tempfile.TemporaryDirectory() as d:
        s = execute(_config(spec, strategy, lr, seed), d, simulate=True, quiet=True).load()["summary"]
    t = s.get("time_to_target_s")
    return (math.inf, None) if t is None else (float(t), int(s["updates_to_target"]))


def _batch(args: tuple[SSPSpec, str, float, tuple[int, ...]]) -> list[tuple[float, int | None]]:
    import torch
    torch.set_num_threads(1)
    spec, strategy, lr, seeds = args
    return [one_run(spec, strategy, lr, k) for k in seeds]


def _runs(spec: SSPSpec, pool: tuple[Any, int] | None, strategy: str, lr: float,
          seeds: tuple[int, ...]) -> list[tuple[float, Any]]:
    """one_run on every seed; with `pool` = (executor, n) the seeds are split into n interleaved parts."""
    if pool is None:
        return _batch((spec, strategy, lr, seeds))
    ex, n = pool
    parts = [seeds[i::n] for i in range(n)]
    got = list(ex.map(_batch, [(spec, strategy, lr, p) for p in parts]))
    by_seed = {k: r for p, g in zip(parts, got) for k, r in zip(p, g)}
    return [by_seed[k] for k in seeds]


def lead_curve(spec: SSPSpec, strategy: str, ns: tuple[int, ...] = (100, 150, 200)) -> list[float]:
    """Timing-only: the virtual time of the n-th applied update (seed 0), for each n."""
    from pslab.experiments.results.rundir import read_jsonl
    from pslab.experiments.runner import execute
    with tempfile.TemporaryDirectory() as d:
        ups = read_jsonl(execute(_config(spec, strategy, spec.lr, spec.seeds[0], timing=True), d, simulate=True,
                                 quiet=True).metrics_path)
    t = np.sort([u["time_s"] for u in ups if u.get("staleness") is not None and not u.get("dropped")])
    return [float(t[n - 1]) if n <= len(t) else math.nan for n in ns]


def _median(v: np.ndarray) -> float:
    return float(np.median(v))


def run_ssp_study(spec: SSPSpec, jobs: int = 1, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every strategy on every seed (module docstring); with `spec.tune` its lr is tuned on the first half of the
    seeds and T reported on the second. Returns {"spec", "cells": [...], "lead": {...}}."""
    spec.validate()
    from pslab.experiments.studies.fairness import widen_past_edge
    half = len(spec.seeds) // 2
    tune_seeds, report_seeds = (spec.seeds[:half], spec.seeds[half:]) if spec.tune else ((), spec.seeds)
    pool = None
    if jobs > 1:
        from pslab.collectives.forking import forkserver_context      # (not spawn: torch imported once)
        pool = (ProcessPoolExecutor(max_workers=jobs, mp_context=forkserver_context()), jobs)
    try:
        cells = []
        for strategy in spec.strategies:
            tried: dict[float, float] = {}
            lr = spec.lr
            if spec.tune:
                def trial(x: float) -> None:
                    x = float(f"{x:.6g}")
                    if x not in tried:
                        tried[x] = _median(np.array([t for t, _ in _runs(spec, pool, strategy, x, tune_seeds)]))
                        if progress:
                            progress(f"{strategy} lr {x:g}: median T {tried[x]:.3f} s on the tuning seeds")
                for m in TUNE_GRID:
                    trial(spec.lr * m)
                for _ in range(spec.widen):
                    best = min(tried, key=lambda k: (tried[k], abs(math.log(k / spec.lr))))
                    nxt = widen_past_edge(sorted(tried), best, 2 ** 0.5)
                    if nxt is None:
                        break
                    trial(nxt)
                lr = min(tried, key=lambda k: (tried[k], abs(math.log(k / spec.lr))))
            res = _runs(spec, pool, strategy, lr, report_seeds)
            cells.append({"strategy": strategy, "s": staleness_bound(strategy), "lr": lr,
                          "lr_tried": sorted(tried.items()), "seeds": list(report_seeds),
                          "T": [t for t, _ in res], "U": [u for _, u in res]})
            if progress:
                progress(f"{strategy} lr {lr:g}: median T {_median(np.array(cells[-1]['T'])):.3f} s")
    finally:
        if pool is not None:
            pool[0].shutdown()
    ns = (100, 150, 200)
    lead = {c["strategy"]: lead_curve(spec, c["strategy"], ns) for c in cells}
    summarise(cells, spec)
    return {"spec": asdict(spec), "cells": cells, "lead_ns": list(ns), "lead_times": lead,
            "claim": claim(cells), "K": _last_worker(spec) + 1}


def summarise(cells: list[dict[str, Any]], spec: SSPSpec) -> None:
    """Per cell: median T and its bootstrap 95 % interval, quartiles, mean (+- 95 %), median U, censored count."""
    n = len(cells[0]["T"]) if cells else 0
    idx = np.random.default_rng(0).integers(0, n, (BOOT, n)) if n else None
    for c in cells:
        T = np.array(c["T"], float)
        boot = np.median(T[idx], axis=1)
        c["median"] = _median(T)
        c["median_ci"] = [float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))]
        c["quartiles"] = [float(np.percentile(T, 25)), float(np.percentile(T, 75))]
        c["censored"] = int(np.isinf(T).sum())
        fin = np.isfinite(T).all()
        c["mean"] = float(T.mean()) if fin else None
        c["mean_ci"] = float(1.96 * T.std(ddof=1) / math.sqrt(n)) if fin and n > 1 else None
        U = [u for u in c["U"] if u is not None]
        c["median_updates"] = float(np.median(U)) if U else None
        c["mean_updates"] = float(np.mean(U)) if U and len(U) == len(c["U"]) else None
        c["_boot"] = boot


def claim(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """T non-increasing in s along the ps-ssp cells (median), with the paired bootstrap share of each step."""
    ssp = sorted((c for c in cells if math.isfinite(c["s"])), key=lambda c: c["s"])
    steps = []
    for a, b in zip(ssp, ssp[1:]):
        share = float(np.mean(a["_boot"] >= b["_boot"]))
        d = np.array(a["T"], float) - np.array(b["T"], float)       # paired: the same seeds, in order
        ok = bool(np.isfinite(d).all()) and len(d) > 1
        steps.append({"from": a["strategy"], "to": b["strategy"], "holds": a["median"] >= b["median"],
                      "bootstrap": share, "mean_drop": float(d.mean()) if ok else None,
                      "mean_drop_ci": float(1.96 * d.std(ddof=1) / math.sqrt(len(d))) if ok else None})
    for c in cells:
        c.pop("_boot", None)
    return {"holds": all(s["holds"] for s in steps), "steps": steps}


def report(data: dict[str, Any]) -> str:
    """The markdown of the study: the table, the lead next to its formula, the verdict."""
    spec, cells, K = data["spec"], data["cells"], data["K"]
    from pslab.experiments.studies.compare import default_config
    t_fast = default_config(None, list(spec["overrides"])).simulate.compute_s
    t_slow = spec["factor"] * t_fast
    seeds = cells[0]["seeds"]
    tuned = spec["seeds"][:len(spec["seeds"]) // 2]
    lr_rule = (f"each strategy's own lr, tuned on seeds {tuned[0] if tuned else ''}..{tuned[-1] if tuned else ''} "
               "(grid lr x 2^(k/2), widened past a winning edge), T on the held-out seeds"
               if spec["tune"] else f"lr {spec['lr']:g} per gradient for every strategy (linear rule: each applies "
               "every gradient as one step)")
    lines = [f"Time to {100 * spec['target_acc']:g} % test accuracy, simulated, K = {K} workers, worker {K - 1} "
             f"{spec['factor']:g}x slower for the whole run (T_fast = {1e3 * t_fast:g} ms, T_slow = "
             f"{1e3 * t_slow:g} ms), accuracy evaluated after every update; {lr_rule}; seeds {seeds[0]}..{seeds[-1]} "
             f"({len(seeds)}).", "",
             "| strategy | lr | median T (s) [95 % CI] | quartiles | mean T (s) ± 95 % | updates U: median, mean | "
             "censored |",
             "|---|---|---|---|---|---|---|"]
    for c in cells:
        mean = "—" if c["mean"] is None else f"{c['mean']:.3f} ± {c['mean_ci']:.3f}"
        lo, hi = c["median_ci"]
        lines.append(f"| {c['strategy']} | {c['lr']:g} | {c['median']:.3f} [{lo:.3f}, {hi:.3f}] | "
                     f"{c['quartiles'][0]:.3f}–{c['quartiles'][1]:.3f} | {mean} | "
                     f"{'—' if c['median_updates'] is None else format(c['median_updates'], 'g')}, "
                     f"{'—' if c['mean_updates'] is None else format(c['mean_updates'], '.1f')} | "
                     f"{c['censored']}/{len(c['T'])} |")
    ref = data["lead_times"].get(cells[0]["strategy"])
    lines += ["", f"Lead of the fast workers (timing-only, seed {spec['seeds'][0]}): time of update n at s = 0 minus "
              f"at s, next to lead(s) = (K-1) s T_slow / K:", "",
              "| strategy | " + " | ".join(f"n = {n}" for n in data["lead_ns"]) + " | formula |",
              "|---|" + "---|" * (len(data["lead_ns"]) + 1)]
    for c in cells:
        if not math.isfinite(c["s"]) or ref is None:
            continue
        got = data["lead_times"][c["strategy"]]
        lines.append(f"| {c['strategy']} | " + " | ".join(f"{1e3 * (a - b):.0f} ms" for a, b in zip(ref, got)) +
                     f" | {1e3 * (K - 1) * c['s'] * t_slow / K:.0f} ms |")
    cl = data["claim"]
    parts = [f"{s['from']} → {s['to']}: {'≥' if s['holds'] else '**<**'} (bootstrap {100 * s['bootstrap']:.0f} %"
             + (f"; paired mean drop {1e3 * s['mean_drop']:+.0f} ± {1e3 * s['mean_drop_ci']:.0f} ms"
                if s["mean_drop"] is not None else "") + ")"
             for s in cl["steps"]]
    lines += ["", f"T non-increasing in s (median): {'HOLDS' if cl['holds'] else 'FAILS'} — " + "; ".join(parts)]
    return "\n".join(lines)


def save(data: dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    p = out / "ssp_straggler.json"
    def clean(v: Any) -> Any:                       # inf (censored, ps-asp's s) -> null
        if isinstance(v, float):
            return v if math.isfinite(v) else None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        return [clean(x) for x in v] if isinstance(v, (list, tuple)) else v
    p.write_text(json.dumps(clean(data), indent=2))
    return p


__all__ = ["SSPSpec", "STRATEGIES", "run_ssp_study", "summarise", "claim", "report", "save", "lead_curve",
           "one_run", "staleness_bound"]
