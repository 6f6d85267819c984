"""The pipeline bubble: naive pipelining, micro-batches (GPipe), 1F1B's memory, and micro-batch size vs utilisation.

Bubble (GPipe, Huang et al. 2019; PipeDream-flush 1F1B, Narayanan et al. 2019/2021): p stages, m micro-batches, every
stage t_f forward and t_b backward per micro-batch. Both schedules take (m+p−1)(t_f+t_b) and keep each stage busy
m(t_f+t_b), so the idle fraction of all stage-time is

    bubble = 1 − m/(m+p−1) = (p−1)/(m+p−1)          naive pipelining (m = 1): (p−1)/p

measured on p real processes running one padded pipeline step of a small MLP (`pipeline_measure.measure_step`:
every action held to t_f or t_b = 2t_f, so the stage times are equal as the formula assumes, and messages pass over
the zmq transport) as 1 − Σ busy / (p · makespan) from the spans the executor recorded on one clock. The formula
ignores message latency: each of the ~2(m+p−1) hops of the critical path adds a wake-up delay, so the measured
bubble is a little larger, the less so the longer an action.

1F1B's memory: GPipe runs all m forwards before any backward, so each stage holds m micro-batches' activations;
1F1B starts backward as soon as the last stage can, so stage k holds at most min(p−k, m) (the executor counts the
micro-batches it holds; `memory_model.tiny_stage_activation_bytes` counts their bytes exactly).

Micro-batch size (the article's "tension between micro-batch count and size"): a batch B in m micro-batches of B/m
rows; one micro-batch of a stage takes t_mb(B/m) forward + backward, which does not shrink in proportion to B/m (a
fixed cost per call, and small matrices run below the large-matrix rate), so

    t(m) = (m+p−1) · t_mb(B/m)          (the bubble's slots times the micro-batch time)

falls with m while the bubble dominates and rises once the per-micro-batch cost does: an interior optimum. Measured
parts: t_mb on each stage's own module alone (a device of its own), and t_mb,all with every stage computing at once;
the p−1 fill and drain slots run alone and the m steady-state slots at once, so the prediction is
(p−1)·t_mb(B/m) + m·t_mb,all(B/m) — the formula above when the stages do not share cores. t(m) itself is measured
on real, unpadded pipeline steps; the formula leaves out each micro-batch's messages.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from .core import Context, Figure, Outcome, Step

SECTION = "The pipeline bubble problem"
STAGES = 4
_PING_TAG = 990_001          # microbatch-size's ping-pong, apart from the pipeline executor's tags


def _tf(ctx: Context) -> float:
    """Padded forward time per stage and micro-batch (backward 2×): long against a message hop (~0.2 ms idle, a
    millisecond or more on a busy machine), which the formula leaves out; quick runs keep it (fewer m instead)."""
    return 0.040


def _bubble_worker(group: Any, runs: list[tuple[str, int]], stage_time: tuple[float, float]) -> list[dict]:
    """One padded pipeline step per (schedule, m) (`pipeline_measure.measure_step`) on the ranks of `group`."""
    import torch
    from pslab.parallelism.pipeline_measure import measure_step
    torch.set_num_threads(1)
    return [measure_step(group, schedule, m, stage_time) for schedule, m in runs]


def _measure_bubbles(p: int, runs: list[tuple[str, int]], tf: float) -> list[tuple[float, list, list[int]]]:
    """(measured bubble, the spans per stage, peak in-flight per stage) of each (schedule, m) on p processes."""
    from pslab import collectives
    from pslab.parallelism.pipeline_measure import bubble_fraction, gather_spans
    ranks = collectives.launch(_bubble_worker, p, backend="zmq", args=(runs, (tf, 2 * tf)), timeout=180)
    out = []
    for i in range(len(runs)):
        spans = gather_spans([r[i] for r in ranks])
        out.append((bubble_fraction(spans), spans, [r[i]["peak_in_flight"] for r in ranks]))
    return out


def _bubble(p: int, m: int) -> float:
    return (p - 1) / (m + p - 1)


# ---- 5. naive pipelining ---------------------------------------------------------------------------------------

def naive_bubble(ctx: Context) -> Outcome:
    from pslab.parallelism.plot import draw_timeline
    tf = _tf(ctx)
    ps = [STAGES] if ctx.quick else [2, STAGES]
    got = {p: _measure_bubbles(p, [("gpipe", 1)], tf)[0] for p in ps}
    b4, spans4, _ = got[STAGES]
    pic = draw_timeline(spans4, ctx.picture("naive-bubble"), title=f"naive pipeline, measured: p={STAGES}, m=1",
                        theoretical_bubble=_bubble(STAGES, 1), xlabel="seconds")
    busy = sum(e - b for _, b, e in spans4[0])
    end = max(e for row in spans4 for _, _, e in row)
    return Outcome(
        figures=[Figure(f"bubble, P = {p}, one batch", got[p][0], (p - 1) / p, "", "=", 0.10,
                        f"1 − Σ busy/(P·makespan) from the executor's spans vs (P−1)/P; forward "
                        f"{tf * 1e3:.0f} ms, backward {2 * tf * 1e3:.0f} ms per stage") for p in ps],
        explanation=(
            f"{STAGES} processes each hold one stage of a model and pass one whole batch down the line and its "
            f"gradient back. Every stage works {busy * 1e3:.0f} ms of a {end * 1e3:.0f} ms step: while one stage "
            f"computes, the others wait for it. The idle share of all stage-time — the bubble — is measured at "
            f"{b4:.3f}, the article's (P−1)/P = {(STAGES - 1) / STAGES:.2f}"
            + ("" if ctx.quick else f"; with 2 stages {got[2][0]:.3f} against 1/2") +
            ". Splitting the layers over stages buys memory (each holds a quarter of the model) but, run this "
            "way, no speed: the step takes as long as one device doing all the work."),
        picture=str(pic),
        notes=["timing-based: every action is padded to a fixed time so the stage times are equal, as the formula "
               "assumes; message hops add a little (the measured bubble is slightly above the formula)"])


# ---- 6. micro-batches -----------------------------------------------------------------------------------------

def micro_batches(ctx: Context) -> Outcome:
    tf = _tf(ctx)
    ms = [1, 4, 8] if ctx.quick else [1, 2, 4, 8]
    got = _measure_bubbles(STAGES, [("gpipe", m) for m in ms], tf)
    pic = _draw_bubbles(ctx.picture("micro-batches"), ms, [g[0] for g in got], STAGES)
    first, last = got[0][0], got[-1][0]
    return Outcome(
        figures=[Figure(f"bubble, P = {STAGES}, m = {m}", g[0], _bubble(STAGES, m), "", "=", 0.10,
                        "measured 1 − Σ busy/(P·makespan) vs (P−1)/(m+P−1)") for m, g in zip(ms, got)],
        explanation=(
            f"The same {STAGES}-stage pipeline, now with the batch cut into m micro-batches that stream through "
            f"(GPipe): while stage 1 works on micro-batch 0, stage 0 already computes micro-batch 1. Only the fill "
            f"and the drain stay idle, p−1 micro-batch slots out of m+p−1, so the measured bubble falls from "
            f"{first:.2f} at m = {ms[0]} to {last:.2f} at m = {ms[-1]}, next to (p−1)/(m+p−1) = "
            f"{_bubble(STAGES, ms[0]):.2f} … {_bubble(STAGES, ms[-1]):.2f} — shrinking as m grows relative to p, "
            f"but never reaching zero."),
        picture=str(pic),
        notes=[f"timing-based: each micro-batch's forward is padded to {tf * 1e3:.0f} ms and its backward to "
               f"{2 * tf * 1e3:.0f} ms on every stage (equal stage times, as the formula assumes); message hops "
               "make the measured bubble a little larger"])


def _draw_bubbles(path: Path, ms: list[int], measured: list[float], p: int) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.8))
    grid = list(range(1, max(ms) * 2 + 1))
    ax.plot(grid, [_bubble(p, m) for m in grid], color="black", lw=1, label=f"(p−1)/(m+p−1), p = {p}")
    ax.scatter(ms, measured, color="#E15759", zorder=3, label="measured (4 real stages)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble (idle share of stage-time)")
    ax.set_ylim(0, 1)
    ax.set_title("micro-batches shrink the pipeline bubble")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- 7. 1F1B ----------------------------------------------------------------------------------------------------

def _stage_bytes_worker(group: Any, schedules: list[str], m: int) -> list[dict[str, Any]]:
    """One rank of a real pipeline of the tiny transformer (the engines `pslab run` uses) per schedule: the peak of
    activations autograd saved on this stage during its second step, and the micro-batches its executor held."""
    import torch
    from pslab.experiments.config import example_config, load_config
    from pslab.experiments.strategies.build import make_engine
    from pslab.experiments.workloads import get_workload
    from pslab.parallelism.checkpointing import ActivationMeter
    from pslab.parallelism.mesh import DeviceMesh
    torch.set_num_threads(1)
    p = group.world_size
    out = []
    for schedule in schedules:
        cfg = load_config(example_config("transformer_tp.toml"),
                          ["train.workers=1", "parallel.tp=1", f"parallel.pp={p}", f"parallel.micro_batches={m}",
                           f"parallel.schedule={schedule}"])
        wl = get_workload(cfg.workload.name, 1, cfg.workload.batch_size, cfg.workload.seed, **cfg.workload.overrides())
        mesh = DeviceMesh(group, pp=p)
        rep = make_engine(cfg, wl).build(wl.make_model, mesh)
        for step in range(2):
            x, y, _ = wl.batch(0, step)
            with ActivationMeter() as meter:
                rep.forward_backward(x, y)
        out.append({"stage": mesh.coord("pp"), "activations": meter.peak, "in_flight": rep.peak_in_flight,
                    "batch": list(x.shape)})
    return out


def _transformer_dims() -> tuple[int, int, int, int, int]:
    """(seq, d, heads, layers, vocab) of the text-transformer workload's model."""
    from pslab.experiments.bench.calibrate import workload_shape
    sh = workload_shape(1)
    return sh.seq, sh.hidden, sh.heads, sh.layers, sh.vocab


