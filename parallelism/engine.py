"""The engine seam: an engine turns (model factory, mesh) into a *replica*; a sync strategy synchronises it.

    replica = engine.build(model_factory, mesh)     # this rank's piece of the model
    strategy.attach(replica)
    loss = replica.forward_backward(x, y)           # local gradients on this replica's batch
    strategy.step(replica)                          # synchronise exactly replica.slots(), update the weights

A replica exposes its parameters and gradients as `ParamSlot`s: the name the tensor has in the *full* model (plus a
shard suffix such as "#tp1/2" when the engine split it), the tensor, and the global rank that owns it. So a
pipeline replica's stage 2 lists only stage 2's parameters, a tensor-parallel rank lists its own shards, and a
parameter-server strategy pushes/pulls exactly those names while a ring all-reduce strategy averages them over the
replica's data-parallel group (`replica.dp`, the ranks that hold the same slots).

`AllReduceStrategy` is the ring BSP strategy. It lets a replica that can overlap gradient all-reduce with backward
(data parallel, via autograd hooks) do so, and otherwise averages all slot gradients in one flat all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol, runtime_checkable

import torch

from .checkpointing import unwrap_name
from .comm import Comm, CommLog
from .mesh import DeviceMesh

ModelFactory = Callable[[], torch.nn.Module]
OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


class EngineError(ValueError):
    """An engine cannot be built for this model / mesh combination; the message says what to change."""


@dataclass
class ParamSlot:
    """One parameter tensor this rank holds: its full-model name, the tensor (with .grad), its owning global rank."""

    name: str
    param: torch.Tensor
    owner: int

    @property
    def grad(self) -> torch.Tensor | None:
        return self.param.grad


@runtime_checkable
class Replica(Protocol):
    """This rank's part of one model replica."""

    dp: Comm          # the data-parallel group: ranks whose slots are replicas of these slots
    log: CommLog      # every collective the engine issued (its own and the strategy's)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Run forward and backward on this replica's batch; leave local gradients in the slots; return the loss."""

    def slots(self) -> list[ParamSlot]:
        """The parameters (and gradients) this rank holds, by full-model name, with their owner rank."""


class Engine(Protocol):
    def build(self, model_factory: ModelFactory, mesh: DeviceMesh) -> Replica: ...


@runtime_checkable
class SyncStrategy(Protocol):
    def attach(self, replica: Replica) -> None: ...

    def step(self, replica: Replica) -> None: ...


def take_grads(params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Detach the gradients earlier calls accumulated (returned) so that backward leaves only this call's; give
    them back with `add_back_grads`. Engines that reduce this call's partial gradients use the pair."""
    earlier = [p.grad for p in params]
    for p in params:
        p.grad = None
    return earlier


def add_back_grads(params: list[torch.Tensor], earlier: list[torch.Tensor | None]) -> None:
    """p.grad = earlier + this call's, written into the earlier tensor: a strategy may own it (a PS push segment)."""
    for p, g in zip(params, earlier):
        if g is not None and not g.is_sparse and p.grad is not None:
            g.add_(p.grad)
            p.grad = g
        elif g is not None:
            p.grad = g + p.grad if p.grad is not None else g


def zero_grads(slots: Iterable[ParamSlot]) -> None:
    for s in slots:
        s.param.grad = None


class AllReduceStrategy:
    """Ring all-reduce BSP: average every slot's gradient over `replica.dp`, then a local optimizer step (with a
    `compress.Compressor`: its compressed mean, error feedback kept per worker)."""

    def __init__(self, optimizer_factory: OptimizerFactory, overlap: bool = True, compressor: Any = None) -> None:
        self.optimizer_factory = optimizer_factory
        self.overlap = overlap and compressor is None
        self.compressor = compressor       # compress.Compressor: the gradients' compressed mean (error feedback)
        self.optimizer: torch.optim.Optimizer | None = None
        self._overlapped = False

    def attach(self, replica: Replica) -> None:
        enable = getattr(replica, "enable_overlapped_sync", None)
        self._overlapped = bool(self.overlap and enable is not None)
        if self._overlapped:
            enable()
        self.optimizer = self.optimizer_factory([s.param for s in replica.slots()])

    def local_state(self) -> dict[str, torch.Tensor]:
        """This rank's own state beyond its parameters and optimizer (snapshot.py stores it per rank): the
        compressor's residual (error feedback) and warm start; empty without a compressor."""
        return self.compressor.state() if self.compressor is not None else {}

    def load_local_state(self, state: dict[str, torch.Tensor], replica: Replica) -> None:
        if self.compressor is not None:
            self.compressor.load_state(state, [s.param for s in replica.slots()])

    def step(self, replica: Replica) -> None:
        if self.optimizer is None:
            raise EngineError("AllReduceStrategy.step before attach(replica)")
        slots = replica.slots()
        if self.compressor is not None:
            for s, g in zip(slots, self.compressor.mean(replica.dp, dense_grads(slots))):
                s.param.grad = g
        elif not self._overlapped:
            allreduce_grads(replica.dp, slots)
        self.optimizer.step()
        zero_grads(slots)


def dense_grads(slots: list[ParamSlot]) -> list[torch.Tensor]:
    """Each slot's gradient as a dense tensor (a sparse one, an embedding's, densified; a missing one as zeros)."""
    return [s.grad.to_dense() if s.grad is not None else torch.zeros_like(s.param) for s in slots]


def allreduce_grads(dp: Comm, slots: list[ParamSlot], site: str = "grads") -> None:
    """Average the slots' gradients over `dp` with one flat all-reduce (missing grads count as zero)."""
    if dp.size == 1 or not slots:
        return
    flat = torch.cat([g.reshape(-1) for g in dense_grads(slots)])
    dp.all_reduce(flat, "sum", site=site)
    flat.mul_(1.0 / dp.size)
    off = 0
    for s in slots:
        n = s.param.numel()
        s.param.grad = flat[off:off + n].view_as(s.param).clone()
        off += n


class LocalReplica:
    """A replica whose module lives whole on this rank (data, tensor parallel): loss_fn(module(x), y).backward()."""

    def __init__(self, module: torch.nn.Module, dp: Comm, rank: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 name_of: Callable[[str, torch.Tensor], str] | None = None) -> None:
        self.module, self.dp, self.log, self.rank = module, dp, dp.log, rank
        self.loss_fn = loss_fn or torch.nn.functional.cross_entropy
        self.name_of = name_of or (lambda name, p: name)
        from .moe import moe_layers
        self._moe = bool(moe_layers(module))    # a mixture-of-experts model adds its load-balancing loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = self.loss_fn(self.forward(x), y)
        if self._moe:
            from .moe import moe_aux_loss
            loss = loss + moe_aux_loss(self.module)
        loss.backward()
        self.after_backward()
        return float(loss.detach())

    def after_backward(self) -> None:
        """Hook for engines that finish work after backward (data parallel: buckets of unused parameters)."""

    def slots(self) -> list[ParamSlot]:
        return [ParamSlot(self.name_of(unwrap_name(n), p), p, self.rank) for n, p in self.module.named_parameters()]


def train_step(replica: Replica, strategy: SyncStrategy, x: torch.Tensor, y: torch.Tensor) -> float:
    """One synchronous step: forward+backward, then the strategy's synchronisation and update."""
    loss = replica.forward_backward(x, y)
    strategy.step(replica)
    return loss
