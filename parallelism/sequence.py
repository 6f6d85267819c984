"""Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"):
split the regions tensor parallelism leaves replicated along the sequence over the same T tp ranks.

In a Megatron TP block (`tensor.py`) LayerNorm, the residual adds and dropout run on the full (B, S, d) activation
on every tp rank — replicated work and replicated saved activations. (Our model has no dropout, so here those
regions are the LayerNorms, the residual adds, the row-parallel bias adds, the embedding and the head.) SP runs
them on the rank's sequence shard, (B, S/T, d), rows [t·S/T, (t+1)·S/T) of every sequence. The conjugate pair f/g
around each TP region becomes ḡ/ḡ*:

    ḡ  (entering the column-parallel linear): forward all-gather along the sequence  (B, S/T, d) -> (B, S, d)
                                              backward reduce-scatter along the sequence
    ḡ* (after the row-parallel linear):       forward reduce-scatter along the sequence (partial sums -> my shard)
                                              backward all-gather along the sequence

The TP region in between is unchanged (heads / columns split, attention sees the whole sequence). Since
all-reduce = reduce-scatter + all-gather, the bytes on the wire are TP's: per block and step,
2 · [(T−1)/T + (T−1)/T] · B·S·d·e = TP's 2 all-reduces of 2(T−1)/T · B·S·d·e (e bytes per element).

Embedding: each rank embeds only its shard's tokens (positions t·S/T …), no communication forward; its embedding
gradient is partial (only its tokens) and is summed below, so no all-gather is needed in backward. Head: LayerNorm
and output linear on the shard; the loss is the mean over the rank's tokens, L_t. With equal token counts the
full-batch loss is L = (1/T) Σ_t L_t, so each rank backpropagates L_t / T (the collectives' backward carries the
cross-rank chain rule) and `forward_backward` returns (1/T) Σ_t L_t (a scalar all-reduce, site "sp loss").

Gradients: a tp-sharded parameter is used on its rank only and gets its full gradient there. A replicated parameter
(LayerNorm weights and biases, embeddings, head, row-parallel biases) is used on every rank, each on its own tokens,
so rank t holds a partial gradient ∂(L_t/T)/∂p; after backward one flat all-reduce (sum) over tp, site
"sp replicated grads", leaves every tp rank with the identical full gradient, exactly as TP without SP
(2(T−1)/T · e · #replicated elements more wire bytes per step; `sp_comm_bytes`).

Saved activations per layer (Korthikanti Table 2, fp16, s·b·h units, a heads): TP s·b·h·(10 + 24/t + 5·a·s/(h·t)),
TP+SP s·b·h/t·(34 + 5·a·s/h) (`paper_layer_bytes`). Ours is fp32 (e = 4) without dropout (no masks, no dropout
outputs) and uses the fused SDPA kernel, which saves the logsumexp (a·s·b) instead of the s×s softmax, and whose
output is the projection's input (one storage). Per layer, in bytes (`layer_activation_bytes`):

    LayerNorm regions   2 · (e·sbh + 2·e·sb)          input + mean + rstd of ln1, ln2       TP: full   SP: /t
    linear inputs       2 · e·sbh                     LN outputs entering qkv and fc1       TP: full   SP: full*
    TP region           e·sbh·(3 + 1 + 4 + 4) + e·asb q,k,v; attention output; GeLU in;   /t in both
                                                      fc2 in; logsumexp

so TP = sbh·(16 + 48/t) + 16·sb + 4·asb/t and TP+SP = sbh·(8 + 56/t) + 16·sb/t + 4·asb/t. (*) Korthikanti's 34/t
also keeps only the *shard* of the linear inputs and all-gathers it again in backward (`regather=True`: one more
all-gather per column-parallel linear per step, site "<layer> regather"): then TP+SP = sbh/t·(64 + 16/h + 4a/h),
the paper's 34 − 2 (masks) in fp16 = 32 elements · 2 bytes. The head and embedding (`model_activation_bytes`) are
replicated under TP and split under SP.

S must be divisible by T (`EngineError` otherwise). Also here: `meter_modules`, an `ActivationMeter` that counts only
tensors saved inside given modules (the LayerNorm regions).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pslab.collectives import chunk_bounds

from .checkpointing import ActivationMeter
from .comm import Comm
from .engine import EngineError, LocalReplica, add_back_grads, take_grads
from .models import Embed

LOSS_SITE = "sp loss"
GRAD_SITE = "sp replicated grads"


def sequence_bounds(seq: int, comm: Comm) -> tuple[int, int]:
    """This tp rank's rows [a, b) of a sequence of length `seq`; EngineError unless T divides it."""
    if seq % comm.size:
        raise EngineError(f"sequence parallelism needs the sequence length ({seq}) divisible by the tp size "
                          f"({comm.size}); pad or crop the sequences")
    return chunk_bounds(seq, comm.size)[comm.rank]


