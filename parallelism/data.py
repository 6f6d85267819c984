"""Data parallelism with gradient bucketing and all-reduce overlapped with backward (the DDP recipe).

Parameters are packed into buckets of at most `bucket_bytes`, in *reverse* registration order (gradients of the
last layers are ready first in backward). A post-accumulate-grad hook on every parameter marks it ready; when
bucket k is full and buckets 0..k−1 are launched, the all-reduce of bucket k's flat buffer is submitted to the
communication thread, so it runs while autograd computes earlier layers. Buckets are
launched in the fixed order 0, 1, 2 … on every rank, whatever order hooks fire in. When the last gradient has
arrived (in its hook) we wait for all buckets and divide by N. (Not an autograd-engine end-of-backward callback:
under reentrant activation checkpointing that would fire at the end of a nested backward, too early.) If some
parameters get no gradient in a step, call `finish()` after backward: it reduces them as zeros. Gradients are views
into the bucket buffers (DDP's gradient_as_bucket_view): autograd accumulates straight into them, so nothing is
copied either way.

Each rank moves 2(N−1)/N · 4Ψ bytes per step (ring all-reduce of Ψ fp32 gradients), independent of N.

`no_sync()` covers forward *and* backward: the flag is captured when forward runs, so gradients of a forward
made inside `no_sync()` accumulate locally; the first synchronised backward then reduces the accumulated sum.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future
from typing import Any, Iterator

import torch

from pslab.collectives import trace
from .checkpointing import wrap_children
from .comm import Comm, CommLog, CommThread
from .engine import LocalReplica, ModelFactory
from .mesh import DeviceMesh

DEFAULT_BUCKET_BYTES = 25 << 20


class _Bucket:
    def __init__(self, index: int, params: list[torch.nn.Parameter]) -> None:
        self.index = index
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.buffer = torch.zeros(self.numel, dtype=params[0].dtype)
        self.pending = len(params)
        self.future: Future | None = None


class GradReducer:
    """Buckets + hooks + ordered launch on a communication thread. Usable on any module."""

    def __init__(self, module: torch.nn.Module, comm: Comm, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        self.comm = comm
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.buckets: list[_Bucket] = []
        cur: list[torch.nn.Parameter] = []
        size = 0
        for p in reversed(self.params):
            nb = p.numel() * p.element_size()
            if cur and size + nb > bucket_bytes:
                self.buckets.append(_Bucket(len(self.buckets), cur))
                cur, size = [], 0
            cur.append(p)
            size += nb
        if cur:
            self.buckets.append(_Bucket(len(self.buckets), cur))
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._thread = CommThread()
        self._next = 0
        self._armed = False          # a synchronised forward ran; its backward must reduce
        self.require_sync = True
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    # ---- forward side --------------------------------------------------------------------------------------
    def prepare_forward(self) -> None:
        """Called before each forward: capture whether the coming backward synchronises."""
        self._armed = self.require_sync
        for b in self.buckets:   # gradients live in the bucket buffers (no copies; DDP's gradient_as_bucket_view)
            off = 0
            for p in b.params:
                n = p.numel()
                view = b.buffer[off:off + n].view_as(p)
                if p.grad is None:
                    view.zero_()
                    p.grad = view
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                    p.grad = view
                off += n
        if self._armed:
            self._next = 0
            for b in self.buckets:
                b.pending, b.future = len(b.params), None

    # ---- backward side -------------------------------------------------------------------------------------
    def _on_grad(self, p: torch.nn.Parameter) -> None:
        if not self._armed:
            return
        b = self._bucket_of[id(p)]
        b.pending -= 1
        self._launch_ready()
        if self._next == len(self.buckets):   # the last gradient arrived: wait for the reductions right here
            self.finish()

    def _launch_ready(self, force: bool = False) -> None:
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if b.pending > 0 and not force:
                return
            self._into_buffer(b)
            b.future = self._thread.submit(self.comm.all_reduce, b.buffer, "sum", f"bucket {b.index}")
            self._next += 1

    @staticmethod
    def _into_buffer(b: _Bucket) -> None:
        """Make sure the bucket buffer holds every gradient (they normally already are views of it)."""
        off = 0
        for p in b.params:
            n = p.numel()
            view = b.buffer[off:off + n]
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad.reshape(-1))
            off += n

    def finish(self) -> None:
        """Wait for every bucket; write averaged gradients back. Runs at the end of backward."""
        if not self._armed:
            return
        self._launch_ready(force=True)   # parameters unused in this forward contribute zeros
        scale = 1.0 / self.comm.size
        for b in self.buckets:
            with trace.waiting("all-reduce bucket"):    # blocked on the communication thread: exposed
                b.future.result()
            b.buffer.mul_(scale)
            off = 0
            for p in b.params:
                n = p.numel()
                view = b.buffer[off:off + n].view_as(p)
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view
                off += n
        self._armed = False

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._thread.close()


class DataParallel(torch.nn.Module):
    """Wrap a module: forward runs it; backward all-reduces (averages) gradients over `comm`, bucketed, overlapped."""

    def __init__(self, module: torch.nn.Module, comm: Comm, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 broadcast_from: int | None = 0) -> None:
        super().__init__()
        self.module = module
        self.comm = comm
        if broadcast_from is not None:  # start every replica from the same weights
            for name, t in module.state_dict().items():
                comm.broadcast(t, broadcast_from, site=f"init {name}")
        self.reducer = GradReducer(module, comm, bucket_bytes)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.reducer.prepare_forward()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: wrap both the forward and the backward of the micro-steps to skip."""
        old = self.reducer.require_sync
        self.reducer.require_sync = False
        try:
            yield
        finally:
            self.reducer.require_sync = old


class DataParallelReplica(LocalReplica):
    """Replica of the data-parallel engine: the whole model; slots owned by this rank; replicated over `dp`."""

    def __init__(self, module: torch.nn.Module, dp: Comm, rank: int, bucket_bytes: int,
                 loss_fn: Any = None) -> None:
        super().__init__(module, dp, rank, loss_fn)
        self.bucket_bytes = bucket_bytes
        self.ddp: DataParallel | None = None

    def enable_overlapped_sync(self) -> None:
        """Used by AllReduceStrategy: reduce gradients from autograd hooks during backward."""
        if self.ddp is None:
            self.ddp = DataParallel(self.module, self.dp, self.bucket_bytes, broadcast_from=None)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with (self.ddp.no_sync() if self.ddp is not None else contextlib.nullcontext()):
            yield

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.ddp if self.ddp is not None else self.module)(x)

    def after_backward(self) -> None:
        if self.ddp is not None:
            self.ddp.reducer.finish()

    def close(self) -> None:
        """Remove the gradient hooks and stop the communication thread of the overlapped sync, if enabled."""
        if self.ddp is not None:
            self.ddp.reducer.close()


class DataParallelEngine:
    """Every rank of the mesh's dp axis holds the whole model; gradients are averaged over dp."""

    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, checkpoint_activations: bool = False,
                 log: CommLog | None = None, loss_fn: Any = None) -> None:
        self.bucket_bytes = bucket_bytes
        self.loss_fn = loss_fn
        self.checkpoint_activations = checkpoint_activations
        self.log = log

    def build(self, model_factory: ModelFactory, mesh: DeviceMesh) -> DataParallelReplica:
        model = model_factory()
        if self.checkpoint_activations:
            wrap_children(model)        # an MoE block's aux losses leave the checkpoint as outputs (checkpointing.py)
        return DataParallelReplica(model, Comm(mesh.group("dp"), self.log), mesh.world.ranks[mesh.rank],
                                   self.bucket_bytes, self.loss_fn)
