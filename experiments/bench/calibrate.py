"""`pslab plan --calibrate`: this machine as a `Cluster` — compute rate, fixed costs, and each link's α-β.

The planner (parallelism/step_model.py) models one rank's step as

    compute_s = FLOPs_rank / flops + m · micro_batch_overhead_s (its stage's share) + step_overhead_s
    a message of B bytes on a link: α + B / β, of which message_cpu_s is CPU

and this file measures those constants here, for the layouts `pslab plan --check` then runs:

Compute (`compute="runs"`, the default). The real training loop — `pslab run` of the text-transformer, allreduce,
dp = `ranks` processes at once (default: the topology's world size, as the check runs them) on one emulated host
with the topology's intra link — at three per-worker batches b (2, 8 and 32, interleaved, `reps` runs each,
summary step_time_s: the median step after the warm-up, max over ranks). With F(b) the FLOPs of one rank's step
(`step_model.model_flops`: Narayanan et al. 2021 eq. 3 without recompute) and c(b) the planner's own seconds for
that run's gradient all-reduce on the measured intra link (subtracted, because the planner adds communication back
for every layout), least squares on

    t(b) − c(b) = intercept + F(b) / rate      →   peak_flops = rate, efficiency = 1.0

The intercept is the fixed cost of one step with one micro-batch — the loop, Python, kernel launches, the
optimizer over tiny tensors — which on a model this small is most of the time: the reason the model needs the
terms at all. `compute="bare"` fits the model's step alone (forward, backward, SGD; no loop, no communication) at
four sizes in `ranks` concurrent processes: a lower bound on both constants.

Micro-batches (`measure_micro_batches`, `fit_micro_batch_overhead`). A dp run cannot tell the per-step cost from
the cost of one pass, which a pipeline pays per micro-batch: dp = world/2 × pp = 2 (GPipe, one emulated host) at
m = 1, 2, 4, 8 micro-batches of the same batch (measured here: 7.4 → 16.8 ms from m = 1 to 8 on 2 ranks). The
split intercept = step_overhead_s + micro_batch_overhead_s is the one whose step model (the same replay the check
uses) fits those four runs best (least squares, ternary search).

Shared cores. Where the topology has more ranks N than this machine has cores C, all of the above was measured with
the N ranks taking turns on the C cores; the Cluster stores each CPU cost per core (`_per_core`: rate · N/C, fixed
costs · C/N, processor sharing) with shared_cores = C, and the step model replays each layout's ranks taking turns
(step_replay.py) — so a pipeline's ranks that wait on a slow link leave their cores to the others, which an
additive model cannot say.

Links. One launch of the topology's ranks over the zmq group under the emulated topology (collectives/topology.py);
for each link class present, rank 0 and a peer across that class ping-pong messages of two sizes S₁ < S₂ (median
of `reps` round trips, one way = half a round trip), the other ranks idle. The fit through the two points

    β = (S₂ − S₁) / (t₂ − t₁),   α = t₁ − S₁ / β

puts into α everything a message pays whatever its size: the emulated latency, the scheduler's wake-up (the
emulation is a lower bound) and the software cost of one send + receive (msgpack header, zmq, Python) — the
per-message cost that many small tensor-parallel all-reduces pay. message_cpu_s = the intra α less the emulated
intra latency: that software share, CPU that takes turns on shared cores. S₂ is sized to take ~16 ms at the
emulated bandwidth (or 4 MiB if unlimited) so the bandwidth term is resolved above the noise: a scheduling delay of
a few ms on the small message (a loaded machine) moves β by ~10%, where a 4 ms S₂ once moved it by 50%.

Overlap (`measure_overlap`): dp = world size under the topology with the overlapped (bucketed, hook-driven)
gradient sync off and on; the time it saves over the compute seconds is the cluster's overlap_fraction (clipped to
[0, 2/3]) — about 0 where ranks share cores.

Memory: this machine's RAM / ranks per "GPU". The result is a `Cluster` named "here" (gpus_per_node = per_host,
nodes = hosts) that `Cluster.to_json()` saves.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch

from pslab import collectives
from pslab.collectives.topology import Topology
from pslab.parallelism.cluster import Cluster
from pslab.parallelism.step_model import OVERLAP_FRACTION
from pslab.parallelism.step_model import model_flops as step_model_flops

SIZES = (4, 8, 16, 32)      # micro-batch sizes of the bare compute fit (the check's runs use 2..8 per rank)
RUN_SIZES = (2, 8, 32)      # per-worker batches of the real-loop compute fit (the check: 2..8 per rank)
SEQ = 32                    # the text workload's window
DIMS = {"dim": 32, "heads": 4, "layers": 2}   # the text-transformer workload's model (experiments/workloads)


class CalibrationError(RuntimeError):
    """A measurement that could not be made or fitted (one line: what and what to change)."""


# ---- the model and its FLOPs -------------------------------------------------------------------------------
def workload_shape(micro_batch: int = 1) -> Any:
    """The text-transformer workload's model as a planner `Shape` (read off the workload's spec and dataset)."""
    from pslab.experiments.workloads import WORKLOADS
    from pslab.experiments.workloads.data import text
    from pslab.parallelism.memory_model import Shape
    spec = WORKLOADS["text-transformer"]
    kw = {**DIMS, **spec.model_kwargs}
    ds = text(SEQ)
    return Shape(layers=kw["layers"], hidden=kw["dim"], heads=kw["heads"], seq=int(ds.x_train.shape[1]),
                 vocab=int(ds.num_classes), micro_batch=micro_batch)


def model_flops(shape: Any, batch: int) -> float:
    """FLOPs of one training step on `batch` sequences: step_model.model_flops (Narayanan et al. 2021 eq. (3),
    without recompute)."""
    return float(step_model_flops(shape, batch))


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b·x; returns (a, b)."""
    n = len(xs)
    if n < 2 or len(set(xs)) < 2:
        raise CalibrationError("a fit needs at least two different sizes")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


