"""Why hardware topology dictates your parallelism layout: TP inside the node, PP across it, and 3D parallelism.
(The same section's larger scale — attention's quadratic memory, context and expert parallelism — is scale.py.)

TP vs PP across a slow link (real runs of the tiny transformer on 2 emulated hosts, collectives/topology.py; a
message of B bytes costs α + B/β on its link). Per step, T = 2, L blocks, m micro-batches, A = b·S·d·4 B:

    tensor parallel    4L all-reduces of A per rank (forward g, backward f, per attention and MLP): 4L·(α + A/β)
    pipeline parallel  m activations of A/m forward, m gradients back, per boundary: ≈ m·(α + (A/m)/β)·(m+p−1)/m

so TP puts 4L× more bytes and 4L/m× more messages on the link. Bandwidth-bound (β small: 4 MB/s, α = 0.1 ms) PP
across the slow link beats TP across it by about the bytes' ratio; latency-bound (α = 5 ms, β unlimited) only the
message counts matter: PP wins while m < 4L, and at m = 4L its edge is gone — the claim is about bytes, and holds
for real models, where 4L (hundreds) ≫ m. The planner's step = the same layout's measured step inside one host +
the link time parallelism/step_model.py (over comm_model.py) adds: exact for TP's blocking all-reduces, too much for
1F1B, which hides part of its sends behind compute — so its TP/PP ratio is a lower bound on the measured one.

3D (experiments/configs/3d.toml, dp 2 × tp 2 × pp 2 on 2 hosts × 4): bytes per step by kind and per link class, as
counted by the groups and the transports, equal the planner's (comm_model, algorithm "pslab") to the byte; the
placement decides which kind crosses the slow link: packed → dp, spread → tp, "tp,dp,pp" → pp.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

from pslab.experiments.config import example_config

from .core import Context, Figure, Modelled, Outcome, Step, kinds, pyplot, run_summary, save

SECTION = "Why hardware topology dictates your parallelism layout"
TIME_SLACK = 0.10           # step-time ratios against the planner's bound: the noise of medians of 3 runs here


# ---- shared helpers ------------------------------------------------------------------------------------------
def _cluster(topo: Any) -> Any:
    """The emulated topology as a planner Cluster with free compute: step_model then gives the link time alone."""
    from pslab.parallelism.cluster import Cluster
    return Cluster("emulated", topo.per_host, topo.hosts, 1e12, 1e30, 1.0, topo.intra_bandwidth_Bps,
                   topo.intra_latency_s, topo.inter_bandwidth_Bps, topo.inter_latency_s, 0.0, 0.0)


# ---- 1. TP inside the node, PP across it ----------------------------------------------------------------------
TP = {"label": "tp=2", "tp": 2}
PP4 = {"label": "pp=2 m=4", "pp": 2, "micro_batches": 4}
PP8 = {"label": "pp=2 m=8", "pp": 2, "micro_batches": 8}


def _regimes() -> dict[str, tuple[Any, list[dict[str, Any]]]]:
    from pslab.collectives.topology import Topology
    fast = {"intra_latency_s": 20e-6, "intra_bandwidth_Bps": 2e9}           # NVLink's role, scaled down
    return {"inside": (Topology(1, 2, **fast), [TP, PP4, PP8]),              # both ranks on one host
            "bandwidth": (Topology(2, 1, **fast, inter_latency_s=100e-6, inter_bandwidth_Bps=4e6), [TP, PP4]),
            "latency": (Topology(2, 1, **fast, inter_latency_s=5e-3), [TP, PP4, PP8])}


def tp_inside_node(ctx: Context) -> Outcome:
    from pslab.experiments.studies.plan_check import overrides, predict_row
    steps, reps = (6, 3) if ctx.quick else (10, 3)
    regimes = _regimes()
    times: dict[tuple[str, str], list[float]] = {}
    links: dict[tuple[str, str], dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="tour-tp-") as root:
        for rep in range(reps):                           # the layouts take turns: a drift in load hits all alike
            for name, (topo, cfgs) in regimes.items():
                for c in cfgs:
                    ctx.say(f"  {name}: {c['label']} (run {rep + 1}/{reps})")
                    s = run_summary(None, overrides(c, topo, steps) + [f"workload.seed={ctx.seed}"], root,
                                    f"{name} {c['label']}")
                    times.setdefault((name, c["label"]), []).append(float(s["step_time_s"]))
                    links[name, c["label"]] = s["link_bytes_per_step"]
    meas = {k: statistics.median(v) for k, v in times.items()}
    model = {(n, c["label"]): predict_row(c, _cluster(topo), steps=steps) for n, (topo, cfgs) in regimes.items()
             for c in cfgs}
    # predicted: the measured step inside one host + the link time the step model adds on the slow link
    pred = {k: meas["inside", k[1]] + model[k]["step_s"] - model["inside", k[1]]["step_s"] for k in model}

    def ratio(d: dict, regime: str, pp: str) -> float:
        return d[regime, TP["label"]] / d[regime, pp]
    rb, rl4, rl8 = (ratio(meas, "bandwidth", PP4["label"]), ratio(meas, "latency", PP4["label"]),
                    ratio(meas, "latency", PP8["label"]))
    pb, pl4, pl8 = (ratio(pred, "bandwidth", PP4["label"]), ratio(pred, "latency", PP4["label"]),
                    ratio(pred, "latency", PP8["label"]))
    tp_b, pp_b = links["bandwidth", TP["label"]]["inter"], links["bandwidth", PP4["label"]]["inter"]
    ms = lambda k: f"{meas[k] * 1e3:.0f} ms"                                  # noqa: E731
    _draw_regimes(ctx.picture("tp-inside-node"), regimes, meas, pred)
    return Outcome(
        figures=[
            Figure("slow-link bytes/step, TP across", tp_b, model["bandwidth", TP["label"]]["bytes_by_link"]["inter"],
                   "B", "=", 0.0, "transports' link counters, all ranks; planner (comm_model, 'pslab'): 4L all-"
                   "reduces of A = b·S·d·4 B per rank, direct exchange"),
            Figure("slow-link bytes/step, PP across", pp_b, model["bandwidth", PP4["label"]]["bytes_by_link"]["inter"],
                   "B", "=", 0.0, "counters; planner: 2·A per boundary (+ 4 B loss, the shape header / steps)"),
            Figure("bandwidth-bound: t(TP across)/t(PP across)", rb, pb, "×", ">=", TIME_SLACK,
                   "medians of 3 runs; planner: the step inside one host (measured) + the link time it adds, a lower "
                   "bound (it charges PP all its link time)", timed=True),
            Figure("bandwidth-bound: PP across beats TP across", rb, 1.0, "×", ">=", 0.0,
                   "the article's claim: TP's step over PP's step, ≥ 1", timed=True),
            Figure("latency-bound, m=4: t(TP across)/t(PP across)", rl4, pl4, "×", ">=", TIME_SLACK,
                   "medians of 3 runs; planner's bound as above (α = 5 ms, bandwidth unlimited)", timed=True),
            Figure("latency-bound, m=8: t(TP across)/t(PP across)", rl8, pl8, "×", ">=", TIME_SLACK,
                   "the same link, 8 micro-batches: PP's m messages per step ≥ TP's 4L = 8; planner's bound < 1",
                   timed=True),
        ],
        modelled=_h100_rows(),
        explanation=(
            f"The same 2-rank model split two ways over one slow link between two emulated hosts. Tensor "
            f"parallelism all-reduces the activations in every block: {tp_b / 1e3:.0f} kB per step cross the link in "
            f"8 messages per rank; pipeline parallelism sends only the boundary activation and its gradient: "
            f"{pp_b / 1e3:.0f} kB, {tp_b / pp_b:.0f}× fewer. Where the link's bandwidth dominates (4 MB/s), TP across "
            f"takes {ms(('bandwidth', TP['label']))} a step and PP across {ms(('bandwidth', PP4['label']))} "
            f"({rb:.1f}×; the planner, which charges the pipeline all of its link time, predicts at least "
            f"{pb:.1f}×); inside one host both take about {ms(('inside', TP['label']))}. Where latency dominates "
            f"(5 ms a message) bytes no longer matter, only messages: PP with 4 micro-batches still wins "
            f"({rl4:.1f}×, bound {pl4:.1f}×) because it sends fewer messages than TP's 4L = 8; with 8 micro-batches "
            f"it pays as many latencies as TP and the edge is gone ({rl8:.2f}×, bound {pl8:.2f}×). So TP belongs "
            f"inside the NVLink node, and PP tolerates the slow link because it moves few bytes — and on a real "
            f"model TP's 4L all-reduces per micro-batch (hundreds) dwarf any pipeline's m messages."),
        picture=str(ctx.picture("tp-inside-node")),
        notes=["bandwidth-bound: inter-host link 4 MB/s + 0.1 ms, so a 32 KiB TP message spends 8.2 ms on the wire "
               "and 0.1 ms in latency; latency-bound: 5 ms, bandwidth unlimited; inside: 2 GB/s + 20 µs (links "
               "scaled 10³–10⁴× below NVLink and InfiniBand so that they show against this CPU's compute)",
               "timing-based: each run's step time is the median step after 2 warm-up steps (slowest rank), each "
               "figure the median of 3 runs. The planner's ratio is a lower bound: TP's all-reduces block, so "
               "its link time is all on the critical path, as the step model charges it, while the step model also "
               "charges the pipeline all of its link time (×(m+p−1)/m) where 1F1B hides part of it behind the other "
               "stage's compute; observed here 5–45 % above the bound (10 % slack for run-to-run noise; 2 ranks "
               "share 2 cores, sleeps overshoot). The claim itself (PP across faster) is checked without slack",
               "bytes are counted per message by each rank's transport: exact"])


def _h100_rows() -> list[Modelled]:
    """The planner on two DGX H100 nodes: GPT-18B (Narayanan et al.) with tp = 8 inside a node vs across the two."""
    from pslab.parallelism import step_model
    from pslab.parallelism.cluster import preset
    from pslab.parallelism.memory_model import Layout, Shape
    c, shape = preset("dgx-h100", nodes=2), Shape(40, 6144, 48, 2048, 51200, 1)
    step = {pl: step_model.predict(shape, Layout(dp=2, tp=8), c, 16, placement=pl).step_s
            for pl in ("packed", "spread")}
    return [Modelled("GPT-18B, 2 DGX H100, tp=8 inside a node", step["packed"], "s/step",
                     "step_model.predict, dp=2 × tp=8, global batch 16, placement packed (NVLink 450 GB/s)"),
            Modelled("the same, tp=8 across the two nodes", step["spread"], "s/step",
                     "placement spread: every TP all-reduce on InfiniBand (50 GB/s per GPU)")]


def _draw_regimes(path: Path, regimes: dict, meas: dict, pred: dict) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [TP["label"], PP4["label"], PP8["label"]]
    colors = {TP["label"]: "tab:red", PP4["label"]: "tab:blue", PP8["label"]: "tab:cyan"}
    for i, name in enumerate(regimes):
        for j, lab in enumerate(labels):
            if (name, lab) not in meas:
                continue
            x = i + (j - 1) * 0.27
            ax.bar(x, meas[name, lab] * 1e3, 0.25, color=colors[lab], label=lab if i == 0 else None)
            ax.plot([x], [pred[name, lab] * 1e3], "k_", markersize=18, label="predicted" if (i, j) == (1, 0) else None)
    ax.set_xticks(range(len(regimes)), ["inside one host", "across: bandwidth-bound\n(4 MB/s)",
                                        "across: latency-bound\n(5 ms)"])
    ax.set_ylabel("step time (ms, median of 3 runs)")
    ax.set_title("the same model split by tensor vs pipeline over one link")
    ax.legend()
    save(fig, path)


# ---- 2. 3D parallelism ------------------------------------------------------------------------------------------
PLACEMENTS = ("packed", "spread", "tp,dp,pp")
FAST_INTER = ["topology.inter_latency_us=20", "topology.inter_bandwidth_GBps=2"]   # the inter link = the intra one


def three_d(ctx: Context) -> Outcome:
    from pslab.experiments.config import load_config
    from pslab.experiments.studies.plan_check import predict_row
    steps, reps = (10, 1) if ctx.quick else (10, 3)     # a median of 8 steps: one run of 5 swung ±10 % under load
    base = [f"train.steps={steps}", "train.eval_every=1000000", f"workload.seed={ctx.seed}"]
    runs = {"packed": [], "spread": [], "tp,dp,pp": [], "fast": []}
    with tempfile.TemporaryDirectory(prefix="tour-3d-") as root:
        for rep in range(reps):
            for label in ("packed", "spread", "fast") + (("tp,dp,pp",) if rep == 0 else ()):
                ctx.say(f"  3d {label} (run {rep + 1}/{reps})")
                ov = base + (FAST_INTER if label == "fast" else [f"topology.placement={label}"])
                runs[label].append(run_summary(example_config("3d"), ov, root, label))
    cfg = load_config(example_config("3d"), base)
    topo, fast = cfg.topology.build(cfg.parallel, cfg.train.workers), load_config(example_config("3d"), base + FAST_INTER)
    layout = {"dp": cfg.train.workers, "tp": cfg.parallel.tp, "pp": cfg.parallel.pp,
              "micro_batches": cfg.parallel.micro_batches, "schedule": cfg.parallel.schedule}
    model = {pl: predict_row({**layout, "placement": pl}, _cluster(topo), steps=steps) for pl in PLACEMENTS}
    m_fast = predict_row({**layout, "placement": "packed"}, _cluster(fast.topology.build()), steps=steps)
    by_kind = kinds(runs["packed"][0])
    t = {k: statistics.median(float(s["step_time_s"]) for s in v) for k, v in runs.items()}
    pred = {pl: t["fast"] + model[pl]["step_s"] - m_fast["step_s"] for pl in PLACEMENTS}
    inter = {pl: float(runs[pl][0]["link_bytes_per_step"]["inter"]) for pl in PLACEMENTS}
    names = {"dp gradient sync": "dp", "tp activations": "tp", "pp boundaries": "pp"}
    figs = [Figure(f"{short} bytes/step ({kind})", by_kind[kind], model["packed"]["bytes_by_kind"][kind], "B", "=", 0.0,
                   "groups' counters, all ranks; planner comm_model ('pslab')") for kind, short in names.items()]
    figs += [Figure(f"{pl}: bytes/step over the slow link", inter[pl], model[pl]["bytes_by_link"]["inter"], "B", "=",
                    0.0, "transports' link counters; planner, same placement") for pl in PLACEMENTS]
    figs += [Figure("packed: bytes/step inside hosts", float(runs["packed"][0]["link_bytes_per_step"]["intra"]),
                    model["packed"]["bytes_by_link"]["intra"], "B", "=", 0.0, "counters; planner"),
             Figure("step time, TP across (spread) / TP inside (packed)", t["spread"] / t["packed"], 1.0, "×", ">=",
                    0.0, f"median of {reps} run(s); the article's claim: TP across the slow link is slower",
                    timed=True),
             Figure("the same ratio, at most the planner's", t["spread"] / t["packed"],
                    pred["spread"] / pred["packed"], "×", "<=", TIME_SLACK,
                    "planner: the all-fast-links step (measured) + the link time it adds, an upper bound here",
                    timed=True)]
    _draw_3d(ctx.picture("3d"), runs, model)
    return Outcome(
        figures=figs,
        explanation=(
            f"dp 2 × tp 2 × pp 2 = 8 real ranks on two emulated hosts of four. Every step moves "
            f"{by_kind['tp activations'] / 1e3:.0f} kB of tensor-parallel activations, "
            f"{by_kind['pp boundaries'] / 1e3:.0f} kB across pipeline boundaries and "
            f"{by_kind['dp gradient sync'] / 1e3:.0f} kB of gradient sync — each exactly the planner's figure. The "
            f"placement only decides which of them crosses the slow link: packed (a data-parallel replica per host) "
            f"sends only the dp sync across ({inter['packed'] / 1e3:.0f} kB), Megatron's order tp,dp,pp (a pipeline "
            f"stage per host) only the pp boundaries ({inter['tp,dp,pp'] / 1e3:.0f} kB), spread every tp all-reduce "
            f"({inter['spread'] / 1e3:.0f} kB in 16 latency-bound exchanges per stage). The step times follow: "
            f"packed {t['packed'] * 1e3:.0f} ms, tp,dp,pp {t['tp,dp,pp'] * 1e3:.0f} ms, spread "
            f"{t['spread'] * 1e3:.0f} ms ({t['spread'] / t['packed']:.1f}×; the planner, which adds link time to "
            f"compute that here partly hides under the waits, says at most {pred['spread'] / pred['packed']:.1f}×). "
            f"That is the 3D layout's rule: tensor parallelism inside the node; pipeline and data parallelism may "
            f"cross."),
        picture=str(ctx.picture("3d")),
        notes=[f"links: {cfg.topology.describe()}; 'all fast' sets the inter link to the intra one (the compute "
               "baseline of the prediction)",
               "timing-based: the spread/packed ratio. The planner adds each placement's link time to the compute; "
               "here 8 ranks share 2 cores and a rank waiting on the link lends its core to another, so part of the "
               "compute hides under the waits — most under spread's long ones — and the planner's ratio is an "
               "upper bound (observed 1–35 % below it; 10 % slack for run-to-run noise). The tp,dp,pp time is one "
               "run, reported, not a figure",
               "bytes: exact counters (kinds by each process group, links by each rank's transport)"])


def _draw_3d(path: Path, runs: dict, model: dict) -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    xs = range(len(PLACEMENTS))
    for k, (cls, col) in enumerate((("intra", "tab:green"), ("inter", "tab:red"))):
        a.bar([x + (k - 0.5) * 0.38 for x in xs], [runs[p][0]["link_bytes_per_step"][cls] / 1e3 for p in PLACEMENTS],
              0.36, color=col, label=f"{cls} host (measured)")
        a.plot([x + (k - 0.5) * 0.38 for x in xs], [model[p]["bytes_by_link"][cls] / 1e3 for p in PLACEMENTS], "k_",
               markersize=16, label="planner" if k else None)
    a.set_xticks(list(xs), PLACEMENTS)
    a.set_ylabel("kB per step, all ranks")
    a.set_title("bytes per link class")
    a.legend(fontsize=8)
    med = [statistics.median(s["step_time_s"] for s in runs[p]) * 1e3 for p in PLACEMENTS]
    b.bar(list(xs), med, color=["tab:green", "tab:red", "tab:blue"])
    b.set_xticks(list(xs), ["packed\n(dp across)", "spread\n(tp across)", "tp,dp,pp\n(pp across)"])
    b.set_ylabel("step time (ms)")
    b.set_title("dp 2 × tp 2 × pp 2 on 2 hosts × 4")
    save(fig, path)


STEPS = [
    Step("tp-inside-node", SECTION, "Tensor parallelism communicates in every layer, so keep it inside the NVLink "
         "node; pipeline parallelism only at stage boundaries, so it tolerates the slower links between servers",
         "pslab plan --calibrate here.json --check --repeats 3", tp_inside_node, 40),
    Step("3d", SECTION, "3D parallelism: tensor parallelism within a node, pipeline across groups of nodes, data "
         "parallelism as the outer loop", "pslab run 3d --set topology.placement=spread", three_d, 60),
]
