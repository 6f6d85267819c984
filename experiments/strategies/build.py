"""From a config to the three objects of the engine seam: the mesh, the engine, the sync strategy.

    world = D · P · C · E · T processes     D = train.workers (data parallel), and parallel.pp, cp, ep, tp
    mesh  = DeviceMesh(world, dp=D, pp=P, tp=T, cp=C, ep=E)   (one process, dp = 1, for `local`)

Engines, chosen in this fixed order (the first that applies; config.py's table refuses what none serves):
    parallel.zero > 0   ZeroEngine(stage)           optimizer state (+ grads, + params) sharded over dp
      (with tp: over each tp rank's shards, 2D, sp too; zero = 1 with tp, pp, cp or ep: the engine below and
       DistributedOptimizerStrategy, ZeRO-1 over each model-parallel rank's dp group)
    parallel.pp > 1     PipelineEngine(schedule, m) the model's layers cut into P stages (virtual_stages v: P·v
                                                    chunks, v per stage), then each stage split over tp (+ sp)
                                                    and checkpointed: dp × tp × pp, 3D
                                                    (parallelism/compose.py: the steps and their order)
    parallel.cp > 1     ContextParallelEngine       the sequence split over C ranks (zig-zag), ring attention
    parallel.ep > 1     ExpertParallelEngine        each MoE layer's experts over E ranks, all-to-all dispatch
    parallel.tp > 1     TensorParallelEngine        attention heads and MLP width split over T ranks
                        (parallel.sp: + sequence parallelism: LayerNorm regions split along the sequence)
    otherwise           DataParallelEngine          the whole model on every rank
(`activation_checkpointing` wraps the blocks of the data, tensor, context, expert and pipeline engines; under tp
an MoE layer's experts are split like MLPs, over ep placed inside that.)

Strategies:
    local      LocalStrategy: K virtual workers in one process, their gradients averaged
    allreduce  AllReduceStrategy (ring all-reduce over replica.dp, then torch.optim) — or ZeroStrategy for ZeRO,
               DistributedOptimizerStrategy for ZeRO-1 on a split model
    local-sgd:H, diloco:H  PeriodicAveragingStrategy: local torch.optim steps, the parameters (DiLoCo: the outer
               step on the pseudo-gradient) averaged over replica.dp every H steps
    ps-*       PSSyncStrategy on this rank's slot group: one shard set per (pp, tp) coordinate, D workers each
    ps-local:H, ps-diloco:H  PSPeriodicStrategy: local torch.optim steps, every H steps the pseudo-gradient pushed
               (the shards run the outer step, asynchronously) and θ read back

`check_layout` adds the rules that need the model (divisibility of heads and width by tp, layers for pp) to the
ones `config.py` checks, so every impossible combination is one line before any process starts.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from pslab.experiments.config import RunConfig
from pslab.experiments.errors import ConfigError
from pslab.experiments.strategies.spec import optimizer_spec, torch_optimizer
from pslab.experiments.workloads import Workload


def world_size(cfg: RunConfig) -> int:
    """Processes a real run starts: D · T · P (1 for local)."""
    if cfg.strategy.kind == "local":
        return 1
    return cfg.train.workers * cfg.parallel.model_parallel


def check_processes(cfg: RunConfig, force: bool = False) -> None:
    """A real run on this machine may start at most max(16, 8 x cores) processes (ranks + shards) unless forced."""
    import os
    cores = os.cpu_count() or 1
    limit = max(16, 8 * cores)
    n = world_size(cfg) + (cfg.train.shards * cfg.parallel.slot_groups if cfg.strategy.uses_ps else 0)
    if n > limit and not force:
        raise ConfigError(f"this run would start {n} processes on {cores} cores (limit {limit}): pass --force to "
                          "start them anyway, or --simulate to study that many workers in virtual time")


def check_layout(cfg: RunConfig, wl: Workload) -> None:
    """Raise ConfigError if the model cannot be split as [parallel] asks."""
    p = cfg.parallel
    per_worker = min(len(sh) for sh in wl.schedule.shards)
    if cfg.workload.batch_size > per_worker:
        raise ConfigError(f"workload.batch_size = {cfg.workload.batch_size} exceeds the {per_worker} training examples "
                          f"each of the {cfg.train.workers} workers holds in {wl.name}: use a batch of at most "
                          f"{per_worker}, or fewer workers")
    if cfg.strategy.kind == "ps-bsp-backup" and cfg.train.shards > 1:
        raise ConfigError("ps-bsp-backup picks the first N gradients of each clock on each shard, and two shards could "
                          "pick different workers (half a gradient applied): use train.shards = 1")
    if cfg.strategy.kind == "ps-bsp-backup" and p.model_parallel > 1:
        raise ConfigError("ps-bsp-backup picks the first N gradients of each clock per shard set; with a split "
                          f"model ({p.describe()}) the shard sets could pick different workers: use parallel.tp = "
                          "pp = cp = ep = 1")
    model = wl.make_model() if p.tp > 1 else None
    if model is not None and getattr(model, "tp_plan", None) is not None:      # the model's own plan
        from pslab.parallelism.tensor import check_tp_plan
        other = [a for a, v in (("sp", p.sp), ("cp", p.cp > 1), ("ep", p.ep > 1)) if v]
        if other:
            raise ConfigError(f"a model split by its own tp_plan runs with tp, pp and dp only (not "
                              f"{', '.join(other)}): {wl.name!r} has no pslab transformer blocks to split otherwise")
        try:
            check_tp_plan(model, model.tp_plan, p.tp)
        except ValueError as e:
            raise ConfigError(f"{wl.name}: {e}") from None
    elif model is not None:
        from pslab.parallelism.models import MLP, Attention
        blocks = [m for m in model.modules() if isinstance(m, (Attention, MLP))]
        if not blocks:
            raise ConfigError(f"parallel.tp = {p.tp} splits attention heads and MLP width; workload "
                              f"{wl.name!r} has none: build the model from pslab.parallelism.models' Attention and "
                              "MLP blocks (as text-transformer does), give it a tp_plan, or use parallel.tp = 1")
        for m in blocks:        # the MLP width is 4 x the model width, a multiple of the heads: one check
            if isinstance(m, Attention) and m.heads % p.tp:
                raise ConfigError(f"parallel.tp = {p.tp} must divide the attention heads ({m.heads}) and the MLP "
                                  f"width of {wl.name}: choose tp in {_divisors(m.heads)}")
    seq = wl.batch(0, 0)[0].shape[-1] if wl.task == "lm" else None
    if p.sp and seq is not None and seq % p.tp:
        heads = next((m.heads for m in wl.make_model().modules() if hasattr(m, "heads")), seq)
        ok = [d for d in _divisors(seq) if d > 1 and heads % d == 0]
        raise ConfigError(f"parallel.sp splits the sequence ({seq} tokens in {wl.name}) over tp = {p.tp} ranks: "
                          + (f"choose tp in {ok}" if ok else f"no tp > 1 divides both the sequence and the {heads} "
                             "heads: choose workload.seq_len divisible by tp"))
    if p.cp > 1:
        from pslab.parallelism.models import Attention
        if seq is None or not any(isinstance(m, Attention) for m in wl.make_model().modules()):
            raise ConfigError(f"parallel.cp = {p.cp} splits a transformer's sequence; workload {wl.name!r} has no "
                              "attention: use workload.name = text-transformer")
        if seq % (2 * p.cp):
            raise ConfigError(f"parallel.cp = {p.cp} cuts the sequence ({seq} tokens) into 2 x cp zig-zag chunks: "
                              f"choose cp in {[c for c in range(2, seq // 2 + 1) if seq % (2 * c) == 0][:6]}")
    if p.pp > 1:
        model = wl.make_model()
        layers = sum(1 for c in model.children() if any(True for _ in c.parameters())) \
            if isinstance(model, torch.nn.Sequential) else 0
        if layers == 0:
            raise ConfigError(f"parallel.pp cuts an nn.Sequential into stages; {wl.name!r} is not one")
        from pslab.parallelism.pipeline import PP_CUTS_ATTR, split_stages, stage_module
        cut = getattr(model, PP_CUTS_ATTR, None) is not None   # the model's own cut (split_stages checks it below)
        if p.pp > layers and not cut:
            raise ConfigError(f"parallel.pp = {p.pp} exceeds the {layers} layers of {wl.name}: use pp <= {layers}")
        v = p.virtual_stages
        if p.pp * v > layers and not cut:
            raise ConfigError(f"parallel.virtual_stages = {v} cuts {wl.name}'s {layers} layers into pp x v = "
                              f"{p.pp * v} chunks, more than it has: use virtual_stages <= {layers // p.pp}")
        from pslab.parallelism.engine import EngineError
        try:
            bounds = split_stages(model, p.pp * v)
            if p.tp > 1 and getattr(model, "tp_plan", None):      # each chunk splits whole colwise/rowwise pairs
                from pslab.parallelism.compose import check_stage_plans
                check_stage_plans(model, model.tp_plan, {k: stage_module(model, b) for k, b in enumerate(bounds)})
        except EngineError as e:
            raise ConfigError(f"{wl.name}: {e}") from None
        if cfg.strategy.uses_ps and (p.ep > 1 or p.tp > 1):   # every rank's chunks hold something of its own
            from pslab.parallelism.models import MLP, Attention
            from pslab.parallelism.moe import MoEBase
            planned = p.ep == 1 and getattr(model, "tp_plan", None)
            ax, kinds, what = (("ep", MoEBase, "an MoE layer") if p.ep > 1 else
                               ("tp", torch.nn.Linear, "a Linear its tp_plan names") if planned else
                               ("tp", (Attention, MLP), "an attention or MLP block"))
            qs = [p.pp] if cut else range(2, layers // v + 1)
            ok = [q for q in qs if _every_stage_holds(model, q, v, kinds, model.tp_plan if planned else None)]
            if p.pp not in ok:
                raise ConfigError(f"parallel.pp = {p.pp} with {ax} = {getattr(p, ax)} under {cfg.strategy.label} "
                                  f"leaves a stage without {what}, so its {ax} ranks > 0 would hold nothing of their "
                                  f"own to push: use pp in {ok or [1]}")


def _every_stage_holds(model: torch.nn.Module, pp: int, v: int, kinds: Any, plan: dict | None = None) -> bool:
    """Whether each of the pp ranks' chunks hold a module of `kinds` (with a tp_plan: a Linear the plan names)."""
    from pslab.parallelism.pipeline import rank_stages
    if plan is not None:
        from pslab.parallelism.compose import stage_plan
        return all(stage_plan(plan, st) for st in rank_stages(model, pp, v))
    return all(any(isinstance(m, kinds) for m in st.modules()) for st in rank_stages(model, pp, v))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def make_engine(cfg: RunConfig, wl: Workload) -> Any:
    """The engine for this config (see the module docstring for the order)."""
    from pslab.parallelism.data import DataParallelEngine
    from pslab.parallelism.pipeline import PipelineEngine
    from pslab.parallelism.tensor import TensorParallelEngine
    from pslab.parallelism.zero import ZeroEngine
    p, loss = cfg.parallel, wl.loss_from_output
    if p.zero and not p.distributed_optimizer:
        spec = optimizer_spec(cfg.train)
        return ZeroEngine(p.zero, lambda params: torch_optimizer(spec, params), loss_fn=loss, sequence_parallel=p.sp,
                          checkpoint_activations=p.activation_checkpointing)
    if p.pp > 1:
        pad = (p.stage_ms / 1000, 2 * p.stage_ms / 1000) if p.stage_ms else None
        return PipelineEngine(p.schedule, p.micro_batches, loss_fn=loss, virtual_stages=p.virtual_stages,
                              checkpoint_activations=p.activation_checkpointing, sequence_parallel=p.sp,
                              stage_time=pad)
    if p.cp > 1:
        from pslab.parallelism.context import ContextParallelEngine
        return ContextParallelEngine(loss_fn=loss, checkpoint_activations=p.activation_checkpointing,
                                     sequence_parallel=p.sp)
    if p.ep > 1:
        from pslab.parallelism.expert import ExpertParallelEngine
        return ExpertParallelEngine(loss_fn=loss, checkpoint_activations=p.activation_checkpointing)
    if p.tp > 1:
        return TensorParallelEngine(loss_fn=loss, sequence_parallel=p.sp,
                                    checkpoint_activations=p.activation_checkpointing)
    return DataParallelEngine(bucket_bytes=p.bucket_kb << 10, loss_fn=loss,
                              checkpoint_activations=p.activation_checkpointing)


