"""At even larger scale (the topology section's last paragraph): sequence / context parallelism, since attention's memory
scales quadratically with sequence length, and expert parallelism, whose communication is an all-to-all.

Attention memory (ring_attention.attention_memory): saved for backward per layer, batch B, width d, H heads,
    naive (probabilities kept)   4·B·S·d + B·H·S²  (∝ S² once S ≫ 4d/H)
    flash-style (PyTorch's SDPA) 4·B·S·d + B·H·S   (∝ S)
measured with autograd's saved-tensor hooks (checkpointing.ActivationMeter); slopes of log bytes vs log S ≈ 2, 1.

Context parallelism (ring attention, cp = C): every saved activation on S/C tokens, per rank (M₁ − 4)/C + 4
(M₁ one process's, parallelism/sequence.model_activation_bytes; 4 B the loss); bytes per step = the planner's "cp
ring + grads": per layer 6C − 4 K/V blocks of b·(S/C)·d·4 B, + the gradients all-reduced over cp.

Expert parallelism (experiments/configs/moe_ep.toml, ep = 2; G the worker's sequences, one routing group each, E
experts, C = ceil(capacity_factor·top_k·S/E) slots per (sequence, expert)): per MoE layer and step 4 all-to-alls
(dispatch, combine, forward and backward) of the (G/ep)·E·C·d·4 B buffer, (ep−1)/ep of it leaving each rank; + the
replicated parameters' gradients (R B) and the loss (4 B) all-reduced over ep:
    D·ep·(4·L·(ep−1)/ep·(G/ep)·E·C·d·4 + AR_ep(R + 4))
An all-reduce of the same buffer would send 2(ep−1)/ep·S (ring; (ep−1)·S direct for ≤ 32 KiB): 2× at ep = 2.
"""

from __future__ import annotations

import math
import statistics
import tempfile
from pathlib import Path
from typing import Any

from pslab.experiments.config import example_config

from .core import Context, Figure, Modelled, Outcome, Step, kinds, pyplot, run_summary, save

SECTION = "Why hardware topology dictates your parallelism layout"
TIME_SLACK = 0.10           # step-time ratios against the planner's bound: the noise of medians of 3 runs here


# ---- shared helpers ------------------------------------------------------------------------------------------
def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log y against log x."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


# ---- 3. attention memory: S² vs S -----------------------------------------------------------------------------
def attention_memory(ctx: Context) -> Outcome:
    from pslab.parallelism.ring_attention import measure_attention_memory
    B, d, H = 1, 32, 8
    seqs = [128, 256, 512] if ctx.quick else [128, 256, 512, 1024]
    rows = measure_attention_memory(seqs, B, d, H, ctx.seed)
    saved = {k: [r[k] for r in rows] for k in ("naive", "flash")}
    theory = {k: [r[f"{k}_model"] for r in rows] for k in saved}
    diff = max(r["max_diff"] for r in rows)
    slope = {k: _slope(seqs, v) for k, v in saved.items()}
    _draw_attention(ctx.picture("attention-memory"), seqs, saved, theory)
    mod = _long_context_rows()
    S = seqs[-1]
    return Outcome(
        figures=[
            Figure(f"naive: saved bytes at S={S}", saved["naive"][-1], theory["naive"][-1], "B", "=", 0.0,
                   "saved-tensor hooks (ActivationMeter peak); 4·B·S·d + B·H·S² fp32"),
            Figure(f"flash-style: saved bytes at S={S}", saved["flash"][-1], theory["flash"][-1], "B", "=", 0.0,
                   "hooks; 4·B·S·d + B·H·S (q, k, v, out, log-sum-exp)"),
            Figure("naive: log-log slope of bytes vs S", slope["naive"], 2.0, "", "=", 0.05,
                   f"least squares over S = {seqs}; → 2 once B·H·S² ≫ 4·B·S·d"),
            Figure("flash-style: log-log slope of bytes vs S", slope["flash"], 1.0, "", "=", 0.02,
                   f"least squares over S = {seqs}"),
        ],
        modelled=mod,
        explanation=(
            f"One attention layer (width {d}, {H} heads), forward and backward, with autograd's saved tensors "
            f"counted as they are kept. Materialising the scores keeps the softmax probabilities, B·H·S² numbers: "
            f"from S = {seqs[0]} to {S} the saved bytes grow {saved['naive'][-1] / saved['naive'][0]:.0f}× for "
            f"{S // seqs[0]}× the sequence (slope {slope['naive']:.2f} on log-log axes), to the byte what the formula "
            f"says. A flash-style kernel (PyTorch's fused CPU attention) computes the same output (max difference "
            f"{diff:.1e}) but keeps only q, k, v, the output and one log-sum-exp per row, and recomputes the scores "
            f"in backward: slope {slope['flash']:.2f}. Quadratic memory made long contexts impossible; with "
            f"flash-style kernels they are linear but still large (the model rows below: hundreds of GB at 128k "
            f"tokens), the reason to split the sequence itself — context parallelism, next."),
        picture=str(ctx.picture("attention-memory")),
        notes=["saved bytes are counted from tensor storages (each storage once, parameters and the leaf input "
               "excluded): exact; the naive slope over these sizes is a little under 2 because 4·B·S·d is linear"])


