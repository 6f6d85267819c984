"""`pslab plan --check`: the planner's predicted step time and bytes next to real runs of the same layouts here.

Each config is a layout of the text-transformer workload on an emulated topology (default 2 hosts x 2 ranks with a
slow inter-host link), run through the real engines (`experiments.runner.execute` with `[parallel]` and
`[topology]` overrides) `repeats` times, the configs taking turns (a drift in the machine's load — other jobs on
its cores — hits every config alike); per config

    measured   = median over repeats of summary.json's step_time_s (median step after the warm-up, max over ranks)
    predicted  = step_model.predict(shape, layout, cluster, global_batch, precision="fp32", placement=...,
                                    algorithm="pslab", overlap=...).step_s
    ratio      = predicted / measured,   error % = |predicted − measured| / measured · 100

with `shape` read off the workload (layers, hidden, heads, sequence, vocabulary; micro-batch b = the per-worker
batch / m) and `cluster` the calibration (`experiments/bench/calibrate.py`: a Cluster named "here"). Bytes: the
planner's `comm_model.step_comm(..., algorithm="pslab", act_bytes=4, grad_bytes=4)` summed per kind and per link
class, next to the run's measured bytes_by_kind and link_bytes_per_step (both summed over ranks, per step). The
default configs (DEFAULT_CONFIGS, 17) cover dp (hierarchical all-reduce across the hosts; with and without
overlap), tp inside a host vs across the slow link (placement packed vs spread), tp over both hosts, dp x pp with the
pipeline inside a host vs across (spread, and the explicit axis order "dp,pp"), ZeRO 1 and 3 over dp and ZeRO-3 over
dp x tp (FSDP + TP), and six layouts with two model-parallel axes, tp x pp (composed, parallelism/compose.py):
packed and spread, with sequence parallelism packed and spread, GPipe, and interleaved 1F1B (v = 2). A config
without a placement takes the topology's. `ranking(rows)`: Spearman's ρ between the predicted and measured order and
the measured cost of the planner's top pick over the measured best.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
from pathlib import Path
from typing import Any

from pslab.collectives.topology import Topology
from pslab.parallelism.cluster import Cluster

BASE = ["workload.name=text-transformer", "train.strategy=allreduce", "train.lr=0.05", "train.optimizer=momentum",
        "train.timeout_s=120", "faults.on_failure=abort"]
BATCH = 8              # per data-parallel worker (workload.batch_size)
# 2 hosts x 2 ranks; inside a host 2 GB/s + 20 µs, between hosts 20 MB/s + 2 ms: slow enough that a layout's
# communication across it shows against the tiny model's ~30 ms of compute on this machine's 2 shared cores
DEFAULT_TOPOLOGY = Topology(hosts=2, per_host=2, intra_latency_s=20e-6, intra_bandwidth_Bps=2e9,
                            inter_latency_s=2e-3, inter_bandwidth_Bps=20e6)

# label -> layout (dp, tp, sp, pp, zero, micro_batches, schedule, overlap, virtual_stages) and placement; world
# size 4 each
DEFAULT_CONFIGS: list[dict[str, Any]] = [
    {"label": "dp=4", "dp": 4},
    {"label": "dp=2 x tp=2 packed", "dp": 2, "tp": 2, "placement": "packed"},
    {"label": "dp=2 x tp=2 spread", "dp": 2, "tp": 2, "placement": "spread"},
    {"label": "tp=4", "dp": 1, "tp": 4},
    {"label": "dp=2 x pp=2 m4 packed", "dp": 2, "pp": 2, "micro_batches": 4, "placement": "packed"},
    {"label": "dp=2 x pp=2 m4 spread", "dp": 2, "pp": 2, "micro_batches": 4, "placement": "spread"},
    {"label": "dp=4 overlap", "dp": 4, "overlap": True},
    {"label": "zero=1 dp=4", "dp": 4, "zero": 1},
    {"label": "zero=3 dp=4", "dp": 4, "zero": 3},
    {"label": "tp=2 x pp=2 m4 packed", "tp": 2, "pp": 2, "micro_batches": 4, "placement": "packed"},
    {"label": "tp=2 x pp=2 m4 spread", "tp": 2, "pp": 2, "micro_batches": 4, "placement": "spread"},
    {"label": "tp=2 sp x pp=2 packed", "tp": 2, "sp": True, "pp": 2, "micro_batches": 4, "placement": "packed"},
    {"label": "tp=2 sp x pp=2 spread", "tp": 2, "sp": True, "pp": 2, "micro_batches": 4, "placement": "spread"},
    {"label": "tp=2 x pp=2 gpipe", "tp": 2, "pp": 2, "micro_batches": 4, "schedule": "gpipe"},
    {"label": "tp=2 x pp=2 v2 packed", "tp": 2, "pp": 2, "micro_batches": 4, "virtual_stages": 2,
     "placement": "packed"},
    {"label": "dp=2 x pp=2 m4 dp,pp", "dp": 2, "pp": 2, "micro_batches": 4, "placement": "dp,pp"},
    {"label": "zero=3 dp=2 x tp=2", "dp": 2, "tp": 2, "zero": 3, "placement": "packed"},
]


class CheckError(ValueError):
    """A config the check cannot run (one line: which key, what it must be)."""


def _norm(c: dict[str, Any]) -> dict[str, Any]:
    known = {"label", "dp", "tp", "sp", "pp", "zero", "micro_batches", "schedule", "placement", "overlap",
             "virtual_stages"}
    unknown = sorted(set(c) - known)
    if unknown:
        raise CheckError(f"check config has unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    out = {"dp": 1, "tp": 1, "sp": False, "pp": 1, "zero": 0, "micro_batches": 1, "schedule": "1f1b",
           "placement": "packed", "overlap": False, "virtual_stages": 1, **c}
    if out["pp"] == 1:
        out["micro_batches"] = 1
    out.setdefault("label", f"dp={out['dp']} tp={out['tp']} pp={out['pp']} zero={out['zero']} {out['placement']}")
    return out


def overrides(c: dict[str, Any], topology: Topology, steps: int, batch: int = BATCH) -> list[str]:
    """`--set` overrides of one config's run (workload, layout, topology)."""
    c = _norm(c)

    def us(s: float) -> str:
        return f"{s * 1e6:.6g}"

    def gbps(b: float) -> str:
        return "0" if math.isinf(b) else f"{b / 1e9:.9g}"
    ov = BASE + [f"workload.batch_size={batch}", f"train.steps={steps}", "train.eval_every=1000000",
                 f"train.workers={c['dp']}", f"parallel.tp={c['tp']}", f"parallel.sp={str(c['sp']).lower()}",
                 f"parallel.pp={c['pp']}",
                 f"parallel.zero={c['zero']}", f"parallel.overlap={str(c['overlap']).lower()}",
                 f"topology.hosts={topology.hosts}", f"topology.gpus_per_host={topology.per_host}",
                 f"topology.placement={c['placement']}",
                 f"topology.intra_latency_us={us(topology.intra_latency_s)}",
                 f"topology.intra_bandwidth_GBps={gbps(topology.intra_bandwidth_Bps)}",
                 f"topology.inter_latency_us={us(topology.inter_latency_s)}",
                 f"topology.inter_bandwidth_GBps={gbps(topology.inter_bandwidth_Bps)}"]
    if c["pp"] > 1:
        ov += [f"parallel.micro_batches={c['micro_batches']}", f"parallel.schedule={c['schedule']}",
               f"parallel.virtual_stages={c['virtual_stages']}"]
    return ov


