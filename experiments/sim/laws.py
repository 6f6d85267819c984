"""Analytic staleness laws of the parameter server, the overlays of the per-worker staleness histograms
(`experiments.results.plots.plot_staleness_per_worker`). Staleness tau = versions applied between a worker's read
and its update; network time is taken as negligible against compute time, the window as steady (all workers run).

ASP, K workers of equal speed (any compute-time law): in steady state every other worker pushes once per round of
the worker's own step, so

    E[tau] = K - 1.

ASP, exponential compute times (memoryless, the same rate for all: `stragglers.delay = "exponential"`,
`simulate.compute_s = 0`): while worker w computes, each next push comes from w itself with probability 1/K, from
another worker with probability (K - 1)/K, independently of the past, so the foreign pushes before w's own are

    P(tau = k) = (1/K) (1 - 1/K)^k,   k = 0, 1, 2, ...          Geometric(1/K) on {0, 1, ...}, mean K - 1.

ASP, one persistent straggler c times slower (deterministic times T for the others, cT for it): during its step the
K - 1 others push c times each, and a fast worker's step sees the K - 2 other fast workers once and the straggler
1/c of the time:

    tau_straggler = c (K - 1)   (a spike),        E[tau_fast] = K - 2 + 1/c.

Bounds. SSP(s) as Ho et al. (`ps-ssp:s`, one version per gradient): a read at clock c needs every worker at >= c - s,
and no worker can have pushed more than c + s + 1 times when the update lands, so tau <= (K - 1)(2s + 1); the
aggregate variant (`ps-ssp-agg:s`, one version per clock) has tau <= s; BSP and backup BSP have tau = 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


def asp_mean(workers: int) -> float:
    """E[tau] under ASP with K equal workers: K - 1."""
    return float(workers - 1)


def geometric_pmf(workers: int, k_max: int) -> np.ndarray:
    """P(tau = k) = (1/K)(1 - 1/K)^k for k = 0..k_max (ASP, exponential compute times)."""
    p = 1.0 / workers
    return p * (1.0 - p) ** np.arange(k_max + 1)


def straggler_spike(workers: int, factor: float) -> float:
    """tau of a persistent straggler c times slower under ASP: c (K - 1)."""
    return float(factor * (workers - 1))


def fast_worker_mean(workers: int, factor: float) -> float:
    """E[tau] of a fast worker beside one straggler c times slower: K - 2 + 1/c."""
    return float(workers - 2 + 1.0 / factor)


def staleness_bound(strategy: str, workers: int) -> int | None:
    """The largest tau a strategy allows (None: unbounded, ASP)."""
    kind, _, arg = str(strategy).partition(":")
    if kind in ("ps-bsp", "ps-bsp-backup", "allreduce", "local"):
        return 0
    if kind == "ps-ssp-agg":
        return int(arg)
    if kind == "ps-ssp":
        return (workers - 1) * (2 * int(arg) + 1)
    return None


@dataclass
class Overlay:
    """What theory says about one worker's staleness in one run: a mean (with its formula), a pmf, a bound."""

    mean: float | None = None
    mean_label: str = ""
    pmf: np.ndarray | None = None
    pmf_label: str = ""
    bound: int | None = None
    notes: list[str] = field(default_factory=list)


def overlay(config: dict[str, Any], worker: int, k_max: int) -> Overlay:
    """The overlay for `worker` of a run with this resolved config (the dict of a run's config.toml)."""
    train, strag = config.get("train") or {}, config.get("stragglers") or {}
    sim = config.get("simulate") or {}
    K, strategy = int(train.get("workers") or 1), str(train.get("strategy") or "")
    ov = Overlay(bound=staleness_bound(strategy, K))
    if strategy != "ps-asp" or K < 2:
        return ov
    factors = {int(w): float(c) for w, c in (strag.get("factors") or {}).items() if float(c) != 1.0}
    delay = strag.get("delay", "none") if float(strag.get("delay_mean_s") or 0.0) > 0 else "none"
    transient = float(strag.get("transient_prob") or 0.0) > 0
    exponential = delay == "exponential" and float(sim.get("compute_s", 1.0)) == 0.0 and not transient
    if exponential:            # step time = delay only: every worker has the same exponential law
        ov.mean, ov.mean_label = asp_mean(K), "K − 1"
        ov.pmf, ov.pmf_label = geometric_pmf(K, k_max), "Geometric(1/K)"
    elif delay == "none" and not transient:
        if not factors:
            ov.mean, ov.mean_label = asp_mean(K), "K − 1"
        elif len(factors) == 1:
            (slow, c), = factors.items()
            if worker == slow:
                ov.mean, ov.mean_label = straggler_spike(K, c), f"c(K − 1), c = {c:g}"
            else:
                ov.mean, ov.mean_label = fast_worker_mean(K, c), f"K − 2 + 1/c, c = {c:g}"
    return ov
