"""Which [parallel] combinations run: the value checks of `[parallel]`, `[topology]` and the MoE workload's keys, and
one table of the combinations refused (`_PARALLEL_RULES`), each row with its one-line reason -- the tutorial lists
them. What needs the model itself (divisibility of heads, layers for pp) is
`experiments.strategies.build.check_layout`'s. Called by `RunConfig.validate`.
"""

from __future__ import annotations

import math
from typing import Callable

from pslab.experiments.config import SCHEDULES, ParallelConfig, RunConfig, WorkloadConfig, _positive
from pslab.experiments.errors import ConfigError
from pslab.experiments.strategies.spec import Strategy


def _uncomposed(p: ParallelConfig) -> str | None:
    """Why cp with ep, or ep with ZeRO 2-3, do not run (one line), else None."""
    if p.cp > 1 and p.ep > 1:
        return (f"parallel.cp = {p.cp} with ep = {p.ep}: an MoE layer routes whole sequences (its capacity "
                "⌈cf·k·S/E⌉ and load-balancing loss are per sequence) while cp gives each rank S/C tokens of each, "
                "and the context-parallel step does not add the load-balancing loss: drop one of them")
    if p.ep > 1 and p.zero > 1:
        return (f"parallel.ep = {p.ep} with zero = {p.zero}: ZeRO 2-3 reduce-scatter each gradient inside backward, "
                "but the non-expert tensors' gradients are partial per ep rank (its own samples) until they are "
                "summed over ep after backward, and ZeroEngine trains on the task loss only (the MoE load-balancing "
                "loss would be dropped): use zero = 1, the distributed optimizer")
    return None


def _split(p: ParallelConfig) -> bool:
    return p.model_parallel > 1 or p.zero > 0