def shape_of(batch: int = BATCH, micro_batches: int = 1) -> Any:
    """The text-transformer workload's model as a planner Shape, micro-batch = batch / micro_batches."""
    from pslab.experiments.bench.calibrate import workload_shape
    if batch % micro_batches:
        raise CheckError(f"the per-worker batch {batch} must be divisible by micro_batches {micro_batches}")
    return workload_shape(batch // micro_batches)


def layout_of(c: dict[str, Any]) -> Any:
    from pslab.parallelism.memory_model import Layout
    c = _norm(c)
    return Layout(dp=c["dp"], tp=c["tp"], pp=c["pp"], zero=c["zero"], sp=c["sp"],
                  micro_batches=c["micro_batches"] if c["pp"] > 1 else 1, schedule=c["schedule"],
                  virtual_stages=c["virtual_stages"])


def predict_row(c: dict[str, Any], cluster: Cluster, batch: int = BATCH, steps: int | None = None) -> dict[str, Any]:
    """The planner's view of one config: the Prediction (as a dict) and its bytes per kind and per link (one-off
    bytes spread over `steps`, as a run's summary reports them)."""
    from pslab.parallelism import step_model
    from pslab.parallelism.comm_model import bytes_by_kind, bytes_by_link
    c = _norm(c)
    shape, layout = shape_of(batch, c["micro_batches"]), layout_of(c)
    p = step_model.predict(shape, layout, cluster, c["dp"] * batch, precision="fp32", placement=c["placement"],
                           algorithm="pslab", overlap=c["overlap"], steps=steps)
    kinds, links = bytes_by_kind(p.comm), bytes_by_link(p.comm)
    return {"prediction": p.as_dict(), "step_s": p.step_s, "bytes_by_kind": kinds, "bytes_by_link": links}


def run_config(c: dict[str, Any], topology: Topology, *, steps: int, root: str | Path,
               batch: int = BATCH) -> dict[str, Any]:
    """One real run of a config: measured step time, bytes by kind and by link (per step, all ranks)."""
    from pslab.experiments.config import load_config
    from pslab.experiments.runner import execute
    c = _norm(c)
    cfg = load_config(None, overrides(c, topology, steps, batch))
    rd = execute(cfg, root, label=c["label"], quiet=True)
    s = json.loads((rd.path / "summary.json").read_text())
    kinds = {k: float(v["measured_per_step"]) for k, v in (s.get("bytes_by_kind") or {}).items()
             if v.get("measured_per_step")}
    links = {k: float(v) for k, v in (s.get("link_bytes_per_step") or {}).items()}
    if not s.get("step_time_s"):
        raise CheckError(f"run {rd.path} has no step_time_s in its summary (too few steps?)")
    return {"step_s": float(s["step_time_s"]), "bytes_by_kind": kinds, "bytes_by_link": links, "run": str(rd.path)}


def _row(c: dict[str, Any], pred: dict[str, Any], runs: list[dict]) -> dict[str, Any]:
    meas = statistics.median(r["step_s"] for r in runs)
    mk, ml = runs[-1]["bytes_by_kind"], runs[-1]["bytes_by_link"]
    kinds = sorted(set(pred["bytes_by_kind"]) | set(mk))
    pk = {k: pred["bytes_by_kind"].get(k, 0.0) for k in kinds}
    mk = {k: mk.get(k, 0.0) for k in kinds}
    pl = pred["bytes_by_link"]
    return {"label": c["label"],
            "layout": {k: c[k] for k in ("dp", "tp", "sp", "pp", "zero", "micro_batches", "virtual_stages")},
            "placement": c["placement"], "predicted_s": pred["step_s"], "measured_s": meas,
            "measured_all_s": [r["step_s"] for r in runs], "ratio": pred["step_s"] / meas,
            "error_pct": abs(pred["step_s"] - meas) / meas * 100, "prediction": pred["prediction"],
            "planner_bytes_by_kind": pk, "measured_bytes_by_kind": mk,
            "planner_bytes_by_link": pl, "measured_bytes_by_link": ml,
            "bytes_equal": all(abs(pk[k] - mk[k]) < 0.5 for k in kinds)
            and (not ml or all(abs(pl.get(k, 0.0) - ml.get(k, 0.0)) < 0.5 for k in set(pl) | set(ml)))}


def check(cluster: Cluster, topology: Topology, configs: list[dict] | None = None, *, repeats: int = 3,
          steps: int = 30, progress: bool = True, batch: int = BATCH, root: str | Path | None = None) -> list[dict]:
    """Run each config `repeats` times under `topology` and put the planner's prediction next to the measurement.
    Rows: label, layout, placement, predicted_s, measured_s (median of repeats), measured_all_s, ratio
    (predicted/measured), error_pct, the prediction's breakdown, bytes by kind and by link (planner, measured),
    bytes_equal (every kind and link the same to the byte)."""
    from tqdm import tqdm
    place = getattr(topology, "placement", "packed")         # a config without one takes the topology's
    configs = [_norm({"placement": place, **c}) for c in (configs or DEFAULT_CONFIGS)]
    if repeats < 1 or steps < 4:
        raise CheckError("check needs repeats >= 1 and steps >= 4 (the first 2 steps are warm-up)")
    for c in configs:
        n = c["dp"] * c["tp"] * c["pp"]
        if n != topology.world_size:
            raise CheckError(f"config {c['label']!r} has {n} ranks but the topology {topology.hosts} x "
                             f"{topology.per_host} has {topology.world_size}; make dp·tp·pp equal hosts·per_host")
    tmp = None
    if root is None:
        tmp = tempfile.TemporaryDirectory(prefix="pslab-check-")
        root = tmp.name
    rows = []
    try:
        preds = [predict_row(c, cluster, batch, steps) for c in configs]
        runs: list[list[dict]] = [[] for _ in configs]
        with tqdm(total=len(configs) * repeats, desc="plan check", unit="run", disable=not progress) as bar:
            for _ in range(repeats):              # configs take turns: a drift in the machine's load hits all alike
                for c, out in zip(configs, runs):
                    bar.set_postfix_str(c["label"])
                    out.append(run_config(c, topology, steps=steps, root=root, batch=batch))
                    bar.update(1)
        for c, pred, rs in zip(configs, preds, runs):
            rows.append(_row(c, pred, rs))
    finally:
        if tmp is not None:
            tmp.cleanup()
    return rows


def _ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def ranking(rows: list[dict]) -> dict[str, Any]:
    """How well the planner orders the configs: Spearman's ρ between predicted and measured step times (the
    Pearson correlation of their ranks), and its top pick (the config it predicts fastest) against the measured
    best: `top_pick_excess` = measured(top pick) / measured(best) − 1 (0 when it picked the best)."""
    if len(rows) < 2:
        raise CheckError("a ranking needs at least 2 configs")
    rp, rm = _ranks([r["predicted_s"] for r in rows]), _ranks([r["measured_s"] for r in rows])
    mp, mm = statistics.fmean(rp), statistics.fmean(rm)
    cov = sum((a - mp) * (b - mm) for a, b in zip(rp, rm))
    var = math.sqrt(sum((a - mp) ** 2 for a in rp) * sum((b - mm) ** 2 for b in rm))
    pick = min(rows, key=lambda r: r["predicted_s"])
    best = min(rows, key=lambda r: r["measured_s"])
    return {"spearman": cov / var if var else None, "top_pick": pick["label"],   # None: one side all tied
            "top_pick_measured_s": pick["measured_s"], "best": best["label"], "best_measured_s": best["measured_s"],
            "top_pick_excess": pick["measured_s"] / best["measured_s"] - 1,
            "within_25pct": sum(r["error_pct"] <= 25 for r in rows), "configs": len(rows)}


def format_table(rows: list[dict]) -> str:
    """The check as text: one line per config (predicted, measured, ratio, error), then bytes per kind and link."""
    out = [f"{'config':<22} {'predicted ms':>12} {'measured ms':>12} {'ratio':>6} {'error':>7}  "
           f"{'compute':>8} {'bubble':>7} {'comm':>7} {'ovh':>6}  bytes"]
    for r in rows:
        p = r["prediction"]
        out.append(f"{r['label']:<22} {r['predicted_s'] * 1e3:>12.2f} {r['measured_s'] * 1e3:>12.2f} "
                   f"{r['ratio']:>6.2f} {r['error_pct']:>6.1f}%  {p.get('compute_s', 0) * 1e3:>8.2f} "
                   f"{p.get('bubble_s', 0) * 1e3:>7.2f} {p.get('exposed_comm_s', 0) * 1e3:>7.2f} "
                   f"{p.get('overhead_s', 0) * 1e3:>6.2f}  {'= measured' if r['bytes_equal'] else 'DIFFER'}")
    within = sum(r["error_pct"] <= 25 for r in rows)
    out.append(f"{within} of {len(rows)} configs within 25 % (compute/bubble/comm/ovh: the prediction's terms, ms; "
               "on shared cores bubble is what the replay adds: ranks taking turns, pipeline waits)")
    if len(rows) > 1:
        rk = ranking(rows)
        rho = "n/a (all tied)" if rk["spearman"] is None else f"{rk['spearman']:.2f}"
        out.append(f"ranking: Spearman ρ = {rho} (predicted vs measured order); the planner's top pick "
                   f"{rk['top_pick']!r} measured {rk['top_pick_measured_s'] * 1e3:.2f} ms, the measured best "
                   f"{rk['best']!r} {rk['best_measured_s'] * 1e3:.2f} ms (+{rk['top_pick_excess'] * 100:.1f} %)")
    out.append("")
    out.append("bytes per step, all ranks (planner / measured):")
    for r in rows:
        parts = [f"{k} {r['planner_bytes_by_kind'][k]:.0f}/{r['measured_bytes_by_kind'][k]:.0f}"
                 for k in r["planner_bytes_by_kind"]]
        ml = r["measured_bytes_by_link"]
        parts += [f"{k} link {r['planner_bytes_by_link'].get(k, 0):.0f}/{ml.get(k, 0):.0f}" for k in ("intra", "inter")]
        out.append(f"  {r['label']:<22} " + "; ".join(parts))
    return "\n".join(out)
