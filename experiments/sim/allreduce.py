"""Ring all-reduce BSP in virtual time (the `allreduce` strategy under --simulate).

Each step every worker computes its real gradient on batch(w, t) from the same parameters, taking
StragglerModel.step_time(w, t, compute_s); the ring starts when the slowest is done, and costs the textbook

    T_ring = 2 (N - 1) * (latency + (M / N) / bandwidth)        M = gradient bytes, N = workers

(reduce-scatter then all-gather, N - 1 steps each, one chunk of M/N per step; the inter-host link when the workers
span several hosts). Then every replica applies the averaged gradient with the same torch.optim step as `local`.
Worker w waits max_v c_v - c_w for the slowest; it sends and receives 2 (N - 1)/N * M bytes per step.
`train.target_acc` stops the run at the first evaluation that reaches it; `simulate.timing_only` skips the gradients
and the optimizer (loss null, no evaluations): the times are the same.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from experiments.config import RunConfig
from experiments.results.records import UpdateRecord
from experiments.results.rundir import JsonlWriter, RunDir
from experiments.strategies.spec import optimizer_spec, torch_optimizer
from experiments.stragglers import StragglerModel
from experiments.workloads import compute_grads, get_workload


def ring_time(nbytes: int, n: int, latency: float, bandwidth: float) -> float:
    return 0.0 if n == 1 else 2 * (n - 1) * (latency + nbytes / n / bandwidth)


def simulate_allreduce(cfg: RunConfig, rundir: RunDir, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    t, m = cfg.train, cfg.simulate
    K, timing = t.workers, m.timing_only
    wl = get_workload(cfg.workload.name, K, cfg.workload.batch_size, cfg.workload.seed)
    model = wl.make_model()
    params = list(model.named_parameters())
    opt = torch_optimizer(optimizer_spec(t), [p for _, p in params])
    straggle = StragglerModel(cfg.stragglers, cfg.workload.seed)
    nbytes = sum(p.numel() * p.element_size() for _, p in params)
    multi_host = K > m.workers_per_host
    lat, bw = (m.latency_inter_s, m.bandwidth_inter_Bps) if multi_host else (m.latency_intra_s, m.bandwidth_intra_Bps)
    t_ring = ring_time(nbytes, K, lat, bw)
    per_rank = int(round(2 * (K - 1) / K * nbytes))
    now, updates = 0.0, 0
    with JsonlWriter(rundir.metrics_path) as mw, JsonlWriter(rundir.eval_path) as ew:
        if not timing:
            ev = wl.evaluate(model)
            ew.write({"updates": 0, "time_s": 0.0, **ev})
            if t.target_acc is not None and ev["test_acc"] >= t.target_acc:
                return {"virtual_time_s": now, "ring_time_s": t_ring, "stopped_at_target": True}
        for step in range(t.steps):
            results, times = [], []
            for w in range(K):
                results.append((None, None, None) if timing else compute_grads(wl, model, w, step))
                times.append(straggle.step_time(w, step, m.compute_s))
            slowest = max(times)
            now += slowest + t_ring
            if not timing:
                for (_, p) in params:
                    p.grad = None
                for n, p in params:
                    p.grad = sum(torch.from_numpy(r[1][n]) for r in results).view_as(p) / K
                opt.step()
            for w, (loss, _, digest) in enumerate(results):
                mw.write(UpdateRecord(w, step, step + 1, now, loss, 0, per_rank, per_rank, slowest - times[w],
                                      digest).to_json())
            before, updates = updates, updates + K
            if progress:
                progress(K)
            if not timing and (updates // t.eval_every > before // t.eval_every or step == t.steps - 1):
                ev = wl.evaluate(model)
                ew.write({"updates": updates, "time_s": now, **ev})
                if t.target_acc is not None and ev["test_acc"] >= t.target_acc:
                    return {"virtual_time_s": now, "ring_time_s": t_ring, "stopped_at_target": True}
    return {"virtual_time_s": now, "ring_time_s": t_ring, "stopped_at_target": False,
            **({"timing_only": True} if timing else {})}