def _shared_group(mesh: Any) -> Any:
    """The group whose ranks hold the same copy of the slots that are not their own (PS: its rank 0 pushes them)."""
    for axis in ("tp", "ep"):
        if mesh.size(axis) > 1:
            return mesh.group(axis)
    return None


def ps_link(cfg: RunConfig, rank: int) -> tuple[str, float, float] | None:
    """[topology] under ps-*: (link class, latency s, bandwidth B/s) between global rank `rank`'s emulated host and
    the shards' (topology.shard_host); None without a topology."""
    topo = cfg.topology.build(cfg.parallel, cfg.train.workers)
    if topo is None:
        return None
    if topo.host(rank) == cfg.topology.shard_host:
        return "intra", topo.intra_latency_s, topo.intra_bandwidth_Bps
    return "inter", topo.inter_latency_s, topo.inter_bandwidth_Bps


def make_strategy(cfg: RunConfig, mesh: Any, addresses: Sequence[Sequence[str]] | None = None,
                  curve_keys_dir: str | None = None, secret: str | None = None) -> Any:
    """The sync strategy; `addresses[g]` are slot group g's shards (ps-* only), admitting `secret` (None: the
    shards this process started there, else PSLAB_JOB_SECRET, as the launcher sets it for its ranks)."""
    s, spec = cfg.strategy, optimizer_spec(cfg.train)
    if s.kind == "local":
        from pslab.experiments.strategies.local import LocalStrategy
        return LocalStrategy(spec, cfg.train.workers)
    if s.kind == "allreduce":
        if cfg.parallel.distributed_optimizer:
            from pslab.parallelism.distributed_optimizer import DistributedOptimizerStrategy
            return DistributedOptimizerStrategy(lambda params: torch_optimizer(spec, params), stage=cfg.parallel.zero)
        if cfg.parallel.zero:
            from pslab.parallelism.zero import ZeroStrategy
            return ZeroStrategy()
        from pslab.parallelism.compress import make_compressor
        from pslab.parallelism.engine import AllReduceStrategy
        return AllReduceStrategy(lambda params: torch_optimizer(spec, params), overlap=cfg.parallel.overlap,
                                 compressor=make_compressor(cfg.train.compress, cfg.train.error_feedback,
                                                            cfg.workload.seed))
    if s.periodic:                 # local-sgd:H, diloco:H (parallelism/local_sgd.py)
        from pslab.parallelism.local_sgd import PeriodicAveragingStrategy, outer_optimizer
        o = cfg.outer
        return PeriodicAveragingStrategy(lambda params: torch_optimizer(spec, params), s.period, cfg.train.steps,
                                         outer_optimizer(o.optimizer, o.lr, o.momentum) if s.kind == "diloco"
                                         else None)
    from pslab.experiments.strategies.ps import PSSyncStrategy, slot_group
    if addresses is None:
        raise ConfigError(f"{s} needs shard addresses (start the shards with ps.start_servers)")
    if s.ps_periodic:              # ps-local:H, ps-diloco:H (strategies/ps_local.py)
        from pslab.experiments.strategies.ps_local import PSPeriodicStrategy
        return PSPeriodicStrategy(addresses[slot_group(mesh)], lambda params: torch_optimizer(spec, params),
                                  s.period, cfg.train.steps, timeout=cfg.train.timeout_s,
                                  curve_keys_dir=curve_keys_dir, secret=secret, link=ps_link(cfg, mesh.rank))
    return PSSyncStrategy(addresses[slot_group(mesh)], timeout=cfg.train.timeout_s, curve_keys_dir=curve_keys_dir,
                          shared_group=_shared_group(mesh), abort=cfg.train.backup_abort,
                          mirror_group=mesh.group("cp") if mesh.size("cp") > 1 else None,
                          link=ps_link(cfg, mesh.rank), secret=secret,
                          compress=None if cfg.train.compress == "none" else cfg.train.compress,
                          error_feedback=cfg.train.error_feedback)
