"""`pslab bench collectives`: our `zmq` backend against torch.distributed gloo, in the same processes, alternating.

For each N, one launch starts N ranks; each rank joins both a zmq group and a gloo group over the same TCPStore.
For every (op, size) the two backends take turns (zmq first on even repetitions, gloo first on odd ones) so drift
in machine load hits both; each measurement is the max over ranks of the mean time of `iters` back-to-back calls.
We report medians over repetitions and the nccl-tests bandwidths:

    algbw = S / t          S = tensor bytes (for all_gather / reduce_scatter: the whole, gathered buffer)
    busbw = algbw * f      f = 2(N-1)/N all_reduce,  (N-1)/N all_gather, reduce_scatter and all_to_all
                           (S: each rank's input, N equal chunks, one stays),  1 broadcast

busbw is comparable across N: it is the bandwidth each rank's link actually sustains under the ring algorithm.

Peers (`--peers`, default gloo): `gloo` is torch.distributed's CPU backend; `mpi` is MPICH through mpi4py, the CPU
collectives HPC users trust (`pip install -e '.[bench]'`: mpi4py + the mpich wheel, whose `mpiexec` lands in the
environment's bin). With mpi among the peers the N ranks are started by `mpiexec -n N` instead of
`collectives.launch`; each MPI rank joins the same zmq and gloo groups (rank 0 of COMM_WORLD hosts the TCPStore) and
times MPI_Allreduce / Allgatherv / Reduce_scatter / Bcast / Alltoall on the same buffers (numpy views of the torch
tensors, no copy), in the same alternation. Every ratio is `peer time / zmq time` (> 1: zmq is faster; for
all_reduce = zmq busbw / peer busbw), median over repetitions, from the same run.

Profile (`--profile`): after the timed repetitions of each (op, size), rank 0 runs `iters` more zmq calls under
cProfile (the other ranks run them unprofiled) and splits one call's time by where it went:

    wait    waiting for a peer: zmq poll, a shared-memory channel's spin and sleeps (shm_channel.Waiter)
    zmq     ZeroMQ send / recv calls (encode and decode are Python, counted there)
    copy    tensor copies (copy_, clone: into and out of shared memory, write-back)
    reduce  the arithmetic (add / maximum / minimum / div)
    python  everything else: validation, routing, bookkeeping, the interpreter

cProfile slows rank 0's Python (so `python` reads high and the peers' `wait` low); `us/call` beside it is the
unprofiled median. `--no-shm-channel` runs the zmq groups without the same-host latency path (shm_channel.py), the
before-and-after switch.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import shutil
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import torch

from pslab import collectives
from pslab.collectives import flight
from pslab.collectives.group import chunk_bounds
from pslab.experiments.bench import free_port

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
DEFAULT_OPS = OPS[:4]              # all_to_all on request (--ops all_to_all): expert parallelism's collective
DEFAULT_SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
PEERS = ("gloo", "mpi", "noflight")
EXTRA = "pip install -e '.[bench]'  (mpi4py and the mpich wheel)"


class MpiGroup:
    """mpi4py's COMM_WORLD behind the calls `_call` makes (in place on numpy views of the torch tensors)."""

    def __init__(self) -> None:
        from mpi4py import MPI
        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        self.rank, self.world_size = self.comm.rank, self.comm.size

    def all_reduce(self, t: torch.Tensor) -> None:
        self.comm.Allreduce(self.MPI.IN_PLACE, t.numpy(), op=self.MPI.SUM)

    def _counts(self, elems: int) -> list[int]:
        return [b - a for a, b in chunk_bounds(elems, self.world_size)]

    def all_gather(self, full: torch.Tensor, part: torch.Tensor) -> None:
        counts = self._counts(full.numel())
        self.comm.Allgatherv(part.numpy(), [full.numpy(), counts])

    def reduce_scatter(self, part: torch.Tensor, full: torch.Tensor) -> None:
        self.comm.Reduce_scatter(full.numpy(), part.numpy(), recvcounts=self._counts(full.numel()), op=self.MPI.SUM)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        self.comm.Bcast(t.numpy(), root=src)

    def all_to_all(self, out: torch.Tensor, full: torch.Tensor) -> None:
        self.comm.Alltoall(full.numpy(), out.numpy())


class Unrecorded:
    """The same zmq group, called through its backend's own methods (what the flight wrapper wraps), timed with the
    recorder paused (collectives/flight.py): the peer that prices the always-on recorder ("--peers noflight";
    vs_noflight = its time / zmq's; `flight_overhead` = the median over reps of zmq / noflight - 1, each rep's pair
    timed back to back)."""

    def __init__(self, group: Any) -> None:
        for op in flight.TRACED_OPS:
            raw = getattr(getattr(type(group), op), "__wrapped__", None)
            if raw is not None:
                setattr(self, op, types.MethodType(raw, group))

    @staticmethod
    def timing() -> Any:
        return flight.paused()


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


