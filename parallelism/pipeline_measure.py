"""Measuring a pipeline step: a small MLP (one Linear per stage; interleaved: per chunk) run for one step with its
stage times padded to (t_F, t_B), every action's span on the shared monotonic clock, and the bubble from the spans:

    bubble = 1 − Σ_stages busy / (p · makespan)      next to (p − 1)/(m + p − 1), or (p − 1)/(v·m + p − 1)

`pslab schedule --run` launches `measure_step` on p ranks, `gather_spans` puts their spans on one clock, and
`bubble_fraction` measures; a traced real run measures the same from its trace (experiments/results/timeline.py).
"""

from __future__ import annotations

from typing import Any

import torch

from .mesh import DeviceMesh
from .pipeline import PipelineEngine
from .schedule import Action
def bubble_fraction(spans_per_stage: list[list[tuple[Action, float, float]]]) -> float:
    """1 − Σ busy / (p · makespan) over per-stage spans measured from a common start."""
    end = max(e for spans in spans_per_stage for _, _, e in spans)
    busy = sum(e - b for spans in spans_per_stage for _, b, e in spans)
    return 1.0 - busy / (len(spans_per_stage) * end)


def measure_step(group: Any, schedule: str, micro_batches: int, stage_time: tuple[float, float],
                 width: int = 32, batch: int = 64, virtual_stages: int = 1) -> dict[str, Any]:
    """Run one padded pipeline step of a small MLP (one Linear per stage; interleaved: per chunk) on the ranks of
    `group`; for `launch`.

    Returns this stage's spans on the shared monotonic clock (perf_counter), its peak in-flight count, and the step
    start — gather them from all ranks and pass to `bubble_fraction` / `plot.draw_timeline`."""
    from .models import mlp
    torch.manual_seed(0)
    mesh = DeviceMesh(group, pp=group.world_size)
    factory = lambda: mlp([width] * (group.world_size * virtual_stages + 1), seed=0)
    rep = PipelineEngine(schedule, micro_batches, stage_time=stage_time, measure=True,
                         report_loss=False, virtual_stages=virtual_stages).build(factory, mesh)
    x, y = torch.randn(batch, width), torch.randint(0, width, (batch,))
    rep.stage_time = None
    rep.forward_backward(x, y)               # warm-up: shape headers, first connections
    rep.stage_time = stage_time
    rep.forward_backward(x, y)
    t0 = rep.step_start
    return {"spans": [(a.stage, a.micro, a.phase, a.chunk, t0 + b, t0 + e) for a, b, e in rep.spans],
            "peak_in_flight": rep.peak_in_flight, "start": t0}


def gather_spans(results: list[dict[str, Any]]) -> list[list[tuple[Action, float, float]]]:
    """Per-stage spans from `measure_step` results of all ranks, relative to the earliest step start."""
    start = min(r["start"] for r in results)
    return [[(Action(s, i, ph, k), b - start, e - start) for s, i, ph, k, b, e in r["spans"]] for r in results]
