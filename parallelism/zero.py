"""ZeRO (Rajbhandari et al., 2020): shard optimizer state (stage 1), + gradients (2), + parameters (3) over N ranks.

Every parameter is cut flat into N chunks with `chunk_bounds(numel, N)`; rank r owns chunk r of each parameter and
runs the optimizer (any element-wise torch optimizer, e.g. Adam) on its chunks only.

    stage 0  plain DP: all-reduce full gradients, every rank updates everything              (p+g+K)Ψ per rank
    stage 1  full gradients; reduce-scatter them; update own chunk; all-gather parameters     (p+g)Ψ + KΨ/N
             (gradients are reduce-scattered from autograd hooks in buckets of units -- a unit
             is a module's own parameters -- as soon as a bucket's are all ready, behind the
             rest of backward on the communication thread: DDP's buckets, 25 MB by default)
    stage 2  as 1, and the full gradients are freed once reduced, a unit at a time (FSDP's
             granularity): only the gradient shard persists                                  pΨ + (g+K)Ψ/N
    stage 3  as 2, and parameters live as shards: a unit's full weights are all-gathered (one
             packed collective) just before its forward (and again before its backward or
             checkpointed recompute), freed after each; the next unit's gather is issued early
             on the communication thread (prefetch)                                         (p+g+K)Ψ/N

(p, g, K bytes per element; see `zero_memory.py` — fp32 Adam: p = g = 4, K = 8.)
Communication per step: stage 0 all-reduce 2(N−1)/N·gΨ; stages 1–2 reduce-scatter + all-gather, the same total;
stage 3 adds a second all-gather (forward and backward; with activation checkpointing the recompute's gather is the
backward's): 3(N−1)/N·Ψ elements. Every collective is packed
(`Pack`): the reduce-scatters per bucket, stage 3's all-gathers per unit, stages 1–2's all-gather over all
parameters; the packed buffers of all parameters, or of all buckets or units, add up to N·L elements,
L = Σ_p ⌈n_p/N⌉, so each rank sends (N−1)·L elements per reduce-scatter or all-gather of all of them.
Stage 3 frees a parameter by pointing it at an empty tensor (`p.data = …`, as FSDP1 did): autograd saved the
Parameter object itself, so the gather before that layer's backward puts the full data back where backward looks.
`state_bytes()` counts the bytes actually allocated (unique storages) for parameters, gradients and optimizer state;
`peak_gathered_bytes` is the most full-parameter bytes stage 3 ever held at once, observed: when a unit's full
buffers are allocated (just before its all-gather fills them) the bytes of the distinct storages the module's
parameters point at are summed (a freed parameter points at an empty one), not a count the engine keeps of what it
meant to allocate.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable

import torch
from torch import nn

from pslab.collectives import chunk_bounds, trace

from .comm import Comm, CommLog, CommThread
from .data import DEFAULT_BUCKET_BYTES
from .engine import EngineError, ModelFactory, OptimizerFactory, ParamSlot
from .mesh import DeviceMesh
from .zero_memory import StateBytes
from .checkpointing import recomputing
from .zero_pack import Bucket, Pack, Unit


def _storage_bytes(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class ZeroReplica:
    """ZeRO stage 0–3 over the data-parallel group `dp`; owns its (sharded) optimizer."""

    def __init__(self, module: nn.Module, dp: Comm, stage: int, optimizer_factory: OptimizerFactory, rank: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 prefetch: bool = True, name_of: Callable[[str, torch.Tensor], str] | None = None,
                 bucket_bytes: int | None = None, sp: Comm | None = None,
                 replicated: list[torch.Tensor] | None = None, cp: Comm | None = None,
                 context_layout: str = "zigzag") -> None:
        """sp: the tp group when the module runs sequence parallel (compose's step 2), with `replicated`, the tensors
        whose gradients are partial per tp rank (summed over sp before they are reduce-scattered); cp: the cp group
        when it runs context parallel (step 3: every gradient is partial per cp rank, averaged over cp first)."""
        if stage not in (0, 1, 2, 3):
            raise EngineError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
        self.module, self.dp, self.log, self.stage, self.rank = module, dp, dp.log, stage, rank
        self.sp = sp if sp is not None and sp.size > 1 else None
        self.cp, self.context_layout = (cp if cp is not None and cp.size > 1 else None), context_layout
        self.name_of = name_of or (lambda name, p: name)     # + "#tp{t}/{T}" for a tensor-parallel shard
        self.loss_fn = loss_fn or torch.nn.functional.cross_entropy
        # reduce-scatter buckets: stage 1 DDP's 25 MB (its full gradients are kept anyway), stages 2-3 one per unit
        self.prefetch = prefetch
        self.bucket_bytes = (DEFAULT_BUCKET_BYTES if stage == 1 else 0) if bucket_bytes is None else bucket_bytes
        self.n, self.r = dp.size, dp.rank
        self.thread = CommThread()
        self.named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.all_bounds = {n: chunk_bounds(p.numel(), self.n) for n, p in self.named}   # every rank's chunks
        self.bounds = {n: bs[self.r] for n, bs in self.all_bounds.items()}              # this rank's
        self.shapes = {n: p.shape for n, p in self.named}
        ids = {id(t) for t in replicated or ()} if self.sp is not None else set()
        # the parameters whose hooks wait for a sum after backward: sp's replicated tensors, or under cp every one
        self.deferred = [(n, p) for n, p in self.named if id(p) in ids or self.cp is not None]
        self.sp_replicated = [p for _, p in self.named if id(p) in ids]   # (summed over tp under cp × sp)
        self.hooks: dict[str, Callable[..., None]] = {}
        self.peak_gathered_bytes = 0
        self.gathered_bytes = 0
        self.last_state: StateBytes | None = None
        total_shard = sum(b - a for a, b in self.bounds.values())
        # persistent gradient shard (stages 2, 3): one flat buffer, a view per parameter
        self.grad_shard = torch.zeros(total_shard) if stage >= 2 else None
        self.shards: dict[str, nn.Parameter] = {}
        off = 0
        for n, p in self.named:
            a, b = self.bounds[n]
            if stage == 0:
                self.shards[n] = p
            elif stage in (1, 2):
                self.shards[n] = nn.Parameter(p.data.view(-1)[a:b])       # a view: updates land in p itself
            else:
                self.shards[n] = nn.Parameter(p.data.view(-1)[a:b].clone())
            if self.grad_shard is not None:
                self.shards[n].grad = self.grad_shard[off:off + b - a]
            off += b - a
        self.optimizer = optimizer_factory(list(self.shards.values()))
        # packed collectives (`Pack`): a reduce-scatter per bucket of units (a unit: a module's own parameters),
        # stage 3 an all-gather per unit, stages 1-2 one all-gather of all parameters after the step
        self.packed = stage > 0 and self.n > 1 and len({p.dtype for _, p in self.named}) == 1
        self.pack = Pack([self.all_bounds[n] for n, _ in self.named])
        self.pack_len = self.pack.length
        self.packed_bytes = self.pack_len * self.named[0][1].element_size() if self.packed else 0
        self.units: list[Unit] = []
        self.buckets: list[Bucket] = []
        self.reducing: list[Future] = []       # this step's reduce-scatters still on the communication thread
        if stage >= 1:
            self._setup_units()
        if stage >= 2 or self.packed:          # (stage 1 unpacked: one reduce-scatter per parameter in step())
            for n, p in self.named:
                self.hooks[n] = self._make_grad_hook(n)
                p.register_post_accumulate_grad_hook(self.hooks[n])

    # ---- communication helpers (everything goes through one thread, so the order is the same on all ranks) ----
    def _sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        with trace.waiting("collective"):
            return self.thread.submit(fn, *args).result()

    def _reduce_scatter_grad(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        a, b = self.bounds[name]
        out = torch.empty(b - a, dtype=grad.dtype)
        self._sync(self.dp.reduce_scatter, out, grad.contiguous().view(-1), "sum", f"grad {name}")
        return out.mul_(1.0 / self.n)

    def _make_grad_hook(self, name: str) -> Callable[[torch.Tensor], None]:
        unit, bucket = self._unit_of[name], self._bucket_of[name]
        later = any(n == name for n, _ in self.deferred)

        def hook(p: torch.Tensor, now: bool = False) -> None:
            if self.stage == 3 and not now:    # the unit's weights are not needed again this backward: freed once
                unit.grads_pending -= 1        # all its gradients are in (a waiting, partial one included)
                if unit.grads_pending == 0:
                    self._free(unit)
            if later and not now:              # a partial gradient (sp, cp): summed first, then fired by
                return                         # zero_partial.fire_deferred
            if bucket.pack is None:
                grad = p.grad.to_dense() if p.grad.is_sparse else p.grad      # an embedding's sparse gradient
                self.shards[name].grad.add_(self._reduce_scatter_grad(name, grad))
                p.grad = None                  # the full gradient is freed as soon as it is reduced
            bucket.pending -= 1
            if bucket.pending == 0:
                self._reduce_bucket(bucket)
        return hook

    def _reduce_bucket(self, b: Bucket) -> None:
        """A bucket's gradients are all ready (or the step is ending): one packed reduce-scatter of them -- behind
        the rest of backward on the communication thread when `prefetch` (waited in step()), else at once. Stage 1
        keeps the full gradients and writes the reduced chunk into its own; stages 2-3 add it to the gradient
        shards and free the full gradients."""
        if b.pack is not None and (self.stage == 1 or any(p.grad is not None for _, p in b.params)):
            grads = []                                     # (stage 3: a unit's data may be freed already)
            for n, p in b.params:
                g = (torch.zeros(self.shapes[n], dtype=p.dtype) if p.grad is None
                     else p.grad.to_dense() if p.grad.is_sparse else p.grad)     # an embedding's sparse gradient
                if self.stage == 1 and g is not p.grad:    # stage 1 keeps its full gradients
                    p.grad = g
                grads.append(g)
            pack = b.pack
            packed = pack.pack(grads, range(self.n))
            if self.stage == 1:     # the reduced chunk's SUM replaces this rank's own, the rest zeroed: a later
                into = grads        # call's backward accumulates onto that (scaled by 1/N in step())
                for t in grads:
                    t.zero_()
            else:
                into = [self.shards[n].grad for n, _ in b.params]
                for _, p in b.params:
                    p.grad = None                          # the full gradients are freed once packed

            def reduce() -> None:
                out = torch.empty(pack.length, dtype=packed.dtype)
                self.dp.reduce_scatter(out, packed, "sum", site=f"grads {b.name}")
                if self.stage != 1:
                    out.mul_(1.0 / self.n)
                at = 0
                for t, (a, c) in zip(into, (bs[self.r] for bs in pack.bounds)):
                    if self.stage == 1:
                        t.view(-1)[a:c] = out[at:at + c - a]
                    else:
                        t.add_(out[at:at + c - a])
                    at += c - a
            if self.prefetch:
                self.reducing.append(self.thread.submit(reduce))
            else:
                self._sync(reduce)
        b.pending, b.reduced = len(b.params), True

    # ---- stage 3: gather just in time, free after use, prefetch the next unit ---------------------------------
    def _setup_units(self) -> None:
        """Units: each module that directly owns parameters (a parameter shared by two modules: the first's); stage 3
        gathers before each unit's forward and backward and frees after them."""
        owner, seen = {id(p): n for n, p in self.named}, set()
        for mname, mod in self.module.named_modules():
            own = [(owner[id(p)], p) for p in mod.parameters(recurse=False) if id(p) in owner and id(p) not in seen]
            seen.update(id(p) for _, p in own)
            if own:
                u = Unit(len(self.units), mname, mod, own)
                u.grads_pending = len(own)
                if self.packed:
                    u.pack = Pack([self.all_bounds[n] for n, _ in own])
                self.units.append(u)
        self._unit_of = {n: u for u in self.units for n, _ in u.params}
        self.buckets = []                           # backward's order: the last units' gradients are ready first
        cur: list[Unit] = []
        size = 0
        for u in reversed(self.units):
            if cur and size + u.nbytes > self.bucket_bytes:
                self.buckets.append(Bucket(cur, self.packed, self.all_bounds))
                cur, size = [], 0
            cur.append(u)
            size += u.nbytes
        if cur:
            self.buckets.append(Bucket(cur, self.packed, self.all_bounds))
        self._bucket_of = {n: b for b in self.buckets for n, _ in b.params}
        if self.stage < 3:
            return
        self.gathered_bytes = sum(u.nbytes for u in self.units)
        for u in self.units:
            u.module.register_forward_pre_hook(lambda mod, args, u=u: self._before_forward(u))
            u.module.register_forward_hook(lambda mod, args, out, u=u: self._after_forward(u, out))
            self._free(u)
        self.peak_gathered_bytes = 0

    def _gather(self, u: Unit, wait: bool = True) -> None:
        if u.state == "free":
            for n, p in u.params:
                p.data = torch.empty(self.shapes[n], dtype=p.dtype)
            self.gathered_bytes += u.nbytes
            self.peak_gathered_bytes = max(self.peak_gathered_bytes, self._held_bytes())
            u.future = self.thread.submit(self._gather_unit, u)
            u.state = "pending"
        if wait and u.state == "pending":
            with trace.waiting("all-gather of a unit"):
                u.future.result()
            u.state = "full"

    def _gather_unit(self, u: Unit) -> None:
        if u.pack is None:
            for n, p in u.params:
                self.dp.all_gather(p.data.view(-1), self.shards[n].data, site=f"param {n}")
            return
        full = torch.empty(self.n * u.pack.length, dtype=u.params[0][1].dtype)
        self.dp.all_gather(full, u.pack.pack_own([self.shards[n].data for n, _ in u.params]), site=f"params {u.name}")
        u.pack.unpack(full, [p.data for _, p in u.params], range(self.n))

    def _held_bytes(self) -> int:
        """Bytes of the distinct storages the full parameters point at now (stage 3: the gathered units')."""
        seen: dict[int, int] = {}
        for _, p in self.named:
            st = p.data.untyped_storage()
            if st.nbytes():
                seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values())

    def _free(self, u: Unit) -> None:
        if u.state == "pending":
            with trace.waiting("all-gather of a unit"):
                u.future.result()
        if u.state != "free":
            for _, p in u.params:
                p.data = torch.empty(0, dtype=p.dtype)   # autograd's saved reference sees the data set before use
            self.gathered_bytes -= u.nbytes
        u.state = "free"

    def _before_forward(self, u: Unit) -> None:
        self._gather(u)
        if self.prefetch and u.index + 1 < len(self.units) and not recomputing():
            self._gather(self.units[u.index + 1], wait=False)

    def _after_forward(self, u: Unit, out: Any) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g, u=u: self._before_backward(u))
        if not recomputing():       # a checkpointed block's recompute: its gather serves the backward too (FSDP's
            self._free(u)           # rule), freed when the unit's gradients are in, as without checkpointing

    def _before_backward(self, u: Unit) -> None:
        self._gather(u)
        if self.prefetch and u.index > 0:
            self._gather(self.units[u.index - 1], wait=False)

    # ---- training ------------------------------------------------------------------------------------------
    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> float:
        with trace.waiting("reduce-scatter"):     # an earlier call's (accumulating): done before autograd adds
            for f in self.reducing:               # to the gradients it writes
                f.result()
        self.reducing = []
        for u in self.units:                      # each call counts its gradients in (stage 3 frees a unit then)
            u.grads_pending = len(u.params)
        if self.sp is not None or self.cp is not None:     # some gradients partial: zero_partial.py
            from .zero_partial import forward_backward_cp, forward_backward_sp
            loss = (forward_backward_cp if self.cp is not None else forward_backward_sp)(self, x, y)
        else:
            out = self.loss_fn(self.module(x), y)
            out.backward()
            loss = float(out.detach())
        self._free_all()
        return loss

    def _free_all(self) -> None:
        """Stage 3: every unit back to its shard (any that backward or a recompute left gathered)."""
        for u in self.units if self.stage == 3 else ():
            self._free(u)

    def step(self) -> None:
        """Synchronise gradients (stages 0–1; 2–3 did it in backward), update own shards, re-assemble parameters."""
        if self.stage == 0:
            from .engine import allreduce_grads
            allreduce_grads(self.dp, [ParamSlot(n, p, self.rank) for n, p in self.named])
        elif self.stage == 1 and not self.packed:
            for n, p in self.named:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                elif p.grad.is_sparse:
                    p.grad = p.grad.to_dense()
                a, b = self.bounds[n]
                flat = p.grad.view(-1)
                flat[a:b] = self._reduce_scatter_grad(n, flat)   # the reduced chunk replaces the local one
        for b in self.buckets:   # a bucket not reduced in backward (a parameter got no gradient): now, zeros for those
            if not b.reduced and (b.pending != len(b.params) or (self.stage == 1 and self.packed)):
                self._reduce_bucket(b)
            b.reduced = False
        self._free_all()
        with trace.waiting("reduce-scatter"):
            for f in self.reducing:
                f.result()
        self.reducing = []
        if self.stage == 1:
            for n, p in self.named:
                a, b = self.bounds[n]
                own = p.grad.view(-1)[a:b]
                self.shards[n].grad = own.mul_(1.0 / self.n) if self.packed else own   # (packed: summed)
        self.optimizer.step()
        self.last_state = self.state_bytes()
        if self.packed and self.stage in (1, 2):                  # one all-gather for every parameter
            params = [p.data for _, p in self.named]              # (stages 1-2: the shards are views of these)
            mine = self.pack.pack(params, [self.r])
            full = torch.empty(self.n * self.pack_len, dtype=mine.dtype)
            self._sync(self.dp.all_gather, full, mine, "params (packed)")
            self.pack.unpack(full, params, range(self.n))
        elif self.stage in (1, 2):
            for n, p in self.named:
                self._sync(self.dp.all_gather, p.data.view(-1), self.shards[n].data.clone(), f"param {n}")
        self.zero_grad()

    def zero_grad(self) -> None:
        for n, p in self.named:
            p.grad = None
        if self.grad_shard is not None:
            self.grad_shard.zero_()
        elif self.stage == 1:
            for s in self.shards.values():
                s.grad = None

    def slots(self) -> list[ParamSlot]:
        if self.stage == 0:
            return [ParamSlot(self.name_of(n, p), p, self.rank) for n, p in self.named]
        params = dict(self.named)
        return [ParamSlot(f"{self.name_of(n, params[n])}#shard{self.bounds[n][0]}:{self.bounds[n][1]}", s, self.rank)
                for n, s in self.shards.items()]

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every full parameter (all-gathered for stage 3). Collective: call on every rank."""
        out = {}
        for n, p in self.named:
            if self.stage == 3:
                full = torch.empty(self.shapes[n], dtype=p.dtype)
                self._sync(self.dp.all_gather, full.view(-1), self.shards[n].data, "export")
                out[n] = full
            else:
                out[n] = p.detach().clone()
        return out

    def state_bytes(self) -> StateBytes:
        """Bytes of distinct storages held now: parameters, gradients, optimizer state."""
        def total(tensors: list[torch.Tensor]) -> int:
            return sum(dict(_storage_bytes(t) for t in tensors if t.untyped_storage().nbytes()).values())
        params = [p for _, p in self.named] + list(self.shards.values())
        grads = [p.grad for _, p in self.named if p.grad is not None]
        grads += [s.grad for s in self.shards.values() if s.grad is not None]
        opt = [v for st in self.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        return StateBytes(params=total(params), grads=total(grads), optimizer=total(opt))

    def close(self) -> None:
        self.thread.close()


class ZeroStrategy:
    """The sync strategy of a ZeRO replica: it owns its sharded optimizer, so step is the replica's own."""

    def attach(self, replica: ZeroReplica) -> None:
        if not isinstance(replica, ZeroReplica):
            raise EngineError("ZeroStrategy works with replicas built by ZeroEngine")

    def step(self, replica: ZeroReplica) -> None:
        replica.step()