PROFILE_KINDS = ("wait", "zmq", "copy", "reduce", "python")


def _kind(func: tuple[str, int, str]) -> str:
    """Which PROFILE_KINDS a cProfile entry (file, line, name) is."""
    file, _, name = func
    if "shm_channel" in file and (name in ("until", "_try_map") or name.startswith("<lambda>")) or any(
            w in name for w in ("poll", "sleep", "sched_yield", "'wait'", "perf_counter", "monotonic")):
        return "wait"
    if f"{os.sep}zmq{os.sep}" in file or any(w in name for w in ("send_multipart", "recv_multipart", "zmq.")):
        return "zmq"
    if any(w in name for w in ("'copy_'", "'clone'", "'contiguous'")):
        return "copy"
    if any(w in name for w in ("'add_'", "method add ", "maximum", "minimum", "'div_'")):
        return "reduce"
    return "python"


def profile_calls(group: Any, op: str, iters: int, full: torch.Tensor, part: torch.Tensor,
                  out: torch.Tensor | None, profiled: bool) -> dict[str, float]:
    """`iters` calls of `op` (under cProfile where `profiled`): microseconds per call in each of PROFILE_KINDS."""
    if not profiled:
        for _ in range(iters):
            _call(group, op, full, part, out)
        return {}
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        _call(group, op, full, part, out)
    prof.disable()
    us = dict.fromkeys(PROFILE_KINDS, 0.0)
    for func, (_, _, tottime, _, _) in pstats.Stats(prof).stats.items():   # type: ignore[attr-defined]
        us[_kind(func)] += tottime / iters * 1e6
    return us