def _gather_seq(x: torch.Tensor, comm: Comm, site: str) -> torch.Tensor:
    """(B, S/T, …) shards -> (B, S, …): the flat all-gather stacks rank-major, then the rank axis joins the sequence."""
    x = x.contiguous()
    out = torch.empty((comm.size,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    comm.all_gather(out, x, site=site)
    b, s = x.shape[:2]
    return out.movedim(0, 1).reshape(b, comm.size * s, *x.shape[2:])


def _scatter_seq(z: torch.Tensor, comm: Comm, site: str) -> torch.Tensor:
    """(B, S, …) partial sums on every rank -> this rank's (B, S/T, …) shard of their sum."""
    b, s = z.shape[0], z.shape[1] // comm.size
    inp = z.reshape(b, comm.size, s, *z.shape[2:]).movedim(1, 0).contiguous()
    out = torch.empty((b, s) + tuple(z.shape[2:]), dtype=z.dtype, device=z.device)
    comm.reduce_scatter(out, inp, "sum", site=site)
    return out


def _conjugate(name: str, forward: Callable[..., torch.Tensor], backward: Callable[..., torch.Tensor],
               doc: str) -> type[torch.autograd.Function]:
    """An autograd Function running `forward(x, comm, site)` forward and its conjugate `backward(grad, comm, site)`
    backward (all-gather ↔ reduce-scatter along the sequence)."""
    def fwd(ctx, x: torch.Tensor, comm: Comm, site: str) -> torch.Tensor:
        ctx.comm, ctx.site = comm, site
        return forward(x, comm, site)

    def bwd(ctx, grad: torch.Tensor):
        return backward(grad, ctx.comm, ctx.site), None, None
    return type(name, (torch.autograd.Function,), {"__doc__": doc, "forward": staticmethod(fwd),
                                                   "backward": staticmethod(bwd)})


_GatherSequence = _conjugate("_GatherSequence", _gather_seq, _scatter_seq,
                             "ḡ: all-gather along the sequence forward, reduce-scatter backward.")
_ScatterSequence = _conjugate("_ScatterSequence", _scatter_seq, _gather_seq,
                              "ḡ*: reduce-scatter along the sequence forward, all-gather backward.")


class _GatherLinear(torch.autograd.Function):
    """ḡ then a column-parallel linear, saving only the input *shard*: backward all-gathers it again (Korthikanti's
    "store Y_i^s, all-gather in backward"), so the linear input costs 1/T of the memory."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, comm: Comm,
                site: str) -> torch.Tensor:  # type: ignore[override]
        ctx.comm, ctx.site, ctx.has_bias = comm, site, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(_gather_seq(x, comm, site), weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        full = _gather_seq(x, ctx.comm, ctx.site + " regather")
        g2 = grad.reshape(-1, grad.shape[-1])
        dw = g2.t() @ full.reshape(-1, full.shape[-1])
        db = g2.sum(0) if ctx.has_bias else None
        dx = _scatter_seq(grad @ weight, ctx.comm, ctx.site)
        return dx, dw, db, None, None


def gather_sequence(x: torch.Tensor, comm: Comm, site: str = "") -> torch.Tensor:
    """ḡ: (B, S/T, …) -> (B, S, …), all-gather forward / reduce-scatter backward."""
    return _GatherSequence.apply(x, comm, site)


def scatter_sequence(z: torch.Tensor, comm: Comm, site: str = "") -> torch.Tensor:
    """ḡ*: (B, S, …) partial sums -> (B, S/T, …) shard of the sum, reduce-scatter forward / all-gather backward."""
    return _ScatterSequence.apply(z, comm, site)


def gather_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, comm: Comm,
                  site: str = "") -> torch.Tensor:
    """F.linear(gather_sequence(x), weight, bias), keeping only the shard x for backward (one more all-gather)."""
    return _GatherLinear.apply(x, weight, bias, comm, site)


class SequenceParallelEmbed(nn.Module):
    """`models.Embed` on this rank's sequence shard: tok(idx[:, a:b]) + pos(a … b−1); no communication. Under
    context parallelism (tp × cp with sp) idx is the cp rank's S/C tokens and `positions` their global positions
    (set per step, as on context.GlobalPositionEmbed): pos(positions[a:b])."""

    def __init__(self, full: Embed, comm: Comm) -> None:
        super().__init__()
        self.tok, self.pos, self.comm = full.tok, full.pos, comm     # same submodule names: same parameter names
        self.positions: torch.Tensor | None = None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        a, b = sequence_bounds(idx.shape[1], self.comm)
        at = (torch.arange(a, b, device=idx.device) if self.positions is None   # (a slice would keep, saved for
              else self.positions[a:b].to(idx.device, copy=True))              # backward, all S/C positions alive)
        return self.tok(idx[:, a:b].contiguous()) + self.pos(at)


def sequence_parallelize_embedding(model: nn.Module, comm: Comm, require: bool = True) -> nn.Module:
    """Swap every `models.Embed` for its sequence-shard version (in place; returns model). require=False: a module
    without one is fine (a pipeline stage after the first: its input is already the sequence shard)."""
    found = False
    for name, child in list(model.named_modules()):
        if isinstance(child, Embed):
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, SequenceParallelEmbed(child, comm))
            found = True
    if require and not found:
        raise EngineError("sequence parallelism splits the sequence at the embedding; build the model with "
                          "pslab.parallelism.models.Embed first (e.g. tiny_transformer)")
    return model


class SequenceParallelReplica(LocalReplica):
    """A tensor-parallel replica whose non-TP regions run on the sequence shard (module docstring).

    `forward_backward(x, y)`: x, y of shape (B, S); the loss function must be a mean over tokens (like `lm_loss`).
    """

    def __init__(self, module: nn.Module, dp: Comm, tp: Comm, rank: int, replicated: list[torch.Tensor],
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 name_of: Callable[[str, torch.Tensor], str] | None = None) -> None:
        super().__init__(module, dp, rank, loss_fn, name_of)
        self.tp, self.replicated = tp, replicated

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> float:
        check_token_targets(x, y)
        a, b = sequence_bounds(x.shape[1], self.tp)
        earlier = take_grads(self.replicated)          # accumulated by earlier calls: already summed over tp
        local = self.loss_fn(self.forward(x), y[:, a:b])
        (local / self.tp.size).backward()
        self.after_backward()
        add_back_grads(self.replicated, earlier)
        total = torch.tensor([float(local.detach())], dtype=torch.float64)
        self.tp.all_reduce(total, "sum", site=LOSS_SITE)
        return float(total[0]) / self.tp.size

    def after_backward(self) -> None:
        """Sum the replicated parameters' partial gradients of this call over tp (one flat all-reduce)."""
        sum_partial_grads(self.replicated, self.tp)


def check_token_targets(x: torch.Tensor, y: torch.Tensor) -> None:
    """Sequence parallelism scores each tp rank's tokens: the targets must be one per token, (B, S) like x's."""
    if y.dim() < 2 or y.shape[:2] != x.shape[:2]:
        raise EngineError(f"sequence parallelism needs a target per token, shape (B, S) = {tuple(x.shape[:2])}, "
                          f"got {tuple(y.shape)}; use it for language models only")


def sum_partial_grads(params: list[torch.Tensor], tp: Comm) -> None:
    """Each tp rank holds the part of these replicated parameters' gradients that came from its own tokens: sum
    them over tp with one flat all-reduce (site GRAD_SITE), so every tp rank holds the full gradient."""
    if tp.size == 1 or not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]   # (sized by the gradient:
    flat = torch.cat([g.reshape(-1) for g in grads])                                  # ZeRO-3 may have freed p)
    tp.all_reduce(flat, "sum", site=GRAD_SITE)
    off = 0
    for p, g in zip(params, grads):   # this call's partial gradients, summed (callers add earlier ones back)
        if p.grad is not None:        # in place: a freed parameter takes no gradient of another size
            p.grad.copy_(flat[off:off + g.numel()].view_as(g))
        else:
            p.grad = flat[off:off + g.numel()].view_as(g).clone()
        off += g.numel()


# ---- measuring: saved activations inside given modules ------------------------------------------------------------

@contextlib.contextmanager
def meter_modules(modules: list[nn.Module]) -> Iterator[ActivationMeter]:
    """An `ActivationMeter` that counts only what autograd saves while one of `modules` runs its forward (hooks enter
    the meter before and leave it after each forward). Not to be nested inside another meter over the same run: the
    innermost saved-tensors hook wins, so tensors counted here are missing there."""
    meter = ActivationMeter()

    def enter(*_: object) -> None:
        meter.__enter__()

    def leave(*_: object) -> None:
        meter.__exit__(None, None, None)

    hooks = []
    for m in modules:
        hooks += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
    try:
        yield meter
    finally:
        for h in hooks:
            h.remove()


# ---- formulas ---------------------------------------------------------------------------------------------------

def paper_layer_bytes(s: int, b: int, h: int, a: int, t: int, sp: bool) -> float:
    """Korthikanti et al. (fp16, with dropout, unfused attention) saved bytes per transformer layer."""
    if sp:
        return s * b * h / t * (34 + 5 * a * s / h)
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def layer_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False, regather: bool = False,
                           e: int = 4) -> int:
    """Saved bytes of one of our Blocks (pre-LN, no dropout, fused SDPA) at tp size t; terms in the module docstring."""
    sbh = s * b * h
    ln = 2 * (e * sbh + 2 * e * s * b)              # ln1, ln2: input, mean, rstd
    lin_in = 2 * e * sbh                            # LN outputs (all-gathered under SP) entering qkv and fc1
    split = e * sbh * (3 + 1 + 4 + 4) + e * a * s * b   # q,k,v; attention out = proj in; GeLU in; fc2 in; logsumexp
    if sp:
        ln //= t
        lin_in = lin_in // t if regather else lin_in
    return ln + lin_in + split // t


