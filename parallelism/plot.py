"""Draw a pipeline timeline: one row per stage, one box per F/B action, idle time (the bubble) left blank.

Takes either a schedule's virtual-time replay (`schedule.simulate`) or spans measured by the executor, so the
textbook picture and the measured one look the same. Uses matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .schedule import Action, Timeline

Span = tuple[Action, float, float]


def draw_timeline(spans: Sequence[Sequence[Span]], path: str | Path, title: str = "",
                  theoretical_bubble: float | None = None, xlabel: str = "time") -> Path:
    """Write a PNG (or any matplotlib format, by suffix) of the per-stage spans; returns the path."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    path = Path(path)
    stages = len(spans)
    end = max((e for row in spans for _, _, e in row), default=1.0)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * sum(len(r) for r in spans[:1]) + 3), 0.6 * stages + 1.4))
    colors = {"F": "#4C9BE8", "B": "#F28E2B"}
    hatches = ("", "//", "..", "xx", "\\\\", "oo")     # interleaved: one hatch per model chunk
    chunked = any(a.chunk for row in spans for a, _, _ in row)
    for s, row in enumerate(spans):
        for a, b, e in row:
            ax.barh(s, e - b, left=b, height=0.8, color=colors[a.phase], edgecolor="black", linewidth=0.5,
                    hatch=hatches[a.chunk % len(hatches)])
            text = f"{a.phase}{a.micro}" + (f".{a.chunk}" if chunked else "")
            ax.text((b + e) / 2, s, text, ha="center", va="center", fontsize=6 if chunked else 7)
    ax.set_yticks(range(stages), [f"stage {s}" for s in range(stages)])
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xlabel(xlabel)
    busy = [sum(e - b for _, b, e in row) for row in spans]
    measured = 1.0 - sum(busy) / (stages * end) if end > 0 else 0.0
    label = f"bubble {measured:.3f}"
    if theoretical_bubble is not None:
        label += f"  ({'(p−1)/(v·m+p−1)' if chunked else '(p−1)/(m+p−1)'} = {theoretical_bubble:.3f})"
    ax.set_title(f"{title}  {label}".strip(), fontsize=9)
    from matplotlib.patches import Patch
    handles = [Patch(color=colors["F"], label="forward"), Patch(color=colors["B"], label="backward")]
    if chunked:           # "F3.1": forward of micro-batch 3 on the rank's model chunk 1 (virtual stage p + s)
        handles += [Patch(facecolor="white", edgecolor="black", hatch=hatches[k], label=f"chunk {k}")
                    for k in range(1 + max(a.chunk for row in spans for a, _, _ in row))]
    ax.legend(handles=handles, loc="upper right", fontsize=7, bbox_to_anchor=(1.0, -0.15), ncol=len(handles))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def draw_schedule(timeline: Timeline, path: str | Path) -> Path:
    """Draw a simulated schedule (equal stage times)."""
    s = timeline.schedule
    v = f", v={s.virtual_stages}" if s.virtual_stages > 1 else ""
    return draw_timeline(timeline.spans, path, title=f"{s.name}: p={s.stages}, m={s.micro_batches}{v}",
                         theoretical_bubble=s.theoretical_bubble(), xlabel="time (forward = 1)")
