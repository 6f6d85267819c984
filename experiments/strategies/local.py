"""The `local` strategy: the single-process reference that every distributed strategy is measured against.

One process plays all K workers. At step t the training loop runs forward + backward on batch(w, t) for
w = 0..K-1 on the same parameters — autograd accumulates the K gradients in .grad — and `LocalStrategy.step`
averages them and takes one torch.optim step:

    theta_{t+1} = opt(theta_t, (1/K) sum_w g_w),    g_w = grad L(theta_t; batch(w, t))

which is large-batch SGD on the concatenated K·b batch — the trajectory BSP (all-reduce or PS) must reproduce.
The loop records one row per (worker, step), like the distributed strategies. The K gradients would be computed in
parallel, so a step is padded like one worker's step (`train.base_step_s`): `local` is "ideal BSP", the same updates
with no communication.
"""

from __future__ import annotations

from typing import Any

import torch

from pslab.parallelism.engine import EngineError, Replica, zero_grads


class LocalStrategy:
    """Average the gradients that `workers` forward/backward passes accumulated, then one optimizer step."""

    plays_all_workers = True            # the loop runs forward_backward once per worker on this one replica

    def __init__(self, spec: Any, workers: int) -> None:
        self.spec, self.workers = spec, int(workers)
        self.optimizer: torch.optim.Optimizer | None = None

    def attach(self, replica: Replica) -> None:
        from pslab.experiments.strategies.spec import torch_optimizer
        self.optimizer = torch_optimizer(self.spec, [s.param for s in replica.slots()])

    def step(self, replica: Replica) -> None:
        if self.optimizer is None:
            raise EngineError("LocalStrategy.step before attach(replica)")
        slots = replica.slots()
        for s in slots:
            if s.grad is not None:
                s.grad.div_(self.workers)   # sum of K gradients -> their mean (bitwise (g_0 + ... + g_K-1) / K)
        self.optimizer.step()
        zero_grads(slots)
