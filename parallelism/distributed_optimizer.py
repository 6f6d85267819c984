"""The distributed optimizer (ZeRO-1 as Megatron-LM applies it): optimizer state sharded over dp, for any replica.

ZeRO stage 1 needs nothing from the model's layout: whatever slots the other axes left on this rank (a pipeline
stage's tensors, tp shards, both), the D ranks of its dp group hold identical copies of them — so they can split
the optimizer's work and state D ways. Per slot tensor of n elements, rank r of dp owns chunk r
(`chunk_bounds(n, D)`), and each step

    reduce-scatter   the slot's gradient over dp, averaged: rank r receives the mean of chunk r    (D−1)/D·S sent
    update           the optimizer (any element-wise one: SGD, momentum, Adam) on the owned chunk only
    all-gather       every rank's updated chunk, so each holds the whole updated tensor again       (D−1)/D·S sent

the same 2(D−1)/D·S bytes as the plain all-reduce of the gradients it replaces (an all-reduce is a reduce-scatter
plus an all-gather), while the optimizer state per rank drops from K·Ψ to K·Ψ/D (`zero_memory.py`). With tp and pp
each (pp, tp) coordinate runs its own distributed optimizer over its own dp group — Megatron's "distributed
optimizer per model-parallel rank" — since those ranks hold different tensors. The same holds per cp and per ep
rank: every rank chunks over its own dp group what it holds (after the cp average, or the ep sum of the replicated
tensors' gradients, its cp / ep peers hold identical copies of those), so each keeps K·Ψ_rank/D of optimizer state.
Megatron shards the replicated part once more, over dp × cp (a C times smaller share); here the cp ranks repeat
their dp group's chunks, as the ep ranks repeat the non-expert ones (correct, not the most frugal: a checkpoint
stores one copy). ZeRO 2 and 3 also shard the gradients and the parameters inside backward and forward; they stay
`zero.py`'s, on data parallelism and dp × tp (× cp) -- except ZeRO-2 in a pipeline (`stage=2`): a stage's gradients
accumulate over its m micro-batches, so here they are reduce-scattered after *each* backward action (the
pipeline's `after_backward`) into the owned chunk's accumulator and the full ones freed -- the gradient memory is
the shard plus one micro-batch's, for m reduce-scatters a step instead of one (Rajbhandari et al.'s stage 2 under
gradient accumulation, DeepSpeed's way; (m+1)(D−1)/D·S sent, as the planner's textbook rule counts).
Snapshots and checkpoints hold the state as the chunks it is kept in (`snapshot.py`: "flat" chunks of whole slots,
"index_flat" chunks of tp shards), so a resume may re-cut it for any other layout.
"""

from __future__ import annotations

import torch
from torch import nn

from pslab.collectives import chunk_bounds

from .comm import Comm
from .engine import EngineError, OptimizerFactory, ParamSlot, Replica, zero_grads


class DistributedOptimizerStrategy:
    """ZeRO-1 over `replica.dp` for any replica: reduce-scatter the gradients, update the owned chunks, all-gather."""

    def __init__(self, optimizer_factory: OptimizerFactory, stage: int = 1) -> None:
        """stage 2: a pipeline replica's gradients reduce-scattered after every backward action (module docstring)."""
        if stage not in (1, 2):
            raise EngineError(f"the distributed optimizer runs ZeRO stage 1 or 2, got {stage}")
        self.optimizer_factory, self.stage = optimizer_factory, stage
        self.optimizer: torch.optim.Optimizer | None = None
        self.shards: list[nn.Parameter] = []
        self.bounds: list[tuple[int, int]] = []
        self.acc: list[torch.Tensor] = []                   # stage 2: each owned chunk's reduced gradient so far
        self._replica: Replica | None = None

    def attach(self, replica: Replica) -> None:
        from .expert import EP_EXPERT_ATTR
        dp = replica.dp
        self.bounds, self.shards = [], []
        for s in replica.slots():
            if not s.param.is_contiguous():
                raise EngineError(f"the distributed optimizer shards flat views of the slots; {s.name} is not "
                                  "contiguous")
            a, b = chunk_bounds(s.param.numel(), dp.size)[dp.rank]
            self.bounds.append((a, b))
            shard = nn.Parameter(s.param.data.view(-1)[a:b])      # a view: updates land in the slot
            if getattr(s.param, EP_EXPERT_ATTR, False):              # (snapshots: an expert's chunk is its ep
                setattr(shard, EP_EXPERT_ATTR, True)                  # rank's own to store)
            self.shards.append(shard)
        self.optimizer = self.optimizer_factory(self.shards)
        if self.stage == 2:
            if not hasattr(replica, "after_backward"):
                raise EngineError("the distributed optimizer's stage 2 reduce-scatters a pipeline's gradients after "
                                  "each micro-batch; this replica is not a pipeline's (use ZeroEngine(2))")
            later = [ax for ax in ("sp", "cp", "ep") if getattr(replica, ax, None) is not None]
            if later:
                raise EngineError(f"the distributed optimizer's stage 2 reduce-scatters each micro-batch's gradients "
                                  f"as its backward ends, but this pipeline's {', '.join(later)} sums them after the "
                                  "last micro-batch: use stage 1")
            self.acc = [torch.zeros(b - a, dtype=sh.dtype) for sh, (a, b) in zip(self.shards, self.bounds)]
            self._replica = replica
            replica.after_backward = self._reduce_micro_batch

    def _reduce(self, dp: Comm, s: ParamSlot, a: int, b: int) -> torch.Tensor:
        """The mean over dp of chunk [a, b) of slot s's gradient (zeros for a slot without one)."""
        g = s.grad
        flat = (g.to_dense() if g is not None and g.is_sparse else g if g is not None
                else torch.zeros_like(s.param)).contiguous().view(-1)
        out = torch.empty(b - a, dtype=flat.dtype)
        dp.reduce_scatter(out, flat, "sum", site=f"grad {s.name}")
        return out.mul_(1.0 / dp.size)

    def _reduce_micro_batch(self) -> None:
        """Stage 2: the gradients the last backward action left (its chunk's slots) reduce-scattered into the owned
        chunks' accumulators, then freed."""
        replica = self._replica
        for s, acc, (a, b) in zip(replica.slots(), self.acc, self.bounds):
            if s.grad is not None:
                acc.add_(self._reduce(replica.dp, s, a, b))
                s.param.grad = None

    def step(self, replica: Replica) -> None:
        if self.optimizer is None:
            raise EngineError("DistributedOptimizerStrategy.step before attach(replica)")
        dp, slots = replica.dp, replica.slots()
        for k, (s, shard, (a, b)) in enumerate(zip(slots, self.shards, self.bounds)):
            if self.stage == 2:                 # reduced after each micro-batch; what remains (none): now
                shard.grad = self.acc[k] + (self._reduce(dp, s, a, b) if s.grad is not None else 0)
                self.acc[k] = torch.zeros_like(self.acc[k])
            else:
                shard.grad = self._reduce(dp, s, a, b)
        self.optimizer.step()
        for s, shard in zip(slots, self.shards):
            dp.all_gather(s.param.data.view(-1), shard.data.clone(), site=f"param {s.name}")
            shard.grad = None
        zero_grads(slots)
