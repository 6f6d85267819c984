"""Partial gradients on a ZeRO replica: the sequence- and context-parallel forward/backward of `zero.py`.

Under sequence parallelism (compose's step 2, sp) a tp rank runs the LayerNorm regions on its S/T tokens, and under
context parallelism (step 3, cp) a cp rank runs every layer on its S/C zig-zag tokens. Its gradient of a tensor
that the ranks share is then only the part that flowed through its own tokens:

    sp   the tensors tp replicates (LayerNorms, row-parallel biases, embedding)  g = Σ_t g_t         L = Σ_t L_t / T
    cp   every parameter                                                         g = (1/C) Σ_r g_r   L = (1/C) Σ_r L_r

ZeRO 2–3 reduce-scatter each gradient over dp from its post-accumulate hook, inside backward -- too early for a
partial one. So those hooks wait (`ZeroReplica.deferred`); after backward the partial gradients are summed (sp:
one flat all-reduce over tp, site "sp replicated grads") or averaged (cp: over cp, "cp grads"), exactly as the
sequence- and context-parallel replicas do without ZeRO, and then the waiting hooks fire (`fire_deferred`): the
reduce-scatter over dp follows as for any other gradient, so the bytes are those of the two replicas' sums plus
ZeRO's. The price: the waiting gradients stay whole until backward ends -- a few small tensors under sp, every
gradient under cp (ZeRO-1's peak; the cp ranks of a dp group also repeat their chunks, where Megatron-LM shards
over dp × cp). Stage 3 frees a unit's gathered weights as soon as its gradients are in, waiting ones included
(their weights are not needed to sum or average a gradient), so its peak of gathered weights is plain dp's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .engine import EngineError, ParamSlot, add_back_grads, take_grads

if TYPE_CHECKING:
    from .zero import ZeroReplica


def forward_backward_sp(rep: ZeroReplica, x: torch.Tensor, y: torch.Tensor) -> float:
    """Sequence parallel (as SequenceParallelReplica): this tp rank scores its S/T tokens; the replicated tensors'
    partial gradients are summed over tp, then their hooks fire. Returns the batch's loss."""
    from .sequence import LOSS_SITE, check_token_targets, sequence_bounds, sum_partial_grads
    check_token_targets(x, y)
    a, b = sequence_bounds(x.shape[1], rep.sp)
    params = [p for _, p in rep.deferred]
    earlier = take_grads(params)                   # (stage 1: what earlier calls accumulated, already summed)
    local = rep.loss_fn(rep.module(x), y[:, a:b])
    (local / rep.sp.size).backward()
    sum_partial_grads([p for p in params if p.grad is not None], rep.sp)   # (an unused one: on no tp rank)
    add_back_grads(params, earlier)
    fire_deferred(rep)
    total = torch.tensor([float(local.detach())], dtype=torch.float64)
    rep.sp.all_reduce(total, "sum", site=LOSS_SITE)
    return float(total[0]) / rep.sp.size


def forward_backward_cp(rep: ZeroReplica, x: torch.Tensor, y: torch.Tensor) -> float:
    """Context parallel (as ContextParallelReplica): this cp rank's zig-zag tokens at their global positions; every
    gradient is averaged over cp, then the hooks fire. Returns the batch's loss."""
    from .context import average_grads_in_place, set_positions, token_positions
    if x.dim() < 2:
        raise EngineError(f"context parallelism splits dim 1 (the sequence) of the batch; got shape {tuple(x.shape)}")
    pos = token_positions(rep.cp, x.shape[1], rep.context_layout)
    set_positions(rep.module, pos)
    x, y = x[:, pos], y[:, pos]
    params = [p for _, p in rep.deferred]
    earlier = take_grads(params)           # (stage 1: what earlier calls accumulated, already reduced)
    if rep.sp is None:
        loss = rep.loss_fn(rep.module(x), y)
        loss.backward()
    else:                                  # tp × cp with sp: this tp rank's S/(C·T) tokens, sp's partial sums first
        from .sequence import LOSS_SITE, check_token_targets, sequence_bounds, sum_partial_grads
        check_token_targets(x, y)
        a, b = sequence_bounds(x.shape[1], rep.sp)
        loss = rep.loss_fn(rep.module(x), y[:, a:b])
        (loss / rep.sp.size).backward()
        sum_partial_grads([p for p in rep.sp_replicated if p.grad is not None], rep.sp)
    average_grads_in_place(rep.cp, [ParamSlot(n, p, rep.rank) for n, p in rep.deferred if p.grad is not None],
                           site="cp grads")
    add_back_grads(params, earlier)
    fire_deferred(rep)
    total = torch.tensor([float(loss.detach())], dtype=torch.float64)
    rep.cp.all_reduce(total, "sum", site="cp loss")
    if rep.sp is not None:
        rep.sp.all_reduce(total, "sum", site=LOSS_SITE)
        total /= rep.sp.size
    return float(total[0]) / rep.cp.size


def fire_deferred(rep: ZeroReplica) -> None:
    """Run the waiting hooks of `rep.deferred` now that their gradients are whole; a parameter without a gradient
    (unused this step) is left to step()'s flush, as without waiting, and stages 0-1 without packing have no hooks
    (they reduce in step())."""
    for n, p in rep.deferred:
        if p.grad is not None and n in rep.hooks:
            rep.hooks[n](p, now=True)
