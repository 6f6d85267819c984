"""Gradient coherence (Dai et al., ICLR 2019, Sec. 5): how well an old gradient still points the right way.

A stale update applies grad F(x_{k-m}) where grad F(x_k) is due. Dai et al. explain why depth amplifies staleness
by the coherence of gradients along the trajectory, measured on one fixed evaluation batch B (so the mini-batch
noise does not enter; F is the loss on B):

    cos_k(m) = <grad F(x_k), grad F(x_{k-m})> / (|grad F(x_k)| |grad F(x_{k-m})|)       (their Fig. 5)
    mu_k(m)  = <grad F(x_k), grad F(x_{k-m})> / |grad F(x_k)|^2                        (their coherence mu)

Coherence near 1 means a gradient m steps old is almost the current one (staleness is cheap); a deeper network's
gradients turn faster, so its coherence decays faster with m and stale SGD makes less progress per step.
On F(x) = 1/2 sum_i h_i x_i^2 under plain gradient descent x_k = (I - eta H)^k x_0, so
grad F(x_k)_i = h_i a_i^k x_{0,i} with a_i = 1 - eta h_i, and

    cos_k(m) = sum_i c_i a_i^(2k-m) / sqrt(sum_i c_i a_i^(2k) * sum_i c_i a_i^(2k-2m)),   c_i = h_i^2 x_{0,i}^2

(`quadratic_cosine`): identical gradients (m = 0, or one coordinate) give exactly 1.

`CoherenceRecorder` is what the emulator (`run_dai(..., coherence_lags=(1, 2, 4, 8), coherence_every=n)`) uses:
every n steps it computes grad F at the current version and at the versions m steps back (kept in the emulator's
history) and records cos_k(m) per lag.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
from torch.func import functional_call

from pslab.experiments.errors import ConfigError


def _flat(grads: Sequence[torch.Tensor] | torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(grads, (torch.Tensor, np.ndarray)):
        grads = [grads]
    return np.concatenate([np.asarray(g.detach() if isinstance(g, torch.Tensor) else g, np.float64).reshape(-1)
                           for g in grads])


def cosine(a: Sequence[torch.Tensor] | torch.Tensor, b: Sequence[torch.Tensor] | torch.Tensor) -> float:
    """cos(a, b) of two gradients (each one tensor or a list of per-parameter tensors), in float64;
    nan when either is zero."""
    x, y = _flat(a), _flat(b)
    if x.shape != y.shape:
        raise ValueError(f"gradients of different sizes: {x.size} and {y.size}")
    nx, ny = float(np.linalg.norm(x)), float(np.linalg.norm(y))
    return float(np.dot(x, y) / (nx * ny)) if nx > 0 and ny > 0 else math.nan


def dai_mu(now: Sequence[torch.Tensor] | torch.Tensor, past: Sequence[torch.Tensor] | torch.Tensor) -> float:
    """Dai et al.'s coherence <g_now, g_past> / |g_now|^2 (nan when g_now = 0)."""
    x, y = _flat(now), _flat(past)
    n2 = float(np.dot(x, x))
    return float(np.dot(x, y) / n2) if n2 > 0 else math.nan


def quadratic_cosine(h: Sequence[float], x0: Sequence[float], lr: float, k: int, m: int) -> float:
    """The analytic cos_k(m) of plain gradient descent on F(x) = 1/2 sum_i h_i x_i^2 (module docstring)."""
    if not 0 <= m <= k:
        raise ValueError(f"need 0 <= m <= k, got m={m}, k={k}")
    h, x0 = np.asarray(h, np.float64), np.asarray(x0, np.float64)
    a, c = 1.0 - lr * h, (h * x0) ** 2
    return float(np.sum(c * a ** (2 * k - m)) / math.sqrt(np.sum(c * a ** (2 * k)) * np.sum(c * a ** (2 * k - 2 * m))))


def batch_gradient(wl: Any, model: torch.nn.Module, names: list[str], params: Sequence[torch.Tensor],
                   batch: tuple[torch.Tensor, torch.Tensor]) -> list[torch.Tensor]:
    """grad F(params) on `batch` (the model's own weights are not touched)."""
    leaves = [p.detach().clone().requires_grad_(True) for p in params]
    x, y = batch
    loss = wl.loss_from_output(functional_call(model, dict(zip(names, leaves)), (x,)), y)
    return list(torch.autograd.grad(loss, leaves))


@dataclass
class CoherenceRecorder:
    """Every `every` steps, cos(grad F(x_k), grad F(x_{k-m})) for each lag m on the workload's fixed batch."""

    lags: tuple[int, ...]
    every: int = 10
    batch_size: int = 512
    series: list[tuple[int, dict[int, float]]] = field(default_factory=list, init=False)
    _batch: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.lags = tuple(int(m) for m in self.lags)
        if not self.lags or min(self.lags) < 1:
            raise ConfigError(f"coherence lags must be integers >= 1, e.g. 1,2,4,8; got {self.lags!r}")
        if self.every < 1 or self.batch_size < 1:
            raise ConfigError(f"coherence needs every >= 1 and batch_size >= 1, got {self.every}, {self.batch_size}")

    @property
    def depth(self) -> int:
        """How many past versions the emulator must keep besides the current one."""
        return max(self.lags)

    def maybe_record(self, k: int, wl: Any, model: torch.nn.Module, names: list[str],
                     history: Sequence[Sequence[torch.Tensor]]) -> dict[int, float] | None:
        """After step k (history[-1] is x_k), record cos_k(m) for every lag m <= k, if k is a multiple of every."""
        if k % self.every or k < min(self.lags):
            return None
        if self._batch is None:
            self._batch = wl.fixed_batch(self.batch_size)
        now = batch_gradient(wl, model, names, history[-1], self._batch)
        row = {m: cosine(now, batch_gradient(wl, model, names, history[-1 - m], self._batch))
               for m in self.lags if m <= k and m < len(history)}
        self.series.append((k, row))
        return row

    def mean_by_lag(self) -> dict[int, float]:
        return mean_by_lag(self.series, self.lags)


def mean_by_lag(series: Sequence[tuple[int, dict[int, float]]], lags: Sequence[int]) -> dict[int, float]:
    """Average of cos_k(m) over the recorded steps k, per lag m (nan entries skipped; nan if none)."""
    out = {}
    for m in lags:
        vals = [row[m] for _, row in series if m in row and not math.isnan(row[m])]
        out[int(m)] = float(np.mean(vals)) if vals else math.nan
    return out
