"""`pslab bench topology`: flat ring vs hierarchical all-reduce on an emulated 2-host cluster with a slow link.

One launch of H x L zmq ranks under a `collectives.topology.Topology` (default 2 hosts x 2 ranks, intra 2 GB/s and
10 us, inter 100 MB/s and 200 us). For every size the two algorithms take turns (ring first on even repetitions);
a sample is the max over ranks of one all-reduce's time; we report medians, the ratio ring / hierarchical, the
bytes each rank put on each link class next to the formulas (collectives/hierarchical.py)

    hierarchical   inter 2(H-1)/H · S/L per rank          intra 2(L-1)/L · S per rank
    flat ring      inter 2(N-1)/N · S per crossing rank (H of them, the others 0)

and the link model's lower bound on the time (the busiest sender's bytes over its link bandwidths, phases in
sequence: ring 2(N-1)/N·S / bw_inter; hierarchical 2(L-1)/L·S / bw_intra + 2(H-1)/H·S/L / bw_inter).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from pslab import collectives
from pslab.collectives import hierarchical as hier
from pslab.collectives.topology import Topology, link_bytes, reset_link_bytes

from .collectives import _fmt_size, parse_size

ALGS = ("ring", "hierarchical")


def _bench_rank(group: Any, sizes: list[int], reps: int) -> list[dict]:
    rows = []
    for size in sizes:
        x = torch.ones(max(1, size // 4))
        for alg in ALGS:                                   # warm-up: connections, sub-groups, shm outboxes
            group.all_reduce(x, algorithm=alg)
        times: dict[str, list[float]] = {a: [] for a in ALGS}
        moved: dict[str, dict[str, int]] = {}
        for rep in range(reps):
            for alg in (ALGS if rep % 2 == 0 else ALGS[::-1]):
                group.barrier()
                reset_link_bytes(group)
                t0 = time.perf_counter()
                group.all_reduce(x, algorithm=alg)
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                moved[alg] = link_bytes(group)
                group.all_reduce(dt, op="max")
                times[alg].append(float(dt[0]))
        rows.append({"bytes": x.numel() * 4, "rank": group.rank, "moved": moved,
                     **{f"{a}_s": statistics.median(v) for a, v in times.items()},
                     **{f"{a}_all_s": v for a, v in times.items()}})
    return rows


def summarise(per_rank: list[list[dict]], topo: Topology) -> list[dict]:
    H, L, N = topo.hosts, topo.per_host, topo.world_size
    out = []
    for i, row in enumerate(per_rank[0]):
        S = row["bytes"]
        r = {"bytes": S, "hosts": H, "per_host": L, "ring_s": row["ring_s"], "hierarchical_s": row["hierarchical_s"],
             "ratio": row["ring_s"] / row["hierarchical_s"]}
        for alg in ALGS:
            for cls in ("intra", "inter"):
                r[f"{alg}_{cls}_bytes"] = [per_rank[k][i]["moved"][alg][cls] for k in range(N)]
        r["formula_hier_inter_per_rank"] = hier.inter_bytes_per_rank(S, H, L)
        r["formula_ring_inter_per_crossing"] = hier.flat_ring_inter_bytes_per_crossing(S, H, L)
        r["formula_hier_intra_per_rank"] = 2 * (L - 1) / L * S
        r["exact_hier_inter"] = hier.exact_inter_bytes(S // 4, 4, H, L, "hierarchical")
        r["exact_ring_inter"] = hier.exact_inter_bytes(S // 4, 4, H, L, "ring")
        r["bound_ring_s"] = 2 * (N - 1) / N * S / topo.inter_bandwidth_Bps
        r["bound_hierarchical_s"] = (2 * (L - 1) / L * S / topo.intra_bandwidth_Bps
                                     + hier.inter_bytes_per_rank(S, H, L) / topo.inter_bandwidth_Bps)
        out.append(r)
    return out


def print_table(rows: list[dict], topo: Topology, out: Any = sys.stdout) -> None:
    print(f"topology: {topo.hosts} hosts x {topo.per_host} ranks; intra {topo.intra_bandwidth_Bps / 1e9:g} GB/s "
          f"{topo.intra_latency_s * 1e6:g} us, inter {topo.inter_bandwidth_Bps / 1e6:g} MB/s "
          f"{topo.inter_latency_s * 1e6:g} us", file=out)
    print(f"{'size':>9}  {'ring ms':>9}{'(bound)':>9}  {'hier ms':>9}{'(bound)':>9}  {'ring/hier':>9}", file=out)
    for r in rows:
        print(f"{_fmt_size(r['bytes']):>9}  {r['ring_s'] * 1e3:>9.2f}{r['bound_ring_s'] * 1e3:>9.2f}  "
              f"{r['hierarchical_s'] * 1e3:>9.2f}{r['bound_hierarchical_s'] * 1e3:>9.2f}  {r['ratio']:>8.2f}x",
              file=out)
    print("\nbytes per rank per link class (measured; formula):", file=out)
    for r in rows:
        ok = (r["hierarchical_inter_bytes"] == r["exact_hier_inter"] and r["ring_inter_bytes"] == r["exact_ring_inter"])
        print(f"{_fmt_size(r['bytes']):>9}  hierarchical inter {r['hierarchical_inter_bytes']} "
              f"(2(H-1)/H*S/L = {r['formula_hier_inter_per_rank']:.0f}), intra {r['hierarchical_intra_bytes']} "
              f"(2(L-1)/L*S = {r['formula_hier_intra_per_rank']:.0f})", file=out)
        print(f"{'':>9}  ring         inter {r['ring_inter_bytes']} (crossing ranks 2(N-1)/N*S = "
              f"{r['formula_ring_inter_per_crossing']:.0f}), intra {r['ring_intra_bytes']}  "
              f"[{'= formula' if ok else 'DIFFERS from formula'}]", file=out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pslab bench topology", description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=2, help="emulated hosts (default 2)")
    p.add_argument("--per-host", type=int, default=2, help="ranks per host (default 2); world = hosts x per-host")
    p.add_argument("--intra-bw", type=float, default=2e9, help="bytes/s (default 2e9; note: [topology] in a run config takes GB/s)")
    p.add_argument("--intra-lat", type=float, default=10e-6, help="seconds (default 10e-6; [topology] takes µs)")
    p.add_argument("--inter-bw", type=float, default=100e6, help="bytes/s (default 100e6)")
    p.add_argument("--inter-lat", type=float, default=200e-6, help="seconds (default 200e-6)")
    p.add_argument("--sizes", type=parse_size, nargs="+", default=[4 << 20, 16 << 20], help="default: 4M 16M")
    p.add_argument("--reps", type=int, default=5, help="repetitions per algorithm; medians reported (default 5)")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON ('-' for stdout only)")
    p.add_argument("--timeout", type=float, default=600, help="hard limit, seconds")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.reps < 1:
        raise SystemExit("pslab bench topology: --reps must be >= 1")
    try:
        topo = Topology(args.hosts, args.per_host, args.intra_lat, args.intra_bw, args.inter_lat, args.inter_bw)
    except ValueError as e:
        raise SystemExit(f"pslab bench topology: {e}") from None
    res = collectives.launch(_bench_rank, topo.world_size, "zmq", args=(args.sizes, args.reps),
                             timeout=args.timeout, topology=topo)
    rows = summarise(res, topo)
    if args.json == "-":
        json.dump({"topology": json.loads(topo.to_json()), "rows": rows}, sys.stdout, indent=1)
        print()
        return 0
    print_table(rows, topo)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"topology": json.loads(topo.to_json()), "rows": rows}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
