"""The 3D-layout planner: every way to lay one transformer out on a cluster, each through the step-time model,
the ones that fit ranked by step time, and the winner explained in words (`pslab plan`).

    cluster = preset("dgx-a100-80gb", nodes=384)
    ranked = plan(Shape(128, 25600, 160, 2048, 51200), cluster, global_batch=3072)   # GPT-1T, Narayanan et al.
    print(explain(ranked, cluster))

The layouts (for `gpus` GPUs, default all of the cluster's):

    dp · tp · pp · cp · ep = gpus         ep = 1 (a dense Shape has no experts); cp ∈ `cp` (default 1)
    tp | heads,  tp ≤ max_tp              (default: no limit; a tp > gpus_per_node group crosses nodes: such
                                           layouts stay in the list, so that the explanation can say why they lose)
    pp ≤ layers                           (stages of ⌈L/p⌉ or ⌊L/p⌋ layers, the extra ones on the first stages;
                                           published runs put 70 layers on 12 stages; the busiest stage sets the
                                           pace. pslab's engines cut [Embed, Block × L, Head] as L + 2 units by
                                           that rule: algorithm "pslab" follows their cut for compute and bytes)
    b ∈ {1, 2, 4, 8},  m = B / (dp · b)   (micro-batch size and count: dp · m · b = the global batch B, m integer)
    ZeRO stage ∈ zero                     (only 0 when dp = 1: the stages differ only across dp ranks)
    recompute ∈ recompute                 (none, selective, full: Korthikanti et al. 2022)
    SP with every tp > 1                  (same bytes as TP's all-reduce, activations /t: it is never worse)
    schedule ∈ schedules                  (1F1B; GPipe optional; one schedule when pp = 1)
    v ∈ virtual_stages                    (interleaved 1F1B, v model chunks per stage: pp > 1, 1f1b, m a multiple
                                           of pp, v·pp ≤ layers; default only v = 1, `--virtual-stages 1,2,4`)
    placement "packed"                    (tp innermost, a tp group fills a node before the next)

Each layout goes through `step_model.predict` (compute = Narayanan et al.'s FLOPs at the cluster's achieved rate,
the bubble (p−1)/(m+p−1) (interleaved: (p−1)/(v·m+p−1), with (p·v−1)/(p−1) times the boundary traffic), each communication α-β on the link its group spans, DP's gradient sync overlapped with
backward; memory per GPU = the worst pipeline stage of `memory_model.estimate`). The layouts that fit (memory ≤ the
GPU's) are ranked by step time; ties by memory per GPU, then by fewer model-parallel ranks.

Speed: the candidates are built first (integer arithmetic, ~2·10⁵ per second); one whose first pipeline stage
alone does not fit is dropped before `predict` (stage 0's memory, ~10⁵ per second, is a lower bound of the max over
stages). The rest is `predict`'s pace: on this 2-core machine ~2800 layouts/s for GPT-1.7B on 32 GPUs, ~600/s for
GPT-1T on 3072 (the communication model walks the groups of the mesh). A tqdm bar on stderr with `progress=True`.

Published runs (`published.py`: `PUBLISHED`, `compare_published`, `pslab plan --published`): Narayanan et al.
2021's Table 1, each row's own layout and the planner's best predicted on the A100 preset with one efficiency for
all rows.

`explain` turns the ranking into sentences: the winner and its time breakdown; why its tensor parallelism stays in
the node (the fastest layout whose tp group crosses nodes, its TP seconds on the inter link against the same bytes
on the intra link); why its pipeline depth (no shallower pipeline fits); and what limits it (memory headroom,
bubble, DP communication left exposed).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Iterator

from .cluster import Cluster
from .memory_model import PRECISIONS, Layout, MemoryModelError, Shape, estimate

MICRO_BATCH_SIZES = (1, 2, 4, 8)
TP_KIND = "tp activations"


class PlanError(MemoryModelError):
    """A planning request that cannot be answered (one line: what to change)."""


class Ranked(list):
    """`plan`'s answer: the feasible Predictions, fastest first, and how the search went."""

    def __init__(self, items: Iterable = ()) -> None:
        super().__init__(items)
        self.enumerated = 0          # layouts built
        self.predicted = 0           # of which went through predict (the rest failed the memory pre-check)
        self.elapsed_s = 0.0
        self.smallest: tuple[float, str] | None = None   # (bytes per GPU, layout) of the leanest, when none fits
        self.gpus = 0
        self.shape: Shape | None = None   # what was planned (explain re-predicts counterfactuals with it)
        self.precision = "mixed"
        self.options: dict = {}      # placement, algorithm, overlap as passed to predict
        self.space: dict = {}        # the recompute modes, ZeRO stages and schedules searched
        self.tried: dict = {}        # (tp, pp) -> layouts enumerated with those degrees (fitting or not)


