"""The timeline as a picture: one lane per rank and PS shard, a few steady steps, coloured by what the process did
(timeline.py's intervals: compute, communication, straggler padding, waiting at a PS gate, a shard's apply).

Read it like HTA's or Perfetto's view: green (upper half of a lane) is compute, red (lower half) communication --
red under green is communication hidden behind compute (overlap), red alone is exposed: the rank waits for it. A
pipeline stage waiting for its input is a blocking receive, so its bubble shows red; white is time outside every
recorded span (Python between calls, an isend in flight).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pslab.experiments.results.plots import plt, save_figure
from pslab.experiments.results.timeline import _intervals, _track_name, load_run

COLORS = {"compute": "#2ca02c", "comm": "#d62728", "pad": "#9e9e9e", "wait": "#ff7f0e", "ps": "#9467bd"}
LABELS = {"compute": "compute", "comm": "communication", "pad": "padding (base_step_s, straggler)",
          "wait": "parked at a PS gate",
          "ps": "shard applies a push"}
STEPS = 3


def _window(procs: list[dict[str, Any]], steps: int = STEPS) -> tuple[float, float]:
    """From the start of step 1 (step 0 connects) to the end of step `steps`, by the ranks' step-tagged spans."""
    starts: dict[int, float] = {}
    ends: dict[int, float] = {}
    for d in procs:
        for e in d["events"]:
            st = e["args"].get("step") if e["ph"] == "X" else None
            if isinstance(st, int):
                starts[st] = min(starts.get(st, e["ts"]), e["ts"])
                ends[st] = max(ends.get(st, e["ts"] + e["dur"]), e["ts"] + e["dur"])
    if not starts:
        every = [e["ts"] for d in procs for e in d["events"]]
        return (min(every), max(every)) if every else (0.0, 1.0)
    first = 1 if len(starts) > 1 else min(starts)
    last = min(max(starts), first + steps - 1)
    return starts[first], ends[last]


def draw(ax: Any, procs: list[dict[str, Any]], title: str = "", steps: int = STEPS) -> None:
    """Lanes of one traced run on `ax` (milliseconds from the window's start)."""
    t0, t1 = _window(procs, steps)
    lanes = [_track_name(d) for d in procs]
    for y, d in enumerate(procs):
        iv = _intervals(d)
        for cat in ("pad", "wait", "ps", "comm", "compute"):
            bars = [((max(a, t0) - t0) / 1e3, (min(b, t1) - max(a, t0)) / 1e3) for a, b in iv[cat] if b > t0 and a < t1]
            if not bars:
                continue
            h, off = (0.36, 0.0) if cat == "compute" else (0.36, 0.38) if cat == "comm" else (0.74, 0.0)
            ax.broken_barh(bars, (y - 0.37 + off, h), facecolors=COLORS[cat], label=LABELS[cat])
    ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_xlim(0, (t1 - t0) / 1e3)
    ax.set_xlabel("ms (steady steps)")
    ax.grid(axis="x", alpha=0.3)
    if title:
        ax.set_title(title, fontsize=10, loc="left")
    handles, labels = ax.get_legend_handles_labels()
    seen = dict(zip(labels, handles))
    ax.legend(seen.values(), seen.keys(), fontsize=7, loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=len(seen),
              frameon=False)


def write_gantt(run_dirs: list[str | Path], out: Path, titles: list[str] | None = None,
                steps: int = STEPS) -> Path:
    """timeline.png in `out`: the traced runs one above the other (same time scale per panel)."""
    procs_per_run = [load_run(r) for r in run_dirs]
    heights = [max(1.2, 0.45 * len(p) + 0.9) for p in procs_per_run]
    fig, axes = plt.subplots(len(run_dirs), 1, figsize=(11, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for i, procs in enumerate(procs_per_run):
        draw(axes[i][0], procs, (titles or [""] * len(run_dirs))[i] or Path(run_dirs[i]).name, steps)
    out.mkdir(parents=True, exist_ok=True)
    return save_figure(fig, out / "timeline.png",
                       "what each rank did: compute (green, upper half), communication (red, lower half)")
