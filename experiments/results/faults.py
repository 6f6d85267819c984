"""The failure report: what happened to a run across each failure, from RUN_DIR/events.jsonl (the one event schema
real runs and the simulator write, experiments/faults/spec.py) with its metrics.jsonl and eval.jsonl.

One failure is the events of one target from an `inject` on (or from a `detect` without one: a failure that was
not injected, e.g. a process killed from outside): detect, then recover (or shard_restart + recover), then
maybe join (a replacement, or the stopped worker re-admitted) or expel (it came back too late). Per failure:

    time to detect   = t_detect - t_inject            (the detect event's detect_s when it has one)
    time to recover  = t_recover - t_detect           (training goes on: ring rebuilt, membership changed, shard back)
    lost             = lost_steps (all-reduce rollback, resynced workers) and lost_updates (a restarted shard)

A stop no longer than faults.detect_s has no detect event: it is a pause, not a failure ("not detected").

The timeline figure (`plot_timeline`) has one column per run with events and three panels over time: world size
(the membership after each event), throughput (applied updates per second over a sliding window), and the training
loss (running mean) with test accuracy points; vertical lines mark inject (red), detect (orange), recover (green)
and join / expel (blue), a planned leave (cyan). A no-failure run of the same strategy, when there is one, is drawn grey for reference.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from pslab.experiments.errors import ExperimentError
from pslab.experiments.faults.spec import EVENT_FIELDS, EVENTS

MARKERS = {"inject": "tab:red", "detect": "tab:orange", "recover": "tab:green", "shard_restart": "tab:green",
           "join": "tab:blue", "expel": "tab:blue", "leave": "tab:cyan", "abort": "black", "checkpoint_failed": "tab:purple"}
WINDOW_POINTS = 200          # throughput is sampled at this many times
WINDOW_FRACTION = 0.05       # the sliding window: this fraction of the run's duration


def validate_events(events: list[Any], where: str = "events.jsonl") -> list[dict[str, Any]]:
    """The events, checked against the schema (ExperimentError naming the line and the field), sorted by time."""
    out = []
    for n, e in enumerate(events, 1):
        if not isinstance(e, dict):
            raise ExperimentError(f"{where} line {n}: an event is a JSON object, got {type(e).__name__}")
        unknown = sorted(set(e) - set(EVENT_FIELDS))
        if unknown:
            raise ExperimentError(f"{where} line {n}: unknown field {unknown[0]!r}; fields are {', '.join(EVENT_FIELDS)}")
        if e.get("event") not in EVENTS:
            raise ExperimentError(f"{where} line {n}: event {e.get('event')!r} is not one of {', '.join(EVENTS)}")
        t = e.get("time_s")
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ExperimentError(f"{where} line {n}: time_s must be seconds >= 0, got {t!r}")
        if not isinstance(e.get("who"), str):
            raise ExperimentError(f"{where} line {n}: who must name the target, e.g. \"worker:2\", got {e.get('who')!r}")
        for k in ("generation", "world_size", "step", "lost_steps", "lost_updates"):
            v = e.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ExperimentError(f"{where} line {n}: {k} must be an integer >= 0, got {v!r}")
        d = e.get("detect_s")
        if d is not None and (isinstance(d, bool) or not isinstance(d, (int, float)) or not d >= 0):
            raise ExperimentError(f"{where} line {n}: detect_s must be seconds >= 0, got {d!r}")
        out.append(e)
    return sorted(out, key=lambda e: e["time_s"])          # stable: same-time events keep their order


def run_events(run: dict[str, Any]) -> list[dict[str, Any]]:
    return validate_events(run.get("events") or [], f"{run.get('path', 'run')}/events.jsonl")


def failures(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One dict per injected fault (see the module docstring), in inject order."""
    out: list[dict[str, Any]] = []
    open_: dict[str, dict[str, Any]] = {}
    for e in events:
        who, kind = e["who"], e["event"]
        if kind == "inject":
            f = {"who": who, "how": e.get("how"), "step": e.get("step"), "t_inject": e["time_s"], "t_detect": None,
                 "t_recover": None, "detect_s": None, "recover_s": None, "lost_steps": None, "lost_updates": None,
                 "world_size": e.get("world_size"), "joined_s": None, "expelled_s": None}
            out.append(f)
            open_[who] = f
            continue
        f = open_.get(who)
        if f is None and kind == "detect":                 # a real failure: nothing was injected, it just happened
            f = {"who": who, "how": e.get("how"), "step": e.get("step"), "t_inject": None, "t_detect": None,
                 "t_recover": None, "detect_s": None, "recover_s": None, "lost_steps": None, "lost_updates": None,
                 "world_size": e.get("world_size"), "joined_s": None, "expelled_s": None}
            out.append(f)
            open_[who] = f
        if f is None:
            continue                                       # e.g. a checkpoint_failed without an injected fault
        if kind == "detect" and f["t_detect"] is None:
            f["t_detect"] = e["time_s"]
            f["detect_s"] = e.get("detect_s", None if f["t_inject"] is None else e["time_s"] - f["t_inject"])
        elif kind in ("recover", "shard_restart"):
            if kind == "recover" or f["t_recover"] is None:
                f["t_recover"] = e["time_s"]
            for k in ("lost_steps", "lost_updates"):
                if e.get(k) is not None:
                    f[k] = e[k]
        elif kind == "join":
            f["joined_s"] = e["time_s"]
        elif kind == "expel":
            f["expelled_s"] = e["time_s"]
        if e.get("world_size") is not None:
            f["world_size"] = e["world_size"]
        if f["t_recover"] is not None and f["t_detect"] is not None:
            f["recover_s"] = f["t_recover"] - f["t_detect"]
    return out


