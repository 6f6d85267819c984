"""`pslab bench dp`: data-parallel training throughput, pslab's DataParallel engine vs torch DDP, same run.

Workload: MLP 784-512-512-10 (ReLU), batch 64 per rank, 2 ranks, SGD, synthetic MNIST-shaped batches.
  pslab  DataParallelEngine + AllReduceStrategy: bucketed gradients all-reduced from autograd hooks on the `zmq`
         backend (ring all-reduce over ZeroMQ), overlapping backward
  ddp    torch.nn.parallel.DistributedDataParallel on gloo (default 25 MB buckets)
Both run in the same two processes (torch.set_num_threads(1) each), alternating per repetition; each repetition
times `--steps` steps after `--warmup` untimed ones. On 2 shared cores overlap cannot buy much (communication needs
CPU too), so the default bucket is DDP's 25 MB; try --bucket-mb 1 for overlapped buckets. samples/s = ranks × batch
× steps / wall time of rank 0 (the step is synchronous, so every rank takes the same time); we print the median over
`--reps` and pslab ÷ DDP.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from pslab.experiments.bench import free_port


def _model():
    from pslab.parallelism.models import mlp
    import torch
    return mlp([784, 512, 512, 10], seed=0, act=torch.nn.ReLU)


def _worker(group, port: int, batch: int, steps: int, warmup: int, reps: int, bucket_mb: float) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pslab.parallelism.data import DataParallelEngine
    from pslab.parallelism.engine import AllReduceStrategy
    from pslab.parallelism.mesh import DeviceMesh

    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=group.rank,
                                world_size=group.world_size)
    g = torch.Generator().manual_seed(100 + group.rank)
    data = [(torch.randn(batch, 784, generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(8)]
    loss_fn = torch.nn.functional.cross_entropy

    mesh = DeviceMesh(group, dp=group.world_size)
    replica = DataParallelEngine(bucket_bytes=int(bucket_mb * (1 << 20))).build(_model, mesh)
    strategy = AllReduceStrategy(lambda ps: torch.optim.SGD(ps, lr=0.01))
    strategy.attach(replica)

    ddp = DDP(_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

    def ours(i: int) -> None:
        x, y = data[i % len(data)]
        replica.forward_backward(x, y)
        strategy.step(replica)

    def theirs(i: int) -> None:
        x, y = data[i % len(data)]
        loss = loss_fn(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def timed(fn) -> float:
        for i in range(warmup):
            fn(i)
        group.barrier()
        t0 = time.perf_counter()
        for i in range(steps):
            fn(i)
        group.barrier()
        return time.perf_counter() - t0

    res: dict[str, list[float]] = {"pslab": [], "ddp": []}
    for rep in range(reps):
        order = [("pslab", ours), ("ddp", theirs)] if rep % 2 == 0 else [("ddp", theirs), ("pslab", ours)]
        for name, fn in order:
            res[name].append(group.world_size * batch * steps / timed(fn))
    dist.destroy_process_group()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pslab bench dp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64, help="samples per rank per step (default 64)")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per repetition (default 40)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5, help="repetitions; medians are printed (default 5)")
    ap.add_argument("--bucket-mb", type=float, default=25.0,
                    help="pslab gradient bucket size in MiB (default 25, like DDP: one bucket for this model)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)

    from pslab import collectives
    out = collectives.launch(_worker, args.ranks, backend="zmq",
                             args=(free_port(), args.batch, args.steps, args.warmup, args.reps, args.bucket_mb),
                             timeout=600)
    r0 = out[0]
    med = {k: statistics.median(v) for k, v in r0.items()}
    ratio = med["pslab"] / med["ddp"]
    paired = statistics.median(a / b for a, b in zip(r0["pslab"], r0["ddp"]))
    result = {"ranks": args.ranks, "batch_per_rank": args.batch, "steps": args.steps, "reps": args.reps,
              "bucket_mb": args.bucket_mb, "samples_per_s": r0, "median": med, "ratio_pslab_over_ddp": ratio,
              "median_paired_ratio": paired}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"MLP 784-512-512-10, batch {args.batch}/rank, {args.ranks} ranks, {args.reps} reps x {args.steps} steps")
        for k in ("pslab", "ddp"):
            print(f"  {k:6s} median {med[k]:9.1f} samples/s   reps: " + " ".join(f"{v:.0f}" for v in r0[k]))
        print(f"  pslab / ddp = {ratio:.3f}x (ratio of medians; median of per-rep ratios {paired:.3f}x; "
              f"target >= 1.1x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
