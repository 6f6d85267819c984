"""Memory optimisation: ZeRO (FSDP) and activation checkpointing — the bytes each saves, and what each costs.

ZeRO's stages (Rajbhandari et al. 2020; the article: "Stage 1 partitions the optimizer states ... Stage 2
additionally the gradients ... Stage 3 additionally the weights"): Ψ parameters, N data-parallel ranks, p/g/K bytes
per element of parameters, gradients and optimizer state (fp32 Adam here: 4, 4, 8):

    stage 0 (p+g+K)Ψ,   1: (p+g)Ψ + KΨ/N,   2: pΨ + (g+K)Ψ/N,   3 (= FSDP): (p+g+K)Ψ/N        bytes per rank

measured as the bytes of the distinct tensor storages each real rank holds after a step (`pslab memory --measure`'s
meter; Adam's per-tensor step counter, 4 B each, comes on top of the formula's K).

What stage 3 costs in bytes: plain data parallelism (and stages 1–2) all-reduce the gradients once per step,
2(N−1)/N·gΨ per rank (reduce-scatter + all-gather); stage 3 also all-gathers every layer's weights again before its
backward: 3(N−1)/N·gΨ, 1.5× — counted by the backend on a real run (experiments/results/bytes.py).

What it costs in time ("only pays off with fast interconnects"): stage 3 sends those bytes as a reduce-scatter and
two all-gathers per parameter tensor — 60× the messages of one flat all-reduce here — each paying the link's
latency. On a link of latency α and bandwidth β a message of B bytes costs α + B/β (`parallelism.comm_model`,
pslab's own algorithms); the step on a slow link ≈ the step on a fast link + the model's difference in
communication seconds between the two links.

Activation checkpointing (Chen et al. 2016; the article: "store only a few checkpoints and recompute the rest
during backward"): with every block checkpointed, backward keeps the block inputs and one block's activations at a
time (`memory_model.tiny_checkpointed_activation_bytes`) instead of every block's
(`sequence.model_activation_bytes`), for one more forward of the recomputed part per step:

    t_ckpt / t_plain ≈ (F + F_r + B) / (F + B) = 1 + F_r/(F + B)     (≈ 4/3 when B ≈ 2F and F_r ≈ F)

with F, B the measured forward and backward times and F_r the measured forward of the checkpointed children.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from pslab.experiments.config import example_config

from .core import Context, Figure, Modelled, Outcome, Step, pyplot, run_summary, save

SECTION = "Memory optimization: ZeRO and activation checkpointing"
KINDS = ("params", "grads", "optimizer")
STAGE_LABELS = {0: "dp=2", 1: "dp=2 zero1", 2: "dp=2 zero2", 3: "dp=2 zero3"}   # experiments/commands/memory.py
# emulated links for zero3-link (collectives/topology.py): 2 hosts of 1 rank, so the dp pair crosses the link
FAST = dict(latency_s=20e-6, bandwidth_Bps=2e9)     # NVLink's role, scaled to this machine
SLOW = dict(latency_s=3e-3, bandwidth_Bps=50e6)     # a slow inter-node link: 150x the latency, 1/40 the bandwidth


# ---- 1. ZeRO stages: bytes per rank ---------------------------------------------------------------------------

def _zero_stages_worker(group: Any, labels: list[str]) -> list[dict[str, Any]]:
    """One rank: `pslab memory --measure`'s meter for each configuration in turn (two steps, the second metered)."""
    import torch
    from pslab.experiments.commands.memory import measure_worker
    torch.set_num_threads(1)
    return [measure_worker(group, label) for label in labels]


def _model(label: str) -> Any:
    """A MEASURE configuration's model (`pslab memory --measure`'s)."""
    from pslab.experiments.commands.memory import _config
    from pslab.experiments.workloads import get_workload
    cfg = _config(label)
    wl = get_workload(cfg.workload.name, 1, cfg.workload.batch_size, cfg.workload.seed, **cfg.workload.overrides())
    return wl.make_model()


def _param_tensors(label: str) -> int:
    """Parameter tensors of a MEASURE configuration's model. Each has its own Adam `step` counter (a 4-byte tensor,
    ZeRO's per-parameter shards too): bytes the formula's K leaves out."""
    return sum(1 for q in _model(label).parameters() if q.requires_grad)


