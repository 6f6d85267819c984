"""`pslab compare --preset communication`: synchronise less often, or send less, next to asynchrony.

Across a slow link the synchronous all-reduce of every gradient is what a step waits for. Asynchrony (ps-asp,
ps-ssp:s) is pslab's first answer; the field's others are to average the model only every H steps (Local SGD,
Lin et al. 2020; DiLoCo, Douillard et al. 2023) or to compress what each step sends (top-k with error feedback,
Stich et al. 2018; PowerSGD, Vogels et al. 2019). This study runs them on one workload, on emulated hosts (one
worker each) joined by a slow link, and holds everything else fixed: model, initial weights, data, each worker's
batch sequence, steps per worker, compute per step, and the learning rate (train.lr per gradient under the compare
default's linear rule, the same for every arm; nothing is tuned per arm, so an arm that would want another lr is
shown at a disadvantage rather than flattered).

Arms (ARMS; label: strategy, + train.compress / train.error_feedback):

    bsp              allreduce                       one all-reduce of the gradient per step (real runs: the
                                                      direct exchange of tensors <= 32 KiB; simulated: a ring)
    ssp:3, asp       ps-ssp:3, ps-asp                 push / pull through the shards; a worker's clock may lead the
                                                      slowest by <= 3 / any number of clocks (the updates a gradient
                                                      misses, its staleness, can exceed 3 under ssp:3)
    local-sgd:H      H = 4, 16                        each worker steps alone; parameters averaged every H steps
    diloco:H         H = 16, 64                       the same H inner steps, then an outer Nesterov step ([outer])
    ps-local:16      ps-local:16                      Local SGD through the shards, asynchronous: each worker pushes
                                                      its pseudo-gradient every 16 steps and nobody waits
    topk 1%          allreduce + topk:0.01            the largest 1 % of each gradient (value, index); residual kept
    topk 1% no EF    the same, error_feedback = false the dropped 99 % lost for ever
    powersgd:2       allreduce + powersgd:2           rank-2 factors of each weight matrix, with error feedback
    asp topk 1%      ps-asp + topk:0.01               asynchrony and compression: each push the largest 1 % (with
                                                      error feedback), the read whole

Bytes a worker's link carries per step, sent + received (the tables' "bytes per sample" divide them by the samples
a worker computed), S = 4n gradient bytes, K workers, T steps (experiments/results/bytes.py prints each sent count
next to its formula in every run's bytes table):

    bsp           twice the all-reduce's sends: 2 · 2 (K − 1)/K · S (ring), 2 (K − 1) · S (direct exchange, tensors
                  <= 32 KiB): a worker receives what it sends
    local-sgd:H, diloco:H   ⌈T/H⌉/T of that (one all-reduce of the parameters per H steps)
    ssp, asp      S pushed + S read back, every byte through the shard host's link
    ps-local:H    S pushed + S read back per H steps: ⌈T/H⌉/T of ssp's
    topk ρ        2 (K − 1) · ⌈ρ n⌉ · (4 + 4)          (values and int32 indices all-gathered)
    asp topk ρ    ⌈ρ n⌉ · (4 + 4) pushed + S read back (the read is not compressed: it is nearly all of it)
    powersgd:r    twice the all-reduce's sends of Σ r (rows + cols) · 4 + the vectors left whole

What is stale, by how much (the records' `staleness`): asp / ssp count the shard's updates a gradient missed; Local
SGD / DiLoCo count the local steps since the last average (0 … H − 1, every worker equally behind); compression is
not stale but biased — error feedback turns the bias into a delay (what was dropped is sent later), which is why
top-k without it stalls.

Outputs (in --out): report.md (the tables, the verdicts, the simulated 64-worker table, the plots),
communication.json (every run's numbers), loss_vs_bytes / loss_vs_time / loss_vs_samples PNGs, and runs/ (each
run's directory, readable by `pslab report`).

Verdicts (`verdicts`): per arm and condition, against bsp on the same seeds: (1) the arm's median final test loss
of the global model lies within bsp's seed band, bsp's median ± 2 sd over the seeds (the sd as `pslab compare`'s
band; medians are lower medians) — quoted with the bytes-per-sample ratio, which is deterministic; (2) its median
time to the target accuracy is shorter than bsp's. Each with a paired seed bootstrap: the share of
BOOT replicates (seeds resampled with replacement, the same draw for every arm) in which the comparison of the
medians holds; below SOLID it is called seed noise.

The simulator part (`--sim-workers`, 64 by default; 0 skips it) runs every arm at 64 workers in virtual time, the
link modelled by [simulate] with the same latency and bandwidth (ring all-reduce and all-gather; a shard's requests
queue on its link), one seed, at the real runs' step lr (`sim_lr`): how time and bytes scale when K grows — where
the ring's 2(K − 1) latencies per all-reduce, not the bytes, become the cost (PowerSGD pays three of them a step).
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from pslab.experiments.config import RunConfig
from pslab.experiments.errors import ConfigError, ExperimentError
from pslab.experiments.results.records import bytes_moved
from pslab.experiments.results.rundir import RunDir
from pslab.experiments.runner import execute


@dataclass(frozen=True)
class Arm:
    label: str
    strategy: str
    compress: str = "none"
    error_feedback: bool = True


ARMS = (Arm("bsp", "allreduce"), Arm("ssp:3", "ps-ssp:3"), Arm("asp", "ps-asp"),
        Arm("local-sgd:4", "local-sgd:4"), Arm("local-sgd:16", "local-sgd:16"),
        Arm("diloco:16", "diloco:16"), Arm("diloco:64", "diloco:64"), Arm("ps-local:16", "ps-local:16"),
        Arm("topk 1%", "allreduce", "topk:0.01"), Arm("topk 1% no EF", "allreduce", "topk:0.01", False),
        Arm("powersgd:2", "allreduce", "powersgd:2"), Arm("asp topk 1%", "ps-asp", "topk:0.01"))
REFERENCE = "bsp"
LATENCY_S = 0.002            # the slow inter-host link: 2 ms ...
BANDWIDTH_BPS = 2e6          # ... and 2 MB/s: bsp's exchange of the digits MLP's gradient (3 x 19.2 kB per worker)
                             # takes ~29 ms on it, 3x a step's padded compute: a link slow for the model, as a WAN
                             # is for an LLM's. Fixed by the study (a --set topology.* is overwritten)
STEPS = 128                  # = 2 x 64: diloco:64 averages twice
COMPUTE_S = 0.01             # each step's compute padded to 10 ms (a 4x straggler: 40 ms): the link dominates
PRESET_OVERRIDES = (f"train.steps={STEPS}", f"train.base_step_s={COMPUTE_S}")   # before the user's --set
SEEDS = 3
SIM_WORKERS = 64
STRAGGLER_FACTOR = 4.0
BOOT = 1000
SOLID = 0.8                  # a comparison holding in fewer bootstrap replicates than this is seed noise


def study_config(cfg: RunConfig) -> RunConfig:
    """`cfg` on the study's link: one emulated host per worker (its model-parallel ranks inside it), the hosts
    joined by LATENCY_S / BANDWIDTH_BPS; the simulator's inter-host link the same, compute_s = the real padding."""
    c = copy.deepcopy(cfg)
    c.topology.hosts, c.topology.gpus_per_host = c.train.workers, c.parallel.model_parallel
    c.topology.inter_latency_us, c.topology.inter_bandwidth_GBps = LATENCY_S * 1e6, BANDWIDTH_BPS / 1e9
    c.simulate.latency_inter_s, c.simulate.bandwidth_inter_Bps = LATENCY_S, BANDWIDTH_BPS
    c.simulate.workers_per_host = 1
    c.faults.on_failure = "abort"          # [topology] fixes the membership; the study injects no failure
    if c.train.base_step_s > 0:
        c.simulate.compute_s = c.train.base_step_s
    return c.validate()