def _bench_rank(zgroup: Any, ops: list[str], sizes: list[int], reps: int, budget: float,
                peers: tuple[str, ...] = ("gloo",), profile: bool = False) -> list[dict]:
    """Runs in every rank: returns rows of median times (rank 0's view of the max over ranks)."""
    torch.set_num_threads(1)
    groups: list[tuple[str, Any]] = [("zmq", zgroup)]
    if "gloo" in peers:
        groups.append(("gloo", collectives.init_process_group("torch", rank=zgroup.rank, world_size=zgroup.world_size,
                                                              store=zgroup.store, timeout=zgroup.timeout)))
    if "mpi" in peers:
        groups.append(("mpi", MpiGroup()))
    if "noflight" in peers:
        groups.append(("noflight", Unrecorded(zgroup)))
    n, rows = zgroup.world_size, []
    for op in ops:
        for size in sizes:
            elems = max(1, size // 4)
            if op == "all_to_all":          # N equal chunks
                elems = max(n, elems - elems % n)
            a, b = chunk_bounds(elems, n)[zgroup.rank]
            full, part = torch.ones(elems), torch.ones(b - a)
            out = torch.empty(elems) if op == "all_to_all" else None
            # warm-up (connections, channels, allocator), then pick an iteration count that fills ~budget seconds
            # per sample from a warm call (a cold first call would make µs-scale samples of 1 iteration)
            for _ in range(2):
                for _, g in groups:
                    _call(g, op, full, part, out)
            t0 = time.perf_counter()
            for _, g in groups:
                _call(g, op, full, part, out)
            probe = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            zgroup.all_reduce(probe, op="max")
            lo = 10 if elems * 4 <= 64 << 10 else 1     # µs-scale calls: a sample of 1 call is mostly barrier skew
            iters = int(max(lo, min(2000, budget / max(float(probe[0]) / 2, 1e-6))))
            times: dict[str, list[float]] = {name: [] for name, _ in groups}
            for rep in range(reps):
                k = rep % len(groups)       # rotate who goes first, so drift in load hits every backend alike
                for name, g in groups[k:] + groups[:k]:
                    zgroup.barrier()
                    with g.timing() if isinstance(g, Unrecorded) else contextlib.nullcontext():
                        t0 = time.perf_counter()
                        for _ in range(iters):
                            _call(g, op, full, part, out)
                        dt = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
                    zgroup.all_reduce(dt, op="max")
                    times[name].append(float(dt[0]))
            rows.append({"op": op, "bytes": elems * 4, "world": n, "iters": iters, "reps": reps,
                         **{f"{k}_s": statistics.median(v) for k, v in times.items()},
                         **{f"{k}_all_s": v for k, v in times.items()}})
            if profile:
                zgroup.barrier()
                rows[-1]["profile_us"] = profile_calls(zgroup, op, iters, full, part, out, zgroup.rank == 0)
    return rows


def _with_bandwidth(row: dict) -> dict:
    f = bus_factor(row["op"], row["world"])
    for k in ("zmq",) + PEERS:
        if f"{k}_s" not in row:
            continue
        row[f"{k}_algbw_GBps"] = row["bytes"] / row[f"{k}_s"] / 1e9
        row[f"{k}_busbw_GBps"] = row[f"{k}_algbw_GBps"] * f
        if k != "zmq":
            row[f"vs_{k}"] = row[f"{k}_s"] / row["zmq_s"]     # = zmq busbw / peer busbw
    if "gloo_s" in row:
        row["busbw_ratio"] = row["vs_gloo"]
    if "noflight_all_s" in row:     # paired: each rep's two samples ran back to back (drift in load cancels)
        row["flight_overhead"] = statistics.median(
            z / f - 1 for z, f in zip(row["zmq_all_s"], row["noflight_all_s"]))
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


def print_table(rows: list[dict], out: Any = None) -> None:
    out = out or sys.stdout                 # resolved per call (a captured or redirected stdout)
    peers = [k for k in PEERS if rows and f"{k}_s" in rows[0]]
    head = f"{'op':<15}{'N':>3}{'size':>10}  {'zmq time':>11}" + "".join(f"{k + ' time':>11}" for k in peers)
    head += f"  {'zmq busbw':>10}" + "".join(f"{k + ' busbw':>11}" for k in peers)
    head += "".join(f"  {'zmq/' + k:>8}" for k in peers)
    unit = f"{'':<15}{'':>3}{'':>10}  {'(us)':>11}" + "".join(f"{'(us)':>11}" for _ in peers)
    unit += f"  {'(GB/s)':>10}" + "".join(f"{'(GB/s)':>11}" for _ in peers) + "".join(f"  {'busbw':>8}" for _ in peers)
    print(head, file=out)
    print(unit, file=out)
    for r in rows:
        line = f"{r['op']:<15}{r['world']:>3}{_fmt_size(r['bytes']):>10}  {r['zmq_s'] * 1e6:>11.1f}"
        line += "".join(f"{r[k + '_s'] * 1e6:>11.1f}" for k in peers)
        line += f"  {r['zmq_busbw_GBps']:>10.3f}" + "".join(f"{r[k + '_busbw_GBps']:>11.3f}" for k in peers)
        line += "".join(f"  {r['vs_' + k]:>7.2f}x" for k in peers)
        print(line, file=out)


def print_profile(rows: list[dict], out: Any = None) -> None:
    """One line per (op, N, size): rank 0's microseconds per zmq call in each kind, and each kind's share."""
    out = out or sys.stdout
    print("\nwhere one zmq call's time goes on rank 0 (cProfile; us per call, share of the profiled call)", file=out)
    print(f"{'op':<15}{'N':>3}{'size':>10}{'us/call':>10}{'profiled':>10}"
          + "".join(f"{k:>15}" for k in PROFILE_KINDS), file=out)
    for r in rows:
        p = r.get("profile_us")
        if not p:
            continue
        tot = sum(p.values()) or 1.0
        line = f"{r['op']:<15}{r['world']:>3}{_fmt_size(r['bytes']):>10}{r['zmq_s'] * 1e6:>10.1f}{tot:>10.1f}"
        line += "".join(f"{p[k]:>9.1f} {p[k] / tot:>4.0%}" for k in PROFILE_KINDS)
        print(line, file=out)


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
    p.add_argument("--peers", default="gloo",
                   help="comma-separated peers timed beside zmq in the same processes: gloo, mpi (MPICH via mpi4py; "
                        f"needs {EXTRA}), noflight (zmq with its flight recorder off: the recorder's cost) "
                        "(default: gloo)")
    p.add_argument("--profile", action="store_true",
                   help="also split one zmq call's time on rank 0 into wait / zmq / copy / reduce / python")
    p.add_argument("--no-shm-channel", action="store_true",
                   help="zmq groups without the same-host latency path (collectives/shm_channel.py): 'before'")
    return p


def _peers(text: str) -> tuple[str, ...]:
    peers = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    bad = [p for p in peers if p not in PEERS]
    if bad or not peers:
        raise SystemExit(f"pslab bench collectives: --peers takes a comma-separated list of {', '.join(PEERS)}, "
                         f"got {text!r}")
    return peers


def mpiexec() -> str:
    """The mpiexec next to this Python (the mpich wheel's), else on PATH; a one-line error naming the extra."""
    import importlib.util
    if importlib.util.find_spec("mpi4py") is None:
        raise SystemExit(f"pslab bench collectives: the mpi peer needs mpi4py and MPICH: {EXTRA}")
    exe = Path(sys.executable).with_name("mpiexec")
    found = str(exe) if exe.exists() else shutil.which("mpiexec")
    if not found:
        raise SystemExit(f"pslab bench collectives: the mpi peer needs an mpiexec (none beside {sys.executable} "
                         f"or on PATH): {EXTRA}")
    return found


def _launch_mpi(n: int, args: argparse.Namespace, peers: tuple[str, ...]) -> list[dict]:
    """Start N ranks with mpiexec (each runs `_mpi_rank`); rank 0 writes the rows to a file we read back."""
    with tempfile.TemporaryDirectory(prefix="pslab-mpi-") as tmp:
        out = Path(tmp) / "rows.json"
        spec = {"ops": args.ops, "sizes": args.sizes, "reps": args.reps, "budget": args.budget, "peers": peers,
                "port": free_port(), "out": str(out), "timeout": min(args.timeout, 300.0), "profile": args.profile,
                "shm_channel": not args.no_shm_channel}
        env = dict(os.environ, PSLAB_JOB_SECRET=os.environ.get("PSLAB_JOB_SECRET") or os.urandom(16).hex(),
                   OMP_NUM_THREADS="1")
        cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "pslab.experiments.bench.collectives", "--mpi-rank",
               json.dumps(spec)]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            _, err = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.communicate()
            raise SystemExit(f"pslab bench collectives: the mpiexec run of N={n} passed --timeout {args.timeout:g} s")
        if proc.returncode != 0 or not out.exists():
            tail = (err or "").strip().splitlines()[-1:] or ["no output"]
            raise SystemExit(f"pslab bench collectives: mpiexec -n {n} failed (status {proc.returncode}): {tail[0]}")
        return json.loads(out.read_text())