# [parallel]: every combination the axes allow runs, except the rows below -- one row per refusal, each with its
# reason (the tutorial lists them). What runs: dp x tp x pp (3D) with sp and activation checkpointing on any of them,
# under allreduce and ps-*, plain or interleaved 1F1B; dp x tp x pp x cp (allreduce and ps-*, with checkpointing),
# with sp too; dp x pp x ep (allreduce and ps-*) and dp x tp x pp x ep (allreduce), with checkpointing; ZeRO 1-3
# over dp, ZeRO 1 also with tp and pp (the distributed optimizer), ZeRO 2 with pp (and tp), ZeRO 2-3 with tp and sp
# (2D: FSDP + TP) and with cp, ZeRO 1-3 with activation checkpointing; overlap on dp and pp (without tp).
# Rows: (applies when (p, strategy, simulated), the one-line message).
_PARALLEL_RULES: tuple[tuple[Callable[[ParallelConfig, Strategy, bool], bool],
                             Callable[[ParallelConfig, Strategy], str]], ...] = (
    (lambda p, s, sim: p.sp and p.tp == 1,
     lambda p, s: "parallel.sp splits the tensor-parallel group's LayerNorm regions along the sequence: it needs "
                  "parallel.tp > 1"),
    # context and expert parallelism compose with tp and pp, cp also with ZeRO 1-3, ep with zero = 1; not with each
    # other, nor ep with ZeRO 2-3
    (lambda p, s, sim: _uncomposed(p) is not None,
     lambda p, s: _uncomposed(p)),
    (lambda p, s, sim: p.overlap and (p.cp > 1 or p.ep > 1),
     lambda p, s: f"parallel.{'cp' if p.cp > 1 else 'ep'} = {max(p.cp, p.ep)}: overlap applies to the data and "
                  "pipeline engines (the cp ring and the ep all-to-alls would share the transport with the bucket "
                  "thread); drop it"),
    (lambda p, s, sim: p.ep > 1 and p.tp > 1 and s.uses_ps,
     lambda p, s: f"parallel.ep = {p.ep} with tp = {p.tp} needs train.strategy = allreduce: under {s.label} one rank "
                  "of a shared group pushes the tensors it shares, and a tensor shared over tp and ep at once has "
                  "no such rank yet"),
    (lambda p, s, sim: sim and (_split(p) or p.overlap or p.activation_checkpointing),
     lambda p, s: "the simulator models data parallelism only: drop the [parallel] settings "
                  f"({p.describe()}) or run without --simulate"),
    (lambda p, s, sim: s.kind == "local" and (_split(p) or p.overlap),
     lambda p, s: "strategy local is one process: parallel."
                  + next((ax for ax in ("tp", "pp", "cp", "ep") if getattr(p, ax) > 1), "zero" if p.zero else "overlap")
                  + " needs strategy allreduce or ps-* (local with activation checkpointing is fine)"),
    (lambda p, s, sim: p.zero and s.kind != "allreduce",
     lambda p, s: f"parallel.zero = {p.zero} shards optimizer state over the all-reduce group: use train.strategy = "
                  "allreduce (the parameter server already keeps the optimizer on the shards)"),
    (lambda p, s, sim: p.zero == 3 and p.pp > 1,
     lambda p, s: f"parallel.zero = 3 with pp = {p.pp}: the stage's weights would be gathered for each of its "
                  f"{p.micro_batches} micro-batches' forward and backward (or kept whole across them, which is ZeRO-2's "
                  "memory): not composed yet; with pp use zero = 1 or 2"),
    (lambda p, s, sim: p.zero == 2 and p.pp > 1 and (p.sp or p.cp > 1 or p.ep > 1),
     lambda p, s: "parallel.zero = 2 with pp reduce-scatters each micro-batch's gradients over dp as its backward "
                  "ends, but sp, cp and ep sum or average the stage's gradients over tp, cp or ep after the last "
                  "micro-batch: with them use zero = 1"),
    (lambda p, s, sim: p.virtual_stages > 1 and (p.pp == 1 or p.schedule != "1f1b"),
     lambda p, s: f"parallel.virtual_stages = {p.virtual_stages} interleaves the stages of 1F1B: it needs "
                  f"parallel.pp > 1 and parallel.schedule = \"1f1b\" (got pp = {p.pp}, schedule = {p.schedule!r})"),
    (lambda p, s, sim: p.stage_ms > 0 and p.pp == 1,
     lambda p, s: f"parallel.stage_ms = {p.stage_ms:g} pads pipeline stages: it needs parallel.pp > 1"),
    (lambda p, s, sim: p.virtual_stages > 1 and p.micro_batches % p.pp != 0,
     lambda p, s: f"parallel.virtual_stages = {p.virtual_stages}: interleaved 1F1B runs micro-batches in groups of "
                  f"pp = {p.pp}, so parallel.micro_batches ({p.micro_batches}) must be a multiple of {p.pp}"),
    (lambda p, s, sim: p.overlap and s.kind != "allreduce",
     lambda p, s: f"parallel.overlap overlaps the all-reduce with backward: it needs train.strategy = allreduce, "
                  f"not {s.label}"),
    (lambda p, s, sim: p.overlap and (p.zero or p.tp > 1),
     lambda p, s: "parallel.overlap runs the dp all-reduce from backward's hooks in the data-parallel and pipeline "
                  "engines (pp > 1: in the last micro-batch's backward), not with zero or tp > 1 (tp's backward "
                  "collectives would share the transport with the bucket thread)"),
)


