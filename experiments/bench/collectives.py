"""`pslab bench collectives`: our `zmq` backend against torch.distributed gloo, in the same processes, alternating.

For each N, one launch starts N ranks; each rank joins both a zmq group and a gloo group over the same TCPStore.
For every (op, size) the two backends take turns (zmq first on even repetitions, gloo first on odd ones) so drift
in machine load hits both; each measurement is the max over ranks of the mean time of `iters` back-to-back calls.
We report medians over repetitions and the nccl-tests bandwidths:

    algbw = S / t          S = tensor bytes (for all_gather / reduce_scatter: the whole, gathered buffer)
    busbw = algbw * f      f = 2(N-1)/N all_reduce,  (N-1)/N all_gather, reduce_scatter and all_to_all
                           (S: each rank's input, N equal chunks, one stays),  1 broadcast

busbw is comparable across N: it is the bandwidth each rank's link actually sustains under the ring algorithm.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

import collectives
from collectives.group import chunk_bounds

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
DEFAULT_OPS = OPS[:4]              # all_to_all on request (--ops all_to_all): expert parallelism's collective
DEFAULT_SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def bus_factor(op: str, n: int) -> float:
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
            "broadcast": 1.0, "all_to_all": (n - 1) / n}[op]


def _call(group: Any, op: str, full: torch.Tensor, part: torch.Tensor, out: torch.Tensor | None = None) -> None:
    if op == "all_to_all":          # expert parallelism's dispatch / combine
        assert out is not None
        group.all_to_all(out, full)
    elif op == "all_reduce":
        group.all_reduce(full)
    elif op == "all_gather":
        group.all_gather(full, part)
    elif op == "reduce_scatter":
        group.reduce_scatter(part, full)
    else:
        group.broadcast(full, src=0)


def _bench_rank(zgroup: Any, ops: list[str], sizes: list[int], reps: int, budget: float) -> list[dict]:
    """Runs in every rank: returns rows of median times (rank 0's view of the max over ranks)."""
    tgroup = collectives.init_process_group("torch", rank=zgroup.rank, world_size=zgroup.world_size,
                                            store=zgroup.store, timeout=zgroup.timeout)
    n, rows = zgroup.world_size, []
    for op in ops:
        for size in sizes:
            elems = max(1, size // 4)
            if op == "all_to_all":          # N equal chunks
                elems = max(n, elems - elems % n)
            a, b = chunk_bounds(elems, n)[zgroup.rank]
            full, part = torch.ones(elems), torch.ones(b - a)
            out = torch.empty(elems) if op == "all_to_all" else None
            # warm-up (connections, allocator) and pick an iteration count that fills ~budget seconds per sample
            t0 = time.perf_counter()
            for g in (zgroup, tgroup):
                _call(g, op, full, part, out)
            probe = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            zgroup.all_reduce(probe, op="max")
            iters = int(max(1, min(200, budget / max(float(probe[0]) / 2, 1e-6))))
            times: dict[str, list[float]] = {"zmq": [], "gloo": []}
            for rep in range(reps):
                order = [("zmq", zgroup), ("gloo", tgroup)]
                for name, g in (order if rep % 2 == 0 else order[::-1]):
                    zgroup.barrier()
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        _call(g, op, full, part, out)
                    dt = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
                    zgroup.all_reduce(dt, op="max")
                    times[name].append(float(dt[0]))
            rows.append({"op": op, "bytes": elems * 4, "world": n, "iters": iters, "reps": reps,
                         **{f"{k}_s": statistics.median(v) for k, v in times.items()},
                         **{f"{k}_all_s": v for k, v in times.items()}})
    return rows


def _with_bandwidth(row: dict) -> dict:
    f = bus_factor(row["op"], row["world"])
    for k in ("zmq", "gloo"):
        row[f"{k}_algbw_GBps"] = row["bytes"] / row[f"{k}_s"] / 1e9
        row[f"{k}_busbw_GBps"] = row[f"{k}_algbw_GBps"] * f
    row["busbw_ratio"] = row["gloo_s"] / row["zmq_s"]  # = zmq busbw / gloo busbw
    return row


def add_memory_bandwidth(reps: int = 5) -> float:
    """GB/s of `a += b` on 64 MiB float32 (bytes touched: read a, read b, write a = 3 x 64 MiB)."""
    torch.set_num_threads(1)
    a, b = torch.ones(16 << 20), torch.ones(16 << 20)
    a += b
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a += b
        ts.append(time.perf_counter() - t0)
    return 3 * a.numel() * 4 / statistics.median(ts) / 1e9


def _fmt_size(b: int) -> str:
    for unit, s in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= s:
            return f"{b / s:.4g} {unit}"
    return f"{b} B"


def print_table(rows: list[dict], out: Any = sys.stdout) -> None:
    print(f"{'op':<15}{'N':>3}{'size':>10}  {'zmq time':>11}{'gloo time':>11}  {'zmq algbw':>10}{'zmq busbw':>10}"
          f"{'gloo busbw':>11}  {'zmq/gloo':>8}", file=out)
    print(f"{'':<15}{'':>3}{'':>10}  {'(us)':>11}{'(us)':>11}  {'(GB/s)':>10}{'(GB/s)':>10}{'(GB/s)':>11}"
          f"  {'busbw':>8}", file=out)
    for r in rows:
        print(f"{r['op']:<15}{r['world']:>3}{_fmt_size(r['bytes']):>10}  {r['zmq_s'] * 1e6:>11.1f}"
              f"{r['gloo_s'] * 1e6:>11.1f}  {r['zmq_algbw_GBps']:>10.3f}{r['zmq_busbw_GBps']:>10.3f}"
              f"{r['gloo_busbw_GBps']:>11.3f}  {r['busbw_ratio']:>7.2f}x", file=out)


def parse_size(s: str) -> int:
    s = s.strip().upper().replace("IB", "").replace("B", "")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    try:
        return int(float(s[:-1] if s[-1:] in "KMG" else s) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {s!r} is not like 4K, 4M or 65536") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pslab bench collectives", description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, nargs="+", default=[2, 4], help="group sizes N (default: 2 4)")
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(DEFAULT_OPS),
                   help="collectives to time (default: all but all_to_all)")
    p.add_argument("--sizes", type=parse_size, nargs="+", default=DEFAULT_SIZES,
                   help="tensor sizes, e.g. 4K 4M 64M (default: 4K 64K 1M 4M 16M 64M)")
    p.add_argument("--reps", type=int, default=5, help="repetitions per backend; medians are reported (default 5)")
    p.add_argument("--budget", type=float, default=0.05, help="seconds per timed sample (sets iterations)")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON ('-' for stdout only)")
    p.add_argument("--timeout", type=float, default=900, help="hard limit per group size, seconds")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if any(n < 2 for n in args.world) or args.reps < 1:
        raise SystemExit("pslab bench collectives: --world values must be >= 2 and --reps >= 1")
    from tqdm import tqdm
    rows: list[dict] = []
    for n in tqdm(args.world, desc="group sizes", unit="N", file=sys.stderr, disable=args.json == "-"):
        res = collectives.launch(_bench_rank, n, "zmq", args=(args.ops, args.sizes, args.reps, args.budget),
                                 timeout=args.timeout)
        rows.extend(_with_bandwidth(r) for r in res[0])
    add_bw = add_memory_bandwidth()
    if args.json == "-":
        json.dump({"rows": rows, "add_GBps": add_bw}, sys.stdout, indent=1)
        print()
        return 0
    print_table(rows)
    print(f"\nin-memory add bandwidth (a += b, 64 MiB float32, 3 x 64 MiB touched): {add_bw:.2f} GB/s")
    for r in rows:
        if r["op"] == "all_reduce" and r["bytes"] >= 64 << 20:
            print(f"all_reduce N={r['world']} 64 MiB: zmq busbw is {r['zmq_busbw_GBps'] / add_bw:.1%} of that")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "add_GBps": add_bw}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