def model_activation_bytes(batch: int, seq: int, d: int, heads: int, layers: int, vocab: int, t: int = 1,
                           sp: bool = False, regather: bool = False, e: int = 4) -> int:
    """Peak saved-activation bytes of one forward+backward of `tiny_transformer` with `lm_loss` on one tp rank
    (t = 1: single process). Embed: token ids (int64) and positions; L layers; head: LN input + mean + rstd, the
    output linear's input, log-softmax of the logits, int64 targets, and nll's scalar total weight. Under TP the
    embedding and head are replicated (full), under SP they work on S/t tokens."""
    s = seq // t if sp else seq
    embed = 8 * batch * s + 8 * s
    head = 2 * e * s * batch * d + 2 * e * s * batch + e * s * batch * vocab + 8 * s * batch + e
    return embed + layers * layer_activation_bytes(seq, batch, d, heads, t, sp, regather, e) + head


def tp_activation_bytes(batch: int, seq: int, d: int, heads: int, layers: int, vocab: int, t: int,
                        e: int = 4) -> int:
    """`model_activation_bytes` under tensor parallelism without SP."""
    return model_activation_bytes(batch, seq, d, heads, layers, vocab, t, False, False, e)


def sp_activation_bytes(batch: int, seq: int, d: int, heads: int, layers: int, vocab: int, t: int,
                        regather: bool = False, e: int = 4) -> int:
    """`model_activation_bytes` under tensor + sequence parallelism (regather: only linear-input shards kept)."""
    return model_activation_bytes(batch, seq, d, heads, layers, vocab, t, True, regather, e)


def sp_comm_bytes(batch: int, seq: int, d: int, layers: int, t: int, replicated_numel: int,
                  regather: bool = False, e: int = 4) -> dict[str, float]:
    """Wire bytes per step sent by one tp rank under SP, by part:

    activations        per block (attention, MLP) all-gather + reduce-scatter forward and backward:
                       layers · 2 · 2 · 2(t−1)/t · B·S·d·e   (= TP's all-reduces)
    regather           regather=True: one more all-gather per column-parallel linear: layers · 2 · (t−1)/t · B·S·d·e
    replicated_grads   one all-reduce of the replicated parameters' gradients: 2(t−1)/t · e · replicated_numel
    loss               the reported loss: one float64 all-reduce: 2(t−1)/t · 8"""
    r = (t - 1) / t
    act = batch * seq * d * e
    return {"activations": layers * 2 * 2 * 2 * r * act, "regather": layers * 2 * r * act if regather else 0.0,
            "replicated_grads": 2 * r * e * replicated_numel, "loss": 2 * r * 8}
