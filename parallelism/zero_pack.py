"""ZeRO's packed layout (zero.py): which parameters travel together, and where each rank's chunk sits in the buffer.

A *unit* is a module that directly owns parameters (FSDP's granularity: stage 3 gathers a unit at a time); a
*bucket* is consecutive units in backward's order whose gradients are reduce-scattered together once all are ready;
a *pack* lays out some parameters' chunks for one collective. With N ranks and chunk_bounds' per-parameter cut,

    segment j of a pack = chunk j of each parameter, back to back, padded with zeros to
    length L = Σ_p |chunk 0 of p|        (chunk 0 is the largest: |chunk j| ≤ ⌈n_p/N⌉)

so the pack's equal N-way split is exactly the per-parameter chunking: one reduce-scatter (all-gather) of N·L
elements moves what one per parameter did, plus at most one element per parameter and rank of padding, and pays
one collective's fixed cost instead of one per parameter (gloo: ~1 ms each).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch
from torch import nn


class Unit:
    """A module that directly owns parameters: the granularity of stage-3 gathering."""

    def __init__(self, index: int, name: str, module: nn.Module, params: list[tuple[str, nn.Parameter]]) -> None:
        self.index, self.name, self.module, self.params = index, name, module, params
        self.nbytes = sum(p.numel() * p.element_size() for _, p in params)
        self.state = "full"
        self.future: Future | None = None
        self.grads_pending = 0
        self.pack: Pack | None = None          # its parameters' packed layout (stage 3: one all-gather per unit)


class Bucket:
    """Consecutive units (in backward's order) whose gradients are reduce-scattered together, once all are ready."""

    def __init__(self, units: list[Unit], pack: bool, all_bounds: dict[str, list[tuple[int, int]]]) -> None:
        self.units = units
        self.params = [(n, p) for u in units for n, p in u.params]
        self.name = units[0].name if len(units) == 1 else f"{units[-1].name}..{units[0].name}"
        self.pack = Pack([all_bounds[n] for n, _ in self.params]) if pack else None
        self.pending = len(self.params)
        self.reduced = False                    # its reduce-scatter issued this step


class Pack:
    """Rank j's chunks of some parameters, back to back, padded to one length: the buffer of one packed collective.

    N segments of `length` = Σ_p |chunk 0 of p| elements (chunk 0 is the largest): segment j holds chunk j of each
    parameter in order, then zeros. Its equal split is exactly the per-parameter chunking, so one reduce-scatter
    (all-gather) of it moves what one per parameter did, plus at most one element per parameter and rank of padding
    -- one collective's fixed cost instead of one per parameter (gloo: ~1 ms each)."""

    def __init__(self, bounds: list[list[tuple[int, int]]]) -> None:
        self.bounds = bounds                                 # per parameter, every rank's [a, b)
        self.length = sum(bs[0][1] - bs[0][0] for bs in bounds)

    def places(self, ranks: Any) -> Any:
        """(parameter index, start in a buffer of `ranks`' segments, chunk [a, b) of that parameter) per chunk."""
        for i, j in enumerate(ranks):
            at = i * self.length
            for k, bs in enumerate(self.bounds):
                a, b = bs[j]
                yield k, at, a, b
                at += b - a

    def pack(self, tensors: list[torch.Tensor], ranks: Any) -> torch.Tensor:
        """The segments of `ranks` (all: the whole packed buffer; [r]: this rank's) cut from full `tensors`."""
        packed = torch.zeros(len(ranks) * self.length, dtype=tensors[0].dtype)
        for k, at, a, b in self.places(ranks):
            packed[at:at + b - a] = tensors[k].reshape(-1)[a:b]
        return packed

    def pack_own(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """This rank's segment from its own chunks (`shards`, chunk r of each parameter), padded to `length`."""
        flat = torch.cat([t.reshape(-1) for t in shards])
        return torch.cat([flat, flat.new_zeros(self.length - flat.numel())]) if flat.numel() < self.length else flat

    def unpack(self, packed: torch.Tensor, tensors: list[torch.Tensor], ranks: Any) -> None:
        """The inverse of `pack`: the segments of `ranks` in `packed` written into full `tensors`."""
        for k, at, a, b in self.places(ranks):
            tensors[k].view(-1)[a:b] = packed[at:at + b - a]