def validate_parallel(p: ParallelConfig, s: Strategy, batch_size: int, simulated: bool) -> None:
    """Values in range, then the table of refused combinations (_PARALLEL_RULES); what needs the model
    (divisibility, number of layers) is `experiments.strategies.build.check_layout`'s."""
    for key in ("tp", "pp", "cp", "ep", "micro_batches", "virtual_stages"):
        _positive(f"parallel.{key}", getattr(p, key))
    if isinstance(p.stage_ms, bool) or not isinstance(p.stage_ms, (int, float)) or not 0 <= p.stage_ms <= 10_000:
        raise ConfigError(f"parallel.stage_ms must be a number of milliseconds in 0..10000, got {p.stage_ms!r}")
    if p.schedule not in SCHEDULES:
        raise ConfigError(f"parallel.schedule must be one of {', '.join(SCHEDULES)}, got {p.schedule!r}")
    if p.zero not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero must be 0, 1, 2 or 3 (the ZeRO stage), got {p.zero!r}")
    for when, says in _PARALLEL_RULES:
        if when(p, s, simulated):
            raise ConfigError(says(p, s))
    per_rank = batch_size // p.ep          # under ep each rank pipelines its 1/ep sample chunk
    if p.pp > 1 and p.micro_batches > per_rank:
        raise ConfigError(f"parallel.micro_batches = {p.micro_batches} exceeds the {per_rank} examples a pipeline "
                          f"gets (workload.batch_size = {batch_size}" + (f" / ep = {p.ep}" if p.ep > 1 else "")
                          + "): each micro-batch needs at least one example; use fewer micro-batches or a larger "
                          "batch")


def validate_topology(cfg: RunConfig) -> None:
    """[topology]: numbers in range, placement known; hosts x gpus_per_host = the run's world size; a strategy and
    backend whose processes can all be placed (allreduce or ps-* over zmq; shard_host a host), a fixed membership
    (faults abort)."""
    tp, t, s = cfg.topology, cfg.train, cfg.strategy
    for key in ("hosts", "gpus_per_host"):
        v = getattr(tp, key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"topology.{key} must be an integer >= 0, got {v!r}")
    for key in ("intra_latency_us", "intra_bandwidth_GBps", "inter_latency_us", "inter_bandwidth_GBps"):
        v = getattr(tp, key)
        if not (v >= 0 and math.isfinite(v)):
            raise ConfigError(f"topology.{key} must be a finite number >= 0 (bandwidth 0: unlimited), got {v}")
    if tp.order() is not None:
        from pslab.parallelism.mesh import AXES
        order, p = tp.order(), cfg.parallel
        degrees = {"dp": t.workers, "pp": p.pp, "tp": p.tp, "cp": p.cp, "ep": p.ep}
        split = [ax for ax in AXES if degrees[ax] > 1]
        missing = [ax for ax in split if ax not in order]
        unknown = [ax for ax in order if ax not in AXES]
        if unknown or len(set(order)) != len(order) or missing:
            what = (f"names {', '.join(unknown)}, not an axis" if unknown else
                    f"leaves out {', '.join(missing)}" if missing else "names an axis twice")
            raise ConfigError(f"topology.placement {tp.placement!r} {what}: it must be packed, spread or an axis order "
                              f"naming every axis this run splits ({', '.join(split) or 'none'}) once, "
                              f"fastest-varying first (cp, ep optional when 1), e.g. \"tp,dp,pp\" (a host per "
                              "pipeline stage)")
    if not tp.enabled:
        if tp.shard_host:
            raise ConfigError(f"topology.shard_host = {tp.shard_host} needs topology.hosts >= 1 (0: no topology)")
        if tp.gpus_per_host:
            raise ConfigError(f"topology.gpus_per_host = {tp.gpus_per_host} needs topology.hosts >= 1 (0: no topology)")
        return
    if tp.gpus_per_host < 1:
        raise ConfigError(f"topology.hosts = {tp.hosts} needs topology.gpus_per_host >= 1 (ranks per host)")
    if cfg.simulate.enabled or cfg.simulate.timing_only:
        raise ConfigError("[topology] emulates links in real runs; the simulator's network is [simulate]'s "
                          "(latency_*, bandwidth_*, workers_per_host): drop [topology] or --simulate")
    if s.kind == "local":
        raise ConfigError(f"[topology] needs train.strategy = allreduce or ps-*: {s.label} is one process: it has no "
                          "links")
    if isinstance(tp.shard_host, bool) or not isinstance(tp.shard_host, int) or not 0 <= tp.shard_host < tp.hosts:
        raise ConfigError(f"topology.shard_host must be one of the emulated hosts 0..{tp.hosts - 1} (where ps-*'s "
                          f"shards run), got {tp.shard_host!r}")
    if tp.shard_host and not s.uses_ps:
        raise ConfigError(f"topology.shard_host places the parameter server's shards: it needs train.strategy = "
                          f"ps-*, not {s.label}")
    if t.backend != "zmq":
        raise ConfigError(f"[topology] is emulated by the zmq backend only (gloo has no emulation): set "
                          f"train.backend = zmq, not {t.backend!r}")
    world = t.workers * cfg.parallel.model_parallel
    if tp.hosts * tp.gpus_per_host != world:
        raise ConfigError(f"topology.hosts x gpus_per_host = {tp.hosts} x {tp.gpus_per_host} = "
                          f"{tp.hosts * tp.gpus_per_host} ranks, but the run has {world} (train.workers {t.workers} "
                          f"x model-parallel degree {cfg.parallel.model_parallel}): make them equal")
    split = cfg.parallel.model_parallel > 1 or cfg.parallel.zero > 0
    if cfg.faults.policy(s.kind, split) != "abort":
        raise ConfigError(f"[topology] places a fixed set of ranks on hosts: faults.on_failure = "
                          f"{cfg.faults.on_failure} would change the membership; set faults.on_failure = abort")