def failure_summary(run: dict[str, Any]) -> dict[str, Any]:
    """For a summary row: number of failures, first time to detect and recover, total steps / updates lost."""
    fs = failures(run_events(run))
    det = [f["detect_s"] for f in fs if f["detect_s"] is not None]
    rec = [f["recover_s"] for f in fs if f["recover_s"] is not None]
    return {"failures": len(fs), "detect_s": det[0] if det else None, "recover_s": rec[0] if rec else None,
            "lost_steps": _total(f["lost_steps"] for f in fs), "lost_updates": _total(f["lost_updates"] for f in fs),
            "detected": len(det)}


def _total(values: Any) -> int | None:
    """The sum of the known values; None (shown "—", as in the Failures table) if none is known: a failure whose
    loss was not measured (an abort; a ps-asp survivor) is not "0 lost"."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def baseline_for(run: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The no-failure run of the same strategy and workers among `runs` (the compare preset's pair), if any."""
    t = (run.get("config") or {}).get("train") or {}
    for r in runs:
        rt = (r.get("config") or {}).get("train") or {}
        if r is not run and not r.get("events") and rt.get("strategy") == t.get("strategy") \
                and rt.get("workers") == t.get("workers"):
            return r
    return None


def _acc(run: dict[str, Any] | None) -> float | None:
    if run is None:
        return None
    acc = (run.get("summary") or {}).get("final_test_acc")
    if acc is None and run.get("evals"):
        acc = run["evals"][-1].get("test_acc")
    return acc


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "—"
    return f"{v:.{digits}g}" if isinstance(v, float) else str(v)


def failure_table(runs: list[dict[str, Any]]) -> str:
    """Markdown: one row per failure of every run with events; '' if none has any."""
    rows = ["| run | failure | at | time to detect (s) | time to recover (s) | steps / updates lost | world size "
            "after | final test acc (%) | no-failure run (%) |", "|---|---|---|---|---|---|---|---|---|"]
    from pslab.experiments.results.plots import run_label
    for r in runs:
        for f in failures(run_events(r)):
            base = baseline_for(r, runs)
            acc, bacc = _acc(r), _acc(base)
            at = f"step {f['step']}, " if f["step"] is not None else ""
            detect = (_fmt(f["detect_s"]) if f["detect_s"] is not None else
                      "— (not injected)" if f["t_inject"] is None else "not detected (a pause)")
            after = _fmt(f["world_size"]) + (f", joined at {_fmt(f['joined_s'])} s" if f["joined_s"] is not None
                                             else "") + (f", expelled at {_fmt(f['expelled_s'])} s"
                                                         if f["expelled_s"] is not None else "")
            rows.append(f"| {run_label(r)} | {f['who']} {f['how'] or ''} | {at}{_fmt(f['t_inject'] if f['t_inject'] is not None else f['t_detect'])} s | {detect} | "
                        f"{_fmt(f['recover_s'])} | {_fmt(f['lost_steps'])} / {_fmt(f['lost_updates'])} | {after} | "
                        f"{_fmt(100 * acc if acc is not None else None)} | "
                        f"{_fmt(100 * bacc if bacc is not None else None)} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def throughput_series(updates: list[dict[str, Any]], t_end: float | None = None,
                      points: int = WINDOW_POINTS) -> tuple[np.ndarray, np.ndarray, float]:
    """(times, applied updates per second over the trailing window, window seconds); an update is applied when it
    is not dropped and has a staleness (a push lost with a shard, or never applied, has none)."""
    ts = np.sort(np.array([u["time_s"] for u in updates if not u.get("dropped") and u.get("staleness") is not None],
                          float))
    end = float(t_end if t_end is not None else (ts[-1] if len(ts) else 0.0))
    if end <= 0 or not len(ts):
        return np.zeros(0), np.zeros(0), 0.0
    window = max(end * WINDOW_FRACTION, 1e-9)
    grid = np.linspace(window, end, points)
    counts = np.searchsorted(ts, grid, side="right") - np.searchsorted(ts, grid - window, side="right")
    return grid, counts / window, window


