"""PNG plots of one or more runs (matplotlib, Agg backend: no display needed).

Each run is the dict `RunDir.load()` returns. Colour = strategy, line style = condition (solid: no straggler,
dashed: with straggler), so one figure can overlay both conditions. Training loss per update is noisy (each update
is one worker's mini-batch), so curves show its running mean over a window of ~5 updates per worker. Runs made by the
simulator are labelled "(simulated)" and their time axis is virtual seconds; timing-only simulations have no loss
and no evaluations, so their report has no loss or accuracy plot. The per-worker staleness histograms carry the
analytic laws of `experiments.sim.laws` (ASP: mean K − 1, Geometric(1/K) for exponential compute times, a persistent
straggler's spike at c(K − 1); the SSP bound). Runs with failures (events.jsonl) add the failure timeline of
`experiments.results.faults`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

STRATEGY_ORDER = ["local", "allreduce", "local-sgd", "diloco", "ps-bsp", "ps-ssp", "ps-bsp-backup", "ps-asp",
                  "ps-ssp-agg", "ps-local", "ps-diloco"]


def run_label(run: dict[str, Any]) -> str:
    s = run.get("summary") or {}
    return s.get("label") or Path(run["path"]).name


def _color(run: dict[str, Any], runs: list[dict[str, Any]]) -> Any:
    """One colour per strategy kind, the same in every report (local blue, allreduce orange, ps-bsp green, ps-ssp
    red, ps-bsp-backup purple, ps-asp brown, ps-ssp-agg pink); when one kind appears with several arguments (a sweep over ps-ssp:s),
    colours go by first appearance instead, so the variants differ."""
    strat = [r["config"]["train"]["strategy"] for r in runs]
    uniq = list(dict.fromkeys(strat))
    kinds = [s.split(":")[0] for s in uniq]
    mine = run["config"]["train"]["strategy"]
    if len(set(kinds)) == len(kinds) and all(k in STRATEGY_ORDER for k in kinds):
        return plt.get_cmap("tab10")(STRATEGY_ORDER.index(mine.split(":")[0]))
    return plt.get_cmap("tab10")(uniq.index(mine) % 10)


def _style(run: dict[str, Any]) -> str:
    return "--" if (run.get("summary") or {}).get("straggler") else "-"


def _time_label(runs: list[dict[str, Any]]) -> str:
    sim = [bool((r.get("summary") or {}).get("simulated")) for r in runs]
    if all(sim):
        return "virtual time (s, simulated)"
    if any(sim):
        return "time (s; wall-clock, or virtual for simulated runs)"
    return "wall-clock time (s)"


def _smooth(y: np.ndarray, window: int) -> np.ndarray:
    if len(y) == 0 or window <= 1:
        return y
    window = min(window, len(y))
    c = np.cumsum(np.insert(y, 0, 0.0))
    out = np.empty_like(y)
    out[window - 1:] = (c[window:] - c[:-window]) / window
    out[: window - 1] = c[1:window] / np.arange(1, window)
    return out


def _applied(run: dict[str, Any]) -> list[dict[str, Any]]:
    ups = [u for u in run["updates"] if not u.get("dropped")]
    return sorted(ups, key=lambda u: (u["time_s"], u["worker"], u["step"]))


def save_figure(fig: Any, path: Path, suptitle: str | None = None, fontsize: float = 10) -> Path:
    """Optional suptitle, tight layout, write the PNG at 110 dpi, close the figure; returns `path`."""
    if suptitle:
        fig.suptitle(suptitle, fontsize=fontsize)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _finish(fig: Any, ax: Any, path: Path, title: str, legend: bool = True) -> Path:
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if legend:
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _epochs_per_gradient(run: dict[str, Any]) -> float | None:
    """Epochs one applied gradient stands for: batch size / training examples (None if the run does not say)."""
    n = (run.get("summary") or {}).get("train_examples")
    b = ((run.get("config") or {}).get("workload") or {}).get("batch_size")
    return b / n if n and b else None


def plot_loss(runs: list[dict[str, Any]], out: Path, x: str) -> Path | None:
    """Training loss against x = "time", "updates" (gradients applied) or "epochs" (samples seen / train size)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        ups = _applied(r)
        per = _epochs_per_gradient(r)
        if not ups or (x == "epochs" and per is None) or ups[0].get("loss") is None:   # timing-only: no loss
            continue
        workers = max(1, (r.get("summary") or {}).get("workers") or 1)
        y = _smooth(np.array([u["loss"] for u in ups], float), 5 * workers)
        n = np.arange(1, len(ups) + 1)
        xs = np.array([u["time_s"] for u in ups]) if x == "time" else n * per if x == "epochs" else n
        ax.plot(xs, y, _style(r), color=_color(r, runs), label=run_label(r), lw=1.4)
    ax.set_xlabel({"time": _time_label(runs), "updates": "gradients applied (updates)",
                   "epochs": "samples seen (epochs of the training set)"}[x])
    ax.set_ylabel("training loss (cross-entropy, running mean)")
    if not ax.lines:
        plt.close(fig)
        return None
    return _finish(fig, ax, out / f"loss_vs_{x}.png", f"Training loss vs {x}")


