"""`pslab plan`: the 3D-layout planner — every (dp, tp, pp, cp, ZeRO, micro-batch size and count, recompute)
layout of a transformer on a cluster, memory per GPU and step time modelled (`parallelism.planner`,
`parallelism.step_model`), the ones that fit ranked by step time, and the winner explained in words.

    pslab plan --model gpt-145b                          # Narayanan et al. 2021's 145.6B on 1536 A100s, batch 2304
    pslab plan --layers 32 --hidden 4096 --heads 32 --seq 2048 --vocab 51200 --nodes 4 --global-batch 512
    pslab plan --model gpt-1t --top 5 --plot plan.png    # stacked bars: compute, bubble, TP, PP, DP, overhead
    pslab plan --model gpt-18b --cluster dgx-h100 --nodes 8 --json
    pslab plan --published                               # every Table 1 row: the paper's layout vs the planner's
    pslab plan --calibrate here.json                     # measure this machine (compute, emulated links)
    pslab plan --check --cluster here.json               # predicted vs measured step time of real runs here

Model: a shape (--layers --hidden --heads --seq --vocab; GPT-style, ffn 4h, learned positions, untied head) or a
published one, --model gpt-1.7b | gpt-3.6b | gpt-7.5b | gpt-18b | gpt-39b | gpt-76b | gpt-145b | gpt-310b |
gpt-530b | gpt-1t: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21, arXiv:2104.04473), Table 1 — heads / hidden / layers, sequence 2048, vocabulary 51200, and
the run's GPUs and global batch as defaults (the paper's tp / pp / achieved TFLOP/s per GPU in --published).

Cluster: --cluster a preset (dgx-a100-80gb, dgx-h100, hgx-h200: parallelism/cluster.py) or a JSON file (what
--calibrate writes); --nodes N nodes (default: the preset's 1, or enough for a --model's GPUs); --gpus G of them
(default all). A preset's compute is efficiency 0.5 x peak: an assumption, not a measurement.

Search: --max-tp, --zero 0,1,2,3, --recompute none,selective,full, --schedules 1f1b[,gpipe], --cp 1[,2,4],
--virtual-stages 1[,2,4] (interleaved 1F1B),
--micro-batch-sizes 1,2,4,8; SP goes with every tp > 1 (--no-sp: never); placement packed (tp innermost: a tp
group inside a node). Megatron-LM's knobs of 2021: --zero 0 --recompute full --no-sp.

Exit status: 0; 1 for bad input (one line on stderr) or when no layout fits (the leanest layout's memory is
printed); 2 for a malformed command line.

--published: one efficiency for every row, the A100 preset's 0.5 (not fitted to the table): the paper's own layout
(its tp, pp, dp; ZeRO 0, no SP, full recompute, 1F1B, the fastest micro-batch size 1-8 that fits) and the
planner's best, predicted TFLOP/s per GPU (eq. (3), the paper's count) next to the reported one.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pslab.experiments.errors import ConfigError

DEFAULT_CLUSTER = "dgx-a100-80gb"
DEFAULT_CALIBRATION = "calibration.json"
MAX_PLOT = 8


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="the 3D-layout planner: every dp/tp/pp/ZeRO/micro-batch/recompute layout of a "
                       "model on a cluster, ranked by modelled step time, explained", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model (a published one, or a transformer shape)")
    m.add_argument("--model", default=None, metavar="NAME", help="a Narayanan et al. 2021 Table 1 model: gpt-1.7b "
                   "... gpt-1t (sets the shape, and defaults for --nodes, --gpus, --global-batch)")
    for k, h in (("layers", "L"), ("hidden", "h"), ("heads", "a"), ("seq", "s"), ("vocab", "v")):
        m.add_argument(f"--{k}", type=int, default=None, help=f"transformer shape: {h}")
    c = p.add_argument_group("cluster and batch")
    c.add_argument("--cluster", default=None, metavar="PRESET|FILE.json",
                   help=f"a preset (dgx-a100-80gb, dgx-h100, hgx-h200) or a cluster JSON file (default "
                   f"{DEFAULT_CLUSTER})")
    c.add_argument("--nodes", type=int, default=None, help="nodes of the cluster (default: the preset's, or enough "
                   "for --model's GPUs)")
    c.add_argument("--gpus", type=int, default=None, help="GPUs to plan for (default: all of the cluster's)")
    c.add_argument("--global-batch", type=int, default=None, help="sequences per step (dp x m x b); required with a "
                   "shape")
    c.add_argument("--precision", default="mixed", help="fp32 | mixed | bf16-pure | fp32-sgd | fp32-sgd0 "
                   "(default mixed)")
    s = p.add_argument_group("search")
    s.add_argument("--max-tp", type=int, default=None, help="largest tp degree to consider (default: any)")
    s.add_argument("--zero", default="0,1,2,3", help="ZeRO stages to consider (default 0,1,2,3)")
    s.add_argument("--recompute", default="none,selective,full", help="recompute modes (default all three)")
    s.add_argument("--schedules", default="1f1b", help="pipeline schedules: 1f1b and/or gpipe (default 1f1b)")
    s.add_argument("--cp", default="1", help="context-parallel degrees to consider (default 1)")
    s.add_argument("--virtual-stages", default="1", help="model chunks per pipeline stage to consider: v > 1 is "
                   "interleaved 1F1B, bubble (p-1)/(v*m+p-1) for (p*v-1)/(p-1) times the boundary traffic (default 1)")
    s.add_argument("--micro-batch-sizes", default="1,2,4,8", help="micro-batch sizes b (default 1,2,4,8)")
    s.add_argument("--no-sp", action="store_true", help="no sequence parallelism (default: SP with every tp > 1)")
    o = p.add_argument_group("output")
    o.add_argument("--top", type=int, default=10, help="layouts to show (default 10)")
    o.add_argument("--json", action="store_true", help="print JSON instead of tables")
    o.add_argument("--plot", default=None, metavar="FILE.png", help="stacked bars of the best layouts' step time")
    o.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    x = p.add_argument_group("published runs, calibration, check")
    x.add_argument("--published", action="store_true", help="Table 1 of Narayanan et al. 2021 (or --model's row): "
                   "the paper's layout and TFLOP/s next to the planner's")
    x.add_argument("--calibrate", nargs="?", const=DEFAULT_CALIBRATION, default=None, metavar="FILE",
                   help=f"measure this machine (compute rate, per-step overhead, each emulated link's latency and "
                   f"bandwidth) and write the cluster JSON to FILE (default {DEFAULT_CALIBRATION})")
    x.add_argument("--check", action="store_true", help="run layouts here under the emulated topology and put the "
                   "planner's predicted step time and bytes next to the measured ones (cluster: --calibrate's, or "
                   "--cluster FILE)")
    x.add_argument("--topology", default=None, metavar="JSON|FILE", help="with --calibrate / --check: the emulated "
                   "topology (collectives.topology.Topology JSON; default 2 hosts x 2 ranks, slow inter link)")
    x.add_argument("--repeats", type=int, default=3, help="with --check: runs per config (default 3)")
    x.add_argument("--steps", type=int, default=30, help="with --check: training steps per run (default 30; the "
                   "measured step is the median after 2 warm-up steps)")
    p.set_defaults(func=run)


# ---- inputs ----------------------------------------------------------------------------------------------------

def _ints(text: str, flag: str, low: int = 1) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in str(text).split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"{flag} must be a comma-separated list of integers, got {text!r}") from None
    if not out or min(out) < low:
        raise ConfigError(f"{flag} must be a non-empty list of integers >= {low}, got {text!r}")
    return out


def _words(text: str, flag: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    out = tuple(v.strip() for v in str(text).split(",") if v.strip())
    bad = [v for v in out if v not in allowed]
    if bad or not out:
        raise ConfigError(f"{flag} must be a comma-separated subset of {', '.join(allowed)}, got {text!r}")
    return out


def _published(name: str) -> Any:
    from pslab.parallelism.published import PUBLISHED
    if name not in PUBLISHED:
        raise ConfigError(f"unknown --model {name!r}; choose one of: {', '.join(PUBLISHED)}")
    return PUBLISHED[name]


def _shape(args: argparse.Namespace) -> Any:
    from pslab.parallelism.memory_model import Shape
    dims = [args.layers, args.hidden, args.heads, args.seq, args.vocab]
    if args.model is not None:
        if any(v is not None for v in dims):
            raise ConfigError("give --model or a shape (--layers ...), not both")
        return _published(args.model).shape()
    if any(v is None for v in dims):
        raise ConfigError("give a model: --model NAME, or all of --layers --hidden --heads --seq --vocab")
    if min(dims) < 1:
        raise ConfigError("--layers, --hidden, --heads, --seq and --vocab must be >= 1")
    if args.hidden % args.heads:
        raise ConfigError(f"--heads {args.heads} must divide --hidden {args.hidden}")
    return Shape(*dims)


def _cluster(args: argparse.Namespace, need_gpus: int | None = None) -> Any:
    from pslab.parallelism.cluster import PRESETS, Cluster, ClusterError, preset
    name = args.cluster or DEFAULT_CLUSTER
    if args.nodes is not None and args.nodes < 1:
        raise ConfigError(f"--nodes must be >= 1, got {args.nodes}")
    try:
        if name in PRESETS:
            c = preset(name)
        elif name.endswith(".json") or Path(name).exists():
            path = Path(name)
            if not path.is_file():
                raise ConfigError(f"--cluster {name}: no such file (a preset: {', '.join(PRESETS)})")
            c = Cluster.from_json(path.read_text())
        else:
            c = preset(name)             # raises: unknown cluster, with the presets listed
        if args.nodes is not None:
            c = c.with_(nodes=args.nodes)
        elif need_gpus is not None and c.gpus < need_gpus:
            c = c.with_(nodes=-(-need_gpus // c.gpus_per_node))
    except ClusterError as e:
        raise ConfigError(str(e)) from None
    return c


def _options(args: argparse.Namespace) -> dict[str, Any]:
    zero = _ints(args.zero, "--zero", low=0)
    if max(zero) > 3:
        raise ConfigError(f"--zero must list ZeRO stages 0, 1, 2 or 3, got {args.zero!r}")
    return dict(zero=zero,
                recompute=_words(args.recompute, "--recompute", ("none", "selective", "full")),
                schedules=_words(args.schedules, "--schedules", ("1f1b", "gpipe")),
                cp=_ints(args.cp, "--cp"), micro_batch_sizes=_ints(args.micro_batch_sizes, "--micro-batch-sizes"),
                sp=not args.no_sp, virtual_stages=_ints(args.virtual_stages, "--virtual-stages"))


# ---- the command -----------------------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> int:
    from pslab.parallelism.memory_model import MemoryModelError
    if args.top < 1:
        raise ConfigError(f"--top must be >= 1, got {args.top}")
    try:
        if args.calibrate is not None or args.check:
            return _run_calibrate_check(args)
        if args.published:
            return _run_published(args)
        return _run_plan(args)
    except MemoryModelError as e:          # PlanError, StepModelError, CommModelError derive from it
        raise ConfigError(str(e)) from None


def _run_plan(args: argparse.Namespace) -> int:
    from pslab.parallelism.planner import breakdown, describe, explain, micro_batch, plan
    shape = _shape(args)
    row = _published(args.model) if args.model else None
    cluster = _cluster(args, need_gpus=(args.gpus or row.gpus) if row else None)
    gpus = args.gpus if args.gpus is not None else (row.gpus if row and args.nodes is None else cluster.gpus)
    batch = args.global_batch if args.global_batch is not None else (row.batch if row else None)
    if batch is None:
        raise ConfigError("--global-batch is required with a shape (sequences per step: dp x m x b)")
    ranked = plan(shape, cluster, batch, precision=args.precision, gpus=gpus, max_tp=args.max_tp,
                  progress=not (args.quiet or args.json), **_options(args))
    text = explain(ranked, cluster)
    top = ranked[:args.top]
    if args.plot and top:
        plot(top, args.plot, f"{args.model or 'model'} on {gpus} x {cluster.name}, batch {batch}")
    if args.json:
        print(json.dumps({
            "model": asdict(shape) | {"params": shape.params(), "name": args.model},
            "cluster": json.loads(cluster.to_json()), "gpus": gpus, "global_batch": batch,
            "precision": args.precision, "enumerated": ranked.enumerated, "predicted": ranked.predicted,
            "feasible": len(ranked), "elapsed_s": ranked.elapsed_s, "explanation": text,
            "top": [{**p.as_dict(), "rank": i + 1, "layout": describe(p), "micro_batch": micro_batch(p),
                     "breakdown_s": breakdown(p)} for i, p in enumerate(top)]}, default=_json_default))
        return 0 if ranked else 1
    print(f"model: {shape.layers} layers, hidden {shape.hidden}, {shape.heads} heads, seq {shape.seq}, vocab "
          f"{shape.vocab}: {shape.params() / 1e9:.3g}B parameters" + (f" ({args.model})" if args.model else ""))
    print(f"cluster: {cluster.name}, {gpus} of {cluster.gpus} GPUs ({cluster.nodes} nodes x {cluster.gpus_per_node}), "
          f"{cluster.gpu_memory_bytes / 1e9:.0f} GB, {cluster.flops / 1e12:.0f} TFLOP/s achieved per GPU "
          f"({cluster.efficiency:g} x {cluster.peak_flops / 1e12:.0f}); global batch {batch}, {args.precision}")
    print(f"{ranked.enumerated} layouts enumerated, {len(ranked)} fit, in {ranked.elapsed_s:.2f} s\n")
    if ranked:
        print(table(top))
        print()
    print(text)
    if args.plot and top:
        print(f"\nplot: {args.plot}")
    return 0 if ranked else 1


def _json_default(o: Any) -> Any:
    if isinstance(o, float) and math.isinf(o):
        return None
    return str(o)


def table(preds: list) -> str:
    from pslab.parallelism.planner import PARTS, breakdown, describe, fmt_seconds
    short = {"compute": "comp", "bubble": "bubble", "TP": "TP", "PP": "PP", "DP exposed": "DP", "other comm": "cp/ep",
             "overhead": "ovh"}
    names = [describe(p) for p in preds]
    w = max(28, max(len(n) for n in names) + 1)
    head = f"{'#':>3} {'layout':<{w}}{'mem/GPU':>9}{'step':>10}{'TFLOP/s':>9}  " + "".join(f"{short[k]:>7}"
                                                                                     for k in PARTS)
    lines = [head, f"{'':>3} {'':<{w}}{'':>9}{'':>10}{'per GPU':>9}  " + "time share".rjust(7 * len(PARTS))]
    for i, (p, n) in enumerate(zip(preds, names), 1):
        bd = breakdown(p)
        step = p.step_s
        cells = "".join(f"{100 * bd[k] / step:>6.1f}%" for k in PARTS)
        lines.append(f"{i:>3} {n:<{w}}{p.memory_bytes / 1e9:>7.1f}GB{fmt_seconds(step):>10}{p.tflops_per_gpu:>9.0f}  {cells}")
    return "\n".join(lines)


def plot(preds: list, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from pslab.parallelism.planner import PARTS, breakdown, describe
    preds = preds[:MAX_PLOT]
    fig, ax = plt.subplots(figsize=(max(7, 1.5 * len(preds) + 2), 4.8))
    names = [describe(p).replace(" b=", "\nb=") for p in preds]
    bottom = [0.0] * len(preds)
    bds = [breakdown(p) for p in preds]
    colours = dict(zip(PARTS, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
                               "tab:gray")))          # one colour per part, whichever parts a picture has
    for k in PARTS:
        vals = [bd[k] for bd in bds]
        if any(vals):
            ax.bar(range(len(preds)), vals, bottom=bottom, label=k, color=colours[k])
            bottom = [b + v for b, v in zip(bottom, vals)]
    for i, p in enumerate(preds):
        ax.annotate(f"{p.tflops_per_gpu:.0f} TFLOP/s", (i, bottom[i]), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(preds)), names, fontsize=7)
    ax.set_ylabel("seconds per step")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---- --published ---------------------------------------------------------------------------------------------

def _run_published(args: argparse.Namespace) -> int:
    from pslab.parallelism.published import PUBLISHED, compare_published
    from tqdm import tqdm
    rows = [_published(args.model)] if args.model else list(PUBLISHED.values())
    out = []
    for r in tqdm(rows, desc="pslab plan --published", unit="run", disable=args.quiet or args.json, file=sys.stderr):
        cluster = _cluster(args, need_gpus=r.gpus) if (args.cluster or args.nodes) else None
        out.append(compare_published(r, cluster))
    if args.json:
        print(json.dumps({"rows": out, "source": SOURCE}))
        return 0
    print(SOURCE)
    print(f"{'':<10}{'':>6}{'':>6}  {'paper':<22}  {'paper layout':>14}  {'planner, Megatron-2021 knobs':<30}"
          f"  planner, every knob")
    print(f"{'model':<10}{'GPUs':>6}{'batch':>6}  {'tp/pp/dp':<12}{'TFLOP/s':>10}  {'predicted':>14}  "
          f"{'tp/pp/dp':<12}{'TFLOP/s':>10}{'':>8}  {'layout':<46}{'TFLOP/s':>8}")
    for d in out:
        pa, own, meg, best = d["paper"], d["paper_layout"], d["planner_megatron"], d["planner_best"]
        own_s = (f"{own['tflops_per_gpu']:.0f} ({own['tflops_per_gpu'] / pa['tflops_per_gpu'] - 1:+.0%})"
                 if own else "does not fit")
        meg_s = (f"{_degrees(meg):<12}{meg['tflops_per_gpu']:>10.0f}"
                 + ("  = paper" if (meg["tp"], meg["pp"], meg["dp"]) == (pa["tp"], pa["pp"], pa["dp"]) else
                    f"{'':>8}") if meg else f"{'none fits':<30}")
        best_s = f"{best['layout']:<46}{best['tflops_per_gpu']:>8.0f}" if best else "none fits"
        print(f"{d['model']:<10}{d['gpus']:>6}{d['batch']:>6}  {_degrees(pa):<12}"
              f"{pa['tflops_per_gpu']:>10.0f}  {own_s:>14}  {meg_s:<30}  {best_s}")
    print(f"\nefficiency {out[0]['efficiency']:g} of {out[0]['peak_tflops']:.0f} TFLOP/s peak for every row (the "
          f"{DEFAULT_CLUSTER} preset's assumption, not fitted). Megatron-2021 knobs: ZeRO 0, full recompute, no SP, "
          f"1F1B (tp, pp, dp, b free); every knob: ZeRO 0-3, recompute none/selective/full, SP. TFLOP/s per GPU: "
          f"eq. (3)'s FLOPs for the layout's own recompute / predicted step time / GPUs (full recompute: eq. (3) "
          f"itself, the paper's count).")
    return 0


def _degrees(d: dict) -> str:
    return f"{d['tp']}/{d['pp']}/{d['dp']}"


SOURCE = ("Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM' "
          "(SC'21, arXiv:2104.04473), Table 1: GPT, seq 2048, vocab 51200, A100 80 GB (Selene, 8 GPUs/node).")


# ---- --calibrate / --check -----------------------------------------------------------------------------------

def _topology(args: argparse.Namespace) -> Any:
    from pslab.collectives.topology import Topology, TopologyError
    text = args.topology
    if text is None:
        from pslab.experiments.studies.plan_check import DEFAULT_TOPOLOGY
        return DEFAULT_TOPOLOGY
    if not text.lstrip().startswith("{"):
        path = Path(text)
        if not path.is_file():
            raise ConfigError(f"--topology {text}: neither a JSON object nor a file")
        text = path.read_text()
    try:
        return Topology.from_json(text)
    except TopologyError as e:
        raise ConfigError(str(e)) from None


def _run_calibrate_check(args: argparse.Namespace) -> int:
    topo = _topology(args)
    progress = not (args.quiet or args.json)
    out: dict[str, Any] = {}
    cluster = None
    if args.check and args.repeats < 1:             # before a calibration's minutes, not after
        raise ConfigError(f"--repeats must be >= 1, got {args.repeats}")
    if args.check and args.steps < 4:
        raise ConfigError(f"--steps must be >= 4 (2 warm-up steps, then the measured ones), got {args.steps}")
    if args.calibrate is not None:
        from pslab.experiments.bench.calibrate import calibrate
        cluster = calibrate(topo, progress=progress)
        Path(args.calibrate).write_text(cluster.to_json() + "\n")
        out["calibration"] = json.loads(cluster.to_json())
        out["calibration_file"] = args.calibrate
        if not args.json:
            print(f"calibrated ({topo.hosts} hosts x {topo.per_host} ranks): {cluster.peak_flops / 1e9:.3g} GFLOP/s "
                  f"per {'core' if cluster.shared_cores else 'rank'}, overhead {cluster.step_overhead_s * 1e3:.2f} ms/step + "
                  f"{cluster.micro_batch_overhead_s * 1e3:.2f} ms per micro-batch; intra {_link(cluster, 'intra')}; "
                  f"inter {_link(cluster, 'inter')}"
                  + (f"; {topo.world_size} ranks share {cluster.shared_cores} cores (costs per core: the step model "
                     f"replays the ranks taking turns)" if cluster.shared_cores else "")
                  + f" -> {args.calibrate}")
    if args.check:
        from pslab.experiments.studies.plan_check import check, format_table
        from pslab.parallelism.cluster import PRESETS
        if cluster is None:
            if not args.cluster or args.cluster in PRESETS:
                raise ConfigError("--check needs a calibration of this machine: add --calibrate [FILE], or give "
                                  "--cluster FILE.json written by it")
            cluster = _cluster(args)
        rows = check(cluster, topo, repeats=args.repeats, steps=args.steps, progress=progress)
        out["check"] = rows
        if len(rows) > 1:
            from pslab.experiments.studies.plan_check import ranking
            out["ranking"] = ranking(rows)
        if not args.json:
            print(format_table(rows))
    if args.json:
        print(json.dumps(out, default=_json_default))
    return 0


def _link(c: Any, kind: str) -> str:
    lat, bw = c.link(kind)
    return f"{lat * 1e6:.0f} µs + B / " + ("inf" if math.isinf(bw) else f"{bw / 1e6:.3g} MB/s")
