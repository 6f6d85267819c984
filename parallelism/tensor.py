"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): split each layer's matrices across the T ranks of a group.

The two conjugate operators, as named in the paper (§3, Fig. 3):

    f: forward identity,   backward all-reduce     (enters a tensor-parallel region)
    g: forward all-reduce, backward identity       (leaves it)

Column-parallel Linear Y = X·A with A = [A_1 … A_T] split by output columns: rank t computes X·A_t after f.
Row-parallel Linear Z = Y·B with B split by input rows: rank t computes Y_t·B_t, then g sums the partial products;
the bias is added once, after g (it is replicated). The MLP is f → column fc1 → GeLU → row fc2 → g, one all-reduce
forward and one backward per block, no communication in between (GeLU acts on a whole column shard). Attention
splits heads: qkv is column-parallel (each rank takes its heads' rows of q, k and v), proj is row-parallel.
Per block of width d, sequence S, batch B: 2 all-reduces of B·S·d activations forward and 2 backward — every layer
communicates, which is why TP stays on the fastest link (adjacent ranks, `mesh.py`).

`sequence_parallel=True` (Korthikanti et al. 2022, `sequence.py`): the regions between the TP regions (LayerNorm,
residuals, embedding, head) run on the rank's S/T tokens; f/g become all-gather / reduce-scatter along the sequence
(the same wire bytes), and the replicated parameters' partial gradients are summed over tp after backward.

Every shard taken by `from_full` records where it came from: `param._tp_index = (dim, LongTensor of indices)` —
the indices along `dim` of the full tensor it holds (column-parallel weight and bias: dim 0 rows, non-contiguous
for attention's qkv; row-parallel weight: dim 1 columns; the row-parallel bias is replicated and has none). It is
an attribute of the Parameter object, so it survives `param.data = …`; `export.py` uses it to reassemble the model.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pslab.collectives import chunk_bounds

from .comm import Comm, CommLog
from .engine import EngineError, LocalReplica
from .mesh import DeviceMesh
from .models import MLP, Attention
from .ring_attention import ring_attention
from .sequence import (SequenceParallelReplica, gather_linear, gather_sequence, scatter_sequence,
                       sequence_parallelize_embedding)

SHARD_ATTR = "_tp_shard"   # set on parameters that are shards (not replicas) across the tp group
TP_PLAN_ATTR = "tp_plan"   # a model's own plan {Linear module name: "colwise" | "rowwise"} (see apply_tp_plan)
TP_STYLES = ("colwise", "rowwise")
TP_INDEX_ATTR = "_tp_index"   # (dim, LongTensor): which indices along dim of the full tensor a shard holds


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, site: str) -> torch.Tensor:  # type: ignore[override]
        ctx.comm, ctx.site = comm, site
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad, "sum", site=ctx.site)
        return grad, None, None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, site: str) -> torch.Tensor:  # type: ignore[override]
        y = x.contiguous().clone()
        comm.all_reduce(y, "sum", site=site)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None, None


def f(x: torch.Tensor, comm: Comm, site: str = "") -> torch.Tensor:
    """Megatron's f operator."""
    return _CopyToTensorParallelRegion.apply(x, comm, site)


def g(x: torch.Tensor, comm: Comm, site: str = "") -> torch.Tensor:
    """Megatron's g operator."""
    return _ReduceFromTensorParallelRegion.apply(x, comm, site)


def _split(n: int, comm: Comm, what: str) -> tuple[int, int]:
    if n % comm.size:
        raise ValueError(f"cannot split {what} of size {n} evenly over {comm.size} tensor-parallel ranks; "
                         f"choose a tp size that divides it")
    return chunk_bounds(n, comm.size)[comm.rank]


def _shard(t: torch.Tensor) -> nn.Parameter:
    p = nn.Parameter(t.detach().clone().contiguous())
    setattr(p, SHARD_ATTR, True)
    return p


