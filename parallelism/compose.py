"""Composition: one replica is the single-process model with each parallelism axis applied in a fixed order.

Every rank builds the same full model (factories seed themselves), then applies the steps below, each over its own
group of the mesh (`mesh.py`: tp innermost, then ep, cp, pp, dp outermost), and keeps what is left:

    model = factory()
    1. pp  cut     keep this rank's pipeline stage: whole top-level layers,    pipeline.py     talks on pp:
                   a balanced cut of the parameterised ones, or the model's                    p2p at the cuts
                   own pp_cuts (interleaved: v chunks of a v·p-way cut,
                   chunks s, s+p, …)
    2. tp  split   Attention / MLP → Megatron column- and row-parallel shards  tensor.py       talks on tp:
                   (an MoE layer: each expert's MLP, the router replicated);                   every block
                   a user's model: the Linears its tp_plan names that the
                   stage holds (whole colwise/rowwise pairs per stage)
       sp          + the LayerNorm regions (and embedding, head) on S/T tokens sequence.py
    3. cp  ring    attention (each tp rank's heads) by ring attention over     context.py      talks on cp:
                   the cp group, every layer on the rank's S/C tokens                          K/V blocks, then
                                                                                               gradients, loss
    4. ep  experts each MoE layer's experts over the ep group (a sample       expert.py       talks on ep:
                   chunk per ep rank, all-to-all dispatch and combine)                         all-to-alls, then
                                                                                               gradients
    5. ac  wrap    activation checkpointing of the stage's layers (an MoE     checkpointing.py  (recompute
                   block's aux losses leave the checkpoint as outputs)                         replays 2, 3, 4)
    6. dp  sync    the slots the steps left are averaged over dp once a step   engine.py (strategy), or
                   (ZeRO-1) reduce-scattered, updated in chunks, all-gathered  distributed_optimizer.py
    then one executor runs the step: the pipeline schedule over m micro-batches (pp > 1), or one forward/backward.

Why this order (as picotron and torchtitan apply it): the pipeline cut is in units of the single-process model's
layers, so it comes first and never sees a shard; tensor parallelism then swaps modules *inside* the stage, so a
stage's tp ranks hold the shards of exactly that stage's blocks, and stage s's tp rank t sends its output to stage
s+1's tp rank t (their pp group: same tp coordinate) — under sp that output is the (B, S/T, d) sequence shard, so
each cut carries 1/T of the activation per rank (Korthikanti et al.); checkpointing wraps what the stage finally
runs, so its recompute replays the tp collectives; data parallelism acts last, on the slots (full-model name, plus
"#tp{t}/{T}" for a shard) that every rank with the same (pp, tp) coordinate holds identically.

Gradients across the steps: a tp shard gets its whole gradient on its rank; a tensor tp replicates (LayerNorm,
embeddings, row-parallel biases) gets identical gradients on every tp rank — except under sp, where each rank's is
the part from its own tokens and `Composed.replicated` lists the tensors the executor sums over tp after backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import torch
from torch import nn

from .checkpointing import wrap_children
from .comm import Comm, CommLog
from .engine import EngineError, ModelFactory
from .mesh import DeviceMesh

ORDER = ("pp", "tp", "cp", "ep", "ac", "dp")       # the steps, in the order they are applied (module docstring)


@dataclass
class Composed:
    """What the steps left on this rank: its module (a stage with tp shards, maybe wrapped) and the groups."""

    module: nn.Module
    pp: Comm
    tp: Comm
    dp: Comm
    cp: Comm
    ep: Comm
    rank: int                                           # this rank's global rank (the slots' owner)
    sequence_parallel: bool = False
    replicated: list[torch.Tensor] = field(default_factory=list)   # summed over tp after backward (sp only)
    chunk_bounds: list[tuple[int, int]] | None = None   # interleaved: the module's v chunks (child indices)
    moe: bool = False                                   # the model (not only this stage) has MoE layers

    def name_of(self, name: str, p: torch.Tensor) -> str:
        """The slot name: the full-model name, plus "#tp{t}/{T}" for a tensor-parallel shard."""
        from .tensor import SHARD_ATTR
        if getattr(p, SHARD_ATTR, False) and self.tp.size > 1:
            return f"{name}#tp{self.tp.rank}/{self.tp.size}"
        return name


def cut_pipeline(model: nn.Module, pp: Comm, virtual_stages: int = 1) -> tuple[nn.Module, list[tuple[int, int]]]:
    """Step 1: this rank's stage of `model` (an nn.Sequential) over the pp group, and its chunks' [start, end) child
    indices: one chunk, or v of a v·p-way cut (chunks pp.rank, pp.rank + p, …: interleaved 1F1B). The model itself
    when pp = 1."""
    if pp.size == 1:
        if virtual_stages > 1:
            raise EngineError("virtual_stages > 1 interleaves pipeline stages; it needs pp > 1")
        return model, []
    from .pipeline import rank_chunks, stage_module
    mine = rank_chunks(model, pp.size, virtual_stages)[pp.rank]
    return stage_module(model, mine), mine


def split_tensor(stage: nn.Module, model: nn.Module, tp: Comm, sequence_parallel: bool,
                 regather: bool, stage_index: int = 0) -> list[torch.Tensor]:
    """Step 2: swap the stage's Attention / MLP blocks for tensor-parallel ones (+ sequence parallelism); returns
    the parameters tp left replicated whose gradients are partial under sp (empty without sp, or at tp = 1)."""
    from .tensor import SHARD_ATTR, tensor_parallelize
    if tp.size == 1:
        return []
    from .models import MLP, Attention
    from .tensor import TP_PLAN_ATTR
    plan = getattr(model, TP_PLAN_ATTR, None)
    if plan is not None:                  # the model's own plan (a user's model); a pp stage splits what it holds
        if stage is not model:
            check_stage_plans(model, plan, {stage_index: stage})
            stage.tp_plan = stage_plan(plan, stage)
        try:
            if stage.tp_plan:
                tensor_parallelize(stage, tp, sequence_parallel, regather)
        except ValueError as e:
            raise EngineError(str(e)) from None
        return []
    if not any(isinstance(m, (Attention, MLP)) for m in model.modules()):
        raise EngineError("tensor parallelism found no Attention or MLP module to split; build the model from "
                          "pslab.parallelism.models blocks, or give it a tp_plan")
    tensor_parallelize(stage, tp, sequence_parallel, regather, require=False)
    if not sequence_parallel:
        return []
    return [p for p in stage.parameters() if not getattr(p, SHARD_ATTR, False)]


def stage_plan(plan: dict[str, str], stage: nn.Module) -> dict[str, str]:
    """The entries of a model's tp_plan that name modules of this pipeline stage (whose children keep the full
    model's indices as names, so the names are unchanged)."""
    return {n: st for n, st in plan.items() if str(n).split(".")[0] in stage._modules}


