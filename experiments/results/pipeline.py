"""The pipeline bubble of a run, measured next to its formula.

Each pipeline rank records, per step after the first, its busy time (the compute spans of its schedule's actions)
and its span (from entering the step to its last action's end; waiting for a neighbour's activation or gradient is
idle). The measured bubble pools them over the ranks and steps:

    bubble_measured = 1 − Σ busy / Σ span            formula (p−1)/(m+p−1); interleaved 1F1B (p−1)/(v·m+p−1)

The formula assumes equal stage times and free messages; a run's stages differ (the embedding, the head, tp's
collectives inside a stage) and every hop costs a wake-up, so the two agree only roughly here; `pslab schedule
--run` pads every action to a fixed time and measures the formula's own setting.
"""

from __future__ import annotations

from typing import Any

from pslab.experiments.config import RunConfig


def pipeline_summary(cfg: RunConfig, results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """{"bubble_measured", "bubble_formula", "formula", "stages", "micro_batches", "virtual_stages", "schedule"} for
    pp > 1 runs whose ranks recorded spans; else None."""
    p = cfg.parallel
    busy = sum(float(r.get("pipeline_busy_s") or 0.0) for r in results)
    span = sum(float(r.get("pipeline_span_s") or 0.0) for r in results)
    if p.pp < 2 or span <= 0:
        return None
    v, m = p.virtual_stages, p.micro_batches
    return {"bubble_measured": 1.0 - busy / span, "bubble_formula": (p.pp - 1) / (v * m + p.pp - 1),
            "formula": "(p-1)/(v*m+p-1)" if v > 1 else "(p-1)/(m+p-1)", "stages": p.pp, "micro_batches": m,
            "virtual_stages": v, "schedule": "interleaved-1f1b" if v > 1 else p.schedule}
