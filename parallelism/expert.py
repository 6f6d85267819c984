"""Expert parallelism (GShard, Lepikhin et al. 2020): the E experts of every MoE layer split over the ep ranks.

Ep rank r of a model replica holds experts [r·E/ep, (r+1)·E/ep) of every MoE layer and a replica of everything else
(attention, LayerNorm, embeddings, routers, head). `forward_backward(x, y)` gets the worker's FULL batch on every
ep rank (like tensor parallelism) and keeps sample chunk r of ep; as the layer's `groups` token groups are
contiguous runs of samples, and groups % ep == 0, rank r's tokens are whole groups (G/ep of them), so routing,
capacity and the aux loss are exactly the single-process model's (`moe.py`). With `group_samples` = n instead,
a rank's chunk must be a multiple of n samples (checked per forward) and the same holds. Per MoE layer, per forward:

    buf    (G/ep, E, C, d)   this rank's dispatch buffer (moe.dispatch)
    send   (ep, E/ep, G/ep, C, d) = buf grouped by the experts' rank      chunk s → rank s
    recv   = all_to_all(send)      (src, E/ep, G/ep, C, d): every rank's tokens for my experts
    out    = expert_j(recv[:, j])  for my E/ep experts                   (the same rows, in the same order, as the
                                                                          single-process expert sees)
    back   = all_to_all(out)       (E, G/ep, C, d) → (G/ep, E, C, d)    then moe.combine, as single-process

`all_to_all` is an autograd Function whose backward is the same all-to-all of the gradient (chunk i of a rank's
output came from rank i, so its gradient goes back to rank i). Per MoE layer and step: 4 all-to-alls (dispatch,
combine; their two backwards) of (G/ep)·E·C·d elements each — 6 under activation checkpointing, whose recompute
replays dispatch and combine; per rank (Comm's wire convention, (ep−1)/ep of S):

    payload = 4 · L_moe · (G/ep) · E · C · d · bytes          wire = (ep − 1)/ep · payload

Loss and gradients. The worker's loss is L = (1/ep) Σ_r L_r, L_r = task loss of chunk r (its mean) + the sum over
layers of rank r's aux loss (mean over its groups) — equal to the single-process loss on the worker's batch. Each
rank back-propagates L_r / ep: an expert's gradient then already sums every rank's tokens (the all-to-all backward
brings them), i.e. it is ∂L/∂θ_e; a replicated parameter's local gradient is ∂(L_r/ep)/∂θ, so one all-reduce
SUM over the ep group (site "ep grads", the loss rides along as the last element) gives ∂L/∂θ on every ep rank.

Slots: full-model names ("1.mlp.experts.3.fc1.weight": experts sit in an nn.ModuleDict keyed by their global index);
each expert Parameter carries `_ep_expert = True` (export and snapshots keep the non-expert replicas of ep rank 0
only). `replica.dp` is the dp group: expert e's replicas are the ranks with the same ep coordinate in the other dp
workers, exactly the dp group, so every sync strategy applies unchanged.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .comm import Comm, CommLog
from .engine import EngineError, LocalReplica, add_back_grads, take_grads
from .mesh import DeviceMesh
from .models import lm_loss
from .moe import MoE, MoEBase, moe_aux_loss, moe_layers

EP_EXPERT_ATTR = "_ep_expert"   # set on expert Parameters: they live on one ep rank only
SITE_GRADS = "ep grads"


class _AllToAll(torch.autograd.Function):
    """all_to_all forward; the same all_to_all of the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, site: str) -> torch.Tensor:  # type: ignore[override]
        ctx.comm, ctx.site = comm, site
        x = x.contiguous()
        return comm.all_to_all(torch.empty_like(x), x, site=site)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous()
        return ctx.comm.all_to_all(torch.empty_like(grad), grad, site=ctx.site), None, None


def all_to_all(x: torch.Tensor, comm: Comm, site: str = "") -> torch.Tensor:
    """Differentiable all-to-all over dim 0 (chunk j → rank j); backward: the reverse all-to-all of the gradient."""
    return _AllToAll.apply(x, comm, site)


