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
parts: t_mb(B/m), one stage's forward + backward in one thread's CPU time (what a device of its own would take,
whatever else this machine runs); the pipeline's own cost o(m) (messages, scheduling, wake-ups) from the same 1F1B
pipeline with near-empty actions (less the EPS they sleep on the critical path). t(m) is measured on p processes
whose every action lasts its micro-batch's measured cost (emulated devices: the figure holds on a busy machine),
against (m+p−1)·t_mb(B/m) + o(m).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from .core import Context, Figure, Outcome, pyplot, save, Step

SECTION = "The pipeline bubble problem"
EPS = 2e-4                   # microbatch-size: the near-empty actions' forward (backward 2·EPS), seconds
STAGES = 4


def _tf(ctx: Context) -> float:
    """Padded forward time per stage and micro-batch (backward 2×): long against a message hop (~0.2 ms idle, a
    millisecond or more on a busy machine), which the formula leaves out. Quick runs (fewer m) pad to 80 ms: they
    are the ones run beside other work (the test suite, CI beside two busy loops, where P = 4, m = 8 measured
    0.304 against 0.273 at 40 ms: ~5 ms of hops and wake-ups per slot), and twice the slot halves that excess."""
    return 0.080 if ctx.quick else 0.040


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
                        f"{tf * 1e3:.0f} ms, backward {2 * tf * 1e3:.0f} ms per stage", timed=True) for p in ps],
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
                        "measured 1 − Σ busy/(P·makespan) vs (P−1)/(m+P−1)", timed=True) for m, g in zip(ms, got)],
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
    plt = pyplot()
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
    return save(fig, path)


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
                   "measured from the spans vs (p−1)/(m+p−1)", timed=True),
            Figure(f"GPipe bubble, p = {p}, m = {m}", bg, _bubble(p, m), "", "=", 0.10,
                   "measured from the spans vs (p−1)/(m+p−1): the same bubble", timed=True),
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
    plt = pyplot()
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
    return save(fig, path)


# ---- 8. micro-batch size vs count -------------------------------------------------------------------------------

