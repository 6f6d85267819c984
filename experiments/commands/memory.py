"""`pslab memory`: bytes per GPU of a training layout — parameters, gradients, optimizer state, activations —
every term with its formula and source (`parallelism.memory_model`), and measured on this machine with --measure.

    pslab memory --params 70e9                              # the article's 70B: ≈16 B/param ≈ 1.12 TB, what fits
    pslab memory --params 7.5e9 --zero 3 --dp 64            # the ZeRO paper's example: 1.88 GB per GPU
    pslab memory --layers 96 --hidden 12288 --heads 96 --seq 2048 --vocab 51200 --tp 8 --pp 8 --sp \\
                 --recompute selective --json               # GPT-3 175B, Korthikanti et al.'s layout
    pslab memory --params 70e9 --plot mem.png               # stacked bars of a few layouts side by side
    pslab memory --measure                                  # the engines here: measured vs modelled, per rank,
                                                            # and attention's saved bytes over S (naive vs flash)

Precisions: fp32 (4+4+8 B/param with Adam), mixed (2+2+12: bf16 weights/grads, fp32 master + moments), bf16-pure
(2+2+4), fp32-sgd (4+4+4), fp32-sgd0 (4+4+0). --measure runs the text-transformer workload (fp32, Adam) through
the real engines (`experiments.strategies.build`, 1 to 8 local processes each; the model and layout flags do not
apply: it always meters the tiny text-transformer; a subset: --configs "tp=2 pp=2,cp=2") and meters each rank: parameters,
gradients and optimizer state as the bytes of the distinct tensor storages the rank holds (its slots' tensors and
.grad, the optimizer's `state` tensors, ZeRO's flat shards via `ZeroReplica.state_bytes`), the activations as
`parallelism.checkpointing.ActivationMeter`'s peak of tensors autograd saved during one step.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pslab.experiments.errors import ConfigError

GPU_SIZES = (80e9, 141e9)
TP_TOML, MOE_TOML = "transformer_tp.toml", "moe_ep.toml"
MEASURE = {   # label: (experiments/configs/ file, overrides); train.workers is the dp degree
    "dp=2": (TP_TOML, ["train.workers=2", "parallel.tp=1"]),
    "dp=2 zero1": (TP_TOML, ["train.workers=2", "parallel.tp=1", "parallel.zero=1"]),
    "dp=2 zero2": (TP_TOML, ["train.workers=2", "parallel.tp=1", "parallel.zero=2"]),
    "dp=2 zero3": (TP_TOML, ["train.workers=2", "parallel.tp=1", "parallel.zero=3"]),
    "tp=2": (TP_TOML, ["train.workers=1", "parallel.tp=2"]),
    "tp=2 sp": (TP_TOML, ["train.workers=1", "parallel.tp=2", "parallel.sp=true"]),
    "pp=2": (TP_TOML, ["train.workers=1", "parallel.tp=1", "parallel.pp=2", "parallel.micro_batches=4"]),
    "ckpt": (TP_TOML, ["train.workers=1", "parallel.tp=1", "parallel.activation_checkpointing=true"]),
    "tp=2 pp=2": (TP_TOML, ["train.workers=1", "parallel.tp=2", "parallel.pp=2", "parallel.micro_batches=4"]),
    "dp=2 tp=2 pp=2 zero1": (TP_TOML, ["train.workers=2", "parallel.tp=2", "parallel.pp=2", "parallel.zero=1",
                                       "parallel.micro_batches=4"]),
    "dp=2 pp=2 zero2": (TP_TOML, ["train.workers=2", "parallel.tp=1", "parallel.pp=2", "parallel.zero=2",
                                  "parallel.micro_batches=4"]),
    "cp=2": (TP_TOML, ["train.workers=1", "parallel.tp=1", "parallel.cp=2"]),
    "tp=2 cp=2": (TP_TOML, ["train.workers=1", "parallel.tp=2", "parallel.cp=2"]),
    "dp=2 tp=2 zero3": (TP_TOML, ["train.workers=2", "parallel.tp=2", "parallel.zero=3"]),
    "dp=2 tp=2 sp zero2": (TP_TOML, ["train.workers=2", "parallel.tp=2", "parallel.sp=true", "parallel.zero=2"]),
    "dp=2 cp=2 zero3": (TP_TOML, ["train.workers=2", "parallel.tp=1", "parallel.cp=2", "parallel.zero=3"]),
    "tp=2 sp cp=2": (TP_TOML, ["train.workers=1", "parallel.tp=2", "parallel.sp=true", "parallel.cp=2"]),
    "dp=2 zero2 ckpt": (TP_TOML, ["train.workers=2", "parallel.tp=1", "parallel.zero=2",
                                  "parallel.activation_checkpointing=true"]),
    "dp=2 zero3 ckpt": (TP_TOML, ["train.workers=2", "parallel.tp=1", "parallel.zero=3",
                                  "parallel.activation_checkpointing=true"]),
    "ep=2": (MOE_TOML, ["train.workers=1"]),      # text-moe: activations depend on the routing (measured only)
    "pp=2 v2": (TP_TOML, ["train.workers=1", "parallel.tp=1", "parallel.pp=2", "parallel.micro_batches=4",
                          "parallel.virtual_stages=2"]),
    "pp=2 cp=2": (TP_TOML, ["train.workers=1", "parallel.tp=1", "parallel.pp=2", "parallel.cp=2",
                            "parallel.micro_batches=4"]),
    "pp=2 ep=2": (MOE_TOML, ["train.workers=1", "parallel.pp=2", "parallel.micro_batches=2"]),
}
KINDS = ("params", "grads", "optimizer", "activations")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("memory", help="bytes per GPU of a layout (ZeRO, TP/PP/CP/EP, activations), modelled or "
                       "measured", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m = p.add_argument_group("model (a parameter count, or a transformer shape)")
    m.add_argument("--params", type=float, default=None, help="parameter count, e.g. 70e9 (model state only)")
    m.add_argument("--expert-params", type=float, default=0.0, help="of --params, those in experts (divided by --ep)")
    for k, h in (("layers", "L"), ("hidden", "h"), ("heads", "a"), ("seq", "s"), ("vocab", "v")):
        m.add_argument(f"--{k}", type=int, default=None, help=f"transformer shape: {h}")
    m.add_argument("--micro-batch", type=int, default=1, help="micro-batch size b (default 1)")
    lay = p.add_argument_group("layout")
    for k in ("dp", "tp", "pp", "cp", "ep"):
        lay.add_argument(f"--{k}", type=int, default=1, help=f"{k} degree (default 1)")
    lay.add_argument("--zero", type=int, default=0, help="ZeRO stage 0-3 over --dp (default 0)")
    lay.add_argument("--sp", action="store_true", help="sequence parallelism over the tp ranks")
    lay.add_argument("--recompute", default="none", help="activation recompute: none | selective | full")
    lay.add_argument("--micro-batches", type=int, default=None, help="pipeline micro-batches per step (default p)")
    lay.add_argument("--schedule", default="1f1b", help="pipeline schedule: 1f1b | gpipe")
    lay.add_argument("--virtual-stages", type=int, default=1, help="model chunks per pipeline stage: v > 1 is "
                     "interleaved 1F1B, which holds p + (p-1)/v micro-batches' activations on the first stage (1F1B: "
                     "p) (default 1)")
    lay.add_argument("--stage", type=int, default=0, help="pipeline stage to report (default 0, the first)")
    p.add_argument("--precision", default="mixed", help="fp32 | mixed | bf16-pure | fp32-sgd | fp32-sgd0 "
                   "(default mixed)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--plot", default=None, metavar="PATH", help="write a stacked-bar picture of layouts")
    p.add_argument("--measure", action="store_true", help="run the engines here and compare with the model")
    p.add_argument("--configs", default=None, help=f"with --measure: comma-separated subset of: {', '.join(MEASURE)}")
    p.add_argument("--backend", default="zmq", choices=("zmq", "torch"), help="with --measure: collectives backend")
    p.add_argument("--attention-seqs", default="128,256,512,1024", metavar="S,S,...",
                   help="with --measure: sequence lengths of the attention rows (naive vs flash-style saved bytes of "
                        "one layer; default 128,256,512,1024)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def gb(x: float) -> str:
    if x >= 1e12:
        return f"{x / 1e12:.3g} TB"
    return f"{x / 1e9:.3g} GB" if x >= 1e8 else f"{x / 1e6:.3g} MB" if x >= 1e5 else f"{x:,.0f} B"


def _model_args(args: argparse.Namespace) -> tuple[float | None, Any]:
    from pslab.parallelism.memory_model import Shape
    dims = [args.layers, args.hidden, args.heads, args.seq, args.vocab]
    if any(v is not None for v in dims):
        if any(v is None for v in dims):
            raise ConfigError("a transformer shape needs all of --layers --hidden --heads --seq --vocab")
        if min(dims) < 1 or args.micro_batch < 1:
            raise ConfigError("--layers, --hidden, --heads, --seq, --vocab and --micro-batch must be >= 1")
        if args.params is not None:
            raise ConfigError("give --params or a shape (--layers ...), not both")
        return None, Shape(*dims, micro_batch=args.micro_batch)
    if args.params is None:
        args.params = 70e9
    return args.params, None


def _layout(args: argparse.Namespace, **over: Any) -> Any:
    from pslab.parallelism.memory_model import Layout
    kw = dict(dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, zero=args.zero, sp=args.sp,
              recompute=args.recompute, micro_batches=args.micro_batches, schedule=args.schedule,
              virtual_stages=args.virtual_stages)
    kw.update(over)
    if over and (kw["pp"] == 1 or (kw["micro_batches"] or kw["pp"]) % kw["pp"]):
        kw["virtual_stages"] = 1             # a comparison row the user's v does not apply to (the user's own: checked)
    return Layout(**kw)


def _fits(params: float | None, shape: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """A short list of layouts (ZeRO stage × N_d, TP, PP) and whether each fits on 80 GB and 141 GB."""
    from pslab.parallelism.memory_model import estimate
    rows = []
    for zero, dp, tp, pp in ((0, 1, 1, 1), (0, 8, 8, 1), (0, 1, 8, 2), (0, 1, 8, 4), (1, 8, 8, 1), (1, 64, 1, 1),
                             (2, 64, 1, 1), (3, 8, 1, 1), (3, 16, 1, 1), (3, 64, 1, 1), (3, 8, 8, 1)):
        if shape is not None and (shape.heads % tp or pp > shape.layers):
            continue
        lay = _layout(args, dp=dp, tp=tp, pp=pp, zero=zero, sp=args.sp and tp > 1, cp=1, ep=1)
        e = estimate(lay, args.precision, params=params, shape=shape, expert_params=args.expert_params)
        rows.append({"layout": f"zero{zero} dp={dp} tp={tp} pp={pp}", "gpus": lay.gpus(), "bytes": e.total,
                     **{f"fits_{int(g / 1e9)}GB": e.total <= g for g in GPU_SIZES}})
    return rows


def run(args: argparse.Namespace) -> int:
    from pslab.parallelism.memory_model import MemoryModelError, estimate
    try:
        if args.measure:
            return _run_measure(args)
        params, shape = _model_args(args)
        e = estimate(_layout(args), args.precision, params=params, shape=shape, expert_params=args.expert_params,
                     stage=args.stage)
        fits = [{"layout": f"yours: {e.layout.describe()}", "gpus": e.layout.gpus(), "bytes": e.total,
                 **{f"fits_{int(g / 1e9)}GB": e.total <= g for g in GPU_SIZES}}] + _fits(params, shape, args)
    except MemoryModelError as err:
        raise ConfigError(str(err)) from None
    from pslab.parallelism.memory_model import PRECISIONS
    psi = params if params is not None else shape.params()
    (pb, gbytes, k), _ = PRECISIONS[args.precision]
    per_param = pb + gbytes + k
    if args.plot:
        _plot(params, shape, args)
    if args.json:
        print(json.dumps({**e.as_dict(), "model_params": psi, "state_bytes_per_param": per_param, "fits": fits}))
        return 0
    print(f"model: {psi:.4g} parameters, precision {args.precision}: p + g + K = {pb} + {gbytes} + {k} = "
          f"{per_param} B/param -> {gb(per_param * psi)} of model state before activations (ZeRO, Fig. 1)")
    print(f"per GPU of layout {e.layout.describe()}" + (f", stage {args.stage}" if e.layout.pp > 1 else "")
          + f": Ψ = {e.params:.4g} parameters on this rank")
    print(f"{'term':<28}{'bytes':>12}  {'formula':<44}  source")
    for t in e.terms:
        print(f"{t.name:<28}{gb(t.bytes):>12}  {t.formula:<44}  {t.source}")
    print(f"{'total per GPU':<28}{gb(e.total):>12}" + ("" if shape is not None else "  (before activations)"))
    print(f"\nwhich layouts fit ({args.precision}{', model state only' if shape is None else ''}; an 80 GB A100 / a "
          "141 GB H200):")
    w = max([28] + [len(r["layout"]) + 2 for r in fits])
    print(f"{'layout':<{w}}{'GPUs':>6}{'per GPU':>12}{'80 GB':>8}{'141 GB':>8}")
    for r in fits:
        print(f"{r['layout']:<{w}}{r['gpus']:>6}{gb(r['bytes']):>12}{'yes' if r['fits_80GB'] else 'no':>8}"
              f"{'yes' if r['fits_141GB'] else 'no':>8}")
    if args.plot:
        print(f"\nplot: {args.plot}")
    return 0


def _plot(params: float | None, shape: Any, args: argparse.Namespace) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from pslab.parallelism.memory_model import estimate
    layouts = [_layout(args, dp=1, zero=0, tp=1, pp=1, sp=False), _layout(args, dp=64, zero=1, tp=1, pp=1, sp=False),
               _layout(args, dp=64, zero=2, tp=1, pp=1, sp=False), _layout(args, dp=64, zero=3, tp=1, pp=1, sp=False),
               _layout(args, dp=1, zero=0, tp=8, pp=2, sp=False)]
    if shape is not None:
        layouts = [lay for lay in layouts if shape.heads % lay.tp == 0 and lay.pp <= shape.layers]
    mine = _layout(args)
    if mine.describe() not in [lay.describe() for lay in layouts]:
        layouts.append(mine)
    ests = [estimate(lay, args.precision, params=params, shape=shape, expert_params=args.expert_params)
            for lay in layouts]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    names = [e.layout.describe() for e in ests]
    bottom = [0.0] * len(ests)
    for kind in KINDS:
        vals = [sum(t.bytes for t in e.terms if t.name.startswith(kind)) / 1e9 for e in ests]
        ax.bar(names, vals, bottom=bottom, label=kind)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, top in enumerate(bottom):
        ax.annotate(gb(top * 1e9), (i, top), ha="center", va="bottom", fontsize=8)
    for g in GPU_SIZES:
        ax.axhline(g / 1e9, ls="--", color="grey", lw=0.8)
        ax.annotate(f"{g / 1e9:.0f} GB GPU", (len(ests) - 0.5, g / 1e9), ha="right", va="bottom", fontsize=7,
                    color="grey")
    ax.set_ylabel("GB per GPU")
    ax.set_title(f"bytes per GPU ({args.precision})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot)
    plt.close(fig)


# ---- --measure -------------------------------------------------------------------------------------------------

def _storage_total(tensors: list[Any]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes():
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _config(label: str) -> Any:
    from pslab.experiments.config import example_config, load_config
    toml, overrides = MEASURE[label]
    return load_config(example_config(toml), overrides)


def measure_worker(group: Any, label: str) -> dict[str, Any]:
    """One rank of one configuration: two training steps, the second metered (Adam's state exists by then)."""
    import torch
    from pslab.experiments.strategies.build import make_engine, make_strategy
    from pslab.experiments.workloads import get_workload
    from pslab.parallelism.checkpointing import ActivationMeter
    from pslab.parallelism.mesh import DeviceMesh
    torch.set_num_threads(1)
    cfg = _config(label)
    wl = get_workload(cfg.workload.name, cfg.train.workers, cfg.workload.batch_size, cfg.workload.seed,
                      **cfg.workload.overrides())
    p = cfg.parallel
    mesh = DeviceMesh(group, dp=cfg.train.workers, pp=p.pp, tp=p.tp, cp=p.cp, ep=p.ep)
    replica = make_engine(cfg, wl).build(wl.make_model, mesh)
    strategy = make_strategy(cfg, mesh)
    strategy.attach(replica)
    out: dict[str, Any] = {"coords": dict(mesh.coords)}
    for step in range(2):
        x, y, _ = wl.batch(mesh.coord("dp"), step)
        with ActivationMeter() as meter:
            replica.forward_backward(x, y)
        if step == 1:
            if hasattr(replica, "state_bytes"):                 # ZeRO: its flat shards and views, counted once
                st = replica.state_bytes()
                out.update(params=st.params, grads=st.grads, optimizer=st.optimizer)
            else:
                slots = replica.slots()
                opt = strategy.optimizer
                out["params"] = _storage_total([s.param for s in slots])
                out["grads"] = _storage_total([s.grad for s in slots if s.grad is not None]   # (ZeRO-2 in a
                                              + list(getattr(strategy, "acc", [])))             # pipeline: shards)
                out["optimizer"] = _storage_total([v for st in opt.state.values() for v in st.values()
                                                   if isinstance(v, torch.Tensor)])
            out["activations"] = meter.peak
        strategy.step(replica)
    getattr(replica, "close", lambda: None)()
    return out


def modelled(label: str, rank: dict[str, Any]) -> dict[str, float | None]:
    """The model's figures for one rank of a MEASURE configuration (fp32 Adam, the workload's exact shapes; an MoE
    model by its parameter count, experts divided by ep, activations None: they depend on the routing)."""
    from pslab.experiments.workloads import get_workload
    from pslab.parallelism.memory_model import (Layout, Shape, estimate, tiny_checkpointed_activation_bytes,
                                          tiny_chunked_activation_bytes, tiny_stage_activation_bytes)
    from pslab.parallelism.models import Attention
    from pslab.parallelism.sequence import model_activation_bytes
    cfg = _config(label)
    wl = get_workload(cfg.workload.name, 1, cfg.workload.batch_size, cfg.workload.seed, **cfg.workload.overrides())
    model = wl.make_model()
    p = cfg.parallel
    if cfg.workload.name == "text-moe":         # (pp > 1: the rank's stage of the engines' cut)
        if p.pp > 1:
            from pslab.parallelism.pipeline import rank_stages
            model = rank_stages(model, p.pp, p.virtual_stages)[rank["coords"].get("pp", 0)]
        total = sum(q.numel() for q in model.parameters())
        experts = sum(q.numel() for n, q in model.named_parameters() if ".experts." in n)
        e = estimate(Layout(dp=cfg.train.workers, ep=p.ep), "fp32", params=total, expert_params=experts)
        return {"params": e.get("params"), "grads": e.get("grads"), "optimizer": e.get("optimizer"),
                "activations": None}
    att = [m for m in model.modules() if isinstance(m, Attention)]
    x = wl.batch(0, 0)[0]
    b, s = x.shape
    d, a, L, V = att[0].d, att[0].heads, len(att), wl.data.num_classes
    shape = Shape(L, d, a, s, V, b)
    assert shape.params() == sum(q.numel() for q in model.parameters()), "Shape.params disagrees with the model"
    stage = rank["coords"].get("pp", 0)
    lay = Layout(dp=cfg.train.workers, tp=p.tp, pp=p.pp, cp=p.cp, zero=p.zero, sp=p.sp,
                 micro_batches=p.micro_batches if p.pp > 1 else None, virtual_stages=p.virtual_stages)
    e = estimate(lay, "fp32", shape=shape, stage=stage)
    if p.pp > 1 and p.sp:
        act = None                              # tp x pp with sp: measured only (no closed form here yet)
    elif p.pp > 1 and p.virtual_stages > 1:     # interleaved 1F1B: the rank's chunks along its schedule
        act = tiny_chunked_activation_bytes(b, s, d, a, L, V, p.pp, p.micro_batches, p.virtual_stages, stage, t=p.tp)
    elif p.pp > 1:
        act = tiny_stage_activation_bytes(b, s, d, a, L, V, p.pp, p.micro_batches, stage, p.schedule, t=p.tp,
                                          cp=p.cp)
    elif p.activation_checkpointing:
        act = tiny_checkpointed_activation_bytes(b, s, d, a, L, V)
    elif p.cp > 1:                              # (tp x cp: the tp rank's figure, with sp on S/T, on S/C tokens)
        act = (model_activation_bytes(b, s, d, a, L, V, t=p.tp, sp=p.sp) - 4) // p.cp + 4
    else:
        act = model_activation_bytes(b, s, d, a, L, V, t=p.tp, sp=p.sp)
    return {"params": e.get("params"), "grads": e.get("grads"), "optimizer": e.get("optimizer"), "activations": act}


def measure(labels: list[str], backend: str = "zmq", quiet: bool = False) -> list[dict[str, Any]]:
    """Run each configuration; per rank: measured and modelled bytes of each kind."""
    from pslab import collectives
    from tqdm import tqdm
    rows = []
    for label in tqdm(labels, desc="pslab memory --measure", unit="config", disable=quiet, file=sys.stderr):
        cfg = _config(label)
        results = collectives.launch(measure_worker, cfg.train.workers * cfg.parallel.model_parallel,
                                     backend=backend, args=(label,), timeout=120)
        for r, res in enumerate(results):
            model = modelled(label, res)
            rows.append({"config": label, "rank": r, "coords": res["coords"],
                         "measured": {k: res[k] for k in KINDS}, "model": model,
                         "ratio": {k: (res[k] / model[k] if model[k] else None) for k in KINDS}})  # type: ignore
    return rows


def _run_measure(args: argparse.Namespace) -> int:
    labels = list(MEASURE) if not args.configs else [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in labels if c not in MEASURE]
    if bad or not labels:
        raise ConfigError(f"unknown --configs {', '.join(bad) or '(empty)'}; choose from: {', '.join(MEASURE)}")
    seqs = _seqs(args.attention_seqs)
    rows = measure(labels, args.backend, args.quiet or args.json)
    from pslab.parallelism.ring_attention import measure_attention_memory
    attention = measure_attention_memory(seqs)
    if args.json:
        print(json.dumps({"rows": rows, "meters": METERS, "attention": attention}))
        return 0
    print("measured (here, per rank) vs modelled (parallelism.memory_model, fp32 Adam, the workload's shapes), "
          "bytes:")
    w = max([12] + [len(r["config"]) + 1 for r in rows])
    print(f"{'config':<{w}}{'rank':>5}" + "".join(f"{k:>26}" for k in KINDS))
    for r in rows:
        cells = "".join(f"{r['measured'][k]:>10,} / {_num(r['model'][k]):>9} {_pct(r['ratio'][k]):>4}" for k in KINDS)
        print(f"{r['config']:<{w}}{r['rank']:>5}{cells}")
    print(f"\n{METERS}")
    worst = max(abs(v - 1) for r in rows for v in r["ratio"].values() if v is not None)
    print(f"largest deviation from the model: {worst:.1%}")
    _print_attention(attention)
    return 0


def _seqs(text: str) -> list[int]:
    try:
        seqs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        seqs = []
    if len(seqs) < 2 or any(not 8 <= s <= 8192 for s in seqs):
        raise ConfigError(f"--attention-seqs takes two or more sequence lengths in 8..8192, like 128,256,512; "
                          f"got {text!r}")
    return sorted(set(seqs))


def _print_attention(rows: list[dict[str, Any]]) -> None:
    """Naive vs flash-style attention's saved bytes over S (one layer, B = 1, d = 32, 8 heads, fp32): measured /
    modelled, and how each grows (S² vs S)."""
    print("\nattention, one layer (B=1, d=32, 8 heads, fp32): saved for backward, measured / modelled "
          "(ring_attention.attention_memory)")
    print(f"{'S':>6}{'naive (probabilities kept)':>36}{'flash-style (SDPA)':>30}")
    for r in rows:
        print(f"{r['seq']:>6}{r['naive']:>18,} / {r['naive_model']:>14,}{r['flash']:>14,} / {r['flash_model']:>12,}")
    a, b = rows[0], rows[-1]
    grow = b["seq"] / a["seq"]
    print(f"S x{grow:g}: naive x{b['naive'] / a['naive']:.1f} (4·B·S·d + B·H·S²: quadratic once S ≫ 4d/H), "
          f"flash-style x{b['flash'] / a['flash']:.1f} (4·B·S·d + B·H·S: linear); outputs equal to "
          f"{max(r['max_diff'] for r in rows):.1e}")


def _num(x: float | None) -> str:
    return "—" if x is None else f"{x:,.0f}"


def _pct(ratio: float | None) -> str:
    return "" if ratio is None else f"{(ratio - 1) * 100:+.0f}%"


METERS = ("cells: measured / modelled, deviation. params, grads, optimizer: bytes of the distinct tensor storages "
          "the rank holds after its second step's backward (its slots' tensors and .grad, the optimizer's state "
          "tensors incl. Adam's step counters; ZeroReplica.state_bytes for ZeRO's shards). activations: "
          "pslab.parallelism.checkpointing.ActivationMeter's peak of tensors autograd saved in that step (parameters "
          "excluded, shared storages once); — : no closed form (an MoE's saved activations depend on its routing).")
