"""`pslab tour`: the article (../shared/000_1bdcf90dde28002e.txt) claim by claim, in its order. Each step runs a
small real experiment (or, where only a model can speak, the model — and says so), prints the measured figure next
to the formula with a paragraph on what it shows, and saves its picture.

    core.py          Figure (measured, theory, how they must agree), Step, Context, run_steps, the index page,
                     the helpers steps share (run_summary, kinds, pyplot, save)
    walls.py         why one GPU is not enough: the memory wall, the compute wall
    split.py         data parallelism (one model, not N), tensor vs pipeline parallelism (bytes, messages)
    allreduce.py     parameter server vs ring: root bytes ∝ N, ring 2(N−1)/N·S per rank, time vs N
    memory.py        ZeRO 1/2/3 (FSDP), its bytes and link sensitivity, activation checkpointing both ways
    pipeline.py      the bubble: naive (P−1)/P, micro-batches, 1F1B's memory, micro-batch size vs utilisation
    topology.py      TP inside the node, PP across it (both regimes), 3D packed vs spread
    scale.py         at larger scale: attention's S² memory, context parallelism, the experts' all-to-all
    sync.py          sync vs async (CAP), stragglers, staleness, sharded checkpoints, elastic recovery

`steps()` lists every step in the article's order.
"""

from __future__ import annotations

import importlib

from .core import Context, Figure, Modelled, Outcome, Result, Step, TourError, run_steps, write_index, write_json

MODULES = ("walls", "split", "allreduce", "memory", "pipeline", "topology", "scale", "sync")


def steps() -> list[Step]:
    """Every step, in the article's order."""
    return [step for name in MODULES for step in importlib.import_module(f"{__name__}.{name}").STEPS]


def select(names: list[str]) -> list[Step]:
    """The steps named (in the article's order, whatever order they were given in); TourError for an unknown one."""
    every = steps()
    known = {s.key for s in every}
    bad = [n for n in names if n not in known]
    if bad:
        raise TourError(f"unknown tour step {bad[0]!r}; `pslab tour --list` shows the {len(every)} steps")
    return [s for s in every if not names or s.key in names]


__all__ = ["Context", "Figure", "Modelled", "Outcome", "Result", "Step", "TourError", "run_steps", "select", "steps",
           "write_index", "write_json"]