def _long_context_rows() -> list[Modelled]:
    from pslab.parallelism.memory_model import Layout, Shape, estimate
    shape = Shape(32, 4096, 32, 32768, 32000, 1)

    def act(lay: Layout) -> float:
        return estimate(lay, "mixed", shape=shape).get("activations") / 1e12
    return [Modelled("7B-class, 32k tokens, scores kept: activations", act(Layout()), "TB",
                     "memory_model.estimate (Korthikanti et al.: sbh(34 + 5as/h) per layer, 32 layers, bf16)"),
            Modelled("the same, scores recomputed (flash / selective)", act(Layout(recompute="selective")), "TB",
                     "memory_model.estimate, recompute 'selective': sbh·34 per layer")]


def _draw_attention(path: Path, seqs: list[int], saved: dict, theory: dict) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for k, col in (("naive", "tab:red"), ("flash", "tab:blue")):
        ax.loglog(seqs, theory[k], "-", color=col, alpha=0.5, label=f"{k}: formula")
        ax.loglog(seqs, saved[k], "o", color=col, label=f"{k}: measured")
    ax.set_xlabel("sequence length S")
    ax.set_ylabel("bytes saved for backward")
    ax.set_title("one attention layer: S² (scores kept) vs S (flash-style)")
    ax.legend()
    save(fig, path)


