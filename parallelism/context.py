"""Context parallelism: the sequence split over the C ranks of the cp group, attention by ring attention.

Every cp rank holds the whole model (or, under tp × cp, its tp rank's shards: each tp rank runs its own heads on
the ring of its cp group; everything else as below) and receives the data-parallel
worker's full batch (B, S). It keeps only its zig-zag chunks (`ring_attention.local_positions`: chunks i and
2C−1−i of 2C) of the tokens x and targets y, so every layer but attention runs on S/C tokens with no communication:

    Embed        token embedding + position embedding at each local token's *global* position
    Attention    qkv → ring_attention(q, k, v, cp, causal) → proj     (the same qkv/proj weights, swapped in)
    MLP, LN, Head unchanged, per token

Loss and gradients. Rank r's loss L_r is the mean over its B·S/C tokens, so the full-batch loss is
L = (1/C)·Σ_r L_r (equal token counts), returned by `forward_backward` on every cp rank (one scalar all-reduce,
site "cp loss"). Each rank backpropagates its own L_r; ring attention's backward sends every rank's contribution to
∂/∂K, ∂/∂V back to the block's owner, so rank r's parameter gradient g_r is the part of ∇(Σ_r' L_r') that flows
through rank r's tokens, and Σ_r g_r = ∇(C·L). Averaging the gradients over cp (one flat all-reduce after backward,
site "cp grads") gives exactly ∇L on every cp rank — the gradient single-process training on (x, y) computes.
From there a CP replica looks like a data-parallel one: `replica.dp` is the dp group, `slots()` are the full-model
names, so every sync strategy (ring all-reduce, parameter server) works unchanged.

Per layer and step each rank sends `ring_attention.ring_bytes` (K/V blocks: 2(C−1) forward, 2(C−1) + 2C backward),
and keeps 1/C of the activations a single process would (`attention_memory`): every saved tensor is per token,
and ring attention saves q, k, v, out and the log-sum-exp of its S/C tokens, as PyTorch's CPU SDPA (flash) kernel
does for S. Measured (ActivationMeter, one forward+backward of tiny_transformer d = 32, 4 heads, 2 layers, B = 4,
S = 2048): 37.4 MB on one process, 18.7 MB per rank at cp = 2, 9.36 MB at cp = 4.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .comm import Comm, CommLog
from .engine import EngineError, LocalReplica, ParamSlot
from .mesh import DeviceMesh
from .models import Attention, Embed, lm_loss
from .ring_attention import LayoutError, chunks_of, local_positions, ring_attention

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class RingAttentionBlock(nn.Module):
    """`models.Attention` with its attention computed by the cp ring; reuses the module's qkv and proj."""

    def __init__(self, full: Attention, comm: Comm, layout: str = "zigzag", causal: bool = True,
                 site: str = "attn") -> None:
        super().__init__()
        self.qkv, self.proj = full.qkv, full.proj
        self.d, self.heads = full.d, full.heads
        self.comm, self.layout, self.causal, self.site = comm, layout, causal, site

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split(self.d, dim=-1)
        hd = self.d // self.heads
        q, k, v = (t.view(b, s, self.heads, hd).transpose(1, 2) for t in (q, k, v))
        y = ring_attention(q, k, v, self.comm, self.causal, self.layout, self.site)
        return self.proj(y.transpose(1, 2).reshape(b, s, self.d))


class GlobalPositionEmbed(nn.Module):
    """`models.Embed` (the same tok/pos modules) adding the position embedding of `positions`, the global positions
    of the local tokens (set by the replica before each forward)."""

    def __init__(self, full: Embed) -> None:
        super().__init__()
        self.tok, self.pos = full.tok, full.pos
        self.positions: torch.Tensor | None = None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.positions is None or self.positions.numel() != idx.shape[1]:
            raise EngineError(f"GlobalPositionEmbed got {idx.shape[1]} tokens but positions for "
                              f"{0 if self.positions is None else self.positions.numel()}; run it through "
                              f"ContextParallelReplica.forward_backward")
        return self.tok(idx) + self.pos(self.positions.to(idx.device))


def context_parallelize(model: nn.Module, comm: Comm, layout: str = "zigzag", require: bool = True) -> nn.Module:
    """Swap every `Attention` for a `RingAttentionBlock` and every `Embed` for a `GlobalPositionEmbed` (in place;
    parameter names unchanged); a tensor-parallel attention (tp × cp) keeps its head shards and runs them on the
    ring. Raises EngineError if the model has no Attention to run on the ring (unless require=False: a pipeline
    stage may hold none)."""
    from .tensor import TensorParallelAttention
    chunks_of(0, comm.size, layout)
    found = False
    for name, child in list(model.named_modules()):
        if isinstance(child, TensorParallelAttention):
            child.ring = (comm, layout, name)
            found = True
        elif isinstance(child, (Attention, Embed)):
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            if isinstance(child, Attention):
                setattr(parent, attr, RingAttentionBlock(child, comm, layout, site=name))
                found = True
            else:
                setattr(parent, attr, GlobalPositionEmbed(child))
    if require and not found:
        raise EngineError("context parallelism found no parallelism.models.Attention to run as ring attention; "
                          "build the model from pslab.parallelism.models blocks (tiny_transformer)")
    return model


def set_positions(module: nn.Module, pos: torch.Tensor) -> None:
    """Give the module's embeddings the global positions of this cp rank's tokens: GlobalPositionEmbed, and
    SequenceParallelEmbed under tp × cp with sp (it slices them further over tp)."""
    from .sequence import SequenceParallelEmbed
    for m in module.modules():
        if isinstance(m, (GlobalPositionEmbed, SequenceParallelEmbed)):
            m.positions = pos