@dataclass(frozen=True)
class Candidate:
    shape: Shape             # with micro_batch = b
    layout: Layout


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(shape: Shape, gpus: int, global_batch: int, *, max_tp: int | None = None,
               schedules: Iterable[str] = ("1f1b",), recompute: Iterable[str] = ("none", "selective", "full"),
               zero: Iterable[int] = (0, 1, 2, 3), micro_batch_sizes: Iterable[int] = MICRO_BATCH_SIZES,
               cp: Iterable[int] = (1,), sp: bool = True, virtual_stages: Iterable[int] = (1,)) -> Iterator[Candidate]:
    """Every layout of the module docstring's table, in a fixed order (tp, pp, cp, b, zero, recompute, schedule,
    v)."""
    zero, recompute, schedules, vs = tuple(zero), tuple(recompute), tuple(schedules), tuple(virtual_stages)
    shapes = {b: replace(shape, micro_batch=b) for b in micro_batch_sizes}
    for tp in divisors(gpus):
        if shape.heads % tp or (max_tp is not None and tp > max_tp):
            continue
        for pp in divisors(gpus // tp):
            if pp > shape.layers:
                continue
            for c in cp:
                if (gpus // (tp * pp)) % c or shape.seq % c:
                    continue
                dp = gpus // (tp * pp * c)
                use_sp = sp and tp > 1 and shape.seq % (tp * c) == 0
                for b, sh in shapes.items():
                    if global_batch % (dp * b):
                        continue
                    m = global_batch // (dp * b)
                    for z in (zero if dp > 1 else (0,)):
                        for r in recompute:
                            for s in (schedules if pp > 1 else schedules[:1]):
                                for v in vs:
                                    if v > 1 and (pp == 1 or s != "1f1b" or m % pp or pp * v > shape.layers):
                                        continue
                                    yield Candidate(sh, Layout(dp=dp, tp=tp, pp=pp, cp=c, zero=z, sp=use_sp,
                                                               recompute=r, micro_batches=m, schedule=s,
                                                               virtual_stages=v))


def _check(shape: Shape, cluster: Cluster, global_batch: int, precision: str, gpus: int,
           schedules: tuple, recompute: tuple, zero: tuple) -> None:
    if type(global_batch) is not int or global_batch < 1:
        raise PlanError(f"--global-batch must be an integer >= 1, got {global_batch!r}")
    if type(gpus) is not int or gpus < 1:
        raise PlanError(f"--gpus must be an integer >= 1, got {gpus!r}")
    if gpus > cluster.gpus:
        raise PlanError(f"--gpus {gpus} exceeds the cluster's {cluster.gpus} ({cluster.nodes} nodes x "
                        f"{cluster.gpus_per_node}): raise --nodes")
    if precision not in PRECISIONS:
        raise PlanError(f"unknown precision {precision!r}; choose one of: {', '.join(PRECISIONS)}")
    if min(shape.layers, shape.hidden, shape.heads, shape.seq, shape.vocab) < 1:
        raise PlanError("--layers, --hidden, --heads, --seq and --vocab must be >= 1")
    if shape.hidden % shape.heads:
        raise PlanError(f"the heads ({shape.heads}) must divide the hidden size ({shape.hidden})")
    bad = [s for s in schedules if s not in ("1f1b", "gpipe")] + [r for r in recompute
                                                                 if r not in ("none", "selective", "full")]
    if bad or not schedules or not recompute or not zero or any(z not in (0, 1, 2, 3) for z in zero):
        raise PlanError("schedules must be 1f1b/gpipe, recompute none/selective/full, zero stages 0-3 (non-empty)")


def plan(shape: Shape, cluster: Cluster, global_batch: int, *, precision: str = "mixed", gpus: int | None = None,
         max_tp: int | None = None, schedules: Iterable[str] = ("1f1b",),
         recompute: Iterable[str] = ("none", "selective", "full"), zero: Iterable[int] = (0, 1, 2, 3),
         progress: bool = False, micro_batch_sizes: Iterable[int] = MICRO_BATCH_SIZES, cp: Iterable[int] = (1,),
         sp: bool = True, where: Callable[[Layout], bool] | None = None, placement: str = "packed",
         algorithm: str = "ring", overlap: bool = True, virtual_stages: Iterable[int] = (1,)) -> Ranked:
    """The feasible layouts of `shape` on `gpus` GPUs of `cluster` for a global batch of sequences, fastest first
    (`where`: keep only the layouts it accepts, e.g. a published run's own tp and pp)."""
    from .step_model import predict
    gpus = cluster.gpus if gpus is None else gpus
    schedules, recompute, zero = tuple(schedules), tuple(recompute), tuple(zero)
    micro_batch_sizes, cp, virtual_stages = tuple(micro_batch_sizes), tuple(cp), tuple(virtual_stages)
    _check(shape, cluster, global_batch, precision, gpus, schedules, recompute, zero)
    if not micro_batch_sizes or not cp or not virtual_stages or min(micro_batch_sizes + cp + virtual_stages) < 1:
        raise PlanError("micro-batch sizes, cp degrees and virtual stages must be non-empty lists of integers >= 1")
    t0 = time.perf_counter()
    cands = [c for c in candidates(shape, gpus, global_batch, max_tp=max_tp, schedules=schedules, recompute=recompute,
                                   zero=zero, micro_batch_sizes=micro_batch_sizes, cp=cp, sp=sp,
                                   virtual_stages=virtual_stages)
             if where is None or where(c.layout)]
    out = Ranked()
    out.enumerated, out.gpus, out.shape, out.precision = len(cands), gpus, shape, precision
    out.options = dict(placement=placement, algorithm=algorithm, overlap=overlap)
    out.space = dict(recompute=recompute, zero=zero, schedules=schedules)
    for c in cands:
        k = (c.layout.tp, c.layout.pp)
        out.tried[k] = out.tried.get(k, 0) + 1
    if not cands:
        if where is not None:
            raise PlanError(f"no layout of {gpus} GPUs passes the given filter (e.g. a fixed tp / pp)")
        raise PlanError(_no_layout(shape, gpus, global_batch, micro_batch_sizes))
    cap = cluster.gpu_memory_bytes
    from tqdm import tqdm
    for c in tqdm(cands, desc="pslab plan", unit="layout", disable=not progress, file=sys.stderr, leave=False):
        first = estimate(c.layout, precision, shape=c.shape, stage=0).total
        if first > cap:
            _lean(out, first, c)
            continue
        out.predicted += 1
        p = predict(c.shape, c.layout, cluster, global_batch, precision=precision, placement=placement,
                    algorithm=algorithm, overlap=overlap)
        if p.fits:
            out.append(p)
        else:
            _lean(out, p.memory_bytes, c)
    out.sort(key=rank_key)
    if out:
        out.smallest = None
    out.elapsed_s = time.perf_counter() - t0
    return out


def rank_key(p) -> tuple:
    lay = p.layout
    return (p.step_s, p.memory_bytes, lay.tp * lay.pp * lay.cp, lay.pp, lay.zero, describe(p))


def _lean(out: Ranked, nbytes: float, c: Candidate) -> None:
    if out.smallest is None or nbytes < out.smallest[0]:
        out.smallest = (nbytes, f"{c.layout.describe()} b={c.shape.micro_batch}")


def _no_layout(shape: Shape, gpus: int, batch: int, bs: tuple) -> str:
    tps = [t for t in divisors(gpus) if shape.heads % t == 0]
    return (f"no layout of {gpus} GPUs: dp·tp·pp must be {gpus} with tp dividing the {shape.heads} heads "
            f"(possible tp: {', '.join(map(str, tps))}), pp at most the {shape.layers} layers, and dp·b dividing "
            f"the global batch {batch} for a micro-batch size b in {', '.join(map(str, bs))}: change --gpus or "
            f"--global-batch")


def describe(p) -> str:
    """A layout in one token list: dp, tp, pp (always), then cp, sp, ZeRO, recompute, micro-batch size and count."""
    lay = p.layout
    parts = [f"dp={lay.dp}", f"tp={lay.tp}", f"pp={lay.pp}"] + [f"cp={lay.cp}"] * (lay.cp > 1)
    parts += ["sp"] * lay.sp + [f"zero{lay.zero}"] * bool(lay.zero)
    parts += [f"rc={lay.recompute}"] * (lay.recompute != "none") + ["gpipe"] * (lay.schedule == "gpipe")
    parts += [f"v={lay.virtual_stages}"] * (lay.virtual_stages > 1)
    parts += [f"b={micro_batch(p)}", f"m={lay.micro_batches}"]
    return " ".join(parts)


# ---- the time breakdown and the explanation ----------------------------------------------------------------

PARTS = ("compute", "bubble", "TP", "PP", "DP exposed", "other comm", "overhead")


def breakdown(p) -> dict[str, float]:
    """Seconds of one step by part: compute, bubble, the communication the step waits for by kind (TP, PP; DP =
    what of the dp / ZeRO sync is left exposed; other = CP, EP), overhead. Sums to the step time."""
    tp = pp = other = 0.0
    exposed_fixed = 0.0
    for t in p.comm:
        if t.overlappable:
            continue
        if t.kind == TP_KIND:
            tp += t.seconds
        elif t.kind == "pp boundaries":
            pp += t.seconds
        elif t.kind.startswith(("cp", "ep")):
            other += t.seconds
        else:
            continue                      # dp / ZeRO terms that are not overlappable: counted in "DP exposed"
        exposed_fixed += t.seconds
    dp = max(0.0, p.exposed_comm_s - exposed_fixed)
    parts = {"compute": p.compute_s, "bubble": p.bubble_s, "TP": tp, "PP": pp, "DP exposed": dp, "other comm": other,
             "overhead": p.overhead_s}
    rest = p.step_s - sum(parts.values())
    if abs(rest) > 1e-9 * max(p.step_s, 1e-30):   # a model whose parts do not add up: keep the total honest
        parts["overhead"] += rest
    return parts


def link_seconds(p, kind: str = TP_KIND) -> dict[str, float]:
    """Seconds of one kind of communication per link class ('intra', 'inter') in a prediction."""
    out = {"intra": 0.0, "inter": 0.0}
    for t in p.comm:
        if t.kind == kind:
            out[t.link] = out.get(t.link, 0.0) + t.seconds
    return out


def _pct(x: float, total: float) -> str:
    return f"{100 * x / total:.0f}%" if total > 0 else "0%"


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f} GB"


def fmt_seconds(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def micro_batch(p) -> int:
    """The micro-batch size b of a prediction: B / (dp · m)."""
    return p.global_batch // (p.layout.dp * p.layout.micro_batches)


def tp_on_intra(p, cluster: Cluster, shape: Shape, precision: str = "mixed", **options):
    """The same layout predicted as if every link were as fast as the intra link (the counterfactual of 'its tp
    group crosses nodes'): what its TP bytes would cost on NVLink."""
    from .step_model import predict
    lat, bw = cluster.link("intra")
    fast = cluster.with_(inter_latency_s=lat, inter_bandwidth_Bps=bw)
    return predict(replace(shape, micro_batch=micro_batch(p)), p.layout, fast, p.global_batch, precision=precision,
                   **options)


def explain(ranked: list, cluster: Cluster) -> str:
    """The top choice in words: what it is, where its time goes, why TP stays in the node, why this pipeline
    depth, and what limits it."""
    if not ranked:
        sm = getattr(ranked, "smallest", None)
        return ("No layout fits." + (f" The leanest, {sm[1]}, needs at least {_gb(sm[0])} per GPU of the "
                                     f"{_gb(cluster.gpu_memory_bytes)}: add GPUs (--nodes) or allow more recompute / "
                                     f"ZeRO." if sm else ""))
    best = ranked[0]
    lay, step = best.layout, best.step_s
    bd = breakdown(best)
    g = cluster.gpus_per_node
    lines = [f"Best of {len(ranked)} layouts that fit: {describe(best)} — {fmt_seconds(step)} per step, "
             f"{best.tflops_per_gpu:.0f} TFLOP/s per GPU ({best.tflops_per_gpu * 1e12 / cluster.peak_flops:.0%} "
             f"of peak), {_gb(best.memory_bytes)} of {_gb(cluster.gpu_memory_bytes)} per GPU."]
    lines.append("Its step: " + ", ".join(f"{k} {_pct(v, step)}" for k, v in bd.items() if v > 0.0005 * step) + ".")
    # -- tensor parallelism and the node boundary
    crossing = [p for p in ranked if p.layout.tp > g]
    if lay.tp > g:
        lines.append(f"Its tp={lay.tp} crosses nodes ({g} GPUs per node): no layout with tp <= {g} is faster "
                     f"(TP costs {fmt_seconds(bd['TP'])} per step here).")
    elif cluster.nodes == 1 or best.layout.gpus() <= g:
        lines.append(f"All {best.layout.gpus()} GPUs sit in one node: every TP all-reduce rides the intra link.")
    elif crossing:
        x = crossing[0]
        rank = ranked.index(x) + 1
        inter = link_seconds(x)
        head = (f"TP stays inside the node: tp={lay.tp} <= {g} GPUs per node, so its all-reduces ride the intra "
                f"link ({fmt_seconds(bd['TP'])} per step)." if lay.tp > 1 else
                "No tensor parallelism (tp=1): the model fits without splitting its layers, and TP's per-layer "
                "all-reduces would only add time.")
        text = (f"{head} The fastest layout whose tp group crosses nodes, {describe(x)} (#{rank}), takes "
                f"{fmt_seconds(x.step_s)} ({x.step_s / step:.2f}x): its TP spends {fmt_seconds(inter['inter'])} on the inter link"
                + (f" (+{fmt_seconds(inter['intra'])} intra)" if inter["intra"] > 0 else ""))
        shape = getattr(ranked, "shape", None)
        if shape is not None:
            fast = link_seconds(tp_on_intra(x, cluster, shape, getattr(ranked, "precision", "mixed"),
                                            **getattr(ranked, "options", {})))
            text += f", where the same bytes would take {fmt_seconds(fast['intra'] + fast['inter'])} on the intra link"
        ratio = cluster.intra_bandwidth_Bps / cluster.inter_bandwidth_Bps
        lines.append(text + f" (the links' bandwidths differ {ratio:.0f}x).")
    else:
        tried = sum(n for (t, _), n in getattr(ranked, "tried", {}).items() if t > g)
        why = (f"none of the {tried} layouts whose tp group crosses nodes fits in memory" if tried else
               f"no tp > {g} is possible here (tp must divide the heads and dp·tp·pp the GPUs, or --max-tp)")
        lines.append((f"TP stays inside the node (tp={lay.tp} <= {g})" if lay.tp > 1 else
                      "No tensor parallelism (tp=1)") + f"; {why}.")
    # -- pipeline depth
    if lay.pp > 1:
        shallower = [p for p in ranked if p.layout.pp < lay.pp]
        if not shallower:
            tried = sum(n for (_, q), n in getattr(ranked, "tried", {}).items() if q < lay.pp)
            why = (f"none of the {tried} layouts with fewer pipeline stages fits in {_gb(cluster.gpu_memory_bytes)} "
                   f"per GPU" if tried else "no layout with fewer pipeline stages exists for these GPUs and batch "
                   "(dp·tp·pp = GPUs, tp | heads, pp ≤ layers)")
            v = lay.virtual_stages
            rule = f"(p-1)/(v*m+p-1) with v={v}" if v > 1 else "(p-1)/(m+p-1)"
            lines.append(f"pp={lay.pp}: {why}; the bubble {rule} costs {_pct(bd['bubble'], step)} with m="
                         f"{lay.micro_batches}.")
        else:
            s = shallower[0]
            lines.append(f"pp={lay.pp}: the fastest shallower pipeline, {describe(s)}, takes {fmt_seconds(s.step_s)} "
                         f"({s.step_s / step:.2f}x).")
    # -- what limits it
    limits = []
    head = best.memory_bytes / cluster.gpu_memory_bytes
    if head > 0.8:
        limits.append(f"memory ({head:.0%} of the GPU used)")
    for k, label in (("bubble", "the pipeline bubble"), ("DP exposed", "DP gradient sync left exposed"),
                     ("TP", "TP communication"), ("PP", "pipeline transfers"), ("other comm", "CP/EP communication"),
                     ("overhead", "per-step overhead")):
        if bd[k] > 0.05 * step:
            limits.append(f"{label} ({_pct(bd[k], step)})")
    searched = getattr(ranked, "space", {}).get("recompute", ("none",))
    if lay.recompute != "none" and "none" in searched:
        limits.append(f"recompute={lay.recompute} (its extra forward FLOPs buy the memory: the same layout without "
                      f"it is slower or does not fit)")
    lines.append("What limits it: " + (", ".join(limits) if limits else "compute: it runs at the cluster's achieved "
                                       "FLOP/s with little else") + ".")
    if len(ranked) > 1:
        r = ranked[1]
        rb = breakdown(r)
        diff = max(PARTS, key=lambda k: rb[k] - bd[k])
        if r.step_s - step <= 1e-6 * step:
            lines.append(f"Runner-up: {describe(r)}, the same {fmt_seconds(r.step_s)}, ranked lower for its memory "
                         f"({_gb(r.memory_bytes)} per GPU).")
        else:
            lines.append(f"Runner-up: {describe(r)}, {fmt_seconds(r.step_s)} (+{(r.step_s / step - 1) * 100:.1f}%), mostly "
                         f"{diff} (+{fmt_seconds(rb[diff] - bd[diff])}).")
    return "\n".join(lines)