def arm_config(base: RunConfig, arm: Arm, seed: int, straggler: bool) -> RunConfig:
    c = copy.deepcopy(base)
    c.train.strategy, c.train.compress, c.train.error_feedback = arm.strategy, arm.compress, arm.error_feedback
    c.workload.seed = base.workload.seed + seed
    c.stragglers.factors = {c.train.workers - 1: STRAGGLER_FACTOR} if straggler else {}
    return c.validate()


def curve(run: dict[str, Any], batch_size: int) -> dict[str, list[float]]:
    """At each evaluation of the global model: bytes moved (sent + received) per worker so far, time, samples, test
    loss."""
    ups = sorted(run["updates"], key=lambda u: u["time_s"])
    K = max(1, int((run.get("summary") or {}).get("workers") or 1))
    out: dict[str, list[float]] = {"bytes": [], "time_s": [], "samples": [], "loss": []}
    i, sent = 0, 0.0
    for e in run["evals"]:
        if e.get("test_loss") is None:
            continue
        while i < len(ups) and ups[i]["time_s"] <= e["time_s"]:
            sent += bytes_moved(ups[i])
            i += 1
        out["bytes"].append(sent / K)
        out["time_s"].append(float(e["time_s"]))
        out["samples"].append(float(e["updates"]) * batch_size)
        out["loss"].append(float(e["test_loss"]))
    return out


