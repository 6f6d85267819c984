"""Local SGD and DiLoCo in virtual time (`local-sgd:H` / `diloco:H` under --simulate).

The same arithmetic as the real strategy (`parallelism/local_sgd.py`), on D copies of the model in one process:
every worker w steps its own copy with its own optimizer on batch(w, t), taking StragglerModel.step_time(w, t,
compute_s) of virtual time and waiting for nobody; after every H-th step (and after the last) the workers meet:
the average starts when the slowest arrives and costs one ring all-reduce of the parameters,

    T_avg = 2 (D − 1) · (latency + (M / D) / bandwidth)        M = parameter bytes (the inter-host link if the
                                                                workers span hosts, as sim/allreduce.py)

then every copy is the average (Local SGD) or θ_outer after the outer step on the averaged pseudo-gradient
(DiLoCo). Worker w's record of step t: the time its step (and, at an average, the average) ended; staleness = the
local step since the last average (t mod H, the last average aside); wait = how long it waited for the slowest at
an average (0 between); bytes 2(D−1)/D·M at an average, 0 between. Evaluation reads the global model (the last
average, θ_outer) every train.eval_every updates, as the real runs do. `simulate.timing_only` skips the tensors
(loss null, no evaluations): the times are the same. Faults are not simulated here (config.py refuses them).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch

from pslab.experiments.config import RunConfig
from pslab.experiments.results.records import UpdateRecord
from pslab.experiments.results.rundir import JsonlWriter, RunDir
from pslab.experiments.sim.allreduce import ring_time
from pslab.experiments.sim.faults import link
from pslab.experiments.strategies.spec import optimizer_spec, torch_optimizer
from pslab.experiments.stragglers import StragglerModel
from pslab.experiments.workloads import compute_grads, get_workload


def simulate_local_sgd(cfg: RunConfig, rundir: RunDir, progress: Callable[[int], None] | None = None
                       ) -> dict[str, Any]:
    t, m, s = cfg.train, cfg.simulate, cfg.strategy
    K, H, timing = t.workers, int(s.period or 1), m.timing_only
    wl = get_workload(cfg.workload.name, K, cfg.workload.batch_size, cfg.workload.seed, **cfg.workload.overrides())
    glob = wl.make_model()                                   # the global model: the last average, or θ_outer
    copies = [copy.deepcopy(glob) for _ in range(K)]
    spec = optimizer_spec(t)
    opts = [torch_optimizer(spec, list(c.parameters())) for c in copies]
    outer = None
    if s.kind == "diloco":
        from pslab.parallelism.local_sgd import outer_optimizer
        outer = outer_optimizer(cfg.outer.optimizer, cfg.outer.lr, cfg.outer.momentum)(list(glob.parameters()))
    nbytes = sum(p.numel() * p.element_size() for p in glob.parameters())
    lat, bw = link(m, K > m.workers_per_host)
    t_avg = ring_time(nbytes, K, lat, bw)
    per_rank = int(round(2 * (K - 1) / K * nbytes)) if K > 1 else 0
    straggle = StragglerModel(cfg.stragglers, cfg.workload.seed)
    clock = [0.0] * K                                        # each worker's virtual time
    updates = 0
    with JsonlWriter(rundir.metrics_path) as mw, JsonlWriter(rundir.eval_path) as ew:
        if not timing:
            ew.write({"updates": 0, "time_s": 0.0, **wl.evaluate(glob)})
        local = 0
        for step in range(t.steps):
            losses, digests = {}, {}
            for w in range(K):
                if timing:
                    losses[w], digests[w] = None, wl.digest(w, step)
                else:
                    losses[w], _, digests[w] = compute_grads(wl, copies[w], w, step)
                    opts[w].step()
                clock[w] += straggle.step_time(w, step, m.compute_s)
            average = local + 1 == H or step == t.steps - 1
            waits = [0.0] * K
            if average:
                start = max(clock)
                waits = [start - c for c in clock]
                clock = [start + t_avg] * K
                if not timing:
                    _average(glob, copies, outer)
            records = sorted(range(K), key=lambda w: (clock[w], w))
            for w in records:
                sent = per_rank if average else 0
                mw.write(UpdateRecord(w, step, step + 1, clock[w], losses[w], local, sent, sent, waits[w],
                                      digests[w]).to_json())
            local = 0 if average else local + 1
            before, updates = updates, updates + K
            if progress:
                progress(K)
            if not timing and (updates // t.eval_every > before // t.eval_every or step == t.steps - 1):
                ew.write({"updates": updates, "time_s": max(clock), **wl.evaluate(glob)})
    return {"virtual_time_s": max(clock), "average_time_s": t_avg, **({"timing_only": True} if timing else {})}


@torch.no_grad()
def _average(glob: torch.nn.Module, copies: list[torch.nn.Module], outer: torch.optim.Optimizer | None) -> None:
    """Local SGD: glob = mean of the copies. DiLoCo: glob ← outer(glob, mean(glob − copy)). Then every copy = glob."""
    K = len(copies)
    for g, *mine in zip(glob.parameters(), *(c.parameters() for c in copies)):    # (deep copies: same order)
        if outer is None:
            g.copy_(sum(p.detach() for p in mine) / K)
        else:
            g.grad = sum(g.detach() - p.detach() for p in mine) / K
    if outer is not None:
        outer.step()
        outer.zero_grad(set_to_none=True)
    for c in copies:
        for p, g in zip(c.parameters(), glob.parameters()):
            p.copy_(g)