def is_expert(p: torch.Tensor) -> bool:
    return bool(getattr(p, EP_EXPERT_ATTR, False))


class ExpertParallelMoE(MoEBase):
    """An MoE layer whose experts are split over `comm` (the ep group): router replicated, own experts local."""

    def __init__(self, full: MoE, comm: Comm, site: str = "moe") -> None:
        super().__init__()
        ep, E = comm.size, full.num_experts
        if E % ep:
            raise EngineError(f"{site}: {E} experts cannot be split over ep = {ep} ranks; choose ep dividing E")
        if full.group_samples is None and full.groups % ep:
            raise EngineError(f"{site}: groups = {full.groups} is not a multiple of ep = {ep}, so a rank's tokens "
                              f"would not be whole token groups; set groups to a multiple of ep")
        self.num_experts, self.top_k, self.capacity_factor = E, full.top_k, full.capacity_factor
        self.groups, self.aux_weight = full.groups // ep, full.aux_weight     # groups of this rank's chunk
        self.group_samples = full.group_samples                             # (or: samples per group, unchanged)
        self.router = full.router
        self.comm, self.site = comm, site
        self.local, self.first = E // ep, comm.rank * (E // ep)
        self.experts = nn.ModuleDict({str(e): full.experts[e] for e in range(self.first, self.first + self.local)})
        for p in self.experts.parameters():
            setattr(p, EP_EXPERT_ATTR, True)
        self._init_state()

    def run_experts(self, buf: torch.Tensor) -> torch.Tensor:
        G, E, C, d = buf.shape
        ep, El = self.comm.size, self.local
        recv = all_to_all(buf.transpose(0, 1).reshape(ep, El, G, C, d), self.comm, self.site)
        out = torch.stack([self.experts[str(self.first + j)](recv[:, j]) for j in range(El)], dim=1)
        back = all_to_all(out, self.comm, self.site)            # (owner rank, E/ep, G, C, d) = (E, G, C, d)
        return back.reshape(E, G, C, d).transpose(0, 1)


class ExpertParallelReplica(LocalReplica):
    """One ep rank of a model replica: sample chunk `ep.rank` of the worker's batch, own experts, replicas of the
    rest (their gradients summed over ep after backward, see the module docstring)."""

    def __init__(self, module: nn.Module, dp: Comm, ep: Comm, rank: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 name_of: Callable[[str, torch.Tensor], str] | None = None) -> None:
        super().__init__(module, dp, rank, loss_fn, name_of)
        self.ep = ep

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> float:
        n = self.ep.size
        if x.shape[0] % n:
            raise EngineError(f"a worker batch of {x.shape[0]} samples cannot be split over ep = {n} ranks; "
                              f"use a batch size divisible by ep (and by the MoE layers' groups)")
        xs, ys = torch.tensor_split(x, n)[self.ep.rank], torch.tensor_split(y, n)[self.ep.rank]
        params = [p for p in self.module.parameters() if not is_expert(p)]
        earlier = take_grads(params)           # accumulated by earlier calls: already summed over ep
        loss = self.loss_fn(self.module(xs), ys) + moe_aux_loss(self.module)
        (loss / n).backward()
        out = sum_over_ep(self.ep, params, loss.detach() / n)
        add_back_grads(params, earlier)
        return out

    def moe_stats(self, reduce: bool = False) -> dict[str, dict[str, torch.Tensor]]:
        """Per MoE layer name: {"routed": (E,) assignments per expert before dropping, "dropped": (E,)} accumulated
        since the last call (then reset). reduce=False: of this rank's tokens (local, no communication);
        reduce=True: summed over the ep group, i.e. the worker's whole batch (a collective: every ep rank calls it)."""
        out = {name: m.pop_stats() for name, m in moe_layers(self.module)}
        if reduce and self.ep.size > 1 and out:
            flat = torch.cat([v for st in out.values() for v in st.values()])
            self.ep.all_reduce(flat, "sum", site="moe stats")
            off = 0
            for st in out.values():
                for k, v in st.items():
                    st[k] = flat[off:off + v.numel()].clone()
                    off += v.numel()
        return out