def _record_index(p: torch.Tensor | None, dim: int, index: torch.Tensor) -> None:
    """Mark shard `p` as holding `index` along `dim` of the full tensor (see TP_INDEX_ATTR)."""
    if p is not None:
        setattr(p, TP_INDEX_ATTR, (dim, index.detach().clone().to(torch.long)))


def tp_index(p: torch.Tensor) -> tuple[int, torch.Tensor] | None:
    """(dim, indices of the full tensor) of a tensor-parallel shard built by `from_full`; None for a replica."""
    return getattr(p, TP_INDEX_ATTR, None)


class ColumnParallelLinear(nn.Module):
    """Y_t = f(X)·A_t + b_t; the output stays split by columns (no gather).

    sequence_parallel: X arrives as this rank's sequence shard and ḡ (all-gather along the sequence) replaces f;
    with regather too, only the shard is saved for backward and gathered again there (`sequence.py`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: Comm, site: str = "",
                 use_f: bool = True, sequence_parallel: bool = False, regather: bool = False) -> None:
        super().__init__()
        self.weight = _shard(weight)
        self.bias = _shard(bias) if bias is not None else None
        self.comm, self.site, self.use_f = comm, site, use_f
        self.sequence_parallel, self.regather = sequence_parallel, regather

    @classmethod
    def from_full(cls, lin: nn.Linear, comm: Comm, rows: torch.Tensor | None = None, site: str = "",
                  use_f: bool = True, sequence_parallel: bool = False,
                  regather: bool = False) -> ColumnParallelLinear:
        """Take this rank's output rows of `lin` (contiguous chunk, or the given row indices)."""
        if rows is None:
            a, b = _split(lin.out_features, comm, "out_features")
            rows = torch.arange(a, b)
        bias = lin.bias[rows] if lin.bias is not None else None
        out = cls(lin.weight[rows], bias, comm, site, use_f, sequence_parallel, regather)
        _record_index(out.weight, 0, rows)
        _record_index(out.bias, 0, rows)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_f and self.sequence_parallel:
            if self.regather:
                return gather_linear(x, self.weight, self.bias, self.comm, self.site)
            x = gather_sequence(x, self.comm, self.site)
        elif self.use_f:
            x = f(x, self.comm, self.site)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Z = g(Y_t·B_t) + b: partial products summed by g; the replicated bias added after.

    sequence_parallel: ḡ* (reduce-scatter along the sequence) replaces g; Z and the bias add are on the shard."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: Comm, site: str = "",
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.weight = _shard(weight)
        self.bias = nn.Parameter(bias.detach().clone()) if bias is not None else None
        self.comm, self.site, self.sequence_parallel = comm, site, sequence_parallel

    @classmethod
    def from_full(cls, lin: nn.Linear, comm: Comm, cols: torch.Tensor | None = None,
                  site: str = "", sequence_parallel: bool = False) -> RowParallelLinear:
        """Take this rank's input columns of `lin` (contiguous chunk, or the given column indices); bias replicated."""
        if cols is None:
            a, b = _split(lin.in_features, comm, "in_features")
            cols = torch.arange(a, b)
        out = cls(lin.weight[:, cols], lin.bias, comm, site, sequence_parallel)
        _record_index(out.weight, 1, cols)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leave = scatter_sequence if self.sequence_parallel else g
        z = leave(F.linear(x, self.weight), self.comm, self.site)
        return z + self.bias if self.bias is not None else z


