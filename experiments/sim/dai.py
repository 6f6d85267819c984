"""Single-process staleness emulation (Dai et al., "Toward understanding the impact of staleness in distributed
machine learning", ICLR 2019).

One model, one optimizer; at step t the gradient is computed on the parameters of r_t steps ago, with r_t drawn
uniformly from {0, ..., s} (capped at t), and applied to the current parameters:

    theta_{t+1} = opt(theta_t, grad L(theta_{t - r_t}; batch(0, t))),   r_t ~ U{0..s}

s = 0 is plain sequential training. This isolates the effect of staleness from everything else (no processes, no
clocks, no network), which is how Dai et al. draw their "steps to reach target accuracy vs s" curves.
The update is made by the parameter server's own optimizer (`ps.optim`, given tau = r_t and, for DC-ASGD, the stale
weights), so staleness-aware learning rates and delay compensation can be swept here too.
The staleness draws come from a generator seeded with (seed, s), so a run is exactly repeatable.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.func import functional_call

from experiments.config import TrainConfig
from experiments.strategies.spec import optimizer_spec
from experiments.workloads import Workload


@dataclass
class DaiResult:
    staleness: int
    steps_to_target: int | None        # None: target not reached within max_steps
    curve: list[tuple[int, float]] = field(default_factory=list)  # (step, test accuracy)
    diverged: bool = False


def run_dai(wl: Workload, train: TrainConfig, staleness: int, max_steps: int, target_acc: float,
            eval_every: int = 10, seed: int = 0) -> DaiResult:
    """Train with emulated staleness s until test accuracy >= target_acc (checked every eval_every steps)."""
    if staleness < 0:
        raise ValueError("staleness must be >= 0")
    torch.set_num_threads(1)
    model = wl.make_model()
    from ps.optim import Contribution, build_optimizer
    names = [n for n, _ in model.named_parameters()]
    live = [p for _, p in model.named_parameters()]
    opt = build_optimizer(optimizer_spec(train), {n: p.detach() for n, p in zip(names, live)})  # updates in place
    history: deque[list[torch.Tensor]] = deque(maxlen=staleness + 1)
    history.append([p.detach().clone() for p in live])
    rng = np.random.default_rng([seed, 0xDA1, staleness])
    res = DaiResult(staleness, None)
    for step in range(max_steps):
        r = min(int(rng.integers(0, staleness + 1)), len(history) - 1)
        stale = [q.requires_grad_(True) for q in (h.clone() for h in history[-1 - r])]
        x, y, _ = wl.batch(0, step)
        out = functional_call(model, dict(zip(names, stale)), (x,))
        loss = wl.loss_from_output(out, y)
        grads = torch.autograd.grad(loss, stale)
        if not torch.isfinite(loss):
            res.diverged = True
            return res
        stale_w = history[-1 - r]
        opt.step([Contribution(dict(zip(names, grads)), r, dict(zip(names, stale_w)))])
        history.append([p.detach().clone() for p in live])
        if (step + 1) % eval_every == 0:
            acc = wl.evaluate(model)["test_acc"]
            res.curve.append((step + 1, acc))
            if acc >= target_acc:
                res.steps_to_target = step + 1
                return res
    return res