def _param_units(label: str) -> int:
    """Modules that own parameters directly in a MEASURE configuration's model: ZeRO-3's units, each with its own
    packed reduce-scatter and two all-gathers per step (parallelism/zero.py)."""
    return sum(1 for mod in _model(label).modules() if any(True for _ in mod.parameters(recurse=False)))


def zero_stages(ctx: Context) -> Outcome:
    from pslab import collectives
    from pslab.experiments.commands.memory import modelled
    from pslab.parallelism.memory_model import Layout, estimate

    stages = [0, 1, 2, 3]
    labels = [STAGE_LABELS[s] for s in stages]
    ranks = collectives.launch(_zero_stages_worker, 2, backend="zmq", args=(labels,), timeout=180)
    counters = 4 * _param_tensors(labels[0])           # Adam's step counters: 4 B per parameter tensor
    figures, rows = [], {}
    for i, (s, label) in enumerate(zip(stages, labels)):
        per_rank = [r[i] for r in ranks]
        model = modelled(label, per_rank[0])
        measured = max(sum(r[k] for k in KINDS) for r in per_rank)      # the fuller rank (they are equal here)
        theory = sum(model[k] for k in KINDS) + counters
        rows[s] = ({k: per_rank[0][k] for k in KINDS}, {k: model[k] for k in KINDS})
        formula = {0: "(p+g+K)Ψ", 1: "(p+g)Ψ + KΨ/N", 2: "pΨ + (g+K)Ψ/N", 3: "(p+g+K)Ψ/N"}[s]
        figures.append(Figure(f"ZeRO-{s} state per rank" + (" (FSDP)" if s == 3 else " (plain DP)" if s == 0 else ""),
                              measured, theory, "B", "=", 0.0,
                              f"storages on 2 real ranks vs {formula} + Adam's step counters ({counters} B); "
                              f"p=g=4, K=8, N=2"))
    psi = rows[0][1]["params"] / 4
    pic = _draw_zero(ctx.picture("zero-stages"), rows)
    big = {s: estimate(Layout(dp=64, zero=s), "mixed", params=7.5e9).total for s in stages}
    m0, m3 = rows[0][0], rows[3][0]
    return Outcome(
        figures=figures,
        modelled=[Modelled(f"7.5B model, N=64, ZeRO-{s}, per GPU", big[s] / 1e9, "GB",
                           "memory_model.estimate, mixed precision (2+2+12 B/param): the ZeRO paper's Fig. 1 example")
                  for s in (0, 3)],
        explanation=(
            f"Two real data-parallel ranks train the tiny transformer ({psi:,.0f} parameters, fp32 Adam) at each ZeRO "
            f"stage, and a meter adds up the storages each rank holds. Plain data parallelism keeps everything on "
            f"every rank: {sum(m0.values()):,} B. Stage 1 shards Adam's moments (the biggest part), stage 2 also the "
            f"gradients, stage 3 also the weights — PyTorch's FSDP is this stage 3 — down to "
            f"{sum(m3.values()):,} B, "
            + ("each to the byte what ZeRO's formula says (plus Adam's 4-byte step counter per tensor)" if
               all(f.agrees for f in figures) else "the table shows where the count departs from ZeRO's formula")
            + f". With N = 2 the "
            f"saving is at most 2×; the formula's 1/N is what makes it matter: a 7.5B model needs "
            f"{big[0] / 1e9:.0f} GB per GPU unsharded and {big[3] / 1e9:.2f} GB with ZeRO-3 over 64 GPUs."),
        picture=str(pic),
        notes=["measured: the bytes of the distinct tensor storages on each rank after its second step "
               "(pslab memory --measure's meter; ZeroReplica.state_bytes for the shards)"])


