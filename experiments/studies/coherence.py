"""`pslab sweep --preset coherence`: gradient coherence per model depth (Dai et al., ICLR 2019, Sec. 5 and Fig. 5).

Each model is trained with the staleness emulator (`experiments.sim.dai`; by default s = 0, i.e. plain SGD with K
workers) while `experiments.sim.coherence` records, every `every` steps k, the cosine between the full gradient on a
fixed evaluation batch (the first 512 training examples) at x_k and at x_{k-m} for each lag m:

    cos_k(m) = <grad F(x_k), grad F(x_{k-m})> / (|grad F(x_k)| |grad F(x_{k-m})|)

Dai et al.'s mechanism: the deeper the model, the faster its gradients turn along the trajectory (lower cos at the
same lag), so a gradient r steps stale is a worse descent direction and staleness costs a deeper model more steps.
The models default to the literature workloads by depth: digits-mlr (0 hidden layers), digits-mlp1 (1), digits-mlp3
(3). Output: `coherence.json` (every recorded point), `coherence.png` (`results.plots.plot_coherence`) and a note
with the mean cosine per lag and model.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from pslab.experiments.config import TrainConfig
from pslab.experiments.sim.coherence import mean_by_lag
from pslab.experiments.sim.dai import run_dai
from pslab.experiments.workloads import get_workload

MODELS = {"mlr (0 hidden)": "digits-mlr", "mlp1 (1 hidden)": "digits-mlp1", "mlp3 (3 hidden)": "digits-mlp3"}


@dataclass
class CoherenceSpec:
    models: dict[str, str] = field(default_factory=lambda: dict(MODELS))
    lags: tuple[int, ...] = (1, 2, 4, 8)
    every: int = 10
    steps: int = 300
    lr: float = 0.1                  # SGD (or base.optimizer) learning rate
    staleness: float = 0
    delay: str = "uniform"
    workers: int = 1
    batch_size: int = 32
    seed: int = 0
    base: TrainConfig = field(default_factory=lambda: TrainConfig(optimizer="sgd"))


def run_coherence_study(spec: CoherenceSpec, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """{label: {"model", "series": [(k, {m: cos})], "mean": {m: mean cos}, "final_acc"}} per model."""
    out: dict[str, Any] = {}
    tc = dataclasses.replace(spec.base, lr=spec.lr)
    for label, name in spec.models.items():
        wl = get_workload(name, spec.workers, spec.batch_size, spec.seed)
        res = run_dai(wl, tc, spec.staleness, spec.steps, math.inf, eval_every=spec.steps, seed=spec.seed,
                      delay=spec.delay, coherence_lags=spec.lags, coherence_every=spec.every)
        out[label] = {"model": name, "series": res.coherence, "mean": mean_by_lag(res.coherence, spec.lags),
                      "final_acc": res.curve[-1][1] if res.curve else None, "diverged": res.diverged}
        if progress:
            progress(1)
    return out


def note(results: dict[str, Any], spec: CoherenceSpec) -> str:
    lines = [f"Mean cos(grad F(x_k), grad F(x_{{k-m}})) over k = {spec.every}, {2 * spec.every}, ... "
             f"{spec.steps} ({spec.base.optimizer} lr {spec.lr}, K = {spec.workers}, s = {spec.staleness:g} "
             f"{spec.delay}):", ""]
    for label, r in results.items():
        pts = ", ".join(f"m={m}: {c:.3f}" for m, c in r["mean"].items())
        acc = "" if r["final_acc"] is None else f" (final test accuracy {100 * r['final_acc']:.1f}%)"
        lines.append(f"- {_name(label, r)}: {pts}{acc}")
    return "\n".join(lines)


def save(results: dict[str, Any], spec: CoherenceSpec, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    p = out / "coherence.json"
    p.write_text(json.dumps({"spec": asdict(spec), "models": results}, indent=2))
    return p


def plot(results: dict[str, Any], out: Path) -> Path:
    from pslab.experiments.results.plots import plot_coherence
    out.mkdir(parents=True, exist_ok=True)
    return plot_coherence({_name(label, r): r["series"] for label, r in results.items()}, out)


def _name(label: str, r: dict[str, Any]) -> str:
    return label if label == r["model"] else f"{label} [{r['model']}]"
