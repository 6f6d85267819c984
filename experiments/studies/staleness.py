"""The staleness-curve presets of `pslab sweep` (after Dai et al., ICLR 2019, Fig. 1 and 2).

For each model, optimizer and staleness s, train with the staleness emulator (`experiments.sim.dai`: each of K
workers computes its gradient on the parameters of r steps ago, r ~ U{0..s} by default, the K gradients averaged
into one step) and measure T, the exact number of steps until test accuracy >= target, on several seeds. Each cell
picks its own learning rate from a geometric grid that is widened until it brackets the optimum, reports the lower
median of T over seeds with censoring (a seed that misses the target within max_steps counts as "> max_steps"),
and is normalised by the s = 0 cell of its row:

    normalised(s) = median T(s) / median T(0)     (> 1: staleness costs steps; "> max_steps / T(0)" if censored)

The search, the exact stopping rule and the censoring rules are in `staleness_search.py`; the tables, the check of
Dai et al.'s four claims (more staleness -> more steps; deeper models more sensitive; momentum and Adam more
sensitive than SGD on the deep model; more workers amplify the effect) and the plot in `staleness_report.py`.

Presets (`preset_spec`):

- `staleness`: the literature workloads digits-mlr, digits-mlp1, digits-mlp3 (models ordered shallow -> deep; the
  last is "the deep model") x SGD / momentum 0.9 / Adam x s in {0, 1, 2, 4, 8, 16}, K = 1, plus K = 4 and 8 rows on
  the deep model with SGD (Dai's worker count: K gradients on K batches of 32, each with its own delay). Target 95 %
  test accuracy, at most 1,000 steps, seeds 0..24 (`--quick`: 0, 1, 2): 25 seeds, the most that fit 10 minutes on
  2 cores (9 seeds left two dips in T(s) and the SGD depth ordering at bootstrap 54 %; docs/tutorial.md section 4).
- `staleness-remedies`: the deep model with SGD, momentum and Adam at s in {0, 4, 8, 16}, the plain optimizer next to
  the staleness-aware learning rate (Zhang et al. 2016: each gradient's lr / max(tau, 1), Adam's step at the mean of
  the gradients' rates; `train.staleness_lr`) and
  DC-ASGD (Zheng et al. 2017: g + lambda g (.) g (.) (w_now - w_read); constant lambda = 0.04, and adaptive with
  lambda_0 = 2, the paper's values), each with its own bracketed lr; seeds 0..8 (four variants per cell: 25 seeds
  would not fit 10 minutes).

Cells run in a process pool (`jobs`, one torch thread each); every run is seeded, so the numbers do not depend on
the pool size.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from pslab.experiments.config import OPTIMIZERS, TrainConfig
from pslab.experiments.errors import ConfigError
from pslab.experiments.sim.delays import DelayModel
from pslab.experiments.studies.staleness_search import search_lr
from pslab.experiments.workloads import WORKLOADS, get_workload

MODELS = {"mlr": "digits-mlr", "mlp1": "digits-mlp1", "mlp3": "digits-mlp3"}   # shallow -> deep
LR_GRID = {"sgd": (0.05, 0.1, 0.2, 0.4, 0.8), "momentum": (0.005, 0.01, 0.02, 0.04, 0.08),
           "adam": (0.001, 0.002, 0.004, 0.008, 0.016)}
STALENESS = (0, 1, 2, 4, 8, 16)
REMEDIES = {"plain": {}, "staleness-lr": {"staleness_lr": True},
            "dc-asgd": {"dc_asgd": True, "dc_lambda": 0.04},
            "dc-asgd-a": {"dc_asgd": True, "dc_adaptive": True, "dc_lambda": 2.0}}
PRESETS = ("staleness", "staleness-remedies")
SEEDS = tuple(range(25))     # the staleness preset's seeds: an odd count, so the lower median is the ordinary median
REMEDY_SEEDS = tuple(range(9))  # the remedies preset's (4 variants per cell)


@dataclass
class SweepSpec:
    models: dict[str, str] = field(default_factory=lambda: dict(MODELS))    # label -> workload, shallow -> deep
    optimizers: dict[str, tuple[float, ...]] = field(default_factory=lambda: dict(LR_GRID))  # initial lr grids
    staleness: tuple[int, ...] = STALENESS
    seeds: tuple[int, ...] = (0, 1, 2)
    target_acc: float = 0.95
    max_steps: int = 1000
    batch_size: int = 32
    eval_every: int = 10             # a check every k steps, every step within eval_margin of the target
    eval_margin: float = 0.02
    workers: int = 1                 # K of the main rows: gradients averaged per step, independent delays
    delay: str = "uniform"           # uniform | constant | geometric | exponential (experiments.sim.delays)
    worker_counts: tuple[int, ...] = ()            # extra K rows on the deepest model ...
    worker_optimizers: tuple[str, ...] = ("sgd",)  # ... with these optimizers
    variants: dict[str, dict[str, Any]] = field(default_factory=lambda: {"plain": {}})  # name -> TrainConfig options
    lr_factor: float = 2.0           # grid ratio, and the step of each widening
    widen: int = 4                   # at most this many lrs added per cell beyond the grid's edges
    base: TrainConfig = field(default_factory=TrainConfig)  # optimizer options (momentum, betas, ...) pass through
    preset: str = "staleness"

    def validate(self) -> None:
        if not self.models or not self.optimizers or not self.staleness or not self.seeds or not self.variants:
            raise ConfigError("the staleness sweep needs at least one model, optimizer, staleness, seed and variant")
        for name in self.models.values():
            if name not in WORKLOADS:
                raise ConfigError(f"unknown workload {name!r}; choose one of: {', '.join(WORKLOADS)}")
        for opt, grid in self.optimizers.items():
            if opt not in OPTIMIZERS or not grid or min(grid) <= 0:
                raise ConfigError(f"optimizer {opt!r} needs a name in {OPTIMIZERS} and a grid of lrs > 0")
        if not 0 < self.target_acc <= 1:
            raise ConfigError(f"--target must be an accuracy in (0, 1], got {self.target_acc}")
        if self.max_steps < 1:
            raise ConfigError(f"--max-steps must be >= 1, got {self.max_steps}")
        if self.workers < 1 or any(k < 1 for k in self.worker_counts):
            raise ConfigError(f"worker counts must be >= 1, got {self.workers} and {list(self.worker_counts)}")
        if self.eval_every < 1 or not 0 <= self.eval_margin <= 1 or self.lr_factor <= 1 or self.widen < 0:
            raise ConfigError("the sweep needs eval_every >= 1, eval_margin in [0, 1], lr_factor > 1, widen >= 0")
        for s in self.staleness:
            DelayModel(self.delay, s)


@dataclass(frozen=True)
class Row:
    """One curve: a model, an optimizer, a variant (optimizer options) and a worker count, over every s."""

    label: str
    model: str
    optimizer: str
    variant: str = "plain"
    workers: int = 1

    @property
    def key(self) -> tuple[str, str, str, int]:
        return self.label, self.optimizer, self.variant, self.workers


def preset_spec(preset: str = "staleness", quick: bool = False, **changes: Any) -> SweepSpec:
    """The spec of a preset (module docstring); `quick`: a smoke version in well under a minute."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown staleness preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    if preset == "staleness":
        spec = SweepSpec(worker_counts=(4, 8), seeds=SEEDS)
        if quick:
            spec = SweepSpec(models={"mlr": "digits-mlr", "mlp3": "digits-mlp3"},
                             optimizers={"sgd": (0.1, 0.2, 0.4), "adam": (0.002, 0.004, 0.008)},
                             staleness=(0, 4, 16), target_acc=0.9, max_steps=300, worker_counts=(4,), widen=2)
    else:
        spec = SweepSpec(models={"mlp3": "digits-mlp3"},
                         optimizers={k: LR_GRID[k] for k in ("sgd", "momentum", "adam")},
                         staleness=(0, 4, 8, 16), variants=dict(REMEDIES), preset=preset, seeds=REMEDY_SEEDS)
        if quick:
            spec = SweepSpec(models={"mlp3": "digits-mlp3"}, optimizers={"sgd": (0.1, 0.2, 0.4)},
                             staleness=(0, 16), target_acc=0.9, max_steps=300, widen=2, preset=preset,
                             variants=dict(REMEDIES))
    return dataclasses.replace(spec, **{k: v for k, v in changes.items() if v is not None})