def one_f_one_b(ctx: Context) -> Outcome:
    from pslab import collectives
    from pslab.parallelism.memory_model import tiny_stage_activation_bytes
    tf, p, m = _tf(ctx), STAGES, 8                 # m > p: GPipe's m and 1F1B's p differ
    (bg, _, in_g), (b1, _, in_1) = _measure_bubbles(p, [("gpipe", m), ("1f1b", m)], tf)
    pp, mb = 2, 8                                     # the 2-block transformer cuts into at most 2 modelled stages
    ranks = collectives.launch(_stage_bytes_worker, pp, backend="zmq", args=(["gpipe", "1f1b"], mb), timeout=180)
    seq, d, a, L, V = _transformer_dims()
    batch = ranks[0][0]["batch"][0]
    act = {sch: [r[i]["activations"] for r in ranks] for i, sch in enumerate(("gpipe", "1f1b"))}
    model = {sch: [tiny_stage_activation_bytes(batch, seq, d, a, L, V, pp, mb, k, sch) for k in range(pp)]
             for sch in ("gpipe", "1f1b")}
    held = {sch: [r[i]["in_flight"] for r in ranks] for i, sch in enumerate(("gpipe", "1f1b"))}
    pic = _draw_1f1b(ctx.picture("1f1b"), p, m, in_g, in_1, act, model, mb)
    return Outcome(
        figures=[
            Figure(f"1F1B bubble, p = {p}, m = {m}", b1, _bubble(p, m), "", "=", 0.10,
                   "measured from the spans vs (p−1)/(m+p−1)"),
            Figure(f"GPipe bubble, p = {p}, m = {m}", bg, _bubble(p, m), "", "=", 0.10,
                   "measured from the spans vs (p−1)/(m+p−1): the same bubble"),
            Figure("GPipe, micro-batches held by stage 0", in_g[0], m, "", "=", 0.0,
                   "the executor's peak count of micro-batches whose backward has not run vs m"),
            Figure("1F1B, micro-batches held by stage 0", in_1[0], min(p, m), "", "=", 0.0,
                   "the executor's peak count vs min(p − k, m), k = 0"),
            Figure("1F1B, micro-batches held by the last stage", in_1[-1], min(1, m), "", "=", 0.0,
                   f"the executor's peak count vs min(p − k, m), k = {p - 1}"),
            Figure(f"GPipe stage-0 saved activations (p = {pp}, m = {mb})", act["gpipe"][0], model["gpipe"][0], "B",
                   "=", 0.0, "ActivationMeter on a real tiny-transformer pipeline vs "
                   "memory_model.tiny_stage_activation_bytes (m micro-batches in flight)"),
            Figure(f"1F1B stage-0 saved activations (p = {pp}, m = {mb})", act["1f1b"][0], model["1f1b"][0], "B",
                   "=", 0.0, "the same, min(p, m) micro-batches in flight"),
        ],
        explanation=(
            f"GPipe runs all m forwards before any backward; 1F1B (PipeDream's one-forward-one-backward) starts each "
            f"stage's backwards as soon as the last stage has produced a gradient and then alternates. On {p} real "
            f"stages with m = {m} the two leave the same bubble ({bg:.3f} and {b1:.3f}, formula "
            f"{_bubble(p, m):.3f}): 1F1B is not faster. What it changes is memory: GPipe's stages each hold all "
            f"{m} micro-batches' activations until the backwards begin (counted: {in_g}); 1F1B's stage k holds at "
            f"most min(p−k, m): {in_1}. On a real {pp}-stage transformer pipeline with {mb} micro-batches (held: "
            f"{held['gpipe']} vs {held['1f1b']}) the first stage's saved activations drop from "
            f"{act['gpipe'][0]:,} B to {act['1f1b'][0]:,} B, to the byte what the model counts — so 1F1B can "
            f"use many micro-batches (a small bubble) without m× the activations."),
        picture=str(pic),
        notes=["bubbles: timing-based (padded actions, as in micro-batches); in-flight counts and bytes: exact",
               f"the byte check runs the 2-block text transformer at p = {pp} (its stages as the memory model cuts "
               f"them); the bubble and counts run a {p}-stage MLP"])