def validate_moe(w: WorkloadConfig, p: ParallelConfig) -> None:
    """workload.experts / top_k / capacity_factor / aux_weight: set only for the MoE workload, in range; ep | E."""
    moe = w.name == "text-moe"
    default = WorkloadConfig()
    if not moe:
        changed = [k for k in WorkloadConfig.MOE_KEYS if getattr(w, k) != getattr(default, k)]
        if changed:
            raise ConfigError(f"workload.{changed[0]} applies to the mixture-of-experts workload only: use "
                              f"workload.name = text-moe, or drop it")
        if p.ep > 1:
            raise ConfigError(f"parallel.ep = {p.ep} places the experts of MoE layers; workload {w.name!r} has none: "
                              "use workload.name = text-moe")
        return
    others = [f"{ax} = {getattr(p, ax)}" for ax in ("cp",) if getattr(p, ax) > 1] + \
        ([f"zero = {p.zero}"] if p.zero > 1 or (p.zero and p.model_parallel == 1) else [])
    if others:
        raise ConfigError(f"workload text-moe runs data, tensor, pipeline or expert parallel (parallel.tp, pp, ep; "
                          f"zero = 1 with them), not with {', '.join(others)}: set them to 1 (zero to 0 or 1)")
    if p.sp:
        raise ConfigError("parallel.sp would route each tp rank's sequence shard on its own, but text-moe's capacity "
                          "and load-balancing loss are per whole sequence: drop parallel.sp (tp without it runs)")
    _positive("workload.experts", w.experts)
    if w.experts > 256:
        raise ConfigError(f"workload.experts = {w.experts}: at most 256 experts per MoE layer here")
    if w.top_k not in (1, 2) or isinstance(w.top_k, bool):
        raise ConfigError(f"workload.top_k must be 1 or 2, got {w.top_k!r}")
    if w.top_k > w.experts:
        raise ConfigError(f"workload.top_k = {w.top_k} exceeds workload.experts = {w.experts}")
    if not (w.capacity_factor > 0 and math.isfinite(w.capacity_factor)):
        raise ConfigError(f"workload.capacity_factor must be a finite number > 0, e.g. 1.25, got {w.capacity_factor}")
    if not (w.aux_weight >= 0 and math.isfinite(w.aux_weight)):
        raise ConfigError(f"workload.aux_weight must be a finite number >= 0, got {w.aux_weight}")
    if w.batch_size % p.ep:
        raise ConfigError(f"parallel.ep = {p.ep} splits each worker's batch over its ep ranks: workload.batch_size = "
                          f"{w.batch_size} must be divisible by it")
    if w.experts % p.ep:
        raise ConfigError(f"parallel.ep = {p.ep} must divide workload.experts = {w.experts}: choose ep in "
                          f"{[d for d in range(1, w.experts + 1) if w.experts % d == 0]}")
