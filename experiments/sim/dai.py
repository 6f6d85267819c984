"""Single-process staleness emulation with K workers (Dai et al., "Toward understanding the impact of staleness in
distributed machine learning", ICLR 2019).

One model, one optimizer. At step t each of the K workers w computes its gradient on its own batch(w, t) at the
parameters of r_{t,w} steps ago, the K delays drawn independently (`delays.py`: uniform U{0..s} as Dai et al.,
constant s, geometric with mean s, discretised exponential), each capped at t; the K gradients are averaged and
applied to the current parameters as one step:

    theta_{t+1} = opt(theta_t, (1/K) sum_w grad L(theta_{t - r_{t,w}}; batch(w, t)))

s = 0 is bulk-synchronous training: K = 1 is plain sequential SGD, K > 1 is large-batch SGD on the K*b examples of
batch(0..K-1, t) — bit for bit what the `local` strategy and BSP compute (same batches, same summation order, one
division by K). K = 1 with uniform delays is the original single-stream emulator (same delay stream). This isolates
staleness from everything else (no processes, clocks or network), which is how Dai et al. draw their
"steps to target accuracy vs s" curves. The step is made by the parameter server's own optimizer (`ps.optim`, given
tau = r_{t,w} and, for DC-ASGD, the stale weights of each contribution), so the staleness-aware learning rate
(alpha / mean tau) and delay compensation can be swept here too. Its learning rate is `train.lr` for every step
(K gradients averaged at lr, as Dai et al.); `train.strategy`, `train.workers` and `train.lr_rule`, which set the
step lr of real runs, do not apply here. The delay draws are seeded (`delays.py`), so a run
is exactly repeatable.

Two exact laws, on a quadratic F(x) = 1/2 h x^2 (`experiments.workloads.quadratic`) with SGD at lr eta and
deterministic gradients:

- constant delay d:  x_{t+1} = x_t - eta h x_{t-d}   (x_j = x_0 for j < 0).
- geometric delays ("asynchrony begets momentum", Mitliagkas et al. 2016). With P(r = l) = (1 - q) q^l,
  q = 1 - 1/M (mean s = M - 1), and any affine gradient G(x) = H x - b, the draw r_t is independent of the past
  iterates, so m_t = E[x_t] obeys

      m_{t+1} = m_t - eta sum_{l>=0} (1 - q) q^l G(m_{t-l})           (m_j = m_0 for j < 0: the cap at t)

  Write S_t = sum_l q^l G(m_{t-l}); then S_t = G(m_t) + q S_{t-1} and m_{t+1} - m_t = -eta (1 - q) S_t, so for t >= 1

      m_{t+1} = m_t + q (m_t - m_{t-1}) - eta (1 - q) G(m_t)

  — heavy-ball momentum with mu = q = 1 - 1/M and learning rate eta (1 - q) = eta / M. The first step differs:
  S_0 = G(m_0) / (1 - q) (every version before step 0 is x_0), so m_1 = m_0 - eta G(m_0), a full-lr step, as if the
  momentum buffer started at its steady state. Both together are exactly torch's
  `SGD(lr=eta, momentum=q, dampening=q)` (its first step takes the raw gradient, later ones
  buf = q buf + (1 - q) g; x -= eta buf). With K workers the K delays average to the same expectation.
  `experiments.studies.momentum` checks it with a z bound over seeded runs and a negative control.

Optional: `coherence_lags=(1, 2, 4, 8)` records cos(grad F(x_k), grad F(x_{k-m})) on a fixed batch every
`coherence_every` steps (`coherence.py`, Dai et al.'s mechanism for depth), and `on_step(step, model)` sees the
parameters after every step (the momentum study records trajectories with it).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from torch.func import functional_call

from pslab.experiments.config import TrainConfig
from pslab.experiments.errors import ConfigError
from pslab.experiments.sim.coherence import CoherenceRecorder
from pslab.experiments.sim.delays import DelayModel, delay_model
from pslab.experiments.strategies.spec import optimizer_spec


@dataclass
class DaiResult:
    staleness: float
    steps_to_target: int | None        # None: target not reached within max_steps
    curve: list[tuple[int, float]] = field(default_factory=list)  # (step, test accuracy)
    diverged: bool = False
    workers: int = 1
    delay: str = "uniform"
    mean_delay: float = 0.0            # measured mean of the (capped) delays used
    coherence: list[tuple[int, dict[int, float]]] = field(default_factory=list)  # (step, {lag: cos})


def run_dai(wl: Any, train: TrainConfig, staleness: float, max_steps: int, target_acc: float,
            eval_every: int = 10, seed: int = 0, *, delay: str | DelayModel = "uniform",
            coherence_lags: tuple[int, ...] = (), coherence_every: int = 10, coherence_batch: int = 512,
            on_step: Callable[[int, torch.nn.Module], None] | None = None) -> DaiResult:
    """Train with emulated staleness until test accuracy >= target_acc (checked every eval_every steps).

    K = wl.workers gradients per step (build the workload with get_workload(name, workers=K, ...)), each with its
    own delay from `delay` with parameter `staleness` (uniform: the bound s; constant: d; geometric/exponential:
    the mean)."""
    dm = delay_model(delay, staleness)
    if max_steps < 0 or eval_every < 1:
        raise ConfigError(f"the emulator needs max_steps >= 0 and eval_every >= 1, got {max_steps}, {eval_every}")
    workers = int(wl.workers)
    torch.set_num_threads(1)
    model = wl.make_model()
    from pslab.ps.optim import Contribution, build_optimizer
    names = [n for n, _ in model.named_parameters()]
    live = [p for _, p in model.named_parameters()]
    spec = replace(optimizer_spec(train), lr=train.lr)    # the emulator's step lr is train.lr, whatever lr_rule
    opt = build_optimizer(spec, {n: p.detach() for n, p in zip(names, live)})  # updates the weights in place
    coh = CoherenceRecorder(tuple(coherence_lags), coherence_every, coherence_batch) if coherence_lags else None
    keep = max(dm.max_delay, coh.depth if coh else 0)
    history: deque[list[torch.Tensor]] = deque(maxlen=keep + 1)
    history.append([p.detach().clone() for p in live])
    draw = dm.sampler(seed)
    res = DaiResult(staleness, None, workers=workers, delay=dm.kind)
    if coh is not None:
        res.coherence = coh.series
    total_delay, n_delays = 0, 0
    for step in range(max_steps):
        contributions = []
        for w in range(workers):
            r = min(draw(), len(history) - 1)
            stale_w = history[-1 - r]
            stale = [h.clone().requires_grad_(True) for h in stale_w]
            x, y, _ = wl.batch(w, step)
            loss = wl.loss_from_output(functional_call(model, dict(zip(names, stale)), (x,)), y)
            grads = torch.autograd.grad(loss, stale)
            if not torch.isfinite(loss):
                res.diverged = True
                res.mean_delay = total_delay / max(n_delays, 1)
                return res
            contributions.append(Contribution(dict(zip(names, grads)), r, dict(zip(names, stale_w))))
            total_delay, n_delays = total_delay + r, n_delays + 1
        opt.step(contributions)
        history.append([p.detach().clone() for p in live])
        res.mean_delay = total_delay / n_delays
        if on_step is not None:
            on_step(step, model)
        if coh is not None:
            coh.maybe_record(step + 1, wl, model, names, history)
        if (step + 1) % eval_every == 0:
            acc = wl.evaluate(model)["test_acc"]
            res.curve.append((step + 1, acc))
            if acc >= target_acc:
                res.steps_to_target = step + 1
                return res
    return res