def _draw_1f1b(path: Path, p: int, m: int, in_g: list[int], in_1: list[int], act: dict, model: dict, mb: int
               ) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6), gridspec_kw={"width_ratios": [3, 2]})
    ks = list(range(p))
    a1.bar([k - 0.2 for k in ks], in_g, width=0.4, color="#4C9BE8", label="GPipe (measured)")
    a1.bar([k + 0.2 for k in ks], in_1, width=0.4, color="#59A14F", label="1F1B (measured)")
    a1.scatter([k - 0.2 for k in ks], [m] * p, marker="_", s=300, color="black", zorder=3, label="m / min(p−k, m)")
    a1.scatter([k + 0.2 for k in ks], [min(p - k, m) for k in ks], marker="_", s=300, color="black", zorder=3)
    a1.set_xticks(ks, [f"stage {k}" for k in ks])
    a1.set_ylabel("micro-batches held (peak)")
    a1.set_title(f"activations in flight, p = {p}, m = {m}", fontsize=9)
    a1.legend(fontsize=7)
    pp = len(act["gpipe"])
    for i, sch in enumerate(("gpipe", "1f1b")):
        a2.bar([k + (i - 0.5) * 0.4 for k in range(pp)], [v / 1e3 for v in act[sch]], width=0.4,
               color=("#4C9BE8", "#59A14F")[i], label=f"{'GPipe' if sch == 'gpipe' else '1F1B'} (measured)")
        a2.scatter([k + (i - 0.5) * 0.4 for k in range(pp)], [v / 1e3 for v in model[sch]], marker="_", s=300,
                   color="black", zorder=3, label="model" if i == 0 else None)
    a2.set_xticks(range(pp), [f"stage {k}" for k in range(pp)])
    a2.set_ylabel("saved activations, kB")
    a2.set_title(f"tiny transformer, p = {pp}, m = {mb}", fontsize=9)
    a2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- 8. micro-batch size vs count -------------------------------------------------------------------------------

