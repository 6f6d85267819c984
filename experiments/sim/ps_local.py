"""ps-local:H and ps-diloco:H in virtual time (strategies/ps_local.py's arithmetic, on D copies in one process).

Worker w reads θ, takes H local steps on its own copy with its own optimizer (StragglerModel.step_time(w, t,
compute_s) each, waiting for nobody), then pushes Δ_w = θ_read − θ_w to the shard (sim/network.py: the shard's
inbound link, FIFO, latency + (S + header)/bandwidth); the shard applies pushes in arrival order with the outer
optimizer (`shard_optimizer_spec`: SGD at 1/K, or [outer] at outer.lr/K), each raising the version by one; the
reply (θ, S bytes) goes back on the shard's outbound link and the worker starts its next period when it arrives.

    τ of a push = version when applied − version the worker read          (staleness in outer steps)

Records (one per local step, as the real run's): time = the end of the step (the push step: when θ came back),
staleness = the period's τ (`records.assign_staleness(period=H)` gives a real run the same), bytes = S pushed and
S read on the push step, 0 between, wait = the push's round trip. Evaluation reads the shard's θ whenever the
gradients applied so far (H per push) cross a multiple of train.eval_every. `simulate.timing_only` skips the
tensors; the times and τ are the same. Faults are not simulated here (config.py refuses them).
"""

from __future__ import annotations

import copy
import heapq
from typing import Any, Callable

import torch

from pslab.experiments.config import RunConfig
from pslab.experiments.results.records import UpdateRecord
from pslab.experiments.results.rundir import JsonlWriter, RunDir
from pslab.experiments.sim.network import Network
from pslab.experiments.strategies.spec import optimizer_spec, shard_optimizer_spec, torch_optimizer
from pslab.experiments.stragglers import StragglerModel
from pslab.experiments.workloads import compute_grads, get_workload


def simulate_ps_local(cfg: RunConfig, rundir: RunDir, progress: Callable[[int], None] | None = None
                      ) -> dict[str, Any]:
    t, m = cfg.train, cfg.simulate
    K, H, timing = t.workers, int(cfg.strategy.period or 1), m.timing_only
    wl = get_workload(cfg.workload.name, K, cfg.workload.batch_size, cfg.workload.seed, **cfg.workload.overrides())
    glob = wl.make_model()                                   # the shard's θ
    copies = [copy.deepcopy(glob) for _ in range(K)]
    opts = [torch_optimizer(optimizer_spec(t), list(c.parameters())) for c in copies]
    outer = torch_optimizer(shard_optimizer_spec(cfg), list(glob.parameters()))
    nbytes = sum(p.numel() * p.element_size() for p in glob.parameters())
    net = Network(m, 1)
    straggle = StragglerModel(cfg.stragglers, cfg.workload.seed)
    version, applied, now_max = 0, 0, 0.0
    read_version = [0] * K
    step_of = [0] * K                                        # each worker's next local step
    pending: list[tuple[float, int]] = []                    # (push arrival at the shard, worker)
    periods: dict[int, tuple[list[tuple], float]] = {}       # worker -> (its period's records, push send time)
    deltas: dict[int, list[torch.Tensor]] = {}
    read = {w: [p.detach().clone() for p in glob.parameters()] for w in range(K)}     # θ each worker last read

    def run_period(w: int, start: float) -> None:
        """Worker w's next local steps from `start` (its copy holds θ as read); queue its push."""
        clock, recs = start, []
        while True:
            step = step_of[w]
            if timing:
                loss, digest = None, wl.digest(w, step)
            else:
                loss, _, digest = compute_grads(wl, copies[w], w, step)
                opts[w].step()
            clock += straggle.step_time(w, step, m.compute_s)
            recs.append((step, clock, loss, digest))
            step_of[w] += 1
            if len(recs) == H or step_of[w] == t.steps:
                break
        if not timing:
            with torch.no_grad():
                deltas[w] = [g.detach() - p.detach() for g, p in zip(read[w], copies[w].parameters())]
        periods[w] = (recs, clock)
        heapq.heappush(pending, (net.to_shard(clock, w, 0, nbytes), w))

    with JsonlWriter(rundir.metrics_path) as mw, JsonlWriter(rundir.eval_path) as ew:
        if not timing:
            ew.write({"updates": 0, "time_s": 0.0, **wl.evaluate(glob)})
        for w in range(K):
            run_period(w, 0.0)
        while pending:
            arrive, w = heapq.heappop(pending)
            tau = version - read_version[w]
            if not timing:
                for p, d in zip(glob.parameters(), deltas.pop(w)):
                    p.grad = d.clone()
                outer.step()
                outer.zero_grad(set_to_none=True)
            version += 1
            back = net.from_shard(arrive, w, 0, nbytes)
            recs, sent_at = periods.pop(w)
            for i, (step, clock, loss, digest) in enumerate(recs):
                last = i == len(recs) - 1
                mw.write(UpdateRecord(w, step, step + 1, back if last else clock, loss, tau,
                                      nbytes if last else 0, nbytes if last else 0,
                                      back - sent_at if last else 0.0, digest).to_json())
            before, applied = applied, applied + len(recs)
            now_max = max(now_max, back)
            if progress:
                progress(len(recs))
            if not timing and (applied // t.eval_every > before // t.eval_every or applied == K * t.steps):
                ew.write({"updates": applied, "time_s": arrive, **wl.evaluate(glob)})
            read_version[w] = version
            if step_of[w] < t.steps:
                if not timing:
                    with torch.no_grad():
                        for p, g in zip(copies[w].parameters(), glob.parameters()):
                            p.copy_(g)
                    read[w] = [p.detach().clone() for p in glob.parameters()]
                run_period(w, back)
    return {"virtual_time_s": now_max, **({"timing_only": True} if timing else {})}
