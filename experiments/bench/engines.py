"""`pslab bench engines`: pslab's engines against PyTorch's own, same model, ranks, initial weights and batches.

Rows (pslab engine  vs  PyTorch peer):

    dp      DataParallelEngine (25 MB bucket) + AllReduceStrategy    DistributedDataParallel
    zero1   ZeroEngine(1)                                           DDP + ZeroRedundancyOptimizer
    zero2   ZeroEngine(2)                                           FSDP2 fully_shard, reshard_after_forward=False
    zero3   ZeroEngine(3)                                           FSDP2 fully_shard, reshard_after_forward=True
    tp      TensorParallelEngine on a model's tp_plan               DTensor parallelize_module (Colwise / Rowwise)
    tp+sp   TensorParallelEngine(sequence_parallel=True)            DTensor + SequenceParallel (LayerNorms, Shard(1))
    gpipe   PipelineEngine("gpipe", 4 micro-batches)                torch.distributed.pipelining ScheduleGPipe
    1f1b    PipelineEngine("1f1b", 4 micro-batches)                 torch.distributed.pipelining Schedule1F1B

Models: dp / zero / gpipe / 1f1b an MLP 784-512-512-512-10 (ReLU), Adam, batch 64 per dp rank (the pipeline's
64 split in 4 micro-batches); tp a 512-2048-512-2048-512-10 MLP whose two Megatron pairs its tp_plan names, batch
64; tp+sp pslab's Embed / (LayerNorm + MLP) x 2 / Head blocks, d 128, sequence 64, batch 8 (the parity tests'
models, larger: tests/parallelism/test_torch_peers.py). Every row is the whole world on one axis (dp, tp or pp =
world).

Each pslab row runs twice, on each of pslab's backends (`zmq`: its own ring over ZeroMQ; `torch`, printed as
"gloo": the same engine over torch.distributed gloo, the peer's own transport), each time in a launch of its own
with the peer beside it in the same processes, alternating which goes first per repetition; each repetition times
`--steps` steps after `--warmup` untimed ones, between barriers. Printed: the median step time (ms, rank 0) of
each, pslab ÷ peer per backend (the median of the per-repetition ratios), and bytes sent per step per rank:
pslab's as its engine counted them, the peer's as the kernel counted its gloo sockets (collectives/sockmeter.py)
in the zmq launch, where pslab's own traffic goes over ZeroMQ, so the gloo sockets carry the peer's bytes only,
and the row's formula (`model_bytes`: the zmq count equals it to the byte, gloo's adds 48 B a message).
Peak memory per rank (`peak_rss`): after the timed repetitions, each engine is built anew and runs max(warmup, 2)
steps in a block of its own, and the busiest rank's growth of its resident set over the block is printed (in
MB: the heap's freed memory handed back first, the kernel's high-water mark reset at the start) -- everything
that engine allocated and touched, parameters to communication buffers, as the process sees it (Linux).
The pipeline rows run pslab's engine with report_loss=False: the peer leaves each step's loss on the last stage,
where pslab's training loop broadcasts it to every stage for its log (one more collective a step).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import statistics
import sys
import time
from typing import Any, Callable, Iterator

from pslab.experiments.bench import free_port

ROWS = ("dp", "zero1", "zero2", "zero3", "tp", "tp+sp", "gpipe", "1f1b")
BACKENDS = ("zmq", "torch")


def _adam(params: list[Any]) -> Any:
    import torch
    return torch.optim.Adam(params, lr=1e-3)


def _mlp() -> Any:
    import torch
    from pslab.parallelism.models import mlp
    return mlp([784, 512, 512, 512, 10], seed=0, act=torch.nn.ReLU)


def _planned() -> Any:
    import torch
    from torch import nn

    class Planned(nn.Sequential):
        tp_plan = {"0": "colwise", "2": "rowwise", "4": "colwise", "6": "rowwise"}
    torch.manual_seed(0)
    return Planned(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512), nn.Tanh(), nn.Linear(512, 2048), nn.GELU(),
                   nn.Linear(2048, 512), nn.Tanh(), nn.Linear(512, 10))


def ff_blocks(vocab: int = 256, d: int = 128, seq: int = 64) -> Any:
    """[Embed, (LayerNorm + MLP residual block) x 2, Head] of pslab's blocks, seed 0: the tp+sp row's model (and,
    smaller, the parity test's). No attention: DTensor would need its heads split per tp rank."""
    import torch
    from torch import nn
    from pslab.parallelism.models import MLP, Embed, Head

    class FF(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.ln, self.mlp = nn.LayerNorm(d), MLP(d)

        def forward(self, x: Any) -> Any:
            return x + self.mlp(self.ln(x))
    torch.manual_seed(0)
    return nn.Sequential(Embed(vocab, d, seq), FF(d), FF(d), Head(d, vocab))


def dtensor_sequence_parallel(model: Any, mesh: Any) -> Any:
    """`ff_blocks` under DTensor tensor + sequence parallelism (in place; returns it): the embedding a replicated
    DTensor (so its gradient is whole), the residual stream Shard(1) between the blocks, each LayerNorm
    SequenceParallel, PrepareModuleInput all-gathering into each MLP, its fc2 RowwiseParallel reduce-scattering
    back. Run forward and backward under `implicit_replication()` (the positions meet the replicated embedding)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_module
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    distribute_module(model[0], mesh)
    plan: dict[str, Any] = {"1": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                                    use_local_output=False)}
    for b in ("1", "2"):
        plan.update({f"{b}.ln": SequenceParallel(),
                     f"{b}.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                     f"{b}.mlp.fc1": ColwiseParallel(),
                     f"{b}.mlp.fc2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)})
    plan.update({"3.ln": SequenceParallel(), "3.out": ColwiseParallel(input_layouts=Shard(1),
                                                                      output_layouts=Replicate())})
    return parallelize_module(model, mesh, plan)


def model_bytes(row: str, world: int) -> tuple[int, str]:
    """(bytes pslab's engine sends per step on rank 0, the formula), from the row's model: Ψ its parameters (for
    ZeRO each parameter padded to a multiple of N, Ψ' = N·Σ_p ⌈ψ_p/N⌉: a pack's segments are one length), 4 B a
    float, a ring's chunks as `chunk_bounds` cuts them. The zmq column equals it to the byte (gloo's adds its 48 B
    header a message); the peers, on gloo: DDP as dp, FSDP2 all-reduces where ZeRO reduce-scatters (3(N−1)/N·Ψ
    without resharding, 4(N−1)/N·Ψ with), DTensor as tp."""
    from torch import nn
    from pslab.collectives.hierarchical import _ring_sent
    n = world
    if row in ("dp", "zero1", "zero2", "zero3", "gpipe", "1f1b"):
        params = [p for m in _mlp() if isinstance(m, nn.Linear) for p in m.parameters()]
        psi = sum(p.numel() for p in params)
        padded = sum(-(-p.numel() // n) for p in params)          # one rank's segment: Ψ'/N
        if row == "dp":
            return 4 * _ring_sent(psi, n, 0), "2(N−1)/N·Ψ·4"
        if row in ("zero1", "zero2"):
            return 4 * 2 * (n - 1) * padded, "RS + AG: 2(N−1)/N·Ψ'·4"
        if row == "zero3":
            return 4 * 3 * (n - 1) * padded, "AG fwd + AG bwd + RS: 3(N−1)/N·Ψ'·4"
        return 64 * 512 * 4, "stage 0: m micro-batches of B/m × 512 activations: B·512·4"
    if row == "tp":                       # one Megatron pair's output (batch × d): a ring all-reduce each
        return 4 * 3 * _ring_sent(64 * 512, n, 0), "3 all-reduces (2 forward, 1 backward: the input needs none)"
    model = ff_blocks()                   # tp+sp: 2 blocks x (AG + RS forward, RS + AG backward) of b·S·d floats,
    a = 8 * 64 * 128 * 4                  # the replicated tensors' gradients summed, and the 8 B loss (direct)
    sharded = sum(b.mlp.fc1.weight.numel() + b.mlp.fc1.bias.numel() + b.mlp.fc2.weight.numel() for b in model[1:-1])
    replicated = sum(p.numel() for p in model.parameters()) - sharded
    return (round(8 * (n - 1) / n * a) + 4 * _ring_sent(replicated, n, 0) + (n - 1) * 8,
            "8(N−1)/N·b·S·d·4 + 2(N−1)/N·R·4 + (N−1)·8 (R: replicated parameters)")

def _data(row: str, rank: int, world: int) -> list[tuple[Any, Any]]:
    """Eight batches of this rank's input (the same on every rank where the axis needs it)."""
    import torch
    g = torch.Generator().manual_seed(7)
    if row == "tp+sp":
        return [(torch.randint(0, 256, (8, 64), generator=g), torch.randint(0, 256, (8, 64), generator=g))
                for _ in range(8)]
    dp = row in ("dp", "zero1", "zero2", "zero3")      # the global batch, this rank's dp shard of it
    xs = [torch.randn(64 * (world if dp else 1), 512 if row == "tp" else 784, generator=g) for _ in range(8)]
    ys = [torch.randint(0, 10, (x.shape[0],), generator=g) for x in xs]
    if dp:
        return [(torch.tensor_split(x, world)[rank], torch.tensor_split(y, world)[rank]) for x, y in zip(xs, ys)]
    return list(zip(xs, ys))


def _pslab(row: str, group: Any) -> tuple[Callable[[int], None], Callable[[], float]]:
    """(step(i), bytes this rank's engine has sent so far) of pslab's engine for `row`."""
    from pslab.parallelism.data import DataParallelEngine
    from pslab.parallelism.engine import AllReduceStrategy
    from pslab.parallelism.mesh import DeviceMesh
    from pslab.parallelism.models import lm_loss
    from pslab.parallelism.pipeline import PipelineEngine
    from pslab.parallelism.tensor import TensorParallelEngine
    from pslab.parallelism.zero import ZeroEngine, ZeroStrategy
    import torch
    world = group.world_size
    data = _data(row, group.rank, world)
    if row == "dp":
        rep = DataParallelEngine(bucket_bytes=25 << 20).build(_mlp, DeviceMesh(group, dp=world))
        strategy: Any = AllReduceStrategy(_adam)
    elif row.startswith("zero"):
        rep = ZeroEngine(int(row[-1]), _adam).build(_mlp, DeviceMesh(group, dp=world))
        strategy = ZeroStrategy()
    elif row == "tp":
        rep = TensorParallelEngine(loss_fn=torch.nn.functional.cross_entropy).build(_planned,
                                                                                    DeviceMesh(group, tp=world))
        strategy = AllReduceStrategy(_adam)
    elif row == "tp+sp":
        rep = TensorParallelEngine(loss_fn=lm_loss, sequence_parallel=True).build(ff_blocks,
                                                                                  DeviceMesh(group, tp=world))
        strategy = AllReduceStrategy(_adam)
    else:
        rep = PipelineEngine(row, 4, report_loss=False).build(_mlp, DeviceMesh(group, pp=world))   # (as the peer:
        # the loss stays on the last stage; pslab's training loop broadcasts it to every stage for its log)
        strategy = AllReduceStrategy(_adam)
    strategy.attach(rep)

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        rep.forward_backward(x, y)
        strategy.step(rep)
    return step, lambda: float(sum(rep.log.by_kind().values()))


def _peer(row: str, group: Any) -> Callable[[int], None]:
    """step(i) of PyTorch's implementation of `row` on the default process group (gloo)."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    world, rank = group.world_size, group.rank
    data = _data(row, rank, world)
    mesh = init_device_mesh("cpu", (world,))
    ce = nn.functional.cross_entropy
    if row in ("dp", "zero1"):
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(_mlp())
        if row == "zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            opt = ZeroRedundancyOptimizer(list(model.parameters()), optimizer_class=torch.optim.Adam, lr=1e-3)
        else:
            opt = _adam(list(model.parameters()))
    elif row in ("zero2", "zero3"):
        from torch.distributed.fsdp import fully_shard
        model = _mlp()
        for m in model:
            if isinstance(m, nn.Linear):
                fully_shard(m, mesh=mesh, reshard_after_forward=row == "zero3")
        fully_shard(model, mesh=mesh, reshard_after_forward=row == "zero3")
        opt = _adam(list(model.parameters()))
    elif row == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        model = _planned()
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        parallelize_module(model, mesh, {n: styles[s]() for n, s in type(model).tp_plan.items()})
        opt = _adam(list(model.parameters()))
    elif row == "tp+sp":
        return _peer_sp(group, data, mesh)
    else:
        return _peer_pp(row, group, data)

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        ce(model(x), y).backward()
        opt.step()
    return step


def _peer_sp(group: Any, data: list[tuple[Any, Any]], mesh: Any) -> Callable[[int], None]:
    from torch.distributed.tensor.experimental import implicit_replication
    from pslab.parallelism.models import lm_loss
    model = dtensor_sequence_parallel(ff_blocks(), mesh)
    opt = _adam(list(model.parameters()))

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        with implicit_replication():
            lm_loss(model(x), y).backward()
        opt.step()
    return step


def _peer_pp(row: str, group: Any, data: list[tuple[Any, Any]]) -> Callable[[int], None]:
    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from pslab.parallelism.pipeline import split_stages, stage_module
    world, rank = group.world_size, group.rank
    model = _mlp()
    mod = stage_module(model, split_stages(model, world)[rank])
    stage = PipelineStage(mod, rank, world, torch.device("cpu"))
    sched = (Schedule1F1B if row == "1f1b" else ScheduleGPipe)(stage, n_microbatches=4,
                                                                 loss_fn=torch.nn.functional.cross_entropy)
    opt = _adam(list(mod.parameters()))

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            sched.step(x)
        elif rank == world - 1:
            sched.step(target=y)
        else:
            sched.step()
        opt.step()
    return step


def _status_bytes(key: str) -> int:
    """A /proc/self/status size (VmRSS, VmHWM) in bytes; 0 where there is none (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@contextlib.contextmanager
def peak_rss() -> Iterator[list[int]]:
    """Yields [bytes]: after the block, the highest resident set the process reached in it minus the one it
    started from. Freed heap memory is handed back first (glibc's malloc_trim), so the start is what is live, and
    the kernel's high-water mark (VmHWM) is reset to it (/proc/self/clear_refs, Linux >= 4.0). Measures whatever
    the block allocated and touched: parameters, gradients, optimizer state, activations, communication buffers."""
    out = [0]
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    start = _status_bytes("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        start = 0                                   # no reset: report nothing rather than the process's history
    try:
        yield out
    finally:
        out[0] = max(0, _status_bytes("VmHWM") - start) if start else 0


def _worker(group: Any, port: int, backend: str, rows: list[str], steps: int, warmup: int, reps: int
            ) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from pslab.collectives.sockmeter import SocketMeter, socket_fds
    from pslab.collectives.gloo_groups import gloo_connections
    torch.set_num_threads(1)
    meter = None
    if not dist.is_initialized():          # the zmq backend: the peer gets a gloo default group of its own, whose
        before = socket_fds()              # connections the kernel counts (collectives/sockmeter.py)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=group.rank,
                                world_size=group.world_size)
        dist.barrier()
        meter = SocketMeter.new_sockets(before, (port,), gloo_connections(group.world_size))
        meter = meter if meter.observable else None
    out: dict[str, Any] = {}
    for row in rows:
        ours, our_bytes = _pslab(row, group)
        theirs = _peer(row, group)
        times: dict[str, list[float]] = {"pslab": [], "peer": []}
        sent: dict[str, list[float]] = {"pslab": [], "peer": []}

        def timed(name: str, fn: Callable[[int], None]) -> None:
            for i in range(warmup):
                fn(i)
            group.barrier()
            if meter is not None:
                meter.claim()
            b0 = our_bytes()
            t0 = time.perf_counter()
            for i in range(steps):
                fn(i)
            group.barrier()
            times[name].append((time.perf_counter() - t0) / steps)
            if name == "pslab":
                sent[name].append((our_bytes() - b0) / steps)
            elif meter is not None:
                sent[name].append(meter.claim()[0] / steps)
        for rep in range(reps):
            for name, fn in ([("pslab", ours), ("peer", theirs)] if rep % 2 == 0 else
                             [("peer", theirs), ("pslab", ours)]):
                timed(name, fn)
        peak: dict[str, int] = {}       # after the timing (every import and first-call cost paid): each built anew
        for name, build in (("pslab", lambda: _pslab(row, group)[0]), ("peer", lambda: _peer(row, group))):
            with peak_rss() as m:           # and run for a few steps in a block of its own
                fn = build()
                for i in range(max(warmup, 2)):
                    fn(i)
            peak[name] = m[0]
            del fn
        out[row] = {"times": times, "sent": sent, "peak": peak}
    dist.destroy_process_group()
    return out


def measure(rows: list[str], worlds: list[int], steps: int, warmup: int, reps: int,
            progress: Callable[[str], None] = lambda s: None) -> list[dict[str, Any]]:
    """One result row per (row, world): medians, ratios, bytes (module docstring)."""
    from pslab import collectives
    results = []
    for world in worlds:
        per_backend = {}
        for backend in BACKENDS:
            progress(f"world {world}, pslab on {backend} beside the peers ...")
            ranks = collectives.launch(_worker, world, backend=backend,
                                       args=(free_port(), backend, rows, steps, warmup, reps), timeout=1800)
            per_backend[backend] = ranks[0]
            for row in rows:                       # peak memory: the busiest rank's
                for who in ("pslab", "peer"):
                    ranks[0][row]["peak"][who] = max(r[row]["peak"][who] for r in ranks)
        for row in rows:
            r: dict[str, Any] = {"row": row, "world": world}
            for backend in BACKENDS:
                t = per_backend[backend][row]["times"]
                r[f"pslab_{backend}_ms"] = 1e3 * statistics.median(t["pslab"])
                r[f"peer_{backend}_ms"] = 1e3 * statistics.median(t["peer"])
                r[f"ratio_{backend}"] = statistics.median(a / b for a, b in zip(t["pslab"], t["peer"]))
            z, t = per_backend["zmq"][row]["sent"], per_backend["torch"][row]["sent"]
            r["pslab_bytes_per_step"] = statistics.median(z["pslab"])
            r["model_bytes_per_step"], r["formula"] = model_bytes(row, world)
            r["pslab_torch_bytes_per_step"] = statistics.median(t["pslab"])
            r["peer_bytes_per_step"] = statistics.median(z["peer"]) if z["peer"] else None
            for backend in BACKENDS:
                r[f"pslab_{backend}_peak_bytes"] = per_backend[backend][row]["peak"]["pslab"]
            r["peer_peak_bytes"] = per_backend["torch"][row]["peak"]["peer"]   # (gloo's own launch: no zmq beside)
            results.append(r)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pslab bench engines", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", choices=["torch"], default="torch", help="the peers (PyTorch's own; the only choice)")
    ap.add_argument("--world", type=int, nargs="+", default=[2], help="ranks per run, e.g. --world 2 4 (default 2)")
    ap.add_argument("--rows", nargs="+", default=list(ROWS), help=f"which rows (default all: {' '.join(ROWS)})")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per repetition (default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before each repetition (default 3)")
    ap.add_argument("--reps", type=int, default=4, help="repetitions, alternating who goes first (default 4)")
    ap.add_argument("--json", action="store_true", help="print one JSON list instead of the table")
    args = ap.parse_args(argv)
    bad = [r for r in args.rows if r not in ROWS]
    if bad:
        ap.error(f"unknown row(s) {', '.join(bad)}; choose from {', '.join(ROWS)}")
    if any(w < 2 or w > 8 for w in args.world) or args.steps < 1 or args.reps < 1 or args.warmup < 0:
        ap.error("--world takes 2..8 ranks, --steps and --reps at least 1, --warmup at least 0")
    if max(args.world) > 4 and any(r in ("gpipe", "1f1b") for r in args.rows):
        ap.error("the pipeline rows cut a 4-Linear MLP into one stage per rank: --world at most 4 for them")
    results = measure(args.rows, args.world, args.steps, args.warmup, args.reps,
                      progress=(lambda s: None) if args.json else (lambda s: print(s, file=sys.stderr, flush=True)))
    if args.json:
        print(json.dumps(results))
        return 0
    import torch
    print(f"pslab vs PyTorch {torch.__version__} (gloo, CPU), median step time over {args.reps} reps x "
          f"{args.steps} steps, rank 0; ratio = median of per-rep pslab / peer (< 1: pslab faster)")
    print("bytes: sent per step per rank; peak MB: the busiest rank's resident-set growth while the engine is built "
          "and runs its first steps (parameters, gradients, optimizer state, activations, buffers)")
    print(f"{'row':7s} {'N':>2s} {'pslab zmq':>10s} {'peer':>8s} {'ratio':>6s} {'pslab gloo':>11s} {'peer':>8s} "
          f"{'ratio':>6s}   {'B/step pslab zmq':>16s} {'model':>11s} {'pslab gloo':>11s} {'peer':>11s}   "
          f"{'peak MB pslab zmq':>17s} {'gloo':>5s} {'peer':>5s}")
    for r in results:
        fmt = lambda v: "—" if v is None else f"{v:,.0f}"
        mb = lambda v: "—" if not v else f"{v / 1e6:.1f}"
        print(f"{r['row']:7s} {r['world']:2d} {r['pslab_zmq_ms']:8.2f}ms {r['peer_zmq_ms']:6.2f}ms "
              f"{r['ratio_zmq']:5.2f}x {r['pslab_torch_ms']:9.2f}ms {r['peer_torch_ms']:6.2f}ms "
              f"{r['ratio_torch']:5.2f}x   {fmt(r['pslab_bytes_per_step']):>16s} {fmt(r['model_bytes_per_step']):>11s} "
              f"{fmt(r['pslab_torch_bytes_per_step']):>11s} {fmt(r['peer_bytes_per_step']):>11s}   "
              f"{mb(r['pslab_zmq_peak_bytes']):>17s} {mb(r['pslab_torch_peak_bytes']):>5s} "
              f"{mb(r['peer_peak_bytes']):>5s}")
    print("model: " + "; ".join(dict.fromkeys(f"{r['row']} {r['formula']}" for r in results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