def plot_accuracy(runs: list[dict[str, Any]], out: Path) -> Path | None:
    if not any(r["evals"] for r in runs):
        return None                                         # timing-only runs evaluate nothing
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        ev = r["evals"]
        if ev:
            ax.plot([e["time_s"] for e in ev], [100 * e["test_acc"] for e in ev], _style(r), marker=".",
                    color=_color(r, runs), label=run_label(r), lw=1.4)
    ax.set_xlabel(_time_label(runs))
    ax.set_ylabel("test accuracy (%)")
    return _finish(fig, ax, out / "test_accuracy.png", "Test accuracy vs time")


def _bars(runs: list[dict[str, Any]], values: list[float], ylabel: str, title: str, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(runs) + 2), 4.5))
    xs = np.arange(len(runs))
    bars = ax.bar(xs, values, color=[_color(r, runs) for r in runs],
                  hatch=None, edgecolor="black", linewidth=0.5)
    for b, r in zip(bars, runs):
        if _style(r) == "--":
            b.set_hatch("//")
    for x, v in zip(xs, values):
        if math.isnan(v):
            ax.annotate("not observable", (x, 0), ha="center", va="bottom", fontsize=7, rotation=90)
        else:
            ax.annotate(f"{v:.3g}", (x, v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(xs, [run_label(r) for r in runs], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    return _finish(fig, ax, path, title + "  (hatched: with straggler)", legend=False)


def plot_throughput(runs: list[dict[str, Any]], out: Path) -> Path:
    v = [float((r.get("summary") or {}).get("updates_per_s") or 0.0) for r in runs]
    unit = "virtual s" if all((r.get("summary") or {}).get("simulated") for r in runs) else "s"
    return _bars(runs, v, f"gradients applied per {unit}\n(while all workers run)", "Throughput",
                 out / "throughput.png")


def plot_wait(runs: list[dict[str, Any]], out: Path) -> Path:
    v = []
    for r in runs:
        s = r.get("summary") or {}
        v.append(float(s.get("wait_s_total") or 0.0) / max(1, s.get("workers") or 1))
    return _bars(runs, v, "time blocked, mean per worker (s)\nPS pull + gate, or all-reduce", "Time waiting",
                 out / "wait_time.png")


def plot_bytes(runs: list[dict[str, Any]], out: Path) -> Path:
    v = [float(b) / 1e6 if (b := (r.get("summary") or {}).get("bytes_per_worker")) is not None else math.nan
         for r in runs]                                  # nan: not observable (no bar), not 0
    return _bars(runs, v, "bytes sent + received per worker (MB)", "Traffic per worker", out / "bytes_per_worker.png")


KIND_COLORS = {"dp gradient sync": "tab:blue", "zero RS + AG": "tab:purple", "tp activations": "tab:orange",
               "pp boundaries": "tab:green", "ps push + pull": "tab:red", "cp ring + grads": "tab:brown",
               "ep all-to-all + grads": "tab:olive"}


def plot_bytes_by_kind(runs: list[dict[str, Any]], out: Path) -> Path | None:
    """Per run two stacked bars, bytes per step by kind summed over ranks: measured (solid) and the formula
    (hatched). None if no run recorded bytes by kind (simulated runs, runs of older pslab versions)."""
    data = [((r.get("summary") or {}).get("bytes_by_kind") or {}) for r in runs]
    if not any(data):
        return None
    kinds = [k for k in KIND_COLORS if any(k in d for d in data)]
    kinds += sorted({k for d in data for k in d} - set(kinds))     # a kind without a colour still counts
    colors = {**KIND_COLORS, **{k: plt.get_cmap("tab20")(i) for i, k in enumerate(kinds) if k not in KIND_COLORS}}
    fig, ax = plt.subplots(figsize=(max(6.5, 1.1 * len(runs) + 2.5), 4.8))
    xs = np.arange(len(runs))
    for i, (which, alpha) in enumerate((("measured_per_step", 1.0), ("model_per_step", 0.4))):
        bottom = np.zeros(len(runs))
        for k in kinds:                              # a measured None (not observable) draws no bar, not 0
            v = np.array([float((d.get(k) or {}).get(which) or 0.0) for d in data]) / 1e3
            ax.bar(xs + (i - 0.5) * 0.38, v, 0.36, bottom=bottom, color=colors[k], alpha=alpha,
                   edgecolor="black", linewidth=0.4, label=k if i == 0 else None)
            bottom += v
        for x, total, d in zip(xs + (i - 0.5) * 0.38, bottom, data):
            if i == 0 and any(v.get("measured_per_step", 0) is None for v in d.values()):
                ax.annotate("not observable", (x, total), ha="center", va="bottom", fontsize=7, rotation=90)
            elif total > 0:
                ax.annotate(f"{total:.3g}", (x, total), ha="center", va="bottom", fontsize=7)
    ax.bar([np.nan], [0], color="lightgrey", edgecolor="black", label="right bar, lighter: formula")
    ax.margins(y=0.12)
    ax.set_xticks(xs, [run_label(r) for r in runs], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("kB sent per step, all processes\n(left: measured, right: formula)")
    return _finish(fig, ax, out / "bytes_by_kind.png", "Communication per step by kind")


def plot_staleness(runs: list[dict[str, Any]], out: Path) -> Path:
    n = len(runs)
    if n == 0:
        raise ValueError("no runs to plot")
    cols = min(4, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(max(6.4, 3.2 * cols), 2.6 * rows + 0.4), squeeze=False)
    for ax, r in zip(axes.flat, runs):
        taus = np.array([u["staleness"] for u in r["updates"] if u.get("staleness") is not None], int)
        if len(taus):
            ax.hist(taus, bins=np.arange(taus.max() + 2) - 0.5, color=_color(r, runs), edgecolor="black", lw=0.4)
            ax.axvline(taus.mean(), color="black", ls=":", lw=1, label=f"mean {taus.mean():.2f}")
            ax.legend(fontsize=7)
        ax.set_xlim(-0.5, (int(taus.max()) if len(taus) else 0) + 1.5)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(run_label(r), fontsize=9)
        ax.set_xlabel("staleness τ (versions)", fontsize=8)
        ax.set_ylabel("updates", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    return save_figure(fig, out / "staleness_hist.png",
                       "Staleness per update\n(τ = shard version when applied − version read)" if cols < 3 else
                       "Staleness per update (τ = shard version when applied − version read)")


def plot_coherence(series: dict[str, list[tuple[int, dict[int, float]]]], out: Path) -> Path:
    """Gradient coherence cos(grad F(x_k), grad F(x_{k-m})) (`experiments.sim.coherence`): one panel per model
    (label -> [(step k, {lag m: cos})]) with a line per lag over k, and a last panel with the mean over k vs m,
    one line per model (Dai et al. 2019, Fig. 5: deeper models decorrelate faster)."""
    if not series:
        raise ValueError("no coherence series to plot")
    n = len(series)
    fig, axes = plt.subplots(1, n + 1, figsize=(3.6 * (n + 1), 3.4), squeeze=False)
    for j, (ax, (label, rows)) in enumerate(zip(axes[0], series.items())):
        lags = sorted({m for _, row in rows for m in row})
        for i, m in enumerate(lags):
            pts = [(k, row[m]) for k, row in rows if m in row]
            ax.plot([k for k, _ in pts], [c for _, c in pts], color=plt.get_cmap("viridis")(i / max(1, len(lags) - 1)),
                    lw=1.2, label=f"m = {m}")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step k", fontsize=8)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, title="lag", title_fontsize=7)
        mean = {m: float(np.nanmean([row[m] for _, row in rows if m in row])) for m in lags}
        axes[0][n].plot(list(mean), list(mean.values()), marker="o", color=f"C{j}", label=label)
    axes[0][0].set_ylabel("cos(grad F(x_k), grad F(x_{k-m}))", fontsize=8)
    last = axes[0][n]
    last.set_xscale("log", base=2)
    last.set_xlabel("lag m (steps)", fontsize=8)
    last.set_ylabel("mean over k", fontsize=8)
    last.set_title("coherence vs lag, per model", fontsize=9)
    last.grid(True, alpha=0.3)
    last.legend(fontsize=7)
    return save_figure(fig, out / "coherence.png", "Gradient coherence on a fixed evaluation batch (Dai et al. 2019)")


def plot_staleness_per_worker(runs: list[dict[str, Any]], out: Path, max_workers: int = 4,
                               max_runs: int = 12) -> Path | None:
    """Per-worker staleness pmf over the steady window (all workers running), one row per PS run and one column per
    worker (all if K <= max_workers, else the first ones and every straggler), with the analytic overlay of
    `experiments.sim.laws`: the predicted mean (dashed), Geometric(1/K) (line) when compute times are exponential,
    the strategy's bound (red); the measured mean dotted. None if no run has PS staleness."""
    from pslab.experiments.results.records import steady_window_end
    from pslab.experiments.sim.laws import overlay
    ps = [r for r in runs if str(r["config"]["train"]["strategy"]).startswith("ps-")
          and any(u.get("staleness") is not None for u in r["updates"])][:max_runs]
    if not ps:
        return None
    K = max(int(r["config"]["train"]["workers"]) for r in ps)
    slow = sorted({int(w) for r in ps for w in (r["config"].get("stragglers") or {}).get("factors") or {}})
    slow = [w for w in slow if w < K][:max_workers - 1]
    cols = sorted(slow + [w for w in range(K) if w not in slow][:max_workers - len(slow)])
    fig, axes = plt.subplots(len(ps), len(cols), figsize=(2.6 * len(cols) + 0.6, 2.1 * len(ps) + 0.7),
                             squeeze=False)
    for row, r in zip(axes, ps):
        t_end = steady_window_end(r["updates"]) or 0.0
        for ax, w in zip(row, cols):
            taus = np.array([u["staleness"] for u in r["updates"] if u["worker"] == w and u.get("staleness")
                             is not None and u["time_s"] <= t_end], int)
            ax.set_title(f"{run_label(r)}: worker {w}", fontsize=7)
            ax.tick_params(labelsize=6)
            if not len(taus):
                continue
            k = np.arange(int(taus.max()) + 1)
            ov = overlay(r["config"], w, int(taus.max()))
            ax.bar(k, np.bincount(taus) / len(taus), width=1.0, color=_color(r, runs), alpha=0.7, lw=0)
            ax.axvline(taus.mean(), color="black", ls=":", lw=1, label=f"mean {taus.mean():.2f}")
            if ov.pmf is not None:
                ax.plot(k, ov.pmf, color="black", lw=1, label=ov.pmf_label)
            if ov.mean is not None:
                ax.axvline(ov.mean, color="tab:blue", ls="--", lw=1, label=f"{ov.mean_label} = {ov.mean:.3g}")
            right = max(int(taus.max()), ov.mean or 0) + 1.5
            if ov.bound is not None and 0 < ov.bound <= 2 * right:
                ax.axvline(ov.bound, color="tab:red", lw=1.2, label=f"bound {ov.bound}")
                right = ov.bound + 1.5
            elif ov.bound:                                    # far off to the right: say so, keep the scale
                ax.plot([], [], color="tab:red", lw=1.2, label=f"bound {ov.bound} (off scale)")
            ax.set_xlim(-0.5, right)
            ax.legend(fontsize=5.5, loc="upper right")
    for ax in axes[-1]:
        ax.set_xlabel("staleness τ (versions)", fontsize=7)
    return save_figure(fig, out / "staleness_per_worker.png",
                       "Staleness per worker while all workers run, with the analytic laws", 9)


def plot_all(runs: list[dict[str, Any]], out: Path) -> dict[str, Path]:
    """Write every comparison plot into `out`; returns {plot name: path}."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plots = {"loss_vs_time": plot_loss(runs, out, "time"), "loss_vs_updates": plot_loss(runs, out, "updates"),
            **({"loss_vs_epochs": plot_loss(runs, out, "epochs")} if any(_epochs_per_gradient(r) for r in runs)
               else {}),
            "test_accuracy": plot_accuracy(runs, out), "throughput": plot_throughput(runs, out),
            "staleness_hist": plot_staleness(runs, out), "wait_time": plot_wait(runs, out),
            "bytes_per_worker": plot_bytes(runs, out),
            **({"bytes_by_kind": p} if (p := plot_bytes_by_kind(runs, out)) is not None else {}),
            "staleness_per_worker": plot_staleness_per_worker(runs, out)}
    if any((r.get("summary") or {}).get("moe") for r in runs):
        from pslab.experiments.results.moe import plot_expert_load
        plots["expert_load"] = plot_expert_load(runs, out)
    if any(r.get("events") for r in runs):
        from pslab.experiments.results.faults import plot_timeline
        plots["failure_timeline"] = plot_timeline(runs, out)
    return {k: v for k, v in plots.items() if v is not None}