# ---- 4. context parallelism -------------------------------------------------------------------------------------
def context_parallel(ctx: Context) -> Outcome:
    from pslab.experiments.config import load_config
    from pslab.experiments.studies.plan_check import shape_of
    from pslab.parallelism.comm_model import bytes_by_kind, step_comm
    from pslab.parallelism.memory_model import Layout
    from pslab.parallelism.sequence import model_activation_bytes
    steps = 3 if ctx.quick else 5
    cps = [1, 2, 4]
    base = ["parallel.tp=1", "train.workers=1", f"train.steps={steps}", "train.eval_every=1000000",
            f"workload.seed={ctx.seed}"]
    runs = {}
    with tempfile.TemporaryDirectory(prefix="tour-cp-") as root:
        for c in cps:
            ctx.say(f"  cp={c}")
            runs[c] = run_summary(example_config("transformer_tp"), base + [f"parallel.cp={c}"], root, f"cp={c}")
    cfg = load_config(example_config("transformer_tp"), base)
    b = cfg.workload.batch_size
    shape = shape_of(b)                                  # the workload's transformer, micro-batch = the batch
    S = shape.seq
    M1 = model_activation_bytes(b, S, shape.hidden, shape.heads, shape.layers, shape.vocab)
    mem = {c: max(runs[c]["activations"]["per_rank"]) for c in cps}
    want = {c: (M1 - 4) // c + 4 if c > 1 else M1 for c in cps}
    cp_bytes = {c: kinds(runs[c]).get("cp ring + grads", 0.0) for c in cps}
    model = {c: bytes_by_kind(step_comm(shape, Layout(cp=c), _free_cluster(c), algorithm="pslab", act_bytes=4,
                                        grad_bytes=4, steps=steps)).get("cp ring + grads", 0.0) for c in cps}
    figs = [Figure(f"cp={c}: ring + grads bytes/step", cp_bytes[c], model[c], "B", "=", 0.0,
                   "cp group's counters, all ranks; planner comm_model: per rank L·(6C−4) blocks (K, V forward; "
                   "dK, dV backward) of b·(S/C)·d·4 B, × C ranks, + AR_C(grads) + AR_C(8 B loss)") for c in cps if c > 1]
    figs += [Figure(f"cp={c}: saved activations per rank", mem[c], want[c], "B", "=", 0.0,
                    "ActivationMeter peak, max over ranks; " + ("M₁ (Korthikanti per layer + embedding, head)"
                                                               if c == 1 else f"(M₁ − 4)/{c} + 4"))
             for c in cps]
    figs.append(Figure(f"per-rank activations, cp={cps[-1]} ÷ cp=1", mem[cps[-1]] / mem[1], 1 / cps[-1], "×", "=",
                       0.01, "measured ratio vs 1/C (the 4 B loss is not split)"))
    _draw_cp(ctx.picture("context-parallel"), cps, mem, want, cp_bytes, model)
    return Outcome(
        figures=figs,
        explanation=(
            f"The tiny transformer's {S}-token sequences split over C ranks by ring attention (zig-zag chunks, K and "
            f"V passed around the ring, a flash-style backward). Each rank keeps only its S/C tokens' activations: "
            f"{mem[1] / 1e3:.0f} kB in one process, {mem[2] / 1e3:.0f} kB per rank at C = 2, "
            f"{mem[4] / 1e3:.0f} kB at C = 4 — 1/C, to the byte of the formula. The price is communication that "
            f"plain data parallelism does not have: per layer 6C − 4 K/V blocks around the ring every step "
            f"({cp_bytes[2] / 1e3:.0f} kB at C = 2, {cp_bytes[4] / 1e3:.0f} kB at C = 4 with the gradient sync), "
            f"exactly what the planner counts. That is the trade for very long contexts: memory per GPU that no "
            f"longer grows with the whole sequence, for ring traffic inside the cp group."),
        modelled=_cp_rows(),
        picture=str(ctx.picture("context-parallel")),
        notes=["runs: one data-parallel worker (train.workers = 1) split into C = 1, 2, 4 processes; bytes and "
               "activation peaks are counters: exact"])


def _free_cluster(n: int) -> Any:
    from pslab.parallelism.cluster import Cluster
    return Cluster("here", n, 1, 1e12, 1e30, 1.0)


def _cp_rows() -> list[Modelled]:
    from pslab.parallelism.memory_model import Layout, Shape, estimate
    shape = Shape(32, 4096, 32, 131072, 32000, 1)

    def act(c: int) -> float:
        return estimate(Layout(cp=c, recompute="selective"), "mixed", shape=shape).get("activations") / 1e9
    return [Modelled("7B-class, 128k tokens, flash-style: activations, cp=1", act(1), "GB",
                     "memory_model.estimate, recompute 'selective' (no S² term), 32 layers, bf16"),
            Modelled("the same, cp=8 (per GPU)", act(8), "GB", "every activation on S/8 tokens")]


def _draw_cp(path: Path, cps: list[int], mem: dict, want: dict, cp_bytes: dict, model: dict) -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    a.bar([str(c) for c in cps], [mem[c] / 1e3 for c in cps], color="tab:blue", label="measured")
    a.plot([str(c) for c in cps], [want[c] / 1e3 for c in cps], "k_", markersize=22, label="(M₁ − 4)/C + 4")
    a.set_xlabel("context-parallel degree C")
    a.set_ylabel("saved activations per rank (kB)")
    a.legend()
    b.bar([str(c) for c in cps[1:]], [cp_bytes[c] / 1e3 for c in cps[1:]], color="tab:orange", label="measured")
    b.plot([str(c) for c in cps[1:]], [model[c] / 1e3 for c in cps[1:]], "k_", markersize=22, label="planner")
    b.legend()
    b.set_xlabel("C")
    b.set_ylabel("cp ring + grads, kB per step")
    save(fig, path)


# ---- 5. expert parallelism: an all-to-all -----------------------------------------------------------------------
def _ep_worker(group: Any, name: str, batch: int, seed: int, wl_overrides: dict) -> dict[str, Any]:
    """One ep rank of one worker (dp = 1 × ep = world): the expert-parallel engine's forward + backward on the
    worker's first batch with every collective logged (payload and the bytes the backend sent), then the same
    buffers all-reduced instead, logged alike."""
    import torch
    from pslab.experiments.workloads import get_workload
    from pslab.parallelism.comm import Comm, CommLog
    from pslab.parallelism.expert import ExpertParallelEngine
    from pslab.parallelism.mesh import DeviceMesh
    torch.set_num_threads(1)
    wl = get_workload(name, 1, batch, seed, **wl_overrides)
    mesh = DeviceMesh(group, dp=1, ep=group.world_size)
    log = CommLog()
    replica = ExpertParallelEngine(log=log).build(wl.make_model, mesh)
    x, y, _ = wl.batch(0, 0)
    replica.forward_backward(x, y)
    a2a = [p for k, _, p, _ in log.records if k == "all_to_all" and p]
    other = CommLog()
    comm = Comm(mesh.group("ep"), other)
    for p in a2a:
        comm.all_reduce(torch.zeros(p // 4), site="the same buffer")
    return {"wire": log.by_kind(), "calls": log.calls("all_to_all"), "allreduce_wire": other.by_kind()["all_reduce"]}


def _ring_or_direct(nbytes: float, n: int) -> float:
    """Bytes one rank sends to all-reduce nbytes over n ranks in pslab's zmq backend (≤ 32 KiB: direct)."""
    from pslab.collectives.zmq_group import SMALL_BYTES
    return 0.0 if n == 1 else (n - 1) * nbytes if nbytes <= SMALL_BYTES else 2 * (n - 1) / n * nbytes


def expert_parallel(ctx: Context) -> Outcome:
    from pslab import collectives
    from pslab.experiments.config import load_config
    from pslab.experiments.workloads import get_workload
    from pslab.parallelism.moe import capacity
    steps = 4 if ctx.quick else 8
    ov = [f"train.steps={steps}", "train.eval_every=1000000", f"workload.seed={ctx.seed}"]
    cfg = load_config(example_config("moe_ep"), ov)
    with tempfile.TemporaryDirectory(prefix="tour-ep-") as root:
        ctx.say("  moe_ep run")
        s = run_summary(example_config("moe_ep"), ov, root, "ep=2")
    w, ep = cfg.workload, cfg.parallel.ep
    D, b = cfg.train.workers, w.batch_size
    ctx.say("  ep engine, collectives logged")
    res = collectives.launch(_ep_worker, ep, "zmq", args=(w.name, b, w.seed, w.overrides()), timeout=120)
    wl = get_workload(w.name, D, b, w.seed, **w.overrides())
    model = wl.make_model()
    S, d = int(wl.data.x_train.shape[1]), model[0].tok.embedding_dim
    L = sum(1 for n, _ in model.named_modules() if n.endswith(".mlp"))
    C = capacity(S, w.experts, w.top_k, w.capacity_factor)          # per (sequence, expert)
    groups = b // ep                                                 # G/ep: a rank's sequences (routing groups)
    buf = groups * w.experts * C * d * 4                             # one dispatch / combine buffer, bytes
    a2a_rank = 4 * L * (ep - 1) / ep * buf
    R = 4 * sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    kind = D * ep * (a2a_rank + _ring_or_direct(R + 4, ep))
    measured_kind = kinds(s)["ep all-to-all + grads"]
    a2a_meas = statistics.median(r["wire"]["all_to_all"] for r in res)
    ar_meas = statistics.median(r["allreduce_wire"] for r in res)
    moe = s["moe"]
    routed_want = moe["sequences"] * S * w.top_k * L
    admitted = moe["routed"] - moe["dropped"]
    loads = {name: layer["routed"] for name, layer in moe["layers"].items()}
    _draw_ep(ctx.picture("expert-parallel"), moe, a2a_meas, ar_meas)
    hot = max(max(v) / statistics.fmean(v) for v in loads.values())
    return Outcome(
        figures=[
            Figure("ep bytes/step: all-to-alls + grads (run)", measured_kind, kind, "B", "=", 0.0,
                   "ep group's counters, all ranks; D·ep·(4L·(ep−1)/ep·(G/ep)·E·C·d·4 + AR_ep(R + 4))"),
            Figure("all-to-all bytes per rank per step", a2a_meas, a2a_rank, "B", "=", 0.0,
                   "the engine's CommLog (bytes the backend sent); 4L·(ep−1)/ep·(G/ep)·E·C·d·4"),
            Figure("all-to-all calls per rank per step", statistics.median(r["calls"] for r in res), 4 * L, "", "=",
                   0.0, "CommLog; dispatch + combine, forward and backward, per MoE layer"),
            Figure("all-reduce of the same buffers ÷ all-to-all", ar_meas / a2a_meas,
                   _ring_or_direct(buf, ep) / ((ep - 1) / ep * buf), "×", "=", 0.0,
                   "counted; (ep−1)·S direct (≤ 32 KiB) or 2(ep−1)/ep·S ring, over (ep−1)/ep·S"),
            Figure("tokens routed (all MoE layers)", moe["routed"], routed_want, "tokens", "=", 0.0,
                   "the routers' counts over the run; sequences × S × top_k × L"),
        ],
        explanation=(
            f"A mixture-of-experts transformer, {w.experts} experts per layer split over ep = {ep} ranks (×{D} data-"
            f"parallel workers). Each MoE layer routes every token to its expert's rank and back: 4 all-to-alls per "
            f"layer and step (dispatch, combine, and their backward), each sending (ep−1)/ep of a {buf / 1e3:.1f} kB "
            f"buffer — {a2a_meas / 1e3:.1f} kB per rank per step, exactly as counted; only the replicated "
            f"parameters' gradients are all-reduced. An all-to-all is a permutation: each token crosses once, to the "
            f"one rank that needs it; all-reducing the same buffers would send {ar_meas / a2a_meas:.0f}× the bytes "
            f"and sum tokens that must stay apart. The buffers are padded to a capacity of C = {C} tokens per "
            f"(sequence, expert), so the bytes do not depend on the routing; the routing decides what is lost: the "
            f"busiest expert got {hot:.1f}× the mean load and {moe['drop_fraction']:.0%} of the assignments "
            f"({admitted:,} of {moe['routed']:,} admitted) were dropped beyond capacity — the all-to-all's 'own can "
            f"of worms' (with dropless routing the same imbalance would decide who waits)."),
        picture=str(ctx.picture("expert-parallel")),
        notes=[f"run: experiments/configs/moe_ep.toml, {steps} steps; the per-op split from a 2-rank launch of the "
               "same engine on the worker's first batch (the run's counters sum all ops of the ep group)",
               "all figures are counters: exact"])


def _draw_ep(path: Path, moe: dict, a2a: float, ar: float) -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [3, 1]})
    layers = list(moe["layers"])
    E = len(moe["layers"][layers[0]]["routed"])
    for i, name in enumerate(layers):
        r, dr = moe["layers"][name]["routed"], moe["layers"][name]["dropped"]
        xs = [i * (E + 1) + e for e in range(E)]
        a.bar(xs, [x - y for x, y in zip(r, dr)], color="tab:blue", label="admitted" if i == 0 else None)
        a.bar(xs, dr, bottom=[x - y for x, y in zip(r, dr)], color="tab:red", label="dropped" if i == 0 else None)
    a.set_xticks([i * (E + 1) + e for i in range(len(layers)) for e in range(E)],
                 [f"{n}\ne{e}" if e == 0 else f"e{e}" for n in layers for e in range(E)], fontsize=7)
    a.set_ylabel("tokens routed (run)")
    a.set_title("expert load per MoE layer")
    a.legend()
    b.bar(["all-to-all", "all-reduce\n(same buffers)"], [a2a / 1e3, ar / 1e3], color=["tab:green", "tab:gray"])
    b.set_ylabel("kB sent per rank per step")
    save(fig, path)


STEPS = [
    Step("attention-memory", SECTION, "Attention's memory scales quadratically with sequence length",
         "pslab memory --measure --configs dp=2 --attention-seqs 128,256,512,1024,2048", attention_memory, 10),
    Step("context-parallel", SECTION, "Sequence/context parallelism splits the sequence dimension for very long "
         "contexts", "pslab run transformer_tp --set parallel.tp=1 --set parallel.cp=2", context_parallel, 15),
    Step("expert-parallel", SECTION, "Expert parallelism routes tokens to experts on different GPUs: an all-to-all, "
         "not an all-reduce", "pslab run moe_ep", expert_parallel, 15),
]