class TensorParallelMLP(nn.Module):
    """f → column fc1 → GeLU → row fc2 → g."""

    def __init__(self, full: MLP, comm: Comm, site: str = "mlp", sequence_parallel: bool = False,
                 regather: bool = False) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear.from_full(full.fc1, comm, site=site, sequence_parallel=sequence_parallel,
                                                  regather=regather)
        self.act = full.act
        self.fc2 = RowParallelLinear.from_full(full.fc2, comm, site=site, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class TensorParallelAttention(nn.Module):
    """Heads split across ranks: rank t owns heads [t·H/T, (t+1)·H/T) of q, k and v, and proj's matching inputs."""

    def __init__(self, full: Attention, comm: Comm, site: str = "attn", sequence_parallel: bool = False,
                 regather: bool = False) -> None:
        super().__init__()
        h0, h1 = _split(full.heads, comm, "attention heads")
        hd = full.d // full.heads
        own = torch.arange(h0 * hd, h1 * hd)
        rows = torch.cat([own, own + full.d, own + 2 * full.d])       # my heads' rows of q, k, v
        self.qkv = ColumnParallelLinear.from_full(full.qkv, comm, rows=rows, site=site,
                                                  sequence_parallel=sequence_parallel, regather=regather)
        self.proj = RowParallelLinear.from_full(full.proj, comm, cols=own, site=site,
                                                sequence_parallel=sequence_parallel)
        self.local_heads, self.head_dim = h1 - h0, hd
        self.ring: tuple[Comm, str, str] | None = None   # (cp group, layout, site): context parallelism's ring

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)                  # (B, S, 3w); under SP x is the (B, S/T, d) shard, qkv the full S
        b, s, _ = qkv.shape
        w = self.local_heads * self.head_dim
        q, k, v = qkv.split(w, dim=-1)
        q, k, v = (t.view(b, s, self.local_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if self.ring is not None:          # tp × cp: this rank's heads, its S/C tokens, K/V around the cp ring
            cp, layout, site = self.ring
            y = ring_attention(q, k, v, cp, True, layout, site)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, w))


def check_tp_plan(model: nn.Module, plan: object, tp: int) -> dict[str, str]:
    """The model's plan, validated: a dict naming nn.Linear modules, each "colwise" (output features split; f
    before it) or "rowwise" (input features split; g after it), every split feature count divisible by `tp`.
    ValueError with a one-line reason otherwise."""
    if not isinstance(plan, dict) or not plan:
        raise ValueError(f"the model's {TP_PLAN_ATTR} must be a non-empty dict {{module name: 'colwise' | "
                         f"'rowwise'}}, got {plan!r}")
    out: dict[str, str] = {}
    for name, style in plan.items():
        try:
            mod = model.get_submodule(str(name))
        except AttributeError:
            raise ValueError(f"{TP_PLAN_ATTR} names {name!r}, which is not a module of the model") from None
        if not isinstance(mod, nn.Linear):
            raise ValueError(f"{TP_PLAN_ATTR} names {name!r}, a {type(mod).__name__}: only nn.Linear modules split")
        if style not in TP_STYLES:
            raise ValueError(f"{TP_PLAN_ATTR}[{name!r}] must be 'colwise' or 'rowwise', got {style!r}")
        n = mod.out_features if style == "colwise" else mod.in_features
        if n % tp:
            raise ValueError(f"{TP_PLAN_ATTR}[{name!r}] = {style!r} splits {n} "
                             f"{'output' if style == 'colwise' else 'input'} features over tp = {tp}: choose a tp "
                             "that divides it")
        out[str(name)] = style
    return out


def apply_tp_plan(model: nn.Module, comm: Comm) -> None:
    """Swap each nn.Linear the model's `tp_plan` names for its Megatron shard (in place), as `parallelize_module`
    does with ColwiseParallel / RowwiseParallel: "colwise" takes this rank's output rows, f before it, its output
    stays split; "rowwise" takes the matching input columns, g after it sums the partial products, the bias added
    once. Between a colwise Linear and its rowwise partner only per-feature operations may run (an activation, a
    dropout): the plan's author vouches for that, as in torch's API; parity with one process is what tests it."""
    plan = check_tp_plan(model, getattr(model, TP_PLAN_ATTR, None), comm.size)
    for name, style in plan.items():
        lin = model.get_submodule(name)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        cls = ColumnParallelLinear if style == "colwise" else RowParallelLinear
        setattr(parent, attr, cls.from_full(lin, comm, site=name))