def _mbs_worker(group: Any, width: int, layers_per_stage: int, batch: int, ms: list[int], reps: int
                ) -> dict[str, Any]:
    """One rank of a real, unpadded 1F1B pipeline of an MLP (layers_per_stage Linear+Tanh per stage). Per m, in
    turns (a drift in the machine's load hits every m alike): one pipeline step (its makespan, from the executor's
    spans); this stage's forward + backward of m micro-batches of batch/m rows alone (the other stages wait: a
    device of its own), and with every stage computing at once (as in the pipeline's steady state). Medians."""
    import torch
    from pslab.parallelism.mesh import DeviceMesh
    from pslab.parallelism.models import mlp
    from pslab.parallelism.pipeline import PipelineEngine
    torch.set_num_threads(1)
    p, me = group.world_size, group.rank
    mesh = DeviceMesh(group, pp=p)
    factory = lambda: mlp([width] * (p * layers_per_stage + 1), seed=0)    # noqa: E731
    torch.manual_seed(0)
    x, y = torch.randn(batch, width), torch.randint(0, width, (batch,))
    engines = {}
    for m in ms:
        engines[m] = PipelineEngine("1f1b", m, report_loss=False, measure=True).build(factory, mesh)
        engines[m].forward_backward(x, y)                          # warm-up: connections, shape headers
    stage = engines[ms[0]].stage
    parts = {m: torch.randn(batch // m, width, requires_grad=True) for m in ms}

    def micro_batches(m: int) -> float:
        t0 = time.perf_counter()
        for _ in range(m):
            stage(parts[m]).sum().backward()
        return (time.perf_counter() - t0) / m

    def hop(m: int) -> float:
        """One-way time of a micro-batch's activation between ranks 0 and 1 (half a ping-pong; others idle)."""
        buf = torch.empty(batch // m, width)
        t0 = time.perf_counter()
        if me == 0:
            group.send(buf, 1, tag=_PING_TAG)
            group.recv(buf, 1, tag=_PING_TAG)
        elif me == 1:
            group.recv(buf, 0, tag=_PING_TAG)
            group.send(buf, 0, tag=_PING_TAG)
        return (time.perf_counter() - t0) / 2

    steps: dict[int, list[float]] = {m: [] for m in ms}
    alone: dict[int, list[float]] = {m: [] for m in ms}
    together: dict[int, list[float]] = {m: [] for m in ms}
    hops: dict[int, list[float]] = {m: [] for m in ms}
    for r in range(reps + 1):
        for m in (ms if r % 2 == 0 else ms[::-1]):
            engines[m].forward_backward(x, y)
            step = max(e for _, _, e in engines[m].spans)
            for turn in range(p):                        # one stage at a time
                group.barrier()
                if turn == me:
                    t = micro_batches(m)
            group.barrier()
            t_all = micro_batches(m)                     # every stage at once
            group.barrier()
            h = hop(m)
            if r:                                        # the first round warms up
                steps[m].append(step)
                alone[m].append(t)
                together[m].append(t_all)
                hops[m].append(h)
    group.barrier()
    med = statistics.median
    return {"step": {m: med(v) for m, v in steps.items()}, "alone": {m: med(v) for m, v in alone.items()},
            "together": {m: med(v) for m, v in together.items()}, "hop": {m: med(v) for m, v in hops.items()}}


def microbatch_size(ctx: Context) -> Outcome:
    from pslab import collectives
    p = 2                                             # one stage per core of a 2-core machine
    width, layers, batch = 512, 2, 512
    ms = [1, 2, 4, 8, 16]
    reps = 4 if ctx.quick else 7
    ranks = collectives.launch(_mbs_worker, p, backend="zmq", args=(width, layers, batch, ms, reps), timeout=300)
    t_mb = {m: max(r["alone"][m] for r in ranks) for m in ms}      # the slower stage sets the pace
    t_conc = {m: max(r["together"][m] for r in ranks) for m in ms}
    share = statistics.median(t_mb[m] / t_conc[m] for m in ms)     # 1: each stage had a core of its own
    hop = statistics.median(max(r["hop"][m] for r in ranks) for m in ms)
    measured = {m: max(r["step"][m] for r in ranks) for m in ms}
    predicted = {m: (p - 1) * t_mb[m] + m * t_conc[m] for m in ms}
    best_m, best_p = min(ms, key=measured.get), min(ms, key=predicted.get)
    rate = {m: batch / m / t_mb[m] for m in ms}                     # samples/s of one stage at micro-batch B/m
    big, small = ms[0], ms[-1]
    pic = _draw_mbs(ctx.picture("microbatch-size"), ms, batch, rate, measured, predicted, p)
    model = "(p−1)·t_mb(B/m) + m·t_mb,all(B/m)"
    interior = best_m not in (big, small)
    shape = ("with an optimum in between" if interior else
             f"though here the measured optimum sits at the edge of the range, m = {best_m}")
    busy = ("" if share >= 0.8 else
            f" Here the stages computed at only {share:.0%} of their solo speed when running at once — the machine "
            f"is busy and they share cores — so the model's steady-state slots are slower than its fill and drain, "
            f"and the optimum moves to fewer micro-batches.")
    return Outcome(
        figures=[
            Figure(f"samples/s of a stage at micro-batch {batch // small} ÷ at {batch // big}",
                   rate[small] / rate[big], 1.0, "×", "<=", 0.0,
                   "measured forward + backward of one stage alone; 1 = a rate that did not depend on the "
                   "micro-batch size"),
            Figure(f"step time at the predicted best m (= {best_p}) ÷ measured best (m = {best_m})",
                   measured[best_p] / measured[best_m], 1.0, "×", "<=", 0.15,
                   f"real pipeline steps (medians); predicted best: argmin over m of {model}"),
            Figure(f"step time, m = {big} ÷ m = {best_p}", measured[big] / measured[best_p],
                   predicted[big] / predicted[best_p], "×", "=", 0.25,
                   f"measured medians vs {model}: the bubble side"),
            Figure(f"step time, m = {small} ÷ m = {best_p}", measured[small] / measured[best_p],
                   predicted[small] / predicted[best_p], "×", ">=", 0.10,
                   f"measured medians vs {model}: the utilisation side, at least what compute predicts (each "
                   "micro-batch's messages come on top)"),
        ],
        explanation=(
            f"A batch of {batch} rows goes through a real {p}-stage pipeline (1F1B) in m micro-batches. More "
            f"micro-batches shrink the bubble, but each one gets smaller, and a stage does not process a small "
            f"micro-batch proportionally faster: alone, a stage handles {rate[big]:,.0f} samples/s at micro-batch "
            f"{batch // big} and only {rate[small]:,.0f} at {batch // small} (a fixed cost per call, small matrices "
            f"below the big-matrix rate). The step is p−1 bubble slots plus m busy slots, each as long as one "
            f"micro-batch takes — the article's (m+p−1)·t_mb(B/m) when each stage has a device of its own — and "
            f"with the measured micro-batch times that predicts the best m = {best_p}. The real step times bottom "
            f"out at m = {best_m} ({measured[best_m] * 1e3:.1f} ms, against {measured[big] * 1e3:.1f} ms at m = "
            f"{big} and {measured[small] * 1e3:.1f} ms at m = {small}): the tension between micro-batch count and "
            f"size, {shape}.{busy}"),
        picture=str(pic),
        notes=[f"timing-based: medians of {reps} rounds, every m in turn; t_mb = a stage's micro-batch alone, "
               f"t_mb,all = with every stage computing at once (= t_mb on dedicated devices; measured "
               f"{share:.0%} of solo speed here); tolerances for an idle 2-core machine",
               f"the formula leaves out each micro-batch's 2 messages per slot ({hop * 1e3:.2f} ms one way here, "
               "ping-pong median): the small-micro-batch side is a lower bound",
               "the planner (parallelism/step_model.py) has no per-micro-batch cost: its compute time does not "
               "depend on the micro-batch size, so it cannot see this optimum"])


def _draw_mbs(path: Path, ms: list[int], batch: int, rate: dict, measured: dict, predicted: dict, p: int) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
    a1.plot([batch // m for m in ms], [rate[m] for m in ms], "o-", color="#4C9BE8")
    a1.set_xscale("log", base=2)
    a1.set_xlabel("micro-batch size (rows)")
    a1.set_ylabel("samples/s of one stage (fwd + bwd)")
    a1.set_title("utilisation falls as micro-batches shrink", fontsize=9)
    a2.plot(ms, [measured[m] * 1e3 for m in ms], "o-", color="#E15759", label="measured step")
    a2.plot(ms, [predicted[m] * 1e3 for m in ms], "s--", color="black",
            label="(p−1)·t_mb + m·t_mb,all (measured parts)")
    a2.set_xscale("log", base=2)
    a2.set_xlabel("micro-batches m")
    a2.set_ylabel("ms per step")
    a2.set_title(f"p = {p}, B = {batch}: bubble vs per-micro-batch cost", fontsize=9)
    a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


STEPS = [
    Step("naive-bubble", SECTION, "with P stages, naive pipelining wastes (P−1)/P of GPU-time waiting: the bubble",
         "pslab schedule --stages 4 --micro-batches 1 --schedule gpipe --run -o naive.png", naive_bubble, 20),
    Step("micro-batches", SECTION, "micro-batches keep every stage busy: the bubble shrinks as m grows relative to "
         "p, but never disappears", "pslab schedule --stages 4 --micro-batches 8 --schedule gpipe --run -o gpipe.png",
         micro_batches, 20),
    Step("1f1b", SECTION, "PipeDream's 1F1B refines GPipe: the same bubble, but at most p micro-batches' "
         "activations held instead of m", "pslab schedule --stages 4 --micro-batches 8 --schedule 1f1b --run "
         "-o 1f1b.png", one_f_one_b, 20),
    Step("microbatch-size", SECTION, "a real tension between micro-batch count (smaller bubble) and micro-batch "
         "size (hardware utilisation)", "pslab run experiments/configs/transformer_tp.toml --set train.workers=1 "
         "--set parallel.tp=1 --set parallel.pp=2 --set parallel.micro_batches=8",
         microbatch_size, 30),
]