def rows(spec: SweepSpec) -> list[Row]:
    """The main rows (every model x optimizer x variant at K = spec.workers), then the worker-count rows (the
    deepest model, plain variant, each of spec.worker_counts with spec.worker_optimizers)."""
    out = [Row(label, model, opt, variant, spec.workers)
           for label, model in spec.models.items() for opt in spec.optimizers for variant in spec.variants]
    deep_label, deep_model = list(spec.models.items())[-1]
    plain = next(iter(spec.variants))
    for k in spec.worker_counts:
        for opt in spec.worker_optimizers:
            if k != spec.workers and opt in spec.optimizers:
                out.append(Row(deep_label, deep_model, opt, plain, k))
    return out


_WORKLOADS: dict[tuple[str, int, int, int], Any] = {}


def _workload(model: str, workers: int, batch: int, seed: int) -> Any:
    key = (model, workers, batch, seed)
    if key not in _WORKLOADS:
        _WORKLOADS[key] = get_workload(model, workers, batch, seed)
    return _WORKLOADS[key]


def run_row_cell(spec: SweepSpec, row: Row, s: int) -> dict[str, Any]:
    """One cell: the lr search of `staleness_search.search_lr` for `row` at staleness s."""
    t0 = time.perf_counter()
    train = dataclasses.replace(spec.base, optimizer=row.optimizer, **spec.variants.get(row.variant, {}))
    res = search_lr(lambda seed: _workload(row.model, row.workers, spec.batch_size, seed), train, s,
                    spec.optimizers[row.optimizer], spec.seeds, target=spec.target_acc, max_steps=spec.max_steps,
                    delay=spec.delay, every=spec.eval_every, margin=spec.eval_margin, factor=spec.lr_factor,
                    widen=spec.widen)
    return {"depth": row.label, "model": row.model, "optimizer": row.optimizer, "variant": row.variant,
            "workers": row.workers, "staleness": s, "seeds": list(spec.seeds), **res,
            "wall_s": round(time.perf_counter() - t0, 2)}


