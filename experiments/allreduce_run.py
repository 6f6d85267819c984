"""The `allreduce` strategy: ring all-reduce BSP over `collectives` (backend zmq: ours; torch: torch.distributed).

Each of K processes computes g_w on batch(w, t), then all_reduce(avg) makes every replica hold (1/K) sum_w g_w and
takes the same torch.optim step — the update of the `local` reference, computed in parallel. Time blocked inside the
all-reduce (waiting for the slowest worker plus moving 2(N−1)/N of the gradient each way) is recorded as wait_s,
the bytes the group counted as bytes_sent / bytes_recv.

With `train.engine = "data"` the replica comes from `parallelism`'s data-parallel engine and is synchronised by its
`AllReduceStrategy`: gradients are bucketed and all-reduced from autograd hooks while backward is still running
(the DDP recipe), so communication overlaps computation; wait_s is then the time spent in backward's tail plus the
optimizer step (the part of the all-reduce that did not overlap cannot be separated from compute).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from experiments.local import make_torch_optimizer
from experiments.worker_common import WorkerContext


def allreduce_worker(group: Any, cfg_dict: dict[str, Any], run_path: str) -> dict[str, Any]:
    ctx = WorkerContext(cfg_dict, run_path, group.rank)
    if ctx.cfg.train.engine == "data":
        return _engine_worker(group, ctx)
    K, steps = ctx.cfg.train.workers, ctx.cfg.train.steps
    params = list(ctx.model.named_parameters())
    opt = make_torch_optimizer(ctx.cfg.train, [p for _, p in params])
    sizes = [p.numel() for _, p in params]
    buf = torch.empty(sum(sizes), dtype=torch.float32)
    ctx.maybe_evaluate(-1, 0)
    group.barrier()
    ctx.start_clock()
    try:
        for step in range(steps):
            loss, grads, digest = ctx.compute(step)
            torch.cat([torch.from_numpy(grads[n]) for n, _ in params], out=buf)
            before = group.traffic()
            tw = time.perf_counter()
            group.all_reduce(buf, op="avg")
            wait = time.perf_counter() - tw
            after = group.traffic()
            off = 0
            for (n, p), k in zip(params, sizes):
                p.grad = buf[off: off + k].view_as(p).clone()
                off += k
            opt.step()
            ctx.record(worker=ctx.rank, step=step, clock=step + 1, time_s=ctx.now(), loss=loss, staleness=0,
                       bytes_sent=after["sent_total"] - before["sent_total"],
                       bytes_recv=after["recv_total"] - before["recv_total"], wait_s=wait, batch=digest)
            ctx.maybe_evaluate(step * K, (step + 1) * K, final=step == steps - 1)
    finally:
        ctx.close()
    return {"rank": ctx.rank}


def _engine_worker(group: Any, ctx: WorkerContext) -> dict[str, Any]:
    from parallelism.data import DataParallelEngine
    from parallelism.engine import AllReduceStrategy
    from parallelism.mesh import DeviceMesh
    K, steps = ctx.cfg.train.workers, ctx.cfg.train.steps
    mesh = DeviceMesh(group, dp=K)
    replica = DataParallelEngine(loss_fn=ctx.wl.loss_from_output).build(ctx.wl.make_model, mesh)
    strategy = AllReduceStrategy(lambda params: make_torch_optimizer(ctx.cfg.train, params))
    strategy.attach(replica)
    ctx.model = replica.module  # evaluation uses the replica's weights
    ctx.maybe_evaluate(-1, 0)
    group.barrier()
    ctx.start_clock()
    try:
        for step in range(steps):
            x, y, idx = ctx.wl.batch(ctx.rank, step)
            before = group.traffic()
            t = time.perf_counter()
            loss = replica.forward_backward(x, y)
            c = time.perf_counter() - t
            target = ctx.straggle.step_time(ctx.rank, step, max(c, ctx.cfg.train.base_step_s))
            if target > c:
                time.sleep(target - c)
            tw = time.perf_counter()
            strategy.step(replica)
            wait = time.perf_counter() - tw
            after = group.traffic()
            from experiments.workloads import batch_digest
            ctx.record(worker=ctx.rank, step=step, clock=step + 1, time_s=ctx.now(), loss=loss, staleness=0,
                       bytes_sent=after["sent_total"] - before["sent_total"],
                       bytes_recv=after["recv_total"] - before["recv_total"], wait_s=wait, batch=batch_digest(idx))
            ctx.maybe_evaluate(step * K, (step + 1) * K, final=step == steps - 1)
    finally:
        ctx.close()
    return {"rank": ctx.rank}
