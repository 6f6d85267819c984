"""The `local` strategy: the single-process reference that every distributed strategy is measured against.

With K workers it computes, at each step t, the K gradients g_w = grad L(theta; batch(w, t)) on the same parameters,
averages them, and takes one torch.optim step:

    theta_{t+1} = opt(theta_t, (1/K) sum_w g_w)

which is large-batch SGD on the concatenated K*b batch — the trajectory BSP (all-reduce or PS) must reproduce.
It records one metrics line per (worker, step), like the distributed strategies, so plots and the batch-identity
check treat all strategies alike. Stragglers do not apply: a single process has no peers to wait for. When
`train.base_step_s` pads each worker's compute (real runs), a local step is padded to the same time — the K
gradients would be computed in parallel — so `local` is "ideal BSP": the same updates with zero communication.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from experiments.config import RunConfig, TrainConfig
from experiments.metrics import JsonlWriter, RunDir
from experiments.workloads import compute_grads, get_workload


def make_torch_optimizer(t: TrainConfig, params) -> torch.optim.Optimizer:
    if t.optimizer == "sgd":
        return torch.optim.SGD(params, lr=t.lr)
    if t.optimizer == "momentum":
        return torch.optim.SGD(params, lr=t.lr, momentum=t.momentum)
    return torch.optim.Adam(params, lr=t.lr, betas=tuple(t.betas))


def run_local(cfg: RunConfig, rundir: RunDir, progress: Callable[[int], None] | None = None) -> float:
    """Train in this process; writes metrics.jsonl and eval.jsonl; returns the wall time in seconds."""
    torch.set_num_threads(1)
    t, K = cfg.train, cfg.train.workers
    wl = get_workload(cfg.workload.name, K, cfg.workload.batch_size, cfg.workload.seed)
    model = wl.make_model()
    opt = make_torch_optimizer(t, model.parameters())
    params = list(model.named_parameters())
    updates = 0
    t0 = time.perf_counter()
    with JsonlWriter(rundir.metrics_path) as mw, JsonlWriter(rundir.eval_path) as ew:
        ew.write({"updates": 0, "time_s": 0.0, **wl.evaluate(model)})
        for step in range(t.steps):
            t_step = time.perf_counter()
            acc = [torch.zeros_like(p) for _, p in params]
            losses = []
            for w in range(K):
                loss, grads, digest = compute_grads(wl, model, w, step)
                for a, (n, p) in zip(acc, params):
                    a += torch.from_numpy(grads[n]).view_as(p)
                losses.append((w, loss, digest))
            for a, (_, p) in zip(acc, params):
                p.grad = a / K
            opt.step()
            pad = t.base_step_s - (time.perf_counter() - t_step)
            if pad > 0:
                time.sleep(pad)
            now = time.perf_counter() - t0
            for w, loss, digest in losses:
                mw.write({"worker": w, "step": step, "clock": step + 1, "time_s": now, "loss": loss,
                          "staleness": 0, "bytes_sent": 0, "bytes_recv": 0, "wait_s": 0.0, "batch": digest})
            before, updates = updates, updates + K
            if updates // t.eval_every > before // t.eval_every or step == t.steps - 1:
                ew.write({"updates": updates, "time_s": now, **wl.evaluate(model)})
            if progress:
                progress(K)
    return time.perf_counter() - t0