def _draw_zero(path: Path, rows: dict[int, tuple[dict, dict]]) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [f"ZeRO-{s}" + ("\n(FSDP)" if s == 3 else "") for s in rows]
    bottom = [0.0] * len(rows)
    for kind, color in zip(KINDS, ("#4C9BE8", "#F28E2B", "#59A14F")):
        vals = [rows[s][0][kind] / 1e3 for s in rows]
        ax.bar(names, vals, bottom=bottom, label=f"{kind} (measured)", color=color, width=0.6)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, s in enumerate(rows):
        model = sum(rows[s][1].values()) / 1e3
        ax.plot([i - 0.35, i + 0.35], [model, model], color="black", lw=1.5,
                label="formula (p+g+K terms)" if i == 0 else None)
        ax.annotate(f"{bottom[i]:.0f} kB", (i, bottom[i]), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("kB per rank (N = 2)")
    ax.set_ylim(0, max(bottom) * 1.3)
    ax.set_title("ZeRO stages: model state per rank, measured on 2 real ranks")
    ax.legend(fontsize=8)
    return save(fig, path)


# ---- 2. ZeRO-3's bytes ----------------------------------------------------------------------------------------

def _psi(seed: int = 0) -> int:
    """Ψ: the text-transformer workload model's parameter count."""
    from pslab.experiments.workloads import get_workload
    wl = get_workload("text-transformer", 1, 8, seed)
    return sum(q.numel() for q in wl.make_model().parameters())


def zero3_bytes(ctx: Context) -> Outcome:
    N = 2
    stages = [0, 3] if ctx.quick else [0, 1, 2, 3]
    psi = _psi(ctx.seed)
    S = 4 * psi                                          # fp32 gradients / weights, bytes
    base = ["train.workers=2", "parallel.tp=1", "train.steps=4", "train.eval_every=1000000",
            f"workload.seed={ctx.seed}"]
    got: dict[int, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory(prefix="pslab-tour-") as root:
        for s in stages:
            summ = run_summary(example_config("transformer_tp.toml"), base + [f"parallel.zero={s}"], root,
                               f"zero{s}")
            kinds = summ.get("bytes_by_kind") or {}
            kind = kinds["dp gradient sync" if s == 0 else "zero RS + AG"]
            got[s] = (kind["measured_per_step"] / N, kind["sends_per_step"] / N)
    figures = []
    for s in stages:
        k = 3 if s == 3 else 2
        figures.append(Figure(f"ZeRO-{s} bytes sent per rank per step", got[s][0], k * (N - 1) / N * S, "B", "=", 0.0,
                              f"the zmq backend's counters vs {k}(N−1)/N·Ψ·4 B (Ψ = {psi:,}, N = {N})"))
    figures.append(Figure("ZeRO-3 ÷ plain DP bytes", got[3][0] / got[0][0], 1.5, "×", "=", 0.0,
                          "measured ratio vs 3(N−1)/N ÷ 2(N−1)/N"))
    return Outcome(
        figures=figures,
        explanation=(
            f"The same model and batches, trained for real on 2 ranks, with the backend counting every byte it "
            f"sends. Plain data parallelism all-reduces the gradients once per step: a reduce-scatter and an "
            f"all-gather, 2(N−1)/N·4Ψ B per rank ({got[0][0]:,.0f} B). ZeRO-1 and -2 move the same bytes in another "
            f"order (reduce-scatter the gradients, update the own shard, all-gather the weights). ZeRO-3 keeps only "
            f"a shard of the weights, so it gathers every layer's weights before its forward and again before its "
            f"backward: 3(N−1)/N·4Ψ B per rank ({got[3][0]:,.0f} B), {got[3][0] / got[0][0]:.3g}× — and it sends "
            f"them as {got[3][1]:.0f} messages per rank per step instead of {got[0][1]:.0f} (for each layer -- a "
            f"module's weight and bias, packed -- a reduce-scatter and two all-gathers, each a ring of messages): "
            f"memory redundancy traded for more, and more frequent, communication."),
        notes=["bytes are the payload the zmq backend counted on a real 4-step run (summary bytes_by_kind), "
               "per step and per rank; the formula is the textbook ring volume with 4-byte elements"])


# ---- 3. ZeRO-3 on a fast and a slow link -----------------------------------------------------------------------

def _topology(link: dict[str, float]) -> Any:
    from pslab.collectives.topology import Topology
    return Topology(hosts=2, per_host=1, intra_latency_s=FAST["latency_s"], intra_bandwidth_Bps=FAST["bandwidth_Bps"],
                    inter_latency_s=link["latency_s"], inter_bandwidth_Bps=link["bandwidth_Bps"])


def _comm_seconds(zero: int, link: dict[str, float]) -> float:
    """The comm model's seconds per step of the dp / ZeRO communication of a dp = 2 layout whose pair crosses
    `link` (pslab's own algorithms: per-message latency hop by hop, bytes / bandwidth)."""
    from pslab.experiments.studies.plan_check import layout_of, shape_of
    from pslab.parallelism.cluster import Cluster
    from pslab.parallelism.comm_model import step_comm
    cl = Cluster("link", 1, 2, 80e9, 1e12, 1.0, FAST["bandwidth_Bps"], FAST["latency_s"], link["bandwidth_Bps"],
                 link["latency_s"])
    terms = step_comm(shape_of(), layout_of({"dp": 2, "zero": zero}), cl, algorithm="pslab", act_bytes=4,
                      grad_bytes=4)
    return sum(t.seconds for t in terms)


def zero3_link(ctx: Context) -> Outcome:
    from pslab.experiments.studies.plan_check import run_config
    repeats, steps = (1, 10) if ctx.quick else (3, 12)
    links = {"fast": FAST, "slow": SLOW}
    runs: dict[tuple[str, int], list[float]] = {(n, z): [] for n in links for z in (0, 3)}
    inter: dict[int, float] = {}                       # bytes per step over the slow link, all ranks
    with tempfile.TemporaryDirectory(prefix="pslab-tour-") as root:
        for _ in range(repeats):                      # configs take turns: a drift in load hits all alike
            for name, link in links.items():
                for z in (0, 3):
                    r = run_config({"dp": 2, "zero": z}, _topology(link), steps=steps, root=root)
                    runs[(name, z)].append(r["step_s"])
                    if name == "slow":
                        inter[z] = r["bytes_by_link"].get("inter", 0.0)
    t = {k: statistics.median(v) for k, v in runs.items()}
    comm = {(n, z): _comm_seconds(z, link) for n, link in links.items() for z in (0, 3)}
    extra = {z: comm[("slow", z)] - comm[("fast", z)] for z in (0, 3)}
    slow_ratio = t[("slow", 3)] / t[("slow", 0)]
    fast_ratio = t[("fast", 3)] / t[("fast", 0)]
    collectives_per_step = 3 * _param_units(STAGE_LABELS[3])       # RS + 2 AG per unit (zero.py)
    big = _big_model_ratios()
    pic = _draw_link(ctx.picture("zero3-link"), t, comm)
    ms = lambda x: f"{x * 1e3:.1f} ms"    # noqa: E731
    return Outcome(
        figures=[
            Figure("ZeRO-3's extra step time on the slow link", (t[("slow", 3)] - t[("fast", 3)]) * 1e3,
                   extra[3] * 1e3, "ms", "=", 0.3,
                   "measured slow − fast medians vs comm_model.step_comm seconds (slow − fast link)", timed=True),
            Figure("bytes over the slow link per step, ZeRO-3 ÷ ZeRO-0", inter[3] / inter[0], 1.5, "×", "=", 0.0,
                   f"the link emulator's counters ({inter[3]:,.0f} vs {inter[0]:,.0f} B) vs 3(N−1)/N ÷ 2(N−1)/N"),
        ],
        modelled=[Modelled(f"GPT 7.5B, dp = 8, ZeRO-3 ÷ ZeRO-0 step, {where}", big[where], "×",
                           "step_model.predict on the dgx-h100 preset (NVLink 450 GB/s, InfiniBand 50 GB/s per GPU), "
                           "mixed precision, m = 4, gradient sync overlapped with backward")
                  for where in ("NVLink (one node)", "InfiniBand (8 nodes)")],
        explanation=(
            f"Two real ranks on two emulated hosts train the tiny transformer with plain data parallelism (ZeRO-0) "
            f"and with ZeRO-3, once over a fast link ({FAST['latency_s'] * 1e6:.0f} µs, "
            f"{FAST['bandwidth_Bps'] / 1e9:.0f} GB/s) and once over a slow one ({SLOW['latency_s'] * 1e3:.0f} ms, "
            f"{SLOW['bandwidth_Bps'] / 1e6:.0f} MB/s). On the fast link ZeRO-3's step is {fast_ratio:.1f}× plain "
            f"DP's ({ms(t[('fast', 3)])} vs {ms(t[('fast', 0)])}: here its many small messages cost CPU time, which "
            f"a GPU would hide behind compute); on the slow link it is {slow_ratio:.1f}× "
            f"({ms(t[('slow', 3)])} vs {ms(t[('slow', 0)])}). The comm model explains the difference: ZeRO-3 pays "
            f"the link's latency for each of its {collectives_per_step} collectives per step "
            f"({ms(comm[('slow', 3)])} on the slow link vs {ms(comm[('slow', 0)])} for plain DP's one all-reduce). "
            f"Sharding the weights is worth it only where the interconnect makes that communication cheap enough to "
            f"hide: the same model of a 7.5B GPT on 8 H100s says ZeRO-3 costs {big['NVLink (one node)']:.2f}× "
            f"plain DP's step inside one NVLink node (the memory saved at about no time) and "
            f"{big['InfiniBand (8 nodes)']:.1f}× across 8 InfiniBand nodes (plain DP is the yardstick there, not an "
            f"option: it needs 120 GB per GPU)."),
        picture=str(pic),
        notes=[f"timing-based: medians of {repeats} run(s) per config × {steps - 2} steps after warm-up (summary "
               "step_time_s, max over ranks); 30 %: emulated delays are lower bounds (scheduler wake-ups) and ZeRO-3 "
               "prefetches the next layer's gather behind compute, which the model does not credit",
               "links are emulated (collectives/topology.py): each message is held until latency + bytes/bandwidth "
               "after it was sent; slowed far below InfiniBand so the difference shows against this CPU's compute"])


def _big_model_ratios() -> dict[str, float]:
    """The planner's step model for a 7.5B GPT (Narayanan et al.'s shape) on dp = 8 inside one DGX H100 (NVLink)
    and across 8 nodes (InfiniBand): ZeRO-3's step time over ZeRO-0's."""
    import dataclasses
    from pslab.parallelism import step_model
    from pslab.parallelism.cluster import preset
    from pslab.parallelism.memory_model import Layout
    from pslab.parallelism.published import PUBLISHED
    shape = PUBLISHED["gpt-7.5b"].shape(1)
    out = {}
    for where, nodes, per_node in (("NVLink (one node)", 1, 8), ("InfiniBand (8 nodes)", 8, 1)):
        cluster = dataclasses.replace(preset("dgx-h100"), nodes=nodes, gpus_per_node=per_node)
        step = {z: step_model.predict(shape, Layout(dp=8, zero=z), cluster, 32, precision="mixed").step_s
                for z in (0, 3)}
        out[where] = step[3] / step[0]
    return out


def _draw_link(path: Path, t: dict, comm: dict) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    xs = [0, 1]
    for z, off, color in ((0, -0.18, "#4C9BE8"), (3, 0.18, "#E15759")):
        vals = [t[(n, z)] * 1e3 for n in ("fast", "slow")]
        ax.bar([x + off for x in xs], vals, width=0.34, color=color, label=f"ZeRO-{z} measured")
        pred = [t[("fast", z)] * 1e3, (t[("fast", z)] + comm[("slow", z)] - comm[("fast", z)]) * 1e3]
        ax.scatter([x + off for x in xs], pred, color="black", marker="_", s=300, zorder=3,
                   label="fast-link step + modelled extra comm" if z == 0 else None)
    ax.set_xticks(xs, ["fast link", "slow link"])
    ax.set_ylabel("step time, ms (median)")
    ax.set_yscale("log")
    ax.set_title("ZeRO-3 vs plain DP on an emulated fast and slow link (2 ranks)")
    ax.legend(fontsize=8)
    return save(fig, path)


# ---- 4. Activation checkpointing -------------------------------------------------------------------------------

def _timed_steps(plain: Any, ckpt: Any, x: Any, y: Any, reps: int) -> dict[str, float]:
    """Median times (s): the plain model's forward (F) and whole step, its checkpointed children's forward (F_r),
    and the checkpointed model's step; the two models take turns. Timed in this thread's CPU time (one torch thread
    runs forward and backward here): what the work costs, whatever else the machine runs meanwhile."""
    from pslab.parallelism.models import lm_loss
    clock = time.thread_time
    fw, step, fr, ck = [], [], [], []
    for r in range(reps + 1):
        plain.zero_grad(set_to_none=True)
        t0 = clock()
        loss = lm_loss(plain(x), y)
        t1 = clock()
        loss.backward()
        t2 = clock()
        h = plain[0](x).detach().requires_grad_()    # the embedding's output: input of the checkpointed children
        t3 = clock()
        plain[1:](h)
        t4 = clock()
        ckpt.zero_grad(set_to_none=True)
        t5 = clock()
        lm_loss(ckpt(x), y).backward()
        t6 = clock()
        if r:                                        # the first round warms up
            fw.append(t1 - t0)
            step.append(t2 - t0)
            fr.append(t4 - t3)
            ck.append(t6 - t5)
    return {"F": statistics.median(fw), "step": statistics.median(step), "F_r": statistics.median(fr),
            "ckpt": statistics.median(ck)}


def checkpointing(ctx: Context) -> Outcome:
    import torch
    from pslab.parallelism.checkpointing import CheckpointWrapper, measure, wrap_children
    from pslab.parallelism.memory_model import Layout, Shape, estimate, tiny_checkpointed_activation_bytes
    from pslab.parallelism.models import lm_loss, tiny_transformer
    from pslab.parallelism.sequence import model_activation_bytes

    torch.set_num_threads(1)
    V, d, a, L, s, b = 64, 128, 4, 4, 64, 16        # big enough that compute, not Python, sets the times
    reps = 5 if ctx.quick else 9
    factory = lambda: tiny_transformer(V, d, a, L, s, seed=ctx.seed)   # noqa: E731
    g = torch.Generator().manual_seed(ctx.seed)
    x, y = torch.randint(0, V, (b, s), generator=g), torch.randint(0, V, (b, s), generator=g)
    mem = measure(factory, x, y, lm_loss, repeats=2)
    plain, ckpt = factory(), wrap_children(factory())
    times = _timed_steps(plain, ckpt, x, y, reps)
    forwards = [w.forwards for w in ckpt.modules() if isinstance(w, CheckpointWrapper) and w.forwards]
    per_step = max(forwards) / (reps + 1)
    F, Fr, step = times["F"], times["F_r"], times["step"]
    B = step - F
    ratio, theory = times["ckpt"] / step, 1 + Fr / (F + B)
    plain_b, ck_b = model_activation_bytes(b, s, d, a, L, V), tiny_checkpointed_activation_bytes(b, s, d, a, L, V)
    gpt3 = Shape(96, 12288, 96, 2048, 51200, 1)
    big = {rc: estimate(Layout(tp=8, pp=8, recompute=rc, micro_batches=8), "mixed", shape=gpt3).get("activations")
           for rc in ("none", "full")}
    pic = _draw_ckpt(ctx.picture("checkpointing"), mem, plain_b, ck_b, times)
    return Outcome(
        figures=[
            Figure("saved activations, no checkpointing", mem["peak_bytes_plain"], plain_b, "B", "=", 0.0,
                   "ActivationMeter's peak (autograd's saved tensors) vs sequence.model_activation_bytes"),
            Figure("saved activations, every block checkpointed", mem["peak_bytes_checkpointed"], ck_b, "B", "=", 0.0,
                   "ActivationMeter's peak vs memory_model.tiny_checkpointed_activation_bytes"),
            Figure("forwards of each block per step", per_step, 2.0, "", "=", 0.0,
                   "CheckpointWrapper's counter: the forward and its recomputation in backward"),
            Figure("step time, checkpointed ÷ plain", ratio, theory, "×", "=", 0.15,
                   f"medians of {reps} interleaved steps (the thread's CPU time) vs 1 + F_r/(F+B) from measured F = {F * 1e3:.1f} ms, "
                   f"B = {B * 1e3:.1f} ms, F_r = {Fr * 1e3:.1f} ms", timed=True),
        ],
        modelled=[Modelled("GPT-3 175B activations per GPU, no recompute", big["none"] / 1e9, "GB",
                           "memory_model (Korthikanti et al. 2022), tp = 8, pp = 8, m = 8, mixed precision"),
                  Modelled("GPT-3 175B activations per GPU, full recompute", big["full"] / 1e9, "GB",
                           "the same, keeping only each layer's input (2sbh)")],
        explanation=(
            f"A {L}-block transformer (width {d}, {s} tokens, batch {b}) trains one step with and without "
            f"checkpointing, and a hook on autograd counts every tensor saved for backward. Plain, backward needs "
            f"{mem['peak_bytes_plain'] / 1e6:.2f} MB of activations; with every block checkpointed only the block "
            f"inputs stay and one block is rebuilt at a time: {mem['peak_bytes_checkpointed'] / 1e6:.2f} MB "
            f"({mem['peak_bytes_plain'] / mem['peak_bytes_checkpointed']:.1f}× less), both to the byte what the "
            f"model counts. The price is compute: each block runs its forward twice, and the step takes "
            f"{ratio:.2f}× as long, as one more forward of the recomputed part predicts from the measured forward "
            f"and backward ({theory:.2f}×; backward is {B / F:.1f}× forward here; with backward = 2 × forward and the whole model recomputed, the "
            f"textbook's 4/3). At "
            f"GPT-3's size the same trade turns {big['none'] / 1e9:.0f} GB of activations per GPU into "
            f"{big['full'] / 1e9:.0f} GB — compute is cheap next to the memory wall."),
        picture=str(pic),
        notes=["bytes: exact counts of autograd's saved tensors (fp32, the model's own formula per tensor)",
               "the time ratio is timing-based (one thread's CPU time, interleaved steps): within 15 %"])


def _draw_ckpt(path: Path, mem: dict, plain_b: int, ck_b: int, times: dict) -> Path:
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 3.6))
    names = ["plain", "checkpointed"]
    a1.bar(names, [mem["peak_bytes_plain"] / 1e6, mem["peak_bytes_checkpointed"] / 1e6], color=["#4C9BE8", "#59A14F"],
           label="measured")
    a1.scatter(names, [plain_b / 1e6, ck_b / 1e6], color="black", marker="_", s=400, zorder=3, label="model")
    a1.set_ylabel("peak saved activations, MB")
    a1.legend(fontsize=8)
    F, step = times["F"] * 1e3, times["step"] * 1e3
    a2.bar(["plain"], [F], color="#4C9BE8", label="forward")
    a2.bar(["plain"], [step - F], bottom=[F], color="#F28E2B", label="backward")
    a2.bar(["checkpointed"], [times["ckpt"] * 1e3], color="#59A14F", label="checkpointed step")
    a2.axhline(step + times["F_r"] * 1e3, color="black", lw=1, ls="--", label="plain + one more forward")
    a2.set_ylabel("ms per step (median)")
    a2.set_ylim(0, max(times["ckpt"], times["step"] + times["F_r"]) * 1e3 * 1.35)
    a2.legend(fontsize=7, loc="upper left")
    fig.suptitle("activation checkpointing: memory for compute", fontsize=10)
    return save(fig, path)


STEPS = [
    Step("zero-stages", SECTION, "ZeRO stage 1 partitions the optimizer states, stage 2 also the gradients, stage 3 "
         "(≈ FSDP) also the weights", 'pslab memory --measure --configs "dp=2,dp=2 zero1,dp=2 zero2,dp=2 zero3"',
         zero_stages, 20),
    Step("zero3-bytes", SECTION, "ZeRO-3 replaces memory redundancy with more communication: weights fetched "
         "just-in-time via all-gather", "pslab run experiments/configs/transformer_tp.toml --set parallel.tp=1 "
         "--set parallel.zero=3", zero3_bytes, 20),
    Step("zero3-link", SECTION, "ZeRO-3 only pays off with fast interconnects that hide its communication",
         "pslab run experiments/configs/topology_tp.toml --set parallel.tp=1 --set train.workers=4 "
         "--set parallel.zero=3", zero3_link, 40),
    Step("checkpointing", SECTION, "activation checkpointing stores a few checkpoints and recomputes the rest in "
         "backward: compute traded for memory", 'pslab memory --measure --configs "dp=2,ckpt"', checkpointing, 15),
]
