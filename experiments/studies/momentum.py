"""`pslab sweep --preset momentum`: "asynchrony begets momentum" (Mitliagkas et al. 2016), checked statistically.

For each M, `runs` seeded runs of the staleness emulator (`experiments.sim.dai`, K workers, geometric delays with
mean M - 1, i.e. P(r = l) = (1 - q) q^l, q = 1 - 1/M) train the quadratic F(x) = 1/2 h x^2 from x_0 = 1 with SGD at
lr eta. The derivation in `dai.py` says their MEAN trajectory is momentum SGD with

    mu = 1 - 1/M,  lr = eta / M  (after a first full step -eta h x_0)  ==  torch SGD(lr=eta, momentum=mu, dampening=mu)

The check: at every step t >= 1 the sample mean of the runs, mean_t, against the momentum trajectory m_t, in
standard errors: z_t = (mean_t - m_t) / (sd_t / sqrt(runs)). Steps whose sd is 0 (step 1 is deterministic) must
agree to 1e-6 instead. The equivalence holds if max_t |z_t| <= z*, with z* the two-sided Bonferroni bound for
T steps at family-wise level alpha: z* = Phi^-1(1 - alpha / (2T)) (alpha = 1e-3, T = 60: z* = 4.31; the z_t are
positively correlated, so the bound is conservative). The negative controls — plain SGD (mu = 0, lr eta: "no
momentum") and the momentum of the wrong worker count (M' = 2M) — go through the same check and must FAIL it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Any, Callable

import numpy as np
import torch

from pslab.experiments.config import TrainConfig
from pslab.experiments.errors import ConfigError
from pslab.experiments.sim.dai import run_dai
from pslab.experiments.workloads.quadratic import QuadraticWorkload


@dataclass
class MomentumSpec:
    m_values: tuple[int, ...] = (2, 4, 8)   # Mitliagkas's M: geometric delays with mean M - 1
    h: float = 1.0                           # curvature of F(x) = 1/2 h x^2
    lr: float = 0.1                          # eta of the stale SGD
    steps: int = 60
    runs: int = 200                          # seeded runs per M (seeds 0 .. runs-1)
    workers: int = 1                         # K emulator workers (gradients averaged per step)
    noise: float = 0.0                       # gradient noise sd (0: all randomness comes from the delays)
    alpha: float = 1e-3                      # family-wise level of the z bound

    def __post_init__(self) -> None:
        if not self.m_values or min(self.m_values) < 1:
            raise ConfigError(f"momentum study: every M must be >= 1, got {self.m_values!r}")
        if self.runs < 2 or self.steps < 1 or self.workers < 1:
            raise ConfigError(f"momentum study needs runs >= 2, steps >= 1 and workers >= 1, got {self.runs}, "
                              f"{self.steps}, {self.workers}")
        if not 0 < self.alpha < 1:
            raise ConfigError(f"momentum study: alpha must be in (0, 1), got {self.alpha}")


def momentum_trajectory(h: float, lr: float, mu: float, steps: int, x0: float = 1.0) -> np.ndarray:
    """x_0..x_steps of torch SGD(lr, momentum=mu, dampening=mu) on 1/2 h x^2 (mu = 0: plain SGD)."""
    x = torch.tensor([float(x0)], requires_grad=True)
    opt = torch.optim.SGD([x], lr=lr, momentum=mu, dampening=mu)
    out = [float(x0)]
    for _ in range(steps):
        opt.zero_grad()
        (0.5 * h * x * x).sum().backward()
        opt.step()
        out.append(float(x.detach()[0]))
    return np.array(out)


def stale_trajectories(spec: MomentumSpec, m: int, progress: Callable[[int], None] | None = None) -> np.ndarray:
    """(runs, steps + 1): x_t of each seeded emulator run with geometric delays of mean m - 1."""
    rows = []
    for seed in range(spec.runs):
        wl = QuadraticWorkload([spec.h], [1.0], workers=spec.workers, noise=spec.noise, seed=seed)
        xs = [1.0]
        run_dai(wl, TrainConfig(optimizer="sgd", lr=spec.lr), m - 1, spec.steps, math.inf,
                eval_every=spec.steps + 1, seed=seed, delay="geometric",
                on_step=lambda _s, model: xs.append(float(model.x.detach()[0])))
        rows.append(xs)
        if progress:
            progress(1)
    return np.array(rows)


def z_bound(points: int, alpha: float = 1e-3) -> float:
    """Two-sided Bonferroni bound: |z| <= z* at each of `points` steps holds with probability >= 1 - alpha."""
    return NormalDist().inv_cdf(1 - alpha / (2 * points))


def check(samples: np.ndarray, reference: np.ndarray, alpha: float = 1e-3) -> dict[str, Any]:
    """Is `reference` the mean of `samples` (runs x steps+1)? max |z_t| over t >= 1 against z_bound."""
    mean = samples.mean(0)
    se = samples.std(0, ddof=1) / math.sqrt(len(samples))
    diff = (mean - reference)[1:]
    se = se[1:]
    noisy = se > 1e-9
    z = np.zeros_like(diff)
    z[noisy] = diff[noisy] / se[noisy]
    exact_ok = bool(np.all(np.abs(diff[~noisy]) <= 1e-6))
    bound = z_bound(len(diff), alpha)
    worst = int(np.argmax(np.abs(z))) + 1
    max_z = float(np.abs(z).max())
    return {"max_z": max_z, "worst_step": worst, "bound": bound, "passed": bool(exact_ok and max_z <= bound),
            "exact_ok": exact_ok}


def run_momentum_study(spec: MomentumSpec, progress: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    out = []
    for m in spec.m_values:
        samples = stale_trajectories(spec, m, progress)
        mu = 1 - 1 / m
        ref = momentum_trajectory(spec.h, spec.lr, mu, spec.steps)
        plain = momentum_trajectory(spec.h, spec.lr, 0.0, spec.steps)
        wrong = momentum_trajectory(spec.h, spec.lr, 1 - 1 / (2 * m), spec.steps)
        out.append({"M": m, "mu": mu, "mean": samples.mean(0).tolist(),
                    "se": (samples.std(0, ddof=1) / math.sqrt(len(samples))).tolist(),
                    "momentum": ref.tolist(), "plain_sgd": plain.tolist(), "wrong_m": wrong.tolist(),
                    "check": check(samples, ref, spec.alpha),
                    "control_plain": check(samples, plain, spec.alpha),
                    "control_wrong_m": check(samples, wrong, spec.alpha)})
    return out


def note(results: list[dict[str, Any]], spec: MomentumSpec) -> str:
    lines = [f"Geometric delays (mean M - 1), {spec.runs} seeded runs, K = {spec.workers}, SGD lr {spec.lr} on "
             f"1/2 {spec.h:g} x^2, {spec.steps} steps; z* = {results[0]['check']['bound']:.2f} "
             f"(Bonferroni, alpha {spec.alpha:g}).", ""]
    for r in results:
        c, p, w = r["check"], r["control_plain"], r["control_wrong_m"]
        lines.append(f"- M = {r['M']}: mean vs momentum mu = {r['mu']:.3f}, lr {spec.lr}/{r['M']}: max|z| = "
                     f"{c['max_z']:.2f} ({'within' if c['passed'] else 'OUTSIDE'} the bound); negative controls: "
                     f"plain SGD max|z| = {p['max_z']:.1f} ({'fails, as it must' if not p['passed'] else 'PASSES?!'}), "
                     f"M' = {2 * r['M']} max|z| = {w['max_z']:.1f} "
                     f"({'fails, as it must' if not w['passed'] else 'PASSES?!'})")
    return "\n".join(lines)


def save(results: list[dict[str, Any]], spec: MomentumSpec, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    p = out / "momentum_study.json"
    p.write_text(json.dumps({"spec": asdict(spec), "results": results}, indent=2))
    return p


def plot_momentum(results: list[dict[str, Any]], spec: MomentumSpec, out: Path) -> Path:
    from pslab.experiments.results.plots import plt, save_figure
    fig, axes = plt.subplots(1, len(results), figsize=(4.6 * len(results), 3.8), squeeze=False)
    for ax, r in zip(axes[0], results):
        t = np.arange(len(r["mean"]))
        mean, se = np.array(r["mean"]), np.array(r["se"])
        ax.fill_between(t, mean - 2 * se, mean + 2 * se, color="C0", alpha=0.25, lw=0)
        ax.plot(t, mean, "o", color="C0", ms=3, label=f"stale SGD, geometric delays (mean of {spec.runs})")
        ax.plot(t, r["momentum"], "-", color="C3", lw=1.5, label=f"momentum mu = 1 - 1/M = {r['mu']:.3f}")
        ax.plot(t, r["plain_sgd"], ":", color="gray", lw=1.2, label="plain SGD (mu = 0, control)")
        ax.set_title(f"M = {r['M']}: max|z| = {r['check']['max_z']:.2f} (z* {r['check']['bound']:.2f})", fontsize=9)
        ax.set_xlabel("step")
        ax.axhline(0, color="k", lw=0.5)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("x_t")
    axes[0][0].legend(fontsize=7)
    return save_figure(fig, out / "momentum.png", "Asynchrony begets momentum (Mitliagkas et al. 2016): mean "
                       "stale trajectory vs momentum SGD (band: +-2 standard errors)")