def world_size_series(events: list[dict[str, Any]], workers: int, t_end: float) -> tuple[list[float], list[int]]:
    """Step function of the membership: (times, world size from that time on)."""
    xs, ys = [0.0], [workers]
    for e in events:
        if e.get("world_size") is not None and e["world_size"] != ys[-1]:
            xs.append(e["time_s"])
            ys.append(e["world_size"])
    xs.append(max(t_end, xs[-1]))
    ys.append(ys[-1])
    return xs, ys


def plot_timeline(runs: list[dict[str, Any]], out: Path, max_runs: int = 6) -> Path | None:
    """failure_timeline.png (module docstring); None if no run has events."""
    from pslab.experiments.results.plots import _applied, _smooth, _time_label, plt, run_label, save_figure
    with_events = [r for r in runs if r.get("events")][:max_runs]
    if not with_events:
        return None
    cols = len(with_events)
    fig, axes = plt.subplots(3, cols, figsize=(4.6 * cols + 0.6, 7.6), squeeze=False, sharex="col")
    for j, r in enumerate(with_events):
        events = run_events(r)
        base = baseline_for(r, runs)
        K = int(((r.get("config") or {}).get("train") or {}).get("workers") or 1)
        t_end = max([u["time_s"] for u in r["updates"]] + [e["time_s"] for e in events] + [0.0])
        ax_w, ax_t, ax_l = axes[0][j], axes[1][j], axes[2][j]
        xs, ys = world_size_series(events, K, t_end)
        ax_w.step(xs, ys, where="post", color="black", lw=1.5)
        ax_w.set_ylim(-0.2, K + 0.8)
        ax_w.set_title(run_label(r), fontsize=9)
        ax_w.set_ylabel("world size (members)", fontsize=8)
        win = 0.0
        for rr, color, lab in ((base, "grey", "no failure"), (r, "tab:blue", "with failure")):
            if rr is None:
                continue
            gx, gy, win = throughput_series(_applied(rr))
            ax_t.plot(gx, gy, color=color, lw=1.2, ls="--" if rr is base else "-", label=lab)
            rups = _applied(rr)
            if rups and rups[0].get("loss") is not None:
                y = _smooth(np.array([u["loss"] for u in rups], float), 5 * K)
                ax_l.plot([u["time_s"] for u in rups], y, color=color, lw=1.2, ls="--" if rr is base else "-",
                          label=f"train loss, {lab}")
        ax_t.set_ylabel(f"updates/s (window {win:.2g} s)" if win else "updates/s", fontsize=8)
        ev = r.get("evals") or []
        if ev:
            acc = ax_l.twinx()
            acc.plot([e["time_s"] for e in ev], [100 * e["test_acc"] for e in ev], "o", color="tab:purple", ms=3,
                     label="test acc (%)")
            acc.set_ylabel("test accuracy (%)", fontsize=8)
            acc.tick_params(labelsize=7)
        ax_l.set_ylabel("training loss (running mean)", fontsize=8)
        ax_l.set_xlabel(_time_label([r]), fontsize=8)
        for ax in (ax_w, ax_t, ax_l):
            ax.grid(True, alpha=0.3)
            ax.tick_params(labelsize=7)
            for e in events:
                ax.axvline(e["time_s"], color=MARKERS.get(e["event"], "grey"), lw=0.9, ls=":")
        top = ax_w.get_ylim()[1]
        for e in events:
            ax_w.annotate(f"{e['event']} {e['who']}", (e["time_s"], top), rotation=90, fontsize=6, va="top",
                          ha="right", color=MARKERS.get(e["event"], "grey"), xytext=(-1, -2), textcoords="offset points")
        if ax_t.lines:
            ax_t.legend(fontsize=6, loc="lower left")
        if ax_l.lines:
            ax_l.legend(fontsize=6, loc="lower left")       # a falling loss leaves that corner (and the dots) free
    sep = "\n" if cols == 1 else " "                     # one column: the title in two lines, not cut off
    return save_figure(fig, Path(out) / "failure_timeline.png",
                       f"Across each failure: membership, throughput, loss{sep}(red inject, orange detect, green "
                       "recover, blue join / expel)", 9)