# ---- compute: the training step at several sizes, all ranks at once ----------------------------------------
def _compute_rank(group: Any, sizes: list[int], reps: int, shape_d: dict) -> dict[int, list[float]]:
    from pslab.parallelism.models import lm_loss, tiny_transformer
    torch.set_num_threads(1)
    model = tiny_transformer(vocab=shape_d["vocab"], d=shape_d["hidden"], heads=shape_d["heads"],
                             layers=shape_d["layers"], seq=shape_d["seq"], seed=group.rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(group.rank)
    data = {b: (torch.randint(shape_d["vocab"], (b, shape_d["seq"]), generator=g),
                torch.randint(shape_d["vocab"], (b, shape_d["seq"]), generator=g)) for b in sizes}

    def step(b: int) -> float:
        x, y = data[b]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        lm_loss(model(x), y).backward()
        opt.step()
        return time.perf_counter() - t0

    for b in sizes:                                   # warm-up
        step(b), step(b)
    out: dict[int, list[float]] = {b: [] for b in sizes}
    for rep in range(reps):
        for b in (sizes if rep % 2 == 0 else sizes[::-1]):
            group.barrier()
            dt = torch.tensor([step(b)], dtype=torch.float64)
            group.all_reduce(dt, op="max")
            out[b].append(float(dt[0]))
    return out


def measure_compute(ranks: int, sizes: tuple[int, ...] = SIZES, reps: int = 15,
                    timeout: float = 120) -> dict[str, Any]:
    """{'rate': FLOP/s per rank, 'overhead_s', 'points': [(b, FLOPs, median s)]} from `ranks` concurrent ranks."""
    shape = workload_shape()
    d = {"vocab": shape.vocab, "hidden": shape.hidden, "heads": shape.heads, "layers": shape.layers, "seq": shape.seq}
    res = collectives.launch(_compute_rank, ranks, "zmq", args=(list(sizes), reps, d), timeout=timeout)
    pts = [(b, model_flops(shape, b), statistics.median(res[0][b])) for b in sizes]
    overhead, inv_rate = fit_line([p[1] for p in pts], [p[2] for p in pts])
    if inv_rate <= 0:
        raise CalibrationError(f"step time did not grow with the batch ({pts}); the machine is too noisy — retry")
    return {"rate": 1.0 / inv_rate, "overhead_s": max(0.0, overhead), "points": pts}


def _comm_only_s(b: int, ranks: int, steps: int, lat: float, bw: float, cores: int = 0,
                 message_cpu_s: float = 0.0) -> float:
    """The planner's communication seconds of one calibration run's step (dp = ranks on one node, the gradient
    all-reduce over a link of latency `lat` and bandwidth `bw`; ranks sharing `cores` cores, `message_cpu_s` of
    each message's latency CPU): what the fit subtracts, since the planner adds it back for every layout."""
    from pslab.parallelism import step_model
    from pslab.parallelism.memory_model import Layout
    if ranks == 1:
        return 0.0
    here = Cluster("comm-only", gpus_per_node=ranks, nodes=1, gpu_memory_bytes=1e12, peak_flops=float("inf"),
                   efficiency=1.0, intra_latency_s=lat, intra_bandwidth_Bps=bw, inter_latency_s=lat,
                   inter_bandwidth_Bps=bw, shared_cores=cores if ranks > cores else 0, message_cpu_s=message_cpu_s)
    return step_model.predict(workload_shape(b), Layout(dp=ranks, micro_batches=1), here, ranks * b,
                              precision="fp32", algorithm="pslab", overlap=False, steps=steps).step_s


def measure_compute_runs(ranks: int, sizes: tuple[int, ...] = RUN_SIZES, reps: int = 3, steps: int = 12,
                         intra: tuple[float, float] | None = None, link: tuple[float, float] | None = None,
                         root: str | None = None, progress: Any = None, cores: int = 0,
                         message_cpu_s: float = 0.0) -> dict[str, Any]:
    """The same fit on the real training loop: `pslab run` of the text-transformer with dp = `ranks` (allreduce)
    at each per-worker batch b, on one emulated host whose link is `intra` (latency s, bandwidth B/s: the
    topology's own intra link; None: none emulated); t(b) = summary step_time_s (median step after the warm-up,
    max over ranks), F(b) = the FLOPs of one rank's step, c(b) = the planner's seconds of the step's gradient
    all-reduce on `link` (the measured α-β of that link; None: 0). Least squares on t(b) − c(b) = overhead +
    F(b)/rate: the intercept is what every real step pays besides the FLOPs and the modelled communication — the
    loop, the optimizer, Python — with `ranks` processes sharing this machine's cores."""
    import json
    import math
    import tempfile
    from pslab.experiments.config import load_config
    from pslab.experiments.runner import execute
    shape = workload_shape()
    topo: list[str] = []
    if intra is not None and ranks > 1:
        lat, bw = intra
        topo = ["topology.hosts=1", f"topology.gpus_per_host={ranks}", f"topology.intra_latency_us={lat * 1e6:.6g}",
                f"topology.intra_bandwidth_GBps={0 if math.isinf(bw) else bw / 1e9:.9g}"]
    times: dict[int, list[float]] = {b: [] for b in sizes}
    with tempfile.TemporaryDirectory(prefix="pslab-calibrate-", dir=root) as tmp:
        for rep in range(reps):
            for b in (sizes if rep % 2 == 0 else sizes[::-1]):
                cfg = load_config(None, ["workload.name=text-transformer", "train.strategy=allreduce",
                                         "train.optimizer=momentum", "train.lr=0.05", f"workload.batch_size={b}",
                                         f"train.workers={ranks}", f"train.steps={steps}", "train.eval_every=1000000",
                                         "faults.on_failure=abort", "train.timeout_s=120"] + topo)
                rd = execute(cfg, tmp, label=f"calibrate b={b}", quiet=True)
                times[b].append(float(json.loads((rd.path / "summary.json").read_text())["step_time_s"]))
                if progress is not None:
                    progress()
    comm = {b: (_comm_only_s(b, ranks, steps, *link, cores, message_cpu_s) if link is not None else 0.0)
            for b in sizes}
    pts = [(b, model_flops(shape, b), statistics.median(times[b])) for b in sizes]
    overhead, inv_rate = fit_line([p[1] for p in pts], [p[2] - comm[p[0]] for p in pts])
    if inv_rate <= 0:
        raise CalibrationError(f"step time did not grow with the batch ({pts}); the machine is too noisy — retry")
    return {"rate": 1.0 / inv_rate, "overhead_s": max(0.0, overhead), "points": pts, "all": times, "comm_s": comm}


def measure_overlap(topology: Topology, rate: float, *, batch: int = 8, reps: int = 3, steps: int = 12,
                    root: str | None = None, progress: Any = None) -> dict[str, Any]:
    """How much of the compute the overlapped gradient sync hides behind, here: dp = world size under `topology`
    (packed), the same run with `parallel.overlap` off and on, interleaved, `reps` each. With c = F(b)/rate the
    step's compute seconds, the planner's overlap_fraction is

        f = clip((t_plain − t_overlap) / c, 0, 2/3)

    (2/3: backward's share, the most a gradient can hide behind). When ranks share the CPU cores, the bucket
    thread competes with the compute it is meant to hide behind and f is about 0 (the check measured overlap
    1.10x slower)."""
    import tempfile
    from pslab.experiments.studies.plan_check import run_config
    times: dict[bool, list[float]] = {False: [], True: []}
    cfg = {"label": "calibrate overlap", "dp": topology.world_size}
    with tempfile.TemporaryDirectory(prefix="pslab-calibrate-", dir=root) as tmp:
        for rep in range(reps):
            for ov in ((False, True) if rep % 2 == 0 else (True, False)):
                times[ov].append(run_config(dict(cfg, overlap=ov), topology, steps=steps, root=tmp,
                                            batch=batch)["step_s"])
                if progress is not None:
                    progress()
    plain, over = statistics.median(times[False]), statistics.median(times[True])
    compute_s = model_flops(workload_shape(), batch) / rate
    f = min(OVERLAP_FRACTION, max(0.0, (plain - over) / compute_s))
    return {"fraction": f, "plain_s": plain, "overlap_s": over, "compute_s": compute_s, "all": times}


MICRO_BATCHES = (1, 2, 4, 8)   # the pipeline runs that split the intercept (per-worker batch 8)


def measure_micro_batches(ranks: int, topology: Topology, micro_batches: tuple[int, ...] = MICRO_BATCHES, *,
                          batch: int = 8, reps: int = 3, steps: int = 20, root: str | None = None,
                          progress: Any = None) -> dict[int, float]:
    """The fixed cost of a micro-batch, measured: dp = ranks/2 × pp = 2 (GPipe) on one emulated host with the
    topology's intra link, the per-worker batch cut into m = 1, 2, 4, 8 micro-batches (interleaved, `reps` runs
    each); {m: median step s}. Each micro-batch pays the pass's fixed cost (Python, kernel launches) again, which
    a dp run with one micro-batch per step cannot tell from the per-step overhead."""
    import tempfile
    from pslab.experiments.studies.plan_check import run_config
    one = Topology(hosts=1, per_host=ranks, intra_latency_s=topology.intra_latency_s,
                   intra_bandwidth_Bps=topology.intra_bandwidth_Bps)
    _check_micro_batches(micro_batches, batch)
    times: dict[int, list[float]] = {m: [] for m in micro_batches}
    with tempfile.TemporaryDirectory(prefix="pslab-calibrate-", dir=root) as tmp:
        for rep in range(reps):
            for m in (micro_batches if rep % 2 == 0 else micro_batches[::-1]):
                cfg = {"label": f"calibrate m={m}", "dp": ranks // 2, "pp": 2, "micro_batches": m,
                       "schedule": "gpipe"}
                times[m].append(run_config(cfg, one, steps=steps, root=tmp, batch=batch)["step_s"])
                if progress is not None:
                    progress()
    return {m: statistics.median(v) for m, v in times.items()}


def _check_micro_batches(micro_batches: tuple[int, ...], batch: int = 8) -> None:
    if any(m < 1 or batch % m for m in micro_batches):
        raise CalibrationError(f"micro-batch counts must divide the per-worker batch {batch}, got {micro_batches}")


def fit_micro_batch_overhead(points: dict[int, float], cluster: Cluster, ranks: int, cores: int,
                             intra: tuple[float, float], batch: int = 8) -> float:
    """The c (seconds, as measured with `ranks` processes at once) whose step model reproduces `points` (the
    `measure_micro_batches` runs: one host, link `intra` = (α, β)) best, least squares over m, with the dp intercept
    (`cluster.step_overhead_s`, as measured) split as step_overhead = intercept − c. The model's step is piecewise
    linear in c, not always unimodal: a grid of 41 points on [0, intercept], then a ternary search between the best
    point's neighbours."""
    from pslab.experiments.studies.plan_check import predict_row
    one = cluster.with_(gpus_per_node=ranks, nodes=1, intra_latency_s=intra[0], intra_bandwidth_Bps=intra[1],
                        shared_cores=cores if ranks > cores else 0)
    total = cluster.step_overhead_s

    def sse(c: float) -> float:
        k = _per_core(one, total - c, c, ranks, cores)
        return sum((predict_row({"dp": ranks // 2, "pp": 2, "micro_batches": m, "schedule": "gpipe"}, k,
                                batch)["step_s"] - t) ** 2 for m, t in points.items())
    grid = [total * i / 40 for i in range(41)]
    best = min(range(41), key=lambda i: sse(grid[i]))
    lo, hi = grid[max(0, best - 1)], grid[min(40, best + 1)]
    for _ in range(40):
        a, b = lo + (hi - lo) / 3, hi - (hi - lo) / 3
        if sse(a) <= sse(b):
            hi = b
        else:
            lo = a
    return (lo + hi) / 2


def _per_core(cluster: Cluster, overhead: float, micro: float, ranks: int, cores: int) -> Cluster:
    """The cluster with its CPU costs per core. Measured with `ranks` processes at once: where they outnumber the
    `cores`, they took turns (processor sharing, step_replay.py), so one core does each fixed cost in cores/ranks of
    the measured seconds and computes ranks/cores times the measured rate; otherwise as measured."""
    f = cores / ranks if ranks > cores else 1.0
    return cluster.with_(peak_flops=cluster.peak_flops / f, step_overhead_s=max(0.0, overhead) * f,
                         micro_batch_overhead_s=max(0.0, micro) * f)


# ---- links: ping-pong per link class under the emulated topology ------------------------------------------
def _large_size(bw: float) -> int:
    if bw == float("inf"):
        return 4 << 20
    return int(min(8 << 20, max(64 << 10, bw * 16e-3)))


def _pingpong_rank(group: Any, topo_json: str, reps: int) -> dict[str, list[tuple[int, float]]]:
    torch.set_num_threads(1)
    topo = Topology.from_json(topo_json)
    peers = {}
    for r in range(1, group.world_size):
        peers.setdefault(topo.link(0, r), r)
    out: dict[str, list[tuple[int, float]]] = {}
    for cls in ("intra", "inter"):
        if cls not in peers:
            continue
        peer = peers[cls]
        _, bw = topo.params(0, peer)
        for size in (64, _large_size(bw)):
            x = torch.zeros(max(1, size // 4))
            times = []
            for rep in range(reps + 2):                       # two warm-up round trips
                group.barrier()
                if group.rank == 0:
                    t0 = time.perf_counter()
                    group.send(x, peer)
                    group.recv(x, peer)
                    times.append((time.perf_counter() - t0) / 2)
                elif group.rank == peer:
                    group.recv(x, 0)
                    group.send(x, 0)
            if group.rank == 0:
                out.setdefault(cls, []).append((x.numel() * 4, statistics.median(times[2:])))
    return out


def measure_links(topology: Topology, reps: int = 9, timeout: float = 120) -> dict[str, dict[str, float]]:
    """{'intra'|'inter': {'latency_s', 'bandwidth_Bps', 'points'}} for each link class the topology has."""
    res = collectives.launch(_pingpong_rank, topology.world_size, "zmq", args=(topology.to_json(), reps),
                             timeout=timeout, topology=topology)
    out = {}
    for cls, pts in res[0].items():
        (s1, t1), (s2, t2) = pts
        if t2 <= t1:
            bw, lat = float("inf"), statistics.median([t1, t2])
        else:
            bw = (s2 - s1) / (t2 - t1)
            lat = max(0.0, t1 - s1 / bw)
        out[cls] = {"latency_s": lat, "bandwidth_Bps": bw, "points": pts}
    return out


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask; os.cpu_count() where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def machine_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8e9


def calibrate(topology: Topology, *, ranks: int | None = None, progress: bool = True, compute: str = "runs",
              reps: int = 5, sizes: tuple[int, ...] | None = None, details: dict | None = None,
              micro_batches: tuple[int, ...] = MICRO_BATCHES) -> Cluster:
    """This machine as a Cluster named "here": compute rate and step overhead with `ranks` processes at once
    (default topology.world_size; `compute` "runs": the real training loop, "bare": the model's step alone; at
    `sizes`, `reps` runs each), the fixed cost of a micro-batch (pipeline runs, "runs" with an even world size
    only), α-β per link class through the zmq group under `topology`. Where the topology has more ranks than this
    machine has cores, the costs are stored per core (shared_cores = the cores; `_per_core`). `details`, if given,
    receives the raw points of every fit."""
    from tqdm import tqdm
    cores = available_cores()
    ranks = topology.world_size if ranks is None else ranks
    if ranks < 1:
        raise CalibrationError(f"ranks must be >= 1, got {ranks}")
    if compute not in ("runs", "bare"):
        raise CalibrationError(f"compute must be 'runs' or 'bare', got {compute!r}")
    sizes = tuple(sizes or (RUN_SIZES if compute == "runs" else SIZES))
    _check_micro_batches(micro_batches)
    runs = compute == "runs" and topology.world_size > 1
    overlap_reps = 3 if runs else 0
    micro_reps = min(3, reps) if runs and ranks % 2 == 0 and len(micro_batches) > 1 else 0
    total = (reps * len(sizes) if compute == "runs" else 1) + 1 + 2 * overlap_reps + len(micro_batches) * micro_reps
    with tqdm(total=total, desc="calibrate", unit="run", disable=not progress) as bar:
        bar.set_postfix_str("links")
        links = measure_links(topology, reps=max(5, 3 * reps)) if topology.world_size > 1 else {}
        bar.update(1)
        bar.set_postfix_str("compute")
        own = links.get("intra")
        message_cpu = max(0.0, own["latency_s"] - topology.intra_latency_s) if own else 0.0
        if compute == "runs":
            comp = measure_compute_runs(ranks, sizes, reps=reps, progress=lambda: bar.update(1),
                                        intra=(topology.intra_latency_s, topology.intra_bandwidth_Bps),
                                        link=(own["latency_s"], own["bandwidth_Bps"]) if own else None,
                                        cores=cores, message_cpu_s=message_cpu)
        else:
            comp = measure_compute(ranks, sizes, reps=max(5, 5 * reps))
            bar.update(1)
        ovl = micro = None
        if overlap_reps:
            bar.set_postfix_str("overlap")
            ovl = measure_overlap(topology, comp["rate"], reps=overlap_reps, progress=lambda: bar.update(1))
        if micro_reps:
            bar.set_postfix_str("micro-batches")
            micro = measure_micro_batches(ranks, topology, micro_batches, reps=micro_reps,
                                          progress=lambda: bar.update(1))
    kw: dict[str, Any] = {}
    for cls in ("intra", "inter"):
        if cls in links:
            kw[f"{cls}_latency_s"] = links[cls]["latency_s"]
            kw[f"{cls}_bandwidth_Bps"] = links[cls]["bandwidth_Bps"]
    for a, b in (("inter", "intra"), ("intra", "inter")):     # one class absent (1 host, or 1 rank per host):
        if a not in links and b in links:                      # never used; copy the other
            kw[f"{a}_latency_s"], kw[f"{a}_bandwidth_Bps"] = kw[f"{b}_latency_s"], kw[f"{b}_bandwidth_Bps"]
    # the overlap measured against the compute of `ranks` taking turns hides the same seconds behind a core's
    overlap = {} if ovl is None else {"overlap_fraction": min(OVERLAP_FRACTION, ovl["fraction"]
                                                              * (ranks / cores if ranks > cores else 1.0))}
    measured = Cluster("here", gpus_per_node=topology.per_host, nodes=topology.hosts,
                       gpu_memory_bytes=machine_memory_bytes() / max(1, topology.world_size),
                       peak_flops=comp["rate"], efficiency=1.0, step_overhead_s=comp["overhead_s"],
                       shared_cores=cores if topology.world_size > cores else 0, message_cpu_s=message_cpu,
                       **kw, **overlap)
    intra = (own["latency_s"], own["bandwidth_Bps"]) if own else (topology.intra_latency_s,
                                                                  topology.intra_bandwidth_Bps)
    c = fit_micro_batch_overhead(micro, measured, ranks, cores, intra) if micro else 0.0
    if details is not None:
        details.update(compute=comp, links=links, overlap=ovl, micro_batches=micro, micro_batch_overhead_s=c,
                       ranks=ranks, cores=cores)
    return _per_core(measured, measured.step_overhead_s - c, c, ranks, cores)