def row(run: dict[str, Any], batch_size: int, target_acc: float) -> dict[str, Any]:
    """The numbers of one run the tables and verdicts read."""
    from pslab.experiments.results.records import time_to_accuracy
    s = run.get("summary") or {}
    hit = time_to_accuracy(run["evals"], target_acc)
    ups = [u for u in run["updates"] if not u.get("dropped")]
    K = max(1, int(s.get("workers") or 1))
    sent = None if any(u.get("bytes_sent") is None for u in ups) else sum(bytes_moved(u) for u in ups) / K
    samples = s.get("samples") or len(ups) * batch_size
    return {"time_s": s.get("time_s"), "time_to_target_s": None if hit is None else hit[0],
            "final_test_loss": s.get("final_test_loss"), "final_test_acc": s.get("final_test_acc"),
            "bytes_moved_per_worker": sent, "bytes_per_sample": None if sent is None else sent / (samples / K),
            "staleness_mean": s.get("staleness_mean"), "staleness_max": s.get("staleness_max"),
            "wait_s_per_worker": (s.get("wait_s_total") or 0.0) / K, "path": run["path"],
            "curve": curve(run, batch_size)}


def run_communication(cfg: RunConfig, out: Path, seeds: int = SEEDS, straggler: bool = True,
                      sim_workers: int = SIM_WORKERS, quiet: bool = False, force: bool = False,
                      target_acc: float = 0.9, arms: tuple[Arm, ...] = ARMS,
                      progress: Callable[[str], None] | None = None) -> tuple[Path, dict[str, Any]]:
    """Every arm x seed, without and (with `straggler`) with a 4x straggler on the last worker, real runs on the
    study's link; then the simulator at `sim_workers` (0: skip); then report.md. Returns (report path, data)."""
    if seeds < 2:
        raise ExperimentError(f"--seeds must be >= 2 (a seed band needs two runs), got {seeds}")
    if sim_workers < 0 or sim_workers == 1:
        raise ExperimentError(f"--sim-workers must be 0 (no simulation) or >= 2, got {sim_workers}")
    if not 0 < target_acc <= 1:
        raise ExperimentError(f"--target-acc must be in (0, 1], e.g. 0.9, got {target_acc}")
    if cfg.simulate.enabled or cfg.simulate.timing_only:
        raise ConfigError("--preset communication runs real processes and then its own simulation "
                          "(--sim-workers): drop --simulate / --timing-only")
    if REFERENCE not in [a.label for a in arms]:
        raise ExperimentError(f"the study compares every arm with {REFERENCE!r}: keep it among the arms")
    out = Path(out)
    t0 = time.perf_counter()
    base = study_config(cfg)
    conditions = [False, True] if straggler else [False]
    plan = [(a, k, st) for st in conditions for a in arms for k in range(seeds)]
    for a, _, st in plan:                      # every arm checked before the first run starts (one line each)
        try:
            arm_config(base, a, 0, st)
        except ConfigError as e:
            raise ConfigError(f"--preset communication, arm {a.label!r}: {e}") from None
    say = progress or (lambda m: None if quiet else print(m, flush=True))
    bs = cfg.workload.batch_size
    results: dict[str, dict[str, list[dict[str, Any]]]] = {"none": {}, "straggler": {}}
    for n, (a, k, st) in enumerate(plan, 1):
        c = arm_config(base, a, k, st)
        cond = "straggler" if st else "none"
        label = f"{a.label} seed {c.workload.seed}" + (" straggler" if st else "")
        rd = execute(c, out / "runs", label=label, quiet=True, force=force)
        r = row(RunDir(rd.path).load(), bs, target_acc)
        results[cond].setdefault(a.label, []).append(r)
        say(f"[{n}/{len(plan)}] {label}: {r['time_s']:.2f} s, test loss {r['final_test_loss']:.3f}, "
            f"{_kb(r['bytes_moved_per_worker'])} kB moved per worker")
    sim: list[dict[str, Any]] = []
    if sim_workers:
        for n, a in enumerate(arms, 1):
            c = arm_config(base, a, 0, False)
            c.train.workers = sim_workers
            c.train.lr = sim_lr(base, sim_workers)
            c.topology.hosts = c.topology.gpus_per_host = 0     # the simulator models the link itself
            c.simulate.enabled = True
            c.validate()
            rd = execute(c, out / "sim", label=f"{a.label} x{sim_workers} (simulated)", simulate=True, quiet=True,
                         force=force)
            r = row(RunDir(rd.path).load(), bs, target_acc)
            r["label"] = a.label
            sim.append(r)
            say(f"[sim {n}] {a.label} at {sim_workers} workers: {r['time_s']:.2f} virtual s")
    data = {"workload": cfg.workload.name, "workers": cfg.train.workers, "steps": base.train.steps,
            "batch_size": bs, "lr": cfg.train.lr, "lr_rule": cfg.train.lr_rule, "optimizer": cfg.train.optimizer,
            "seeds": [cfg.workload.seed + k for k in range(seeds)], "latency_s": LATENCY_S,
            "bandwidth_Bps": BANDWIDTH_BPS, "straggler_factor": STRAGGLER_FACTOR, "target_acc": target_acc,
            "arms": [a.__dict__ for a in arms], "results": results, "sim_workers": sim_workers, "sim": sim,
            "sim_lr": sim_lr(base, sim_workers) if sim_workers else None}
    data["verdicts"] = {cond: verdicts(res) for cond, res in results.items() if res}
    data["elapsed_s"] = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    (out / "communication.json").write_text(json.dumps(data, indent=1))
    from pslab.experiments.studies.communication_report import write
    return write(data, out), data