class ExpertParallelEngine:
    """Split every MoE layer's experts over the mesh's ep axis (dp × ep, or dp × ep × tp meshes: under tp each
    expert's MLP is itself split column/row over the tp group, compose.py's step 2); replicas averaged over dp.
    loss_fn defaults to `lm_loss`; the training loss is loss_fn(logits, y) + moe_aux_loss(model);
    checkpoint_activations wraps the blocks (their aux losses kept, checkpointing.py)."""

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 log: CommLog | None = None, checkpoint_activations: bool = False) -> None:
        self.loss_fn, self.log, self.checkpoint_activations = loss_fn or lm_loss, log, checkpoint_activations

    def build(self, model_factory: Callable[[], nn.Module], mesh: DeviceMesh) -> ExpertParallelReplica:
        from .compose import compose
        others = [f"{ax}={mesh.size(ax)}" for ax in ("pp", "cp") if mesh.size(ax) > 1]
        if others:
            raise EngineError(f"ExpertParallelEngine runs on dp x ep (x tp) meshes; this one also has "
                              f"{', '.join(others)} (pp x ep: PipelineEngine)")
        c = compose(model_factory, mesh, self.log if self.log is not None else CommLog(),
                    checkpoint_activations=self.checkpoint_activations)
        if not c.moe:
            raise EngineError("ExpertParallelEngine found no MoE layer in the model; build it with "
                              "pslab.parallelism.moe.MoE (e.g. models.tiny_moe_transformer)")
        return ExpertParallelReplica(c.module, c.dp, c.ep, c.rank, self.loss_fn, c.name_of)


def expert_parallelize(model: nn.Module, ep: Comm, require: bool = True) -> nn.Module:
    """Swap every `MoE` layer for an `ExpertParallelMoE` over `ep` (in place; names unchanged). EngineError if the
    model has none (unless require=False: a pipeline stage may hold none)."""
    layers = [(n, m) for n, m in moe_layers(model) if isinstance(m, MoE)]
    if require and not layers:
        raise EngineError("ExpertParallelEngine found no MoE layer in the model; build it with "
                          "pslab.parallelism.moe.MoE (e.g. models.tiny_moe_transformer)")
    for name, m in layers:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, ExpertParallelMoE(m, ep, site=name))
    return model


def sum_over_ep(ep: Comm, params: list[nn.Parameter], loss: torch.Tensor) -> float:
    """Sum the params' gradients (and the loss, riding along as the last element) over ep, into new tensors; returns
    the summed loss. The replicated parameters' step: each rank back-propagated L_r / ep (module docstring)."""
    if ep.size == 1:
        return float(loss)
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
                     + [loss.reshape(1).to(params[0].dtype if params else torch.float32)])
    ep.all_reduce(flat, "sum", site=SITE_GRADS)
    off = 0
    for p in params:
        p.grad = flat[off:off + p.numel()].view_as(p).clone()
        off += p.numel()
    return float(flat[-1])


def all_to_all_message_bytes(groups_per_rank: int, experts: int, capacity: int, d: int, elem_bytes: int = 4) -> int:
    """Bytes of one dispatch (or combine) buffer a rank hands to all_to_all: (G/ep)·E·C·d·elem_bytes."""
    return groups_per_rank * experts * capacity * d * elem_bytes


def all_to_all_bytes_per_step(groups_per_rank: int, experts: int, capacity: int, d: int, ep: int,
                              moe_layers: int = 1, elem_bytes: int = 4, wire: bool = False) -> float:
    """All-to-all bytes per training step per rank: 4 · L_moe · message (dispatch + combine forward, the same
    backward); wire=True: the (ep−1)/ep of it that leaves the rank. 0 for ep = 1 (nothing is sent)."""
    if ep == 1:
        return 0
    payload = 4 * moe_layers * all_to_all_message_bytes(groups_per_rank, experts, capacity, d, elem_bytes)
    return payload * (ep - 1) / ep if wire else payload
