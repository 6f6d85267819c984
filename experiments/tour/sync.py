"""Bridging to classical distributed systems theory: sync vs async (CAP), stragglers, staleness, sharded checkpoints
and elastic recovery — each a real run of the same machinery `pslab compare`, `pslab sweep` and `pslab run` use.

Stragglers (the article: "synchronous training ... throughput is capped by your slowest worker"). BSP is the CAP
trade made for consistency: every replica identical after every step, so a step lasts as long as the slowest worker's
and K workers of step times t_i apply K / max_i t_i updates per second. ASP (HogWild!-style parameter server) makes
it for availability: nobody waits, worker i applies 1 / t_i updates per second and the run Σ_i 1 / t_i. One worker
c = 4 times slower (compare_default's straggler: its padded compute c·b instead of b = base_step_s) turns a step of
T₀ (measured without the straggler, synchronisation included) into T₀ + (c − 1)·b, so

    BSP:  K / (T₀ + (c − 1)·b)   and never more than K / (c·b)       ASP:  (K − 1) / T₀ + 1 / (T₀ + (c − 1)·b).

Staleness ("gradients get applied against stale weights"): under ASP with K equally fast workers, the other K − 1
push once per round of a worker's own step, so the versions applied between its read and its update average
E[τ] = K − 1 whatever the step-time law (`experiments.sim.laws`); with memoryless (exponential) step times the
distribution is Geometric(1/K). Measured: τ of every update, from the shard's own version counter.

Staleness hurts ("this staleness can hurt convergence"): Dai et al. (ICLR 2019) train with every gradient computed on
the parameters of r ~ U{0..s} steps ago; the steps T(s) to a target accuracy grow with s. The study's emulator
(`experiments.sim.dai`) and its search (`studies.staleness`: lr bracketed per cell, median over seeds, censoring,
a seed bootstrap) measure T(s) on the deep model with SGD; theory says only that it does not fall: T(s) ≥ T(s') for
s > s', T(s_max) > T(0).

Sharded checkpoints ("sharded across the same partitioning ZeRO already uses, so no single node holds the entire
checkpoint"): a ZeRO-3 run over N ranks saves what each rank owns — its 1/N chunk of every parameter and of its
Adam moments — so with Ψ parameters and 4 + 4 + 4 bytes each (fp32 weight, exp_avg, exp_avg_sq) rank r's file holds
12Ψ/N bytes (± one element per tensor: the array_split rule) plus a fixed overhead (RNG states, the header: under
OVERHEAD_B), and the state tensors of the N files add up to exactly 12Ψ (every element stored once); plain data
parallelism writes the whole 12Ψ on rank 0.

Elastic training ("detects a failed node, reconfigures the process group around the remaining healthy GPUs, and
resumes from the last checkpoint without restarting"): an all-reduce run with faults.on_failure = shrink loses one
worker to SIGKILL (seen at once by its pidfd) and another to SIGSTOP (a hang: no heartbeat for faults.detect_s);
each time the survivors roll back to their last in-memory commit (every k = faults.commit_every steps), rebuild the
ring at one member fewer and go on. Bounds: detection ≤ detect_s (a hang: plus the supervisor's poll lateness, 50 %
slack here); the step resumed at = k·⌊at_step / k⌋ (the last commit before the failure); steps redone ≤ k; the
survivors finish every step.
"""

from __future__ import annotations

import contextlib
import copy
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from .core import Context, Figure, Modelled, Outcome, Step

SECTION = "Bridging to classical distributed systems theory"
NO_EVAL = "train.eval_every=1000000"      # no evaluation inside timed runs (it would take a worker's time)
MEAN_DELAY_S = 0.02                       # the staleness step's exponential step time
ADAM_BYTES = 4 + 4 + 4                    # fp32 weight, exp_avg, exp_avg_sq: what a checkpoint must keep
OVERHEAD_B = 20_000                       # per checkpoint file: RNG states (~13 KB) + header and meta (a few KB)
RATE_TOL = 0.15                           # throughput models: 15 % (timing on a shared 2-core machine)
STALENESS_TOL = 0.10                      # mean staleness vs K − 1: 10 % (the run's edges, finite run)
HANG_SLACK = 0.5                          # hang detection: + 50 % for the supervisor's poll under load