def _mpi_rank(spec: dict) -> int:
    """One rank under mpiexec: the zmq (and gloo) groups over a TCPStore hosted by MPI rank 0, then the timings."""
    from mpi4py import MPI
    rank, n = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
    zgroup = collectives.init_process_group("zmq", rank=rank, world_size=n, master_addr="127.0.0.1",
                                            master_port=spec["port"], timeout=spec["timeout"],
                                            shm_channel=spec.get("shm_channel", True))
    try:
        rows = _bench_rank(zgroup, spec["ops"], spec["sizes"], spec["reps"], spec["budget"], tuple(spec["peers"]),
                           spec.get("profile", False))
        if rank == 0:
            Path(spec["out"]).write_text(json.dumps(rows))
        MPI.COMM_WORLD.Barrier()
    finally:
        zgroup.destroy()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--mpi-rank"]:              # internal: one rank started by mpiexec (see _launch_mpi)
        return _mpi_rank(json.loads(argv[1]))
    args = build_parser().parse_args(argv)
    if any(n < 2 for n in args.world) or args.reps < 1:
        raise SystemExit("pslab bench collectives: --world values must be >= 2 and --reps >= 1")
    peers = _peers(args.peers)
    if "mpi" in peers:
        mpiexec()                                # fail before any work when the extra is missing
    from tqdm import tqdm
    rows: list[dict] = []
    for n in tqdm(args.world, desc="group sizes", unit="N", file=sys.stderr, disable=args.json == "-"):
        if "mpi" in peers:
            res0 = _launch_mpi(n, args, peers)
        else:
            res0 = collectives.launch(_bench_rank, n, "zmq", args=(args.ops, args.sizes, args.reps, args.budget,
                                                                   peers, args.profile), timeout=args.timeout,
                                      shm_channel=not args.no_shm_channel)[0]
        rows.extend(_with_bandwidth(r) for r in res0)
    add_bw = add_memory_bandwidth()
    if args.json == "-":
        json.dump({"rows": rows, "add_GBps": add_bw}, sys.stdout, indent=1)
        print()
        return 0
    print_table(rows)
    if args.profile:
        print_profile(rows)
    print(f"\nin-memory add bandwidth (a += b, 64 MiB float32, 3 x 64 MiB touched): {add_bw:.2f} GB/s")
    for r in rows:
        if r["op"] == "all_reduce" and r["bytes"] >= 64 << 20:
            print(f"all_reduce N={r['world']} 64 MiB: zmq busbw is {r['zmq_busbw_GBps'] / add_bw:.1%} of that")
    for r in rows:
        if "flight_overhead" in r:
            print(f"flight recorder: {r['flight_overhead']:+.1%} on {r['op']} N={r['world']} {_fmt_size(r['bytes'])} "
                  f"(median over {r['reps']} reps of zmq / noflight - 1, each pair back to back)")
    for k in peers:
        print(f"zmq / {k}: " + ", ".join(f"{r['op']} N={r['world']} {_fmt_size(r['bytes'])} {r['vs_' + k]:.2f}x"
                                          for r in rows if r["op"] == "all_reduce"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "add_GBps": add_bw}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
