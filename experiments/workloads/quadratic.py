"""A quadratic "workload" with a known answer, for the staleness emulator's exact and statistical tests and the
momentum study (`pslab sweep --preset momentum`).

    F(x) = 1/2 sum_i h_i x_i^2 - <xi, x>,     grad F(x) = H x - xi,     x in R^d (one parameter, "x")

xi is the gradient noise of worker w at step t: xi ~ N(0, noise^2 I) seeded with (seed, w, t), or 0 (noise = 0:
deterministic gradients, all randomness then comes from the delays). The gradient is affine in x, so the expected
trajectory of a stale run obeys a linear recursion — which is why a constant delay d gives exactly
x_{t+1} = x_t - eta H x_{t-d} and why geometric delays average to momentum (see `experiments.sim.dai`).

It quacks like `experiments.workloads.Workload` for what the emulator uses (`workers`, `make_model`, `batch`,
`loss_from_output`, `evaluate`, `fixed_batch`) and is not in the `WORKLOADS` registry: it is not a real-run
workload. `evaluate` reports test_loss = 1/2 sum h_i x_i^2 (noise-free) and test_acc = 0.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import nn

from pslab.experiments.errors import ConfigError


class QuadraticModel(nn.Module):
    """The parameter x; the forward pass ignores its input and returns x."""

    def __init__(self, x0: torch.Tensor) -> None:
        super().__init__()
        self.x = nn.Parameter(x0.clone())

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.x


class QuadraticWorkload:
    name = "quadratic"
    task = "quadratic"

    def __init__(self, h: Sequence[float], x0: Sequence[float], workers: int = 1, noise: float = 0.0,
                 seed: int = 0) -> None:
        self.h = torch.tensor(list(h), dtype=torch.float32)
        self.x0 = torch.tensor(list(x0), dtype=torch.float32)
        if self.h.dim() != 1 or self.h.shape != self.x0.shape or len(self.h) == 0:
            raise ConfigError(f"a quadratic needs curvatures h and a start x0 of the same length >= 1, got "
                              f"{len(self.h)} and {len(self.x0)}")
        if workers < 1 or noise < 0:
            raise ConfigError(f"quadratic workload: workers must be >= 1 and noise >= 0, got {workers}, {noise}")
        self._workers, self.noise, self.seed = int(workers), float(noise), int(seed)
        self._zero = torch.zeros(1)

    @property
    def workers(self) -> int:
        return self._workers

    def make_model(self) -> nn.Module:
        return QuadraticModel(self.x0)

    def batch(self, worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """(unused input, the noise xi of (worker, step), a one-element index)."""
        if self.noise == 0:
            xi = torch.zeros_like(self.h)
        else:
            rng = np.random.default_rng([self.seed, 0x9AD, worker, step])
            xi = torch.from_numpy(rng.normal(0.0, self.noise, len(self.h)).astype(np.float32))
        return self._zero, xi, np.array([step], dtype=np.int64)

    def fixed_batch(self, n: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        return self._zero, torch.zeros_like(self.h)

    def loss_from_output(self, out: torch.Tensor, xi: torch.Tensor) -> torch.Tensor:
        return 0.5 * (self.h * out * out).sum() - (xi * out).sum()

    def loss(self, model: nn.Module, x: torch.Tensor, xi: torch.Tensor) -> torch.Tensor:
        return self.loss_from_output(model(x), xi)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        x = model(self._zero)
        return {"test_loss": float(0.5 * (self.h * x * x).sum()), "test_acc": 0.0}