def check_stage_plans(model: nn.Module, plan: dict[str, str], stages: dict[int, nn.Module]) -> None:
    """Each stage's planned Linears, in module order, are colwise/rowwise pairs, so what crosses a cut is whole
    (not one tp rank's share of the features). EngineError naming the pair a cut separates."""
    order = [n for n, _ in model.named_modules() if n in plan]
    for k, st in stages.items():
        mine = [n for n in order if n in stage_plan(plan, st)]
        styles = [plan[n] for n in mine]
        if styles != ["colwise", "rowwise"] * (len(styles) // 2) or len(styles) % 2:
            raise EngineError(f"pipeline stage {k} holds the tp_plan's Linears {mine} ({', '.join(styles)}): a cut "
                              "must not separate a colwise Linear from its rowwise partner (what crosses a cut is "
                              "whole); move the cut (pp_cuts) or the plan")


# what a mixture-of-experts model cannot go through, by step
_MOE_REFUSED = {
    "sp": "sequence parallelism would route each tp rank's sequence shard on its own, but a mixture-of-experts "
          "layer's capacity and load-balancing loss are per token group (whole sequences): drop sequence "
          "parallelism for MoE models",
    "cp": "context parallelism does not add a mixture-of-experts model's load-balancing loss: use the data, tensor "
          "or expert-parallel engine for MoE models",
}


def compose(model_factory: ModelFactory, mesh: DeviceMesh, log: CommLog, sequence_parallel: bool = False,
            regather: bool = False, checkpoint_activations: bool = False, refuse_moe: str | None = None,
            virtual_stages: int = 1, context_layout: str = "zigzag") -> Composed:
    """Build this rank's piece of the model by the steps of ORDER (module docstring). refuse_moe ("cp"): refuse a
    mixture-of-experts model for that step's reason even at degree 1 (the context-parallel engine's promise);
    virtual_stages: model chunks per pipeline rank (interleaved 1F1B)."""
    if regather and not sequence_parallel:
        raise EngineError("regather=True keeps sequence shards of the linear inputs; it needs sequence_parallel=True")
    model = model_factory()
    from .moe import moe_layers
    moe = bool(moe_layers(model))
    if moe and refuse_moe:
        raise EngineError(_MOE_REFUSED[refuse_moe])
    if sequence_parallel:
        from .models import Embed
        if not any(isinstance(m, Embed) for m in model.modules()):
            raise EngineError("sequence parallelism splits the sequence at the embedding; build the model with "
                              "pslab.parallelism.models.Embed first (e.g. tiny_transformer)")
    pp = Comm(mesh.group("pp"), log)
    stage, chunks = cut_pipeline(model, pp, virtual_stages)                 # 1. pp
    tp = Comm(mesh.group("tp"), log)
    if moe and sequence_parallel:
        raise EngineError(_MOE_REFUSED["sp"])
    replicated = split_tensor(stage, model, tp, sequence_parallel, regather, pp.rank)  # 2. tp (+ sp)
    cp = Comm(mesh.group("cp"), log)
    if cp.size > 1:
        from .context import context_parallelize
        if moe:
            raise EngineError(_MOE_REFUSED["cp"])
        context_parallelize(stage, cp, context_layout, require=pp.size == 1)  # 3. cp
    ep = Comm(mesh.group("ep"), log)
    if ep.size > 1:
        from .expert import expert_parallelize
        expert_parallelize(stage, ep, require=pp.size == 1)               # 4. ep
    if checkpoint_activations:
        wrap_children(stage)                                                # 5. activation checkpointing
    dp = Comm(mesh.group("dp"), log)                                        # 6. dp: the strategy's, on dp
    return Composed(stage, pp, tp, dp, cp, ep, mesh.world.ranks[mesh.rank], sequence_parallel and tp.size > 1,
                    replicated, chunks if virtual_stages > 1 else None, moe)

