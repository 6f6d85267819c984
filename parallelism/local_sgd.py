"""Periodic averaging: Local SGD (Lin et al. 2020) and DiLoCo (Douillard et al. 2023) — synchronise every H steps.

All-reduce BSP averages the D workers' gradients at every step. These two average far less often. Between
averages each worker i steps its own optimizer on its own gradient, with no communication at all:

    θ_i ← opt_i(θ_i, g_i(θ_i))                       H local steps; the copies drift apart; each worker's
                                                      optimizer state (momentum, Adam moments) stays its own
then, after every H-th step (and after the run's last step, so the run ends on one model):

    Local SGD:  θ_i ← θ̄ = (1/D) Σ_j θ_j              one all-reduce of the S parameter bytes
    DiLoCo:     Δ = (1/D) Σ_j (θ_outer − θ_j)         the averaged pseudo-gradient: one all-reduce of S bytes
                θ_outer ← outer(θ_outer, Δ);  θ_i ← θ_outer
                outer = SGD with Nesterov momentum, lr 0.7, momentum 0.9 (the paper's; `[outer]` in the config)

Communication: one all-reduce of the parameters per H steps instead of one of the gradients per step, H× fewer
bytes (the same size: a parameter and its gradient have the same bytes).

Exactness (tests/experiments/test_local_sgd.py). H = 1 with plain SGD is all-reduce BSP:
(1/D) Σ_j (θ − η g_j) = θ − η (1/D) Σ_j g_j, equal to float rounding. DiLoCo with outer SGD, lr 1, momentum 0
is Local SGD: θ_outer − (θ_outer − θ̄) = θ̄. The learning rate: each local step moves one copy by η g_i and the
average divides every move by D, so a step's distance per gradient is η/D, as BSP's: `train.lr_rule` scales η
with G = D (spec.py), and local-sgd:1 and allreduce then take the same steps.

Staleness: at local step k after an average (k = 0 … H−1) a worker's gradient is computed on parameters that
lack the other workers' last k steps each; the records' `staleness` is k (the local steps its parameters have
taken alone). Evaluation reads the global model — the last average (Local SGD), θ_outer (DiLoCo) — through
`global_view`, not one worker's drifted copy. The simulator runs the same arithmetic on D copies in virtual time
(experiments/sim/local_sgd.py).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from .engine import EngineError, OptimizerFactory, Replica, zero_grads


class PeriodicAveragingStrategy:
    """A SyncStrategy: local optimizer steps, and every `period` steps (and after step `total_steps`) the
    parameters averaged over replica.dp — Local SGD — or, with `outer_factory`, DiLoCo's outer step on the
    averaged pseudo-gradient (module docstring)."""

    def __init__(self, optimizer_factory: OptimizerFactory, period: int, total_steps: int,
                 outer_factory: OptimizerFactory | None = None) -> None:
        if period < 1 or total_steps < 1:
            raise EngineError(f"periodic averaging needs period >= 1 and total_steps >= 1, got {period}, "
                              f"{total_steps}")
        self.optimizer_factory, self.outer_factory = optimizer_factory, outer_factory
        self.period, self.total_steps = int(period), int(total_steps)
        self.optimizer: torch.optim.Optimizer | None = None
        self.outer: torch.optim.Optimizer | None = None
        self.anchor: list[torch.Tensor] = []     # the global model: the last average, or θ_outer
        self.local_steps = 0                     # steps since the last average (the next gradient's staleness)
        self.done = 0
        self.staleness = 0                       # of the gradient the last step applied (the loop records it)
        self.averages = 0

    def attach(self, replica: Replica) -> None:
        params = [s.param for s in replica.slots()]
        self.optimizer = self.optimizer_factory(params)
        self.anchor = [p.detach().clone() for p in params]
        if self.outer_factory is not None:
            self.outer = self.outer_factory(self.anchor)

    def step(self, replica: Replica) -> None:
        if self.optimizer is None:
            raise EngineError("PeriodicAveragingStrategy.step before attach(replica)")
        slots = replica.slots()
        self.optimizer.step()
        zero_grads(slots)
        self.staleness = self.local_steps
        self.local_steps += 1
        self.done += 1
        if self.local_steps == self.period or self.done == self.total_steps:
            self._average(replica)

    def _average(self, replica: Replica) -> None:
        """Local SGD: θ_i ← mean θ_j. DiLoCo: θ_outer ← outer(θ_outer, mean (θ_outer − θ_j)), θ_i ← θ_outer."""
        params = [s.param for s in replica.slots()]
        dp = replica.dp
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            if self.outer is not None:
                flat = torch.cat([a.reshape(-1) for a in self.anchor]) - flat      # θ_outer − θ_i
            if dp.size > 1:
                dp.all_reduce(flat, "sum", site="params")
                flat.mul_(1.0 / dp.size)
            off = 0
            for p, a in zip(params, self.anchor):
                piece = flat[off:off + p.numel()].view_as(p)
                off += p.numel()
                if self.outer is not None:
                    a.grad = piece.clone()
                else:
                    a.copy_(piece)
            if self.outer is not None:
                self.outer.step()
                self.outer.zero_grad(set_to_none=True)
            for p, a in zip(params, self.anchor):
                p.copy_(a)
        self.local_steps = 0
        self.averages += 1

    @contextlib.contextmanager
    def global_view(self, replica: Replica) -> Iterator[None]:
        """The replica's parameters are the global model inside the block, its own again after."""
        params = [s.param for s in replica.slots()]
        own = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, a in zip(params, self.anchor):
                p.copy_(a)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, o in zip(params, own):
                    p.copy_(o)


def outer_optimizer(name: str, lr: float, momentum: float) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    """DiLoCo's outer optimizer over θ_outer: "nesterov" (SGD with Nesterov momentum, the paper's) or "sgd"
    (heavy-ball momentum; momentum 0 is plain SGD)."""
    if name not in OUTER_OPTIMIZERS:
        raise EngineError(f"outer optimizer must be one of {', '.join(OUTER_OPTIMIZERS)}, got {name!r}")

    def make(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        if name == "nesterov":
            return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=True)
        return torch.optim.SGD(params, lr=lr, momentum=momentum)
    return make


OUTER_OPTIMIZERS = ("nesterov", "sgd")