class ZeroEngine:
    """ZeRO over the mesh's dp axis, on the whole model, each tp rank's shards (dp × tp: 2D, FSDP + TP) or cp replica.

    With tp the model is first split over the tp group (`compose.py`'s step 2); ZeRO then chunks what the rank holds
    (its shards, and the tensors tp replicates) over its dp group exactly as it chunks a whole model. Partial
    gradients -- sp's replicated tensors, every tensor under cp -- are summed (averaged) after backward, then
    reduce-scattered over dp (`zero_partial.py`). Under tp and cp nothing runs behind compute (no prefetched gather,
    each reduce-scatter waited in its hook): one process's transport is not shared by two threads at once.
    Activation checkpointing (compose's step 5): the hooks fire in the recomputed backward; under stage 3 the
    recompute's gather of a unit is its backward gather (kept until the unit's gradients are in, no prefetch of the
    next unit then), so a unit is still gathered twice a step, as FSDP does with checkpointing.
    Not with pp (a pipeline accumulates gradients over its micro-batches: zero = 1 or 2 there is the distributed
    optimizer) or ep (its sum of the replicated tensors' gradients over ep after backward would meet gradients that
    stages 2–3 already reduce-scattered; ZeroEngine also trains on the task loss only)."""

    def __init__(self, stage: int, optimizer_factory: OptimizerFactory, loss_fn: Any = None, prefetch: bool = True,
                 log: CommLog | None = None, bucket_bytes: int | None = None, sequence_parallel: bool = False,
                 checkpoint_activations: bool = False, context_layout: str = "zigzag") -> None:
        self.stage, self.optimizer_factory, self.loss_fn, self.prefetch, self.log = (
            stage, optimizer_factory, loss_fn, prefetch, log)
        self.bucket_bytes, self.sequence_parallel = bucket_bytes, sequence_parallel
        self.checkpoint_activations, self.context_layout = checkpoint_activations, context_layout

    def build(self, model_factory: ModelFactory, mesh: DeviceMesh) -> ZeroReplica:
        other = [f"{ax}={mesh.size(ax)}" for ax in ("pp", "ep") if mesh.size(ax) > 1]
        if other:
            raise EngineError(f"ZeroEngine shards over dp, on the whole model or its tp / cp replicas; this mesh also "
                              f"has {', '.join(other)} (with pp: zero = 1, DistributedOptimizerStrategy)")
        from .compose import compose
        log = self.log if self.log is not None else CommLog()
        c = compose(model_factory, mesh, log, sequence_parallel=self.sequence_parallel,
                    checkpoint_activations=self.checkpoint_activations, context_layout=self.context_layout,
                    refuse_moe="cp" if mesh.size("cp") > 1 else None)
        if c.moe:
            raise EngineError("ZeroEngine's replica trains on the task loss only and would drop a mixture-of-"
                              "experts model's load-balancing loss: use zero = 1 (DistributedOptimizerStrategy) "
                              "with the data, tensor, expert or pipeline engine for MoE models")
        prefetch = self.prefetch and c.tp.size == 1 and c.cp.size == 1
        return ZeroReplica(c.module, c.dp, self.stage, self.optimizer_factory, c.rank, self.loss_fn, prefetch,
                           c.name_of, self.bucket_bytes, sp=c.tp if c.sequence_parallel else None,
                           replicated=c.replicated, cp=c.cp, context_layout=self.context_layout)