def tensor_parallelize(model: nn.Module, comm: Comm, sequence_parallel: bool = False,
                       regather: bool = False, require: bool = True) -> nn.Module:
    """Swap every `Attention` and `MLP` in `model` for its tensor-parallel version (in place; returns model).
    sequence_parallel: their entries/exits become ḡ/ḡ* and every `Embed` embeds only the rank's sequence shard.
    require=False: a module with nothing to split is fine (a pipeline stage holding only the embedding or head).
    A model with its own `tp_plan` (a user's model) is split by that plan instead (apply_tp_plan)."""
    if getattr(model, TP_PLAN_ATTR, None) is not None:
        if sequence_parallel:
            raise ValueError("sequence parallelism splits pslab's transformer blocks; a model split by its own "
                             f"{TP_PLAN_ATTR} runs without it")
        apply_tp_plan(model, comm)
        return model
    for name, child in list(model.named_modules()):
        if isinstance(child, (Attention, MLP)):
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            cls = TensorParallelAttention if isinstance(child, Attention) else TensorParallelMLP
            setattr(parent, attr, cls(child, comm, site=name, sequence_parallel=sequence_parallel,
                                      regather=regather))
    if sequence_parallel:
        sequence_parallelize_embedding(model, comm, require)
    if require and comm.size > 1 and not any(getattr(p, SHARD_ATTR, False) for p in model.parameters()):
        raise ValueError("tensor_parallelize found no Attention or MLP module to split; build the model from "
                         "pslab.parallelism.models blocks")
    return model


class TensorParallelEngine:
    """Split Attention/MLP blocks over the mesh's tp axis; replicas of the tp shards are averaged over dp.

    Slot names: sharded tensors get the suffix "#tp{t}/{T}" after their full-model name; replicated tensors (LayerNorm,
    embeddings, row-parallel biases) keep the plain name and have identical gradients on every tp rank.

    sequence_parallel (Korthikanti et al. 2022, `sequence.py`): the replicated regions run on the rank's S/T tokens,
    the replicated gradients are summed over tp after backward; same slots, same gradients. regather: keep only the
    sequence shard of the column-parallel inputs for backward (1/T of their memory, one more all-gather each)."""

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 log: CommLog | None = None, sequence_parallel: bool = False, regather: bool = False,
                 checkpoint_activations: bool = False) -> None:
        self.loss_fn, self.log, self.checkpoint_activations = loss_fn, log, checkpoint_activations
        if regather and not sequence_parallel:
            raise EngineError("regather=True keeps sequence shards of the linear inputs; it needs "
                              "sequence_parallel=True")
        self.sequence_parallel, self.regather = sequence_parallel, regather

    def build(self, model_factory: Callable[[], nn.Module], mesh: DeviceMesh) -> LocalReplica:
        from .compose import compose
        other = [f"{ax}={mesh.group(ax).world_size}" for ax in ("pp", "cp", "ep") if mesh.group(ax).world_size > 1]
        if other:       # their replicas do more than one forward/backward on the whole batch
            raise EngineError(f"TensorParallelEngine runs on dp x tp meshes; this one also has {', '.join(other)} "
                              "(pp: PipelineEngine, cp: ContextParallelEngine, ep: ExpertParallelEngine)")
        c = compose(model_factory, mesh, self.log if self.log is not None else CommLog(), self.sequence_parallel,
                    self.regather, self.checkpoint_activations)
        if c.sequence_parallel:
            from .models import lm_loss
            return SequenceParallelReplica(c.module, c.dp, c.tp, c.rank, c.replicated, self.loss_fn or lm_loss,
                                           c.name_of)
        return LocalReplica(c.module, c.dp, c.rank, self.loss_fn, c.name_of)
