"""The staleness-curve preset of `pslab sweep` (after Dai et al., ICLR 2019, Fig. 1).

For each model (shallow: digits-mlp, 1 hidden layer; deep: digits-deep-mlp, 4 hidden layers), each optimizer
(SGD, momentum 0.9, Adam) and each staleness s in {0, 1, 2, 4, 8, 16}: train with the single-process staleness
emulation (`experiments.sim.dai`: every gradient computed on the parameters of U{0..s} steps ago) and count the steps
until test accuracy >= target. As Dai et al. do, the learning rate is picked per cell from a small grid: the value
that reaches the target in the fewest steps (mean over seeds). With one seed, a run stops as soon as it has used
as many steps as the best learning rate so far (it can no longer win), which changes no reported number.

    normalised(s) = steps(s) / steps(0)      (per model and optimizer; > 1 means staleness slowed convergence)

Cells where no learning rate reaches the target within max_steps are reported as None ("not reached").

The emulator's options pass through: `workers` (K gradients per step, each with its own delay, averaged — Dai et
al.'s worker-count effect; the workload is built with K worker shards) and `delay` (uniform U{0..s} by default;
constant, geometric or exponential with parameter s, see `experiments.sim.delays`), and `models` may name any
workload, e.g. the literature-standard {"shallow": "digits-mlp1", "deep": "digits-mlp3"}.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from experiments.config import TrainConfig
from experiments.sim.dai import run_dai
from experiments.workloads import get_workload

MODELS = {"shallow": "digits-mlp", "deep": "digits-deep-mlp"}
LR_GRID = {"sgd": (0.05, 0.1, 0.2), "momentum": (0.01, 0.02, 0.05), "adam": (0.001, 0.003, 0.01)}
STALENESS = (0, 1, 2, 4, 8, 16)


@dataclass
class SweepSpec:
    models: dict[str, str] = field(default_factory=lambda: dict(MODELS))
    optimizers: dict[str, tuple[float, ...]] = field(default_factory=lambda: dict(LR_GRID))
    staleness: tuple[int, ...] = STALENESS
    seeds: tuple[int, ...] = (0,)
    target_acc: float = 0.85
    max_steps: int = 1000
    batch_size: int = 32
    eval_every: int = 10
    workers: int = 1                 # K emulator workers: gradients averaged per step, independent delays
    delay: str = "uniform"           # uniform | constant | geometric | exponential (experiments.sim.delays)
    base: TrainConfig = field(default_factory=TrainConfig)  # optimizer options (staleness_lr, dc_asgd, ...) pass through


def run_cell(model: str, optimizer: str, lrs: tuple[float, ...], s: int, spec: SweepSpec) -> dict[str, Any]:
    best: dict[str, Any] = {"steps": None, "lr": None}
    tried = []
    for lr in lrs:
        cap = spec.max_steps
        if len(spec.seeds) == 1 and best["steps"] is not None:
            cap = min(cap, int(best["steps"]))
        steps = []
        for seed in spec.seeds:
            wl = get_workload(model, spec.workers, spec.batch_size, seed)
            tc = dataclasses.replace(spec.base, optimizer=optimizer, lr=lr)
            r = run_dai(wl, tc, s, cap, spec.target_acc, spec.eval_every, seed, delay=spec.delay)
            steps.append(r.steps_to_target)
        mean = float(np.mean(steps)) if all(x is not None for x in steps) else None
        tried.append({"lr": lr, "steps": steps, "mean": mean})
        if mean is not None and (best["steps"] is None or mean < best["steps"]):
            best = {"steps": mean, "lr": lr}
    return {"model": model, "optimizer": optimizer, "staleness": s, "steps": best["steps"], "lr": best["lr"],
            "tried": tried}


def run_staleness_sweep(spec: SweepSpec, progress: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    cells = []
    for kind, model in spec.models.items():
        for opt, lrs in spec.optimizers.items():
            for s in spec.staleness:
                c = run_cell(model, opt, lrs, s, spec)
                c["depth"] = kind
                cells.append(c)
                if progress:
                    progress(1)
    base = {(c["depth"], c["optimizer"]): c["steps"] for c in cells if c["staleness"] == 0}
    for c in cells:
        b = base.get((c["depth"], c["optimizer"]))
        c["normalised"] = c["steps"] / b if c["steps"] is not None and b else None
    return cells


def trend_note(cells: list[dict[str, Any]], spec: SweepSpec) -> str:
    """A few sentences computed from the numbers (nothing hard-coded): does staleness cost steps, and where most?"""
    lines = []
    s_max = max(spec.staleness)
    for depth in spec.models:
        for k, opt in enumerate(spec.optimizers):
            row = {c["staleness"]: c for c in cells if c["depth"] == depth and c["optimizer"] == opt}
            pts = ", ".join(f"s={s}: {row[s]['steps']:.0f}" if row[s]["steps"] is not None else f"s={s}: not reached"
                            for s in spec.staleness)
            lines.append(f"- {depth} / {opt}: steps to {100 * spec.target_acc:.0f}% — {pts}")
    def ratio(depth: str, opt: str) -> float | None:
        c = next(c for c in cells if c["depth"] == depth and c["optimizer"] == opt and c["staleness"] == s_max)
        if c["normalised"] is not None:
            return c["normalised"]
        return float("inf") if c["steps"] is None else None
    summary = []
    for depth in spec.models:
        rs = {opt: ratio(depth, opt) for opt in spec.optimizers}
        txt = ", ".join(f"{o} {'not reached' if r == float('inf') else ('—' if r is None else f'{r:.2f}x')}"
                        for o, r in rs.items())
        summary.append(f"At s={s_max} relative to s=0 ({depth} model): {txt}.")
    return "\n".join(lines + [""] + summary)


def save(cells: list[dict[str, Any]], spec: SweepSpec, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    p = out / "staleness_sweep.json"
    p.write_text(json.dumps({"spec": asdict(spec), "cells": cells}, indent=2))
    with open(out / "staleness_sweep.csv", "w") as f:
        f.write("depth,model,optimizer,staleness,lr,steps_to_target,normalised\n")
        for c in cells:
            f.write(f"{c['depth']},{c['model']},{c['optimizer']},{c['staleness']},{c['lr']},"
                    f"{'' if c['steps'] is None else c['steps']},{'' if c['normalised'] is None else c['normalised']}\n")
    return p


def _delay_label(kind: str) -> str:
    return {"uniform": "U{0..s}", "constant": "s", "geometric": "Geometric, mean s",
            "exponential": "rounded Exp, mean s"}.get(kind, kind)


def plot_curve(cells: list[dict[str, Any]], spec: SweepSpec, out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    depths = list(spec.models)
    fig, axes = plt.subplots(2, len(depths), figsize=(5.2 * len(depths), 7.5), squeeze=False)
    for j, depth in enumerate(depths):
        for k, opt in enumerate(spec.optimizers):
            row = sorted((c for c in cells if c["depth"] == depth and c["optimizer"] == opt),
                         key=lambda c: c["staleness"])
            xs = [c["staleness"] for c in row]
            for i, key in enumerate(("steps", "normalised")):
                ys = [np.nan if c[key] is None else c[key] for c in row]
                (line,) = axes[i][j].plot(xs, ys, marker="o", label=opt)
                missed = [x for x, c in zip(xs, row) if c["steps"] is None]
                if missed and i == 0:       # not reached: an x in the optimizer's colour at the step cap,
                    nudge = 1 + 0.12 * (k - 1)  # nudged sideways so that two optimizers' crosses both show
                    axes[i][j].plot([x * nudge for x in missed], [spec.max_steps] * len(missed), "x",
                                    color=line.get_color(), ms=9, mew=2)
        axes[0][j].set_title(f"{depth} model ({spec.models[depth]})")
        axes[0][j].set_ylabel(f"steps to {100 * spec.target_acc:.0f}% test accuracy")
        axes[1][j].set_ylabel("steps normalised to s = 0")
        axes[1][j].axhline(1.0, color="gray", lw=0.8, ls=":")
        for i in range(2):
            axes[i][j].set_xlabel(f"staleness s (delay ~ {_delay_label(spec.delay)} steps; symlog axis)")
            axes[i][j].set_xscale("symlog", linthresh=1)
            axes[i][j].set_xticks(list(spec.staleness), [str(s) for s in spec.staleness])
            axes[i][j].set_xlim(-0.3, max(spec.staleness) * 1.25 + 0.5)
            axes[i][j].grid(True, alpha=0.3)
            axes[i][j].legend(fontsize=8, title="optimizer", title_fontsize=8)
    fig.suptitle("Steps to target accuracy vs staleness (single-process emulation, Dai et al. 2019"
                 + (f", K = {spec.workers} workers" if spec.workers > 1 else "")
                 + f"); x: not reached within {spec.max_steps} steps", fontsize=10)
    fig.tight_layout()
    p = out / "staleness_curve.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p
