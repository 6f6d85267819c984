"""The GPU check: pslab's torch backend with NCCL, the data-parallel engine on CUDA, collectives on CUDA tensors.

    python scripts/gpu_check.py [--ranks N] [--sizes 4K 1M 64M] [--out DIR]      (or scripts/gpu_check.sh)

Never run in CI (CI machines have no GPU); run it in one go when a GPU machine is lent. Three parts, each PASS or
FAIL with its reason; exit status 0 only when all pass, 2 when there is no CUDA (nothing was run):

1. **NCCL vs numpy**: `collectives.launch(backend="torch", torch_backend="nccl")`, every rank on cuda:rank, all_reduce
   (sum, max), all_gather, reduce_scatter (equal and uneven chunks), broadcast, all_to_all on CUDA float32 tensors;
   each result against numpy computed from every rank's seeded input (float64 reference, rtol 1e-5).
2. **DP engine on CUDA vs torch DDP**: the same tiny transformer, the same per-rank batches, 5 SGD steps with pslab's
   `DataParallelEngine` + `AllReduceStrategy` (overlapped buckets) and with `torch.nn.parallel.DistributedDataParallel`;
   every parameter equal within 1e-5 (relative to its norm).
3. **all_reduce on CUDA tensors, pslab's TorchGroup next to raw `torch.distributed.all_reduce`** (NCCL), per size:
   median time over reps, the nccl-tests bus bandwidth 2(N−1)/N·S / t, and the ratio pslab / raw (the wrapper's
   overhead; 1.0 is the goal). With one GPU the world is 1 (NCCL refuses two ranks on one device): parts 1–2 then
   check the code paths, not the communication, and part 3 times the trivial all-reduce; the output says so.

Writes `gpu_check.json` (every figure) into --out (default: current directory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402


def _inputs(rank: int, n: int, numel: int) -> np.ndarray:
    return np.random.default_rng(1000 + rank).standard_normal(numel * n).astype(np.float32)


def _close(got: torch.Tensor, want: np.ndarray, what: str) -> None:
    g = got.detach().cpu().double().numpy().reshape(-1)
    if g.shape != want.reshape(-1).shape or not np.allclose(g, want.reshape(-1), rtol=1e-5, atol=1e-5):
        err = float(np.max(np.abs(g - want.reshape(-1)))) if g.shape == want.reshape(-1).shape else "shape"
        raise AssertionError(f"{what}: differs from numpy (max abs error {err})")


def _device(rank: int, cuda: bool) -> torch.device:
    torch.set_num_threads(1)
    if not cuda:
        return torch.device("cpu")
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def part_collectives(group, cuda: bool, numel: int) -> str:
    """Part 1, in every rank: each collective on CUDA tensors against numpy."""
    dev = _device(group.rank, cuda)
    r, n = group.rank, group.world_size
    xs = [_inputs(k, n, numel).astype(np.float64) for k in range(n)]
    x = torch.tensor(_inputs(r, n, numel), device=dev)
    t = x.clone()
    group.all_reduce(t, "sum")
    _close(t, sum(xs), "all_reduce sum")
    t = x.clone()
    group.all_reduce(t, "max")
    _close(t, np.max(xs, axis=0), "all_reduce max")
    out = torch.empty(numel * n * n, device=dev)
    group.all_gather(out, x)
    _close(out, np.concatenate(xs), "all_gather")
    for total in (numel * n, numel * n - 1):          # equal chunks (NCCL's own), then uneven (the fallback)
        from pslab.collectives.group import chunk_bounds
        a, b = chunk_bounds(total, n)[r]
        out = torch.empty(b - a, device=dev)
        group.reduce_scatter(out, x[:total].contiguous(), "sum")
        _close(out, sum(v[:total] for v in xs)[a:b], f"reduce_scatter of {total}")
    t = x.clone()
    group.broadcast(t, 0)
    _close(t, xs[0], "broadcast")
    out = torch.empty_like(x)
    group.all_to_all(out, x)
    want = np.concatenate([xs[k].reshape(n, -1)[r] for k in range(n)])
    _close(out, want, "all_to_all")
    return "ok"


def _model(seed: int = 0) -> torch.nn.Module:
    from pslab.parallelism.models import tiny_transformer
    return tiny_transformer(vocab=64, d=64, heads=4, layers=2, seq=16, seed=seed)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * rank + step)
    x = torch.randint(0, 64, (8, 16), generator=g)
    return x, torch.roll(x, -1, dims=1)


def part_dp(group, cuda: bool, steps: int) -> list[float]:
    """Part 2, in every rank: pslab's DP engine on CUDA and torch DDP on the same batches; returns both weights."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from pslab.parallelism.data import DataParallelEngine
    from pslab.parallelism.engine import AllReduceStrategy, train_step
    from pslab.parallelism.mesh import DeviceMesh
    from pslab.parallelism.models import lm_loss
    dev = _device(group.rank, cuda)
    mesh = DeviceMesh(group, dp=group.world_size)
    replica = DataParallelEngine(loss_fn=lm_loss).build(lambda: _model().to(dev), mesh)
    strategy = AllReduceStrategy(lambda ps: torch.optim.SGD(ps, lr=0.1), overlap=True)
    strategy.attach(replica)
    init = torch.cat([p.detach().reshape(-1).clone() for p in replica.module.parameters()])
    for s in range(steps):
        x, y = _batch(group.rank, s)
        train_step(replica, strategy, x.to(dev), y.to(dev))
    ours = torch.cat([p.detach().reshape(-1) for p in replica.module.parameters()])
    ddp = DistributedDataParallel(_model().to(dev), device_ids=[group.rank] if cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for s in range(steps):
        x, y = _batch(group.rank, s)
        opt.zero_grad()
        lm_loss(ddp(x.to(dev)), y.to(dev)).backward()
        opt.step()
    theirs = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
    dist.barrier()
    moved = float((theirs - init).norm() / init.norm())
    if moved < 1e-4:
        raise AssertionError(f"the weights hardly moved in {steps} steps ({moved:.1e}): the comparison would be empty")
    return float((ours - theirs).norm() / theirs.norm())


def part_bench(group, cuda: bool, sizes: list[int], reps: int) -> list[dict]:
    """Part 3, in every rank: all_reduce through pslab's TorchGroup vs raw dist.all_reduce on the same CUDA buffer."""
    import torch.distributed as dist
    dev = _device(group.rank, cuda)
    n = group.world_size
    rows = []
    for nbytes in sizes:
        buf = torch.ones(nbytes // 4, device=dev)
        iters = max(5, min(200, int(2e9 / max(nbytes, 1))))
        times: dict[str, list[float]] = {"pslab": [], "raw": []}
        for _ in range(reps):
            for name, fn in (("pslab", lambda: group.all_reduce(buf, "sum")),
                             ("raw", lambda: dist.all_reduce(buf))):
                fn()
                _sync(cuda)
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                _sync(cuda)
                times[name].append((time.perf_counter() - t0) / iters)
        row = {"bytes": nbytes, "world": n}
        for name, ts in times.items():
            t = statistics.median(ts)
            row[f"{name}_s"] = t
            row[f"{name}_busbw_GBps"] = 2 * (n - 1) / n * nbytes / t / 1e9 if n > 1 else None
        row["pslab_over_raw_time"] = row["pslab_s"] / row["raw_s"]
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=None, help="ranks, one per GPU (default: every visible GPU, <= 8)")
    ap.add_argument("--sizes", nargs="+", default=["4K", "1M", "64M", "256M"], help="all_reduce sizes (part 3)")
    ap.add_argument("--reps", type=int, default=5, help="repetitions in part 3; medians are reported")
    ap.add_argument("--out", default=".", help="directory for gpu_check.json")
    ap.add_argument("--cpu", action="store_true",
                    help="the same checks on CPU tensors over gloo: tests this script (no GPU verdict); default 2 ranks")
    a = ap.parse_args(argv)
    from pslab.collectives import launch
    from pslab.experiments.bench.collectives import parse_size
    if a.cpu:
        n, names, backend = a.ranks or 2, ["cpu (gloo: this script's self-test, not a GPU check)"], "gloo"
    else:
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device here: nothing was run (this check runs only on a GPU machine)")
            return 2
        n, backend = a.ranks or min(torch.cuda.device_count(), 8), "nccl"
        if not 1 <= n <= torch.cuda.device_count():
            print(f"gpu_check: --ranks must be 1..{torch.cuda.device_count()} (one rank per GPU)", file=sys.stderr)
            return 1
        names = [torch.cuda.get_device_name(i) for i in range(n)]
    nccl = "" if a.cpu else f", NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"
    print(f"gpu_check: {n} rank(s) on {', '.join(names)}; torch {torch.__version__}{nccl}"
          + ("  (one GPU: world 1, code paths only)" if n == 1 and not a.cpu else ""))
    report: dict = {"ranks": n, "devices": names, "torch": torch.__version__, "parts": {}}
    failed = 0
    cuda = not a.cpu
    parts = [("1 NCCL collectives vs numpy", part_collectives, (cuda, 4099)),
             ("2 DP engine on CUDA vs DDP", part_dp, (cuda, 5)),
             ("3 all_reduce: pslab TorchGroup vs raw NCCL", part_bench, (cuda, [parse_size(s) for s in a.sizes], a.reps))]
    for label, fn, args in parts:
        t0 = time.perf_counter()
        try:
            res = launch(fn, world_size=n, backend="torch", torch_backend=backend, args=args, timeout=600)
            if fn is part_dp and max(res) > 1e-5:
                raise AssertionError(f"weights differ from DDP's: relative error {max(res):.2e}")
            report["parts"][label] = {"status": "PASS", "result": res[0], "seconds": time.perf_counter() - t0}
            print(f"PASS  {label}  ({time.perf_counter() - t0:.1f} s)")
            if fn is part_dp:
                print(f"      relative weight difference after 5 steps: {max(res):.2e}")
            if fn is part_bench:
                for row in res[0]:
                    bw = "" if row["pslab_busbw_GBps"] is None else \
                        f"  busbw {row['pslab_busbw_GBps']:.1f} vs {row['raw_busbw_GBps']:.1f} GB/s"
                    print(f"      {row['bytes']:>11,} B  pslab {row['pslab_s'] * 1e6:9.1f} µs  raw "
                          f"{row['raw_s'] * 1e6:9.1f} µs  pslab/raw time {row['pslab_over_raw_time']:.2f}{bw}")
        except BaseException as e:     # report and go on: every part gets its verdict
            failed += 1
            report["parts"][label] = {"status": "FAIL", "error": f"{type(e).__name__}: {e}",
                                      "trace": traceback.format_exc()}
            print(f"FAIL  {label}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print(f"gpu_check: {len(parts) - failed}/{len(parts)} parts passed; figures in {out / 'gpu_check.json'}")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