def run_cell(model: str, optimizer: str, lrs: tuple[float, ...], s: int, spec: SweepSpec,
             workers: int | None = None, variant: str = "plain") -> dict[str, Any]:
    """One cell by workload name and initial lr grid (the older entry point): see `run_row_cell`."""
    spec = dataclasses.replace(spec, optimizers={**spec.optimizers, optimizer: tuple(lrs)})
    label = next((k for k, v in spec.models.items() if v == model), model)
    return run_row_cell(spec, Row(label, model, optimizer, variant, workers or spec.workers), s)


def _init_pool() -> None:
    import torch
    torch.set_num_threads(1)


def default_jobs() -> int:
    """The CPU cores this process may use (each pool process runs one torch thread)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:                  # not on Linux
        return max(1, os.cpu_count() or 1)


def run_staleness_sweep(spec: SweepSpec, progress: Callable[[int], None] | None = None,
                        jobs: int = 1) -> list[dict[str, Any]]:
    """Every (row, s) cell, in a pool of `jobs` processes (1: in this process); cells come back in row order with
    `normalised` (and `normalised_lower` when censored) filled in."""
    spec.validate()
    tasks = [(row, s) for row in rows(spec) for s in spec.staleness]
    depth = {label: i for i, label in enumerate(spec.models)}
    # the costliest cells first, so that two processes finish together: more workers, more staleness, deeper
    order = sorted(range(len(tasks)), key=lambda i: -tasks[i][0].workers * (2 + tasks[i][1])
                   * (1 + depth[tasks[i][0].label]))
    cells: list[dict[str, Any] | None] = [None] * len(tasks)
    if jobs <= 1:
        for i in order:
            cells[i] = run_row_cell(spec, *tasks[i])
            if progress:
                progress(1)
    else:
        from pslab.collectives.forking import forkserver_context      # (not spawn: torch imported once)
        with ProcessPoolExecutor(max_workers=jobs, mp_context=forkserver_context(), initializer=_init_pool) as ex:
            futures = {ex.submit(run_row_cell, spec, *tasks[i]): i for i in order}
            for f in as_completed(futures):
                cells[futures[f]] = f.result()
                if progress:
                    progress(1)
    done = [c for c in cells if c is not None]
    normalise(done, spec)
    return done


def normalise(cells: list[dict[str, Any]], spec: SweepSpec) -> None:
    """normalised = median T(s) / median T(0) of the same row; censored: normalised None and
    normalised_lower = max_steps / T(0) (the ratio is larger). vs_plain = T(variant) / T(plain) at the same s."""
    key = lambda c: (c["depth"], c["optimizer"], c["variant"], c["workers"])  # noqa: E731
    base = {key(c): c["steps"] for c in cells if c["staleness"] == 0}
    plain = next(iter(spec.variants))
    by = {(*key(c), c["staleness"]): c for c in cells}
    for c in cells:
        b = base.get(key(c))
        c["normalised"] = c["steps"] / b if c["steps"] is not None and b else None
        c["normalised_lower"] = spec.max_steps / b if c["steps"] is None and b else None
        p = by.get((c["depth"], c["optimizer"], plain, c["workers"], c["staleness"]))
        c["vs_plain"] = (c["steps"] / p["steps"] if p is not None and c["variant"] != plain
                         and c["steps"] is not None and p["steps"] else None)


def save(cells: list[dict[str, Any]], spec: SweepSpec, out: Path, extra: dict[str, Any] | None = None) -> Path:
    """staleness_sweep.json (spec, cells with every lr tried, and `extra`: claims, wall time) and .csv (one line
    per cell: the chosen lr, the median and per-seed steps, the censored count, normalised, edge hits)."""
    out.mkdir(parents=True, exist_ok=True)
    p = out / "staleness_sweep.json"
    p.write_text(json.dumps({"spec": asdict(spec), "cells": cells, **(extra or {})}, indent=2))
    cols = ("depth", "model", "optimizer", "variant", "workers", "staleness", "lr", "steps_to_target",
            "median_censored", "censored", "seeds", "seed_steps", "normalised", "normalised_lower", "lr_edge",
            "widened")
    blank = lambda v: "" if v is None else v  # noqa: E731
    with open(out / "staleness_sweep.csv", "w") as f:
        f.write(",".join(cols) + "\n")
        for c in cells:
            vals = {**c, "steps_to_target": c["steps"], "seeds": len(c["seeds"]),
                    "seed_steps": ";".join(str(v) if v is not None else f">{spec.max_steps}" for v in c["seed_steps"])}
            f.write(",".join(str(blank(vals.get(k))) for k in cols) + "\n")
    return p


from pslab.experiments.studies.staleness_report import plot_curve, tables, trend_note  # noqa: E402  (re-exported)

__all__ = ["SweepSpec", "Row", "PRESETS", "preset_spec", "rows", "run_cell", "run_row_cell", "run_staleness_sweep",
           "normalise", "save", "plot_curve", "tables", "trend_note", "default_jobs"]