def _stage_costs(width: int, layers: int, batch: int, ms: list[int], reps: int) -> dict[int, tuple[float, float]]:
    """One stage's forward and backward time per micro-batch of batch/m rows, for each m: medians of `reps`
    rounds (every m in turn), in this thread's CPU time (one torch thread): what the work costs a device of its
    own, whatever else the machine runs."""
    import torch
    from pslab.parallelism.models import mlp
    torch.set_num_threads(1)
    stage = mlp([width] * (layers + 1), seed=0)
    parts = {m: torch.randn(batch // m, width, requires_grad=True) for m in ms}
    fw: dict[int, list[float]] = {m: [] for m in ms}
    bw: dict[int, list[float]] = {m: [] for m in ms}
    clock = time.thread_time
    for r in range(reps + 1):
        for m in (ms if r % 2 == 0 else ms[::-1]):
            f = b = 0.0
            for _ in range(m):
                t0 = clock()
                out = stage(parts[m]).sum()
                t1 = clock()
                out.backward()
                t2 = clock()
                f, b = f + t1 - t0, b + t2 - t1
            if r:                                     # the first round warms up
                fw[m].append(f / m)
                bw[m].append(b / m)
    return {m: (statistics.median(fw[m]), statistics.median(bw[m])) for m in ms}


def _mbs_worker(group: Any, runs: list[tuple[int, tuple[float, float]]], reps: int) -> list[list[dict]]:
    """One rank of a 1F1B pipeline whose actions last a micro-batch's measured cost (`_stage_costs`), and of the
    same pipeline with near-empty actions (EPS forward, 2·EPS backward: they sleep, and wake up, like the real ones)
    — its own cost o(m): messages, scheduling, wake-ups. Per m, `reps` steps of each, in turns
    (`pipeline_measure.measure_step`)."""
    import torch
    from pslab.parallelism.pipeline_measure import measure_step
    torch.set_num_threads(1)
    return [[measure_step(group, "1f1b", m, c) for _ in range(reps) for c in (cost, (EPS, 2 * EPS))]
            for m, cost in runs]


def microbatch_size(ctx: Context) -> Outcome:
    from pslab import collectives
    from pslab.parallelism.pipeline_measure import gather_spans
    p = 2
    width, layers, batch = 1024, 2, 512
    ms = [1, 2, 4, 8, 16]
    reps = 3 if ctx.quick else 5
    cost = _stage_costs(width, layers, batch, ms, reps)
    t_mb = {m: sum(cost[m]) for m in ms}
    ranks = collectives.launch(_mbs_worker, p, backend="zmq", args=([(m, cost[m]) for m in ms], 2 if ctx.quick else 3),
                               timeout=300)
    measured, empty = {}, {}
    for i, m in enumerate(ms):
        steps: list[list[float]] = [[], []]                # [with the costs, empty actions]
        for k in range(len(ranks[0][i])):
            spans = gather_spans([r[i][k] for r in ranks])
            steps[k % 2].append(max(e for row in spans for _, _, e in row) - min(b for row in spans for _, b, _ in row))
        measured[m], empty[m] = statistics.median(steps[0]), statistics.median(steps[1])
    # the near-empty run slept 3·EPS per slot of the critical path: the rest of it is the pipeline's own cost
    predicted = {m: (m + p - 1) * (t_mb[m] - 3 * EPS) + empty[m] for m in ms}
    best_m, best_p = min(ms, key=measured.get), min(ms, key=predicted.get)
    rate = {m: batch / m / t_mb[m] for m in ms}                     # samples/s of one stage at micro-batch B/m
    big, small = ms[0], ms[-1]
    pic = _draw_mbs(ctx.picture("microbatch-size"), ms, batch, rate, measured, predicted, p)
    model = "(m+p−1)·t_mb(B/m) + the pipeline's own cost"
    interior = best_p not in (big, small)
    return Outcome(
        figures=[
            Figure(f"samples/s of a stage at micro-batch {batch // small} ÷ at {batch // big}",
                   rate[small] / rate[big], 1.0, "×", "<=", 0.0,
                   "one stage's forward + backward in CPU time; 1 = a rate that did not depend on the micro-batch "
                   "size", timed=True),
            *[Figure(f"pipeline step, m = {m}", measured[m] * 1e3, predicted[m] * 1e3, "ms", "=", 0.10,
                     f"1F1B on {p} processes, each action as long as its measured cost (emulated devices), vs "
                     f"(m+p−1)·(t_mb(B/m) − 3ε) = {(m + p - 1) * (t_mb[m] - 3 * EPS) * 1e3:.1f} ms + o(m) = "
                     f"{empty[m] * 1e3:.1f} ms, the same pipeline with near-empty actions (ε, 2ε: messages, "
                     f"scheduling, wake-ups)", timed=True)
              for m in (big, best_p, small)],
            Figure(f"step at the predicted best m (= {best_p}) ÷ the measured best (m = {best_m})",
                   measured[best_p] / measured[best_m], 1.0, "×", "<=", 0.05,
                   f"argmin over m of {model} with the measured t_mb", timed=True),
        ],
        explanation=(
            f"A batch of {batch} rows goes through a {p}-stage pipeline (1F1B) in m micro-batches. More "
            f"micro-batches shrink the bubble, but each one gets smaller, and a stage does not process a small "
            f"micro-batch proportionally faster: measured alone, a stage handles {rate[big]:,.0f} samples/s at "
            f"micro-batch {batch // big} and only {rate[small]:,.0f} at {batch // small} (a fixed cost per call, "
            f"small matrices below the big-matrix rate). The step is p−1 bubble slots plus m busy slots, each as long "
            f"as one micro-batch takes: (m+p−1)·t_mb(B/m) (plus the pipeline's own messages and wake-ups, measured with "
            f"near-empty actions), which with the measured micro-batch times is smallest at m = "
            f"{best_p}{' — an optimum in between' if interior else ''}. The pipeline run with those times bottoms out "
            f"at m = {best_m} ({measured[best_m] * 1e3:.0f} ms, against {measured[big] * 1e3:.0f} ms at m = {big} "
            f"and {measured[small] * 1e3:.0f} ms at m = {small}): the tension between micro-batch count and size."),
        picture=str(pic),
        notes=[f"the costs are measured (one thread's CPU time, medians of {reps} rounds, every m in turn); the "
               f"pipeline's {p} devices are emulated — each action lasts its micro-batch's measured cost — so the "
               "step holds on a busy machine as on p free cores (with two free cores, an unpadded run of "
               "`pslab run ... --set parallel.pp=2 --set parallel.micro_batches=M` shows the same shape)",
               "the planner (parallelism/step_model.py) has no per-micro-batch cost: its compute time does not "
               "depend on the micro-batch size, so it cannot see this optimum"])


def _draw_mbs(path: Path, ms: list[int], batch: int, rate: dict, measured: dict, predicted: dict, p: int) -> str:
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
    a1.plot([batch // m for m in ms], [rate[m] for m in ms], "o-", color="#4C9BE8")
    a1.set_xscale("log", base=2)
    a1.set_xlabel("micro-batch size (rows)")
    a1.set_ylabel("samples/s of one stage (fwd + bwd)")
    a1.set_title("utilisation falls as micro-batches shrink", fontsize=9)
    a2.plot(ms, [measured[m] * 1e3 for m in ms], "o-", color="#E15759", label="pipeline step (measured)")
    a2.plot(ms, [predicted[m] * 1e3 for m in ms], "s--", color="black", label="(m+p−1)·t_mb(B/m) + o(m)")
    a2.set_xscale("log", base=2)
    a2.set_xlabel("micro-batches m")
    a2.set_ylabel("ms per step")
    a2.set_title(f"p = {p}, B = {batch}: bubble vs per-micro-batch cost", fontsize=9)
    a2.legend(fontsize=8)
    return save(fig, path)


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