def token_positions(cp: Comm, seq: int, layout: str) -> torch.Tensor:
    """The global positions of this cp rank's tokens of a sequence of `seq` (its zig-zag chunks); EngineError in one
    line if the sequence does not cut into 2C chunks."""
    try:
        return local_positions(cp.rank, cp.size, seq, layout)
    except LayoutError as e:
        raise EngineError(f"context parallelism over cp = {cp.size}: {e}") from None


def average_grads_in_place(comm: Comm, slots: list[ParamSlot], site: str) -> None:
    """Average the slots' gradients over `comm` with one flat all-reduce, written back into the existing gradient
    tensors (a sync strategy may have pointed them at its own buffers, e.g. a parameter-server push segment). Each
    slot is sized by its gradient when it has one (ZeRO-3 may have freed the parameter's data already)."""
    if comm.size == 1 or not slots:
        return
    grads = [s.grad.to_dense() if s.grad is not None else torch.zeros_like(s.param) for s in slots]
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, "sum", site=site)
    flat.mul_(1.0 / comm.size)
    off = 0
    for s, g in zip(slots, grads):
        n = g.numel()
        avg = flat[off:off + n].view_as(g)
        if s.grad is not None and not s.grad.is_sparse:
            s.grad.copy_(avg)
        else:
            s.param.grad = avg.clone()
        off += n


class ContextParallelReplica(LocalReplica):
    """The whole model on each cp rank, fed that rank's zig-zag chunks of the full (B, S) batch. With `sp` (the tp
    group under tp × cp with sequence parallelism) the LayerNorm regions run on the tp rank's S/(C·T) of them: the
    rank scores those tokens (L = Σ_{c,t} L_{c,t} / (C·T)), and the `replicated` tensors' partial gradients are
    summed over tp before the average over cp."""

    def __init__(self, module: nn.Module, cp: Comm, dp: Comm, rank: int, loss_fn: LossFn | None,
                 layout: str, name_of: Callable[[str, torch.Tensor], str] | None = None, sp: Comm | None = None,
                 replicated: list[torch.Tensor] | None = None) -> None:
        super().__init__(module, dp, rank, loss_fn, name_of)
        self.cp, self.layout = cp, layout
        self.sp = sp if sp is not None and sp.size > 1 else None
        self.replicated = list(replicated or [])

    def local_batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x, y) at this rank's tokens, and their global positions. EngineError if S does not cut into 2C."""
        if x.dim() < 2:
            raise EngineError(f"context parallelism splits dim 1 (the sequence) of the batch; got shape "
                              f"{tuple(x.shape)}")
        pos = token_positions(self.cp, x.shape[1], self.layout)
        return x[:, pos], y[:, pos], pos

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> float:
        xl, yl, pos = self.local_batch(x, y)
        set_positions(self.module, pos)
        if self.sp is None:
            loss = self.loss_fn(self.module(xl), yl)
            loss.backward()
        else:                                  # tp × cp with sp: this tp rank's S/(C·T) tokens
            from .engine import add_back_grads, take_grads
            from .sequence import LOSS_SITE, check_token_targets, sequence_bounds, sum_partial_grads
            check_token_targets(xl, yl)
            a, b = sequence_bounds(xl.shape[1], self.sp)
            earlier = take_grads(self.replicated)
            loss = self.loss_fn(self.module(xl), yl[:, a:b])
            (loss / self.sp.size).backward()
            sum_partial_grads(self.replicated, self.sp)
            add_back_grads(self.replicated, earlier)
        average_grads_in_place(self.cp, self.slots(), site="cp grads")   # mean over cp: ∇ of the full-batch loss
        t = torch.tensor([float(loss.detach())], dtype=torch.float64)
        if self.cp.size > 1:
            self.cp.all_reduce(t, "sum", site="cp loss")
        if self.sp is not None:
            self.sp.all_reduce(t, "sum", site=LOSS_SITE)
            t /= self.sp.size
        return float(t[0]) / self.cp.size


class ContextParallelEngine:
    """Split the sequence over the mesh's cp axis (ring attention), after splitting the heads over tp if the mesh
    has tp > 1 (`compose.py`: tp × cp, each tp rank's heads on the ring of its cp group); replicas are averaged over
    dp as usual.

    Slot names are the full model's (tp shards: "#tp{t}/{T}"); the mesh must have pp = ep = 1."""

    def __init__(self, loss_fn: LossFn | None = None, log: CommLog | None = None, layout: str = "zigzag",
                 checkpoint_activations: bool = False, sequence_parallel: bool = False) -> None:
        chunks_of(0, 1, layout)
        self.loss_fn, self.log, self.layout = loss_fn, log, layout
        self.checkpoint_activations, self.sequence_parallel = checkpoint_activations, sequence_parallel

    def build(self, model_factory: Callable[[], nn.Module], mesh: DeviceMesh) -> ContextParallelReplica:
        from .compose import compose
        other = {ax: mesh.size(ax) for ax in ("pp", "ep") if mesh.size(ax) > 1}
        if other:
            raise EngineError(f"ContextParallelEngine combines cp with dp and tp; this mesh also has "
                              f"{', '.join(f'{a}={n}' for a, n in other.items())}: set them to 1")
        c = compose(model_factory, mesh, self.log if self.log is not None else CommLog(),
                    sequence_parallel=self.sequence_parallel, checkpoint_activations=self.checkpoint_activations,
                    context_layout=self.layout, refuse_moe="cp")
        return ContextParallelReplica(c.module, c.cp, c.dp, c.rank, self.loss_fn or lm_loss, self.layout, c.name_of,
                                      sp=c.tp if c.sequence_parallel else None, replicated=c.replicated)