@contextlib.contextmanager
def _scratch() -> Iterator[Path]:
    """A temporary folder for the step's run directories, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="pslab-tour-sync-") as d:
        yield Path(d)


def _run(cfg: Any, root: Path, label: str | None = None) -> dict[str, Any]:
    """One real run (runner.execute: real processes on 127.0.0.1), read back: config, summary, updates, events."""
    from pslab.experiments.results.rundir import RunDir
    from pslab.experiments.runner import execute
    rd = execute(cfg, root, label=label, quiet=True)
    return RunDir(rd.path).load()


def _config(overrides: list[str], seed: int) -> Any:
    """compare_default.toml (`pslab compare`'s workload) with these overrides."""
    from pslab.experiments.studies.compare import default_config
    return default_config(None, [*overrides, f"workload.seed={seed}"])


# ---------------------------------------------------------------------------------------------------- stragglers
def straggler(ctx: Context) -> Outcome:
    import torch

    from pslab.experiments.studies.compare import STRAGGLER_FACTOR, with_straggler
    torch.set_num_threads(1)
    steps = 25 if ctx.quick else 60
    base = _config([f"train.steps={steps}", NO_EVAL], ctx.seed)
    K, b, c = base.train.workers, base.train.base_step_s, STRAGGLER_FACTOR
    ups: dict[tuple[str, bool], float] = {}
    stal: dict[str, float] = {}
    with _scratch() as root:
        for strategy in ("allreduce", "ps-asp"):
            for slow in (False, True):
                cfg = copy.deepcopy(base)
                cfg.train.strategy = strategy
                cfg = with_straggler(cfg) if slow else cfg.validate()
                ctx.say(f"  {strategy}{' + one straggler' if slow else ''}")
                s = _run(cfg, root)["summary"]
                ups[strategy, slow] = float(s["updates_per_s"])
                if not slow:
                    stal[strategy] = float(s["staleness_mean_steady"] or 0.0)
    t0 = {st: K / ups[st, False] for st in ("allreduce", "ps-asp")}    # a worker's step, measured, no straggler
    extra = (c - 1) * b
    bsp = K / (t0["allreduce"] + extra)
    asp = (K - 1) / t0["ps-asp"] + 1 / (t0["ps-asp"] + extra)
    cap = K / (c * b)
    pic = _straggler_picture(ctx.picture("straggler"), ups, {"allreduce": bsp, "ps-asp": asp}, cap, c)
    kept_bsp = ups["allreduce", True] / ups["allreduce", False]
    kept_asp = ups["ps-asp", True] / ups["ps-asp", False]
    return Outcome(
        figures=[
            Figure("BSP (allreduce) + straggler", ups["allreduce", True], bsp, "updates/s", "=", RATE_TOL,
                   f"steady updates/s of the run vs K / (T₀ + (c−1)·b): K={K}, c={c:g}, b={b * 1e3:g} ms, "
                   f"T₀={t0['allreduce'] * 1e3:.1f} ms measured without the straggler", timed=True),
            Figure("BSP capped by the slowest worker", ups["allreduce", True], cap, "updates/s", "<=", 0.0,
                   f"the same run vs K / (c·b): the straggler alone needs c·b = {c * b * 1e3:g} ms a step", timed=True),
            Figure("ASP (ps-asp) + straggler", ups["ps-asp", True], asp, "updates/s", "=", RATE_TOL,
                   f"steady updates/s vs Σ 1/t_i = (K−1)/T₀ + 1/(T₀ + (c−1)·b), T₀={t0['ps-asp'] * 1e3:.1f} ms "
                   "measured without the straggler", timed=True),
        ],
        explanation=(
            f"Synchronous training is the consistency side of CAP: after every all-reduce the {K} replicas are "
            f"identical (staleness 0), so each step waits for the slowest worker. Slow one worker down {c:g}× and "
            f"BSP keeps {kept_bsp:.0%} of its throughput ({ups['allreduce', False]:.0f} → "
            f"{ups['allreduce', True]:.0f} updates/s), at the straggler's pace and never above its cap K/(c·b) = "
            f"{cap:.0f}. Asynchronous training chooses availability: the parameter server applies each push when it "
            f"comes, so the {K - 1} fast workers run on and ASP keeps {kept_asp:.0%} ({ups['ps-asp', False]:.0f} → "
            f"{ups['ps-asp', True]:.0f}), what Σ 1/t_i predicts — paid for in consistency: its updates were "
            f"computed on weights {stal['ps-asp']:.1f} versions old on average (next step)."),
        picture=str(pic),
        notes=["timing-based: updates/s over the window while every worker runs (summary.updates_per_s); each "
               f"step's compute is padded to b = {b * 1e3:g} ms (compare_default.toml) so the straggler is a real "
               "effect, and the models use the step time T₀ each strategy measured without it (synchronisation "
               f"included); tolerance {RATE_TOL:.0%} for a shared machine"])


def _straggler_picture(path: Path, ups: dict[tuple[str, bool], float], model: dict[str, float], cap: float,
                       c: float) -> Path:
    from pslab.experiments.results.plots import plt, save_figure
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    names = {"allreduce": "BSP (allreduce)", "ps-asp": "ASP (ps-asp)"}
    for i, st in enumerate(names):
        for j, slow in enumerate((False, True)):
            x = i * 3 + j
            ax.bar(x, ups[st, slow], color="tab:blue" if st == "allreduce" else "tab:orange",
                   hatch="//" if slow else None, edgecolor="black", label=None)
            ax.text(x, ups[st, slow], f"{ups[st, slow]:.0f}", ha="center", va="bottom", fontsize=8)
        ax.plot([i * 3 + 0.6, i * 3 + 1.4], [model[st]] * 2, color="black", lw=2,
                label="model with the straggler" if i == 0 else None)
    ax.axhline(cap, color="red", ls="--", lw=1, label=f"BSP cap K/(c·b) = {cap:.0f}")
    ax.set_xticks([0, 1, 3, 4], [f"{names['allreduce']}\nall equal", f"{names['allreduce']}\none {c:g}× slower",
                                 f"{names['ps-asp']}\nall equal", f"{names['ps-asp']}\none {c:g}× slower"],
                  fontsize=8)
    ax.set_ylabel("updates per second (all workers running)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    return save_figure(fig, path, "One straggler: BSP waits for it, ASP does not", 10)


# ---------------------------------------------------------------------------------------------------- staleness
def staleness(ctx: Context) -> Outcome:
    import numpy as np
    import torch

    from pslab.experiments.results.records import steady_window_end
    from pslab.experiments.sim.laws import asp_mean
    torch.set_num_threads(1)
    workers = (2, 4) if ctx.quick else (2, 4, 8)
    steps = 30 if ctx.quick else 60
    taus: dict[int, list[int]] = {}
    means: dict[int, float] = {}
    with _scratch() as root:
        for K in workers:
            ctx.say(f"  ps-asp, K={K}")
            cfg = _config(["train.strategy=ps-asp", f"train.workers={K}", f"train.steps={steps}", NO_EVAL,
                           "train.base_step_s=0.0", 'stragglers.delay="exponential"',
                           f"stragglers.delay_mean_s={MEAN_DELAY_S}"], ctx.seed)
            run = _run(cfg, root)
            ups = [u for u in run["updates"] if not u.get("dropped") and u.get("staleness") is not None]
            end = steady_window_end(ups) or 0.0
            taus[K] = [int(u["staleness"]) for u in ups if u["time_s"] <= end]
            means[K] = float(np.mean(taus[K]))
    big = workers[-1]
    stale_share = float(np.mean(np.array(taus[big]) > 0))
    pic = _staleness_picture(ctx.picture("staleness"), taus, means, big)
    return Outcome(
        figures=[Figure(f"mean staleness, K={K}", means[K], asp_mean(K), "versions", "=", STALENESS_TOL,
                        f"τ of {len(taus[K])} updates (the shard's version counter, steady window) vs K − 1",
                        timed=True)
                 for K in workers],
        explanation=(
            f"Asynchronous updates are applied to weights that have moved on: with K workers pushing whenever "
            f"they are ready, K − 1 others update the model, on average, while one computes its gradient. Measured "
            f"on every update of real ps-asp runs (exponential step times, mean {MEAN_DELAY_S * 1e3:g} ms): mean "
            f"staleness " + ", ".join(f"{means[K]:.2f} at K={K}" for K in workers) + " — the law K − 1. At "
            f"K={big}, {stale_share:.0%} of the gradients were computed on weights that were no longer current "
            f"(up to {max(taus[big])} versions old): the price ASP pays for never waiting, and it grows with the "
            f"number of workers."),
        picture=str(pic),
        notes=["the histogram's Geometric(1/K) is the law for memoryless step times; here each step also has a "
               "fixed part (compute and the push/pull), which makes τ = 0 rarer than the geometric law says; the "
               "mean K − 1 holds for any step-time law with equal speeds",
               "counted over the steady window (every worker running), as summary.staleness_mean_steady"])


def _staleness_picture(path: Path, taus: dict[int, list[int]], means: dict[int, float], big: int) -> Path:
    import numpy as np

    from pslab.experiments.results.plots import plt, save_figure
    from pslab.experiments.sim.laws import geometric_pmf
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    t = np.array(taus[big])
    k_max = int(t.max()) if len(t) else 0
    ax.bar(np.arange(k_max + 1), np.bincount(t, minlength=k_max + 1) / max(len(t), 1), color="tab:orange",
           alpha=0.8, label=f"measured, K={big} ({len(t)} updates)")
    ax.plot(np.arange(k_max + 1), geometric_pmf(big, k_max), "k.-", label="Geometric(1/K): memoryless steps")
    ax.axvline(big - 1, color="red", ls="--", label="mean K − 1")
    ax.axvline(float(t.mean()), color="tab:orange", ls=":", label=f"measured mean {t.mean():.2f}")
    ax.set_xlabel("staleness τ (versions between read and update)")
    ax.set_ylabel("share of updates")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    ks = sorted(means)
    bx.plot(ks, [k - 1 for k in ks], "k--", label="K − 1")
    bx.plot(ks, [means[k] for k in ks], "o", color="tab:orange", ms=8, label="measured mean")
    bx.set_xlabel("workers K")
    bx.set_ylabel("mean staleness")
    bx.set_xticks(ks)
    bx.legend(fontsize=8)
    bx.grid(True, alpha=0.3)
    return save_figure(fig, path, "ASP: gradients applied against stale weights (real ps-asp runs)", 10)


# ---------------------------------------------------------------------------------------------- staleness hurts
def staleness_hurts(ctx: Context) -> Outcome:
    import numpy as np
    import torch

    from pslab.experiments.studies.staleness import LR_GRID, SEEDS, default_jobs, preset_spec, run_staleness_sweep
    from pslab.experiments.studies.staleness_report import SOLID, Bootstrap
    torch.set_num_threads(1)
    deep = {"mlp3": "digits-mlp3"}
    if ctx.quick:      # the preset's own --quick sizes, on its deep model with SGD
        spec = preset_spec("staleness", quick=True, models=deep, optimizers={"sgd": (0.1, 0.2, 0.4)},
                           worker_counts=(), seeds=tuple(ctx.seed + i for i in range(3)))
    else:              # the preset's row "mlp3 sgd K=1": its staleness values, seeds, target, budget and lr grid
        spec = preset_spec("staleness", models=deep, optimizers={"sgd": LR_GRID["sgd"]}, worker_counts=(),
                           seeds=tuple(ctx.seed + i for i in range(len(SEEDS))))
    ctx.say(f"  {len(spec.staleness)} staleness values x {len(spec.seeds)} seeds, lr bracketed per value")
    cells = sorted(run_staleness_sweep(spec, jobs=1 if ctx.quick else default_jobs()), key=lambda c: c["staleness"])
    key = ("mlp3", "sgd", "plain", spec.workers)
    s_max = max(spec.staleness)
    by_s = {c["staleness"]: c for c in cells}
    inf = float("inf")
    t = [by_s[s]["steps"] if by_s[s]["steps"] is not None else inf for s in spec.staleness]
    dips = sum(1 for i in range(len(t)) for j in range(i + 1, len(t)) if t[j] < t[i])
    ratio = t[-1] / t[0]
    boot = Bootstrap(cells, len(spec.seeds))
    share = float(np.mean(boot.steps(key, s_max) > boot.steps(key, 0)))
    pic = _hurts_picture(ctx.picture("staleness-hurts"), cells, spec)
    target = f"{100 * spec.target_acc:g} %"
    pts = ", ".join(f"s={s}: {'>' + str(spec.max_steps) if by_s[s]['steps'] is None else by_s[s]['steps']}"
                    for s in spec.staleness)
    return Outcome(
        figures=[
            Figure(f"T(s={s_max}) / T(0), steps to {target}", ratio, 1.0, "×", ">=", 0.0,
                   f"median steps over {len(spec.seeds)} seeds, each s at its own best lr (bracketed grid); "
                   "theory: staleness never helps"),
            Figure("pairs s < s' with T(s') < T(s)", dips, 0.0, "pairs", "=", 0.0,
                   f"over s in {list(spec.staleness)}: more staleness, never fewer steps (Dai et al.'s claim 1)"),
            Figure(f"seed bootstrap: share with T({s_max}) > T(0)", share, SOLID, "", ">=", 0.0,
                   f"1,000 resamples of the seeds (studies.staleness_report.Bootstrap) vs the study's bar {SOLID:g} "
                   "for a difference beyond seed noise"),
        ],
        explanation=(
            f"Staleness is not free: in Dai et al.'s emulation each gradient is computed on the weights of up to s "
            f"steps ago, as a slow worker's gradient lands on a model that has moved on. On the deep MLP with SGD, "
            f"the median steps to {target} test accuracy are {pts}: {ratio:.2f}× the synchronous count at "
            f"s={s_max}, rising with s at every step of the grid, even though every s gets its own best learning "
            f"rate (a smaller lr is how staleness is survived, and it costs steps). This is why frontier labs "
            f"train synchronously and fight stragglers instead of tolerating staleness."),
        picture=str(pic),
        notes=[f"single-process emulator (experiments/sim/dai.py), uniform delays U{{0..s}}, K = {spec.workers}; "
               f"{len(spec.seeds)} seeds, at most {spec.max_steps} steps" +
               (" (the preset's --quick sizes)" if ctx.quick else " (the preset's deep-model SGD row)"),
               "the theory here is a direction (T non-decreasing in s), not a number; the bootstrap share says the "
               "growth at s_max exceeds seed noise"])


def _hurts_picture(path: Path, cells: list[dict[str, Any]], spec: Any) -> Path:
    from pslab.experiments.results.plots import plt, save_figure
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    xs = [c["staleness"] for c in cells]
    for c in cells:
        ys = [v if v is not None else spec.max_steps for v in c["seed_steps"]]
        ax.plot([c["staleness"]] * len(ys), ys, ".", color="tab:blue", alpha=0.3, ms=5)
    ax.plot(xs, [c["steps"] if c["steps"] is not None else float("nan") for c in cells], "o-", color="tab:red",
            label="median over seeds (its best lr)")
    for c in cells:
        ax.annotate(f"lr {c['lr']:g}", (c["staleness"], c["steps"] or spec.max_steps), fontsize=7,
                    xytext=(4, -10), textcoords="offset points")
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xticks(list(spec.staleness), [str(s) for s in spec.staleness])
    ax.set_xlabel("staleness bound s (delays U{0..s})")
    ax.set_ylabel(f"steps to {100 * spec.target_acc:g} % test accuracy")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path, "Staleness costs steps (digits-mlp3, SGD; dots: seeds)", 10)


# ------------------------------------------------------------------------------------------- sharded checkpoints
def _checkpoint_files(run_path: str) -> list[tuple[int, int, int]]:
    """(rank, file bytes, bytes of state tensors in it: parameters and Adam moments) of the newest committed
    engine checkpoint of a run, read from disk."""
    from pslab.collectives.tensorfile import read_tensor_file
    from pslab.parallelism.state_io import committed_steps
    step_dirs = committed_steps(Path(run_path) / "checkpoints")
    if not step_dirs:
        raise RuntimeError(f"{run_path}: no committed checkpoint")
    out = []
    for p in sorted(step_dirs[0][1].glob("rank-*.pslab")):
        tensors, meta = read_tensor_file(p)
        state = sum(v.numel() * v.element_size() for k, v in tensors.items()
                    if k.endswith(("/param", "/opt/exp_avg", "/opt/exp_avg_sq")))
        out.append((int(meta["rank"]), p.stat().st_size, state))
    return out


def sharded_checkpoint(ctx: Context) -> Outcome:
    import torch

    from pslab.experiments.workloads import get_workload
    torch.set_num_threads(1)
    workload = "mnist-mlp"
    model = get_workload(workload, 1, 32, ctx.seed).make_model()
    psi = sum(p.numel() for p in model.parameters())
    full = ADAM_BYTES * psi
    layouts = [("data parallel", 2, 0), ("ZeRO-3", 2, 3), ("ZeRO-3", 4, 3)]
    files: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
    with _scratch() as root:
        for name, n, zero in layouts:
            ctx.say(f"  {name}, N={n}")
            cfg = _config(["train.strategy=allreduce", f'workload.name="{workload}"', 'train.optimizer="adam"',
                           "train.lr=0.001", f"train.workers={n}", f"parallel.zero={zero}", "train.steps=4",
                           "faults.checkpoint_every=2", "train.base_step_s=0.0", NO_EVAL], ctx.seed)
            files[name, n] = _checkpoint_files(_run(cfg, root)["path"])
    z2, z4, dp = files["ZeRO-3", 2], files["ZeRO-3", 4], files["data parallel", 2]
    big2, big4 = max(f[1] for f in z2), max(f[1] for f in z4)
    sum4 = sum(f[1] for f in z4)
    state4 = sum(f[2] for f in z4)
    pic = _checkpoint_picture(ctx.picture("sharded-checkpoint"), files, full)
    return Outcome(
        figures=[
            Figure("ZeRO-3, N=2: largest rank file", big2, full / 2, "B", "=", OVERHEAD_B / (full / 2),
                   f"file sizes on disk vs 12Ψ/N (Ψ = {psi:,} parameters of {workload}, Adam); tolerance: "
                   f"{OVERHEAD_B / 1e3:g} KB of RNG states and header per file"),
            Figure("ZeRO-3, N=4: largest rank file", big4, full / 4, "B", "=", OVERHEAD_B / (full / 4),
                   "file sizes on disk vs 12Ψ/N; the same overhead"),
            Figure("ZeRO-3, N=4: state tensors over all files", state4, full, "B", "=", 0.0,
                   "parameter + exp_avg + exp_avg_sq tensors read back from the 4 files vs 12Ψ: every element "
                   "stored once, on one rank"),
            Figure("ZeRO-3, N=4: sum of the rank files", sum4, full, "B", "=", 4 * OVERHEAD_B / full,
                   "Σ file sizes vs the full state 12Ψ; tolerance: N × the per-file overhead"),
            Figure("data parallel, N=2: rank 0's file", max(f[1] for f in dp), full, "B", "=", OVERHEAD_B / full,
                   "plain data parallelism: rank 0 stores every replica's (identical) state"),
        ],
        modelled=[Modelled("70B model's checkpoint per rank, 1,024 ranks", 70e9 * ADAM_BYTES / 1024 / 1e9, "GB",
                           "70e9 × 12 B (fp32 master weights + Adam moments) / N; 840 GB on one node unsharded")],
        explanation=(
            f"A checkpoint is the training state: weights and optimizer moments, {ADAM_BYTES} bytes per parameter "
            f"with Adam in fp32 — {full / 1e6:.2f} MB for this {psi:,}-parameter model. Plain data parallelism "
            f"writes it all from rank 0 ({max(f[1] for f in dp) / 1e3:.0f} KB; rank 1's file holds only its RNG "
            f"states, {min(f[1] for f in dp) / 1e3:.0f} KB). A ZeRO-3 run saves along the partition it "
            f"trains with: each rank writes only the 1/N chunk of every tensor it owns, "
            f"{big2 / 1e3:.0f} KB per rank at N=2 and {big4 / 1e3:.0f} KB at N=4 against 12Ψ/N = "
            f"{full / 2e3:.0f} and {full / 4e3:.0f} KB (the rest is each file's RNG states and header), and the "
            f"four files hold every element of the state exactly once. No node holds the entire checkpoint, and the write is spread "
            f"over all N ranks' disks and links; `pslab run --resume` re-cuts these pieces for any other layout."),
        picture=str(pic),
        notes=["real runs: allreduce with parallel.zero = 3 (and 0), faults.checkpoint_every = 2; sizes are the "
               "committed step's rank-*.pslab files (parallelism/state_io.py), counted on disk"])


def _checkpoint_picture(path: Path, files: dict[tuple[str, int], list[tuple[int, int, int]]], full: int) -> Path:
    from pslab.experiments.results.plots import plt, save_figure
    fig, ax = plt.subplots(figsize=(7, 4.2))
    x = 0
    ticks, labels = [], []
    for (name, n), fs in files.items():
        xs = [x + i for i in range(len(fs))]
        ax.bar(xs, [f[1] / 1e3 for f in fs], color="tab:gray" if name == "data parallel" else "tab:green",
               edgecolor="black")
        ax.plot([xs[0] - 0.4, xs[-1] + 0.4], [full / n / 1e3] * 2, "k--", lw=1)
        ax.text(xs[-1] + 0.45, full / n / 1e3, "12Ψ/N", fontsize=7, va="center")
        ticks += xs
        labels += [f"rank {f[0]}" for f in fs]
        ax.text((xs[0] + xs[-1]) / 2, full / 1e3 * 1.08, f"{name}\nN={n}", ha="center", fontsize=8)
        x += len(fs) + 1.5
    ax.axhline(full / 1e3, color="red", lw=1, label=f"full state 12Ψ = {full / 1e3:.0f} KB")
    ax.set_xticks(ticks, labels, fontsize=7, rotation=45)
    ax.set_ylim(0, full / 1e3 * 1.25)
    ax.set_ylabel("checkpoint file (KB)")
    ax.legend(fontsize=8, loc="center right")
    ax.grid(True, axis="y", alpha=0.3)
    return save_figure(fig, path, "Checkpoint bytes per rank: sharded along ZeRO's partition", 10)


# ---------------------------------------------------------------------------------------------------- elastic
def _rollbacks(updates: list[dict[str, Any]], worker: int) -> list[tuple[int, int]]:
    """(last step done, step resumed at) each time a worker's records go back to an earlier step."""
    steps = [u["step"] for u in sorted((u for u in updates if u["worker"] == worker), key=lambda u: u["time_s"])]
    return [(a, b) for a, b in zip(steps, steps[1:]) if b <= a]


def elastic(ctx: Context) -> Outcome:
    import torch

    from pslab.experiments.results.faults import plot_timeline
    torch.set_num_threads(1)
    steps = 30 if ctx.quick else 40
    k, detect_s = 5, 1.0
    kill_at, stop_at = 12, steps - 13
    events = f'[{{kill="worker:2", at_step={kill_at}}}, {{stop="worker:1", at_step={stop_at}, for_s=3.0}}]'
    common = ["train.strategy=allreduce", f"train.steps={steps}", "faults.on_failure=shrink",
              f"faults.commit_every={k}", f"faults.detect_s={detect_s}"]
    with _scratch() as root:
        ctx.say("  allreduce, no failure")
        ref = _run(_config(common, ctx.seed), root, label="allreduce")
        ctx.say("  allreduce, worker 2 killed, worker 1 hung")
        run = _run(_config([*common, f"faults.events={events}"], ctx.seed), root,
                   label="allreduce + kill worker:2, stop worker:1")
        tmp = root / "timeline"
        tmp.mkdir()
        drawn = plot_timeline([run, ref], tmp)
        pic = ctx.picture("elastic")
        if drawn is not None:
            shutil.copyfile(drawn, pic)
    K = int(run["config"]["train"]["workers"])
    if run["summary"] is None:
        raise RuntimeError("the run with failures did not complete (no summary.json)")
    det = {e["who"]: float(e["detect_s"]) for e in run["events"] if e["event"] == "detect"}
    ups = run["updates"]
    survivors = [w for w in range(K) if w not in (1, 2)]
    backs = [_rollbacks(ups, w) for w in survivors]
    if any(len(b) != 2 for b in backs):
        raise RuntimeError(f"expected two rollbacks per survivor, got {backs}")
    resumed = [min(b[i][1] for b in backs) for i in range(2)]
    redone = max(a - b + 1 for bs in backs for a, b in bs)
    last = {u["worker"] for u in ups if u["step"] == steps - 1}
    done = sum(len({u["step"] for u in ups if u["worker"] == w}) for w in survivors)
    acc, acc_ref = run["summary"].get("final_test_acc"), ref["summary"].get("final_test_acc")
    return Outcome(
        figures=[
            Figure("crash (kill -9) detected after", det.get("worker:2", float("inf")), detect_s, "s", "<=", 0.0,
                   "inject → detect (events.jsonl) vs faults.detect_s; a dead process is seen at once (its pidfd)",
                   timed=True),
            Figure("hang (SIGSTOP) detected after", det.get("worker:1", float("inf")), detect_s, "s", "<=",
                   HANG_SLACK, "inject → detect vs faults.detect_s without a heartbeat; slack for the supervisor's "
                   "poll on a loaded machine", timed=True),
            Figure("crash: training resumed at step", resumed[0], k * (kill_at // k), "step", "=", 0.0,
                   f"survivors' records (metrics.jsonl) vs the last commit k·⌊{kill_at}/k⌋, k = {k}"),
            Figure("hang: training resumed at step", resumed[1], k * (stop_at // k), "step", "=", 0.0,
                   f"survivors' records vs the last commit k·⌊{stop_at}/k⌋"),
            Figure("steps redone per failure (work lost)", redone, k, "steps", "<=", 0.0,
                   "the most steps a survivor did twice vs the commit interval faults.commit_every"),
            Figure("workers in the last step", len(last), K - 2, "workers", "=", 0.0,
                   "distinct workers with a record of the final step vs K − 2: the group reshaped twice"),
            Figure("steps completed by the survivors", done, (K - 2) * steps, "steps", "=", 0.0,
                   "distinct steps each survivor recorded, summed, vs (K − 2) × train.steps: the run completed"),
        ],
        explanation=(
            f"At scale a failure is a certainty, so the job must survive it. In a real {K}-worker all-reduce run, "
            f"worker 2 is killed at step {kill_at} and worker 1 hangs at step {stop_at}. The crash is noticed in "
            f"{det.get('worker:2', float('nan')) * 1e3:.0f} ms (the process is gone), the hang after "
            f"{det.get('worker:1', float('nan')):.2f} s without a heartbeat (bound {detect_s:g} s). Each time the "
            f"survivors roll back to their last commit (steps {resumed[0]} and {resumed[1]}: every {k} steps), "
            f"rebuild the ring with one member fewer ({K} → {K - 1} → {K - 2}) and go on: at most {redone} steps "
            f"are redone per failure instead of the whole run, and the {K - 2} survivors finish all {steps} steps "
            f"(final test accuracy {acc if acc is None else f'{acc:.3f}'}, against "
            f"{acc_ref if acc_ref is None else f'{acc_ref:.3f}'} without failures). The in-memory commit plays the "
            f"checkpoint's role here; a job restarted from scratch would instead reload sharded files like those "
            f"of the previous step (`pslab run --resume`) and lose everything since they were written."),
        picture=str(pic) if pic.exists() else None,
        notes=["the faults fire when the worker begins that step (at_step), so the rollback points are fixed by "
               "the config, not by timing; the detection times are timing-based (bounds)",
               f"faults.on_failure = shrink, commit_every = {k}, detect_s = {detect_s:g} s, heartbeat 0.5 s; "
               "each step's compute padded to 20 ms (compare_default.toml)"])


STEPS = [
    Step("straggler", SECTION, "Synchronous training (BSP) keeps replicas consistent — CAP's consistency side — but "
         "its throughput is capped by the slowest worker; asynchronous (HogWild!-style PS) is not",
         "pslab compare --strategies allreduce,ps-asp", straggler, 40),
    Step("staleness", SECTION, "Asynchronous training sacrifices consistency: gradients get applied against stale "
         "weights", "pslab run compare_default --set train.strategy=ps-asp --set train.base_step_s=0 "
         "--set stragglers.delay=exponential --set stragglers.delay_mean_s=0.02", staleness, 30),
    Step("staleness-hurts", SECTION, "This staleness can hurt convergence, which is why frontier labs train "
         "synchronously", "pslab sweep --preset staleness", staleness_hurts, 60),
    Step("sharded-checkpoint", SECTION, "Production systems checkpoint sharded across the same partitioning ZeRO "
         "uses, so no single node holds the entire checkpoint",
         "pslab run compare_default --set train.strategy=allreduce --set parallel.zero=3 --set train.optimizer=adam "
         "--set train.lr=0.001 --set faults.checkpoint_every=20", sharded_checkpoint, 20),
    Step("elastic", SECTION, "Elastic training detects a failed node, reconfigures the group around the healthy "
         "ones and resumes from the last checkpoint without restarting the run",
         "pslab compare --preset failure --strategies allreduce,ps-asp", elastic, 30),
]