def sim_lr(cfg: RunConfig, workers: int) -> float:
    """The per-gradient lr at `workers` that keeps the real runs' step lr (train.lr_rule: linear K·lr, sqrt √K·lr):
    the linear rule's 64 × lr would be a step 16× larger than any real run took, and digits diverges there."""
    scale = {"linear": cfg.train.workers / workers, "sqrt": math.sqrt(cfg.train.workers / workers)}
    return cfg.train.lr * scale.get(cfg.train.lr_rule, 1.0)


def _kb(b: float | None) -> str:
    return "?" if b is None else f"{b / 1e3:.1f}"


def verdicts(res: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per arm against REFERENCE on the same seeds (paired): final test loss inside the reference's band (its
    lower median ± 2 sd over seeds), and time to target shorter; each with the bootstrap share of seed-resampled
    replicates in which the comparison of medians holds. Runs that never reached the target count as infinitely
    slow."""
    ref = res[REFERENCE]
    n = len(ref)
    idx = np.random.default_rng(0).integers(0, n, (BOOT, n))
    ref_loss = np.array([r["final_test_loss"] for r in ref], float)
    band = 2 * float(np.std(ref_loss, ddof=1)) if n > 1 else 0.0
    ref_t = np.array([_inf(r["time_to_target_s"]) for r in ref], float)
    ref_b = lower_median([r["bytes_per_sample"] for r in ref])
    boot_ref_loss, boot_ref_t = _boot_median(ref_loss, idx), _boot_median(ref_t, idx)
    out = []
    for label, runs in res.items():
        if label == REFERENCE:
            continue
        loss = np.array([r["final_test_loss"] for r in runs], float)
        t = np.array([_inf(r["time_to_target_s"]) for r in runs], float)
        bps = lower_median([r["bytes_per_sample"] for r in runs])
        d_loss = lower_median(loss) - lower_median(ref_loss)
        within = abs(d_loss) <= band
        boot_within = np.abs(_boot_median(loss, idx) - boot_ref_loss) <= band
        faster = bool(lower_median(t) < lower_median(ref_t))
        boot_faster = _boot_median(t, idx) < boot_ref_t
        out.append({"arm": label, "loss": lower_median(loss), "ref_loss": lower_median(ref_loss),
                    "band": band, "d_loss": d_loss, "within_band": within,
                    "within_share": float(np.mean(boot_within == within)),
                    "fewer_bytes": ref_b / bps if bps and ref_b else None,
                    "t_target": _finite(lower_median(t)), "ref_t_target": _finite(lower_median(ref_t)),
                    "faster": faster, "faster_share": float(np.mean(boot_faster == faster))})
    return out


def lower_median(values: Any) -> float | None:
    """The lower median (the middle seed for an odd count; inf-safe; None values left out; None if none is left):
    the one median of the study's tables and verdicts, as each bootstrap replicate uses."""
    xs = sorted(float(x) for x in values if x is not None)
    return xs[(len(xs) - 1) // 2] if xs else None


def _inf(v: float | None) -> float:
    return math.inf if v is None else float(v)


def _finite(v: float) -> float | None:
    return v if math.isfinite(v) else None


def _boot_median(v: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """The lower median of each bootstrap replicate (inf-safe: a never-reached target stays inf)."""
    return np.sort(v[idx], axis=1)[:, (idx.shape[1] - 1) // 2]
