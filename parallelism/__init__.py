"""pslab's parallelism engines: data, tensor, pipeline, ZeRO sharding, activation checkpointing, over one mesh.

    mesh = DeviceMesh(world_group, dp=2, tp=2)                  # named axes; tp groups on adjacent ranks
    replica = TensorParallelEngine(loss_fn=lm_loss).build(model_factory, mesh)
    # or 3D: DeviceMesh(world, dp=2, pp=2, tp=2); PipelineEngine("1f1b", 4, loss_fn=lm_loss).build(...)
    # 4D: DeviceMesh(world, dp=2, pp=2, cp=2, tp=2), the same PipelineEngine (virtual_stages=2: interleaved)
    strategy = AllReduceStrategy(lambda ps: torch.optim.SGD(ps, lr=0.1))   # or a parameter-server strategy
    strategy.attach(replica)
    loss = train_step(replica, strategy, x, y)
    state = gather_full_state(replica, mesh)    # the full model's parameters on the mesh's rank 0, else None

A replica is the single-process model with the axes applied in one fixed order (`compose.py`), each step on its
own group of the mesh:

    1. pp  cut the model into stages of whole layers          talks on pp  (p2p at the cuts, same tp and cp coordinate;
           (interleaved: v chunks per stage)                               wrapping from the last stage to the first)
    2. tp  Attention / MLP → Megatron shards (+ sp)           talks on tp  (every block)
    3. cp  each tp rank's heads by ring attention             talks on cp  (K/V blocks; then gradients, loss)
    4. ep  each MoE layer's experts over the ep ranks         talks on ep  (all-to-alls; then gradients, loss)
    5. ac  activation checkpointing of the stage's layers     (its recompute replays steps 2, 3 and 4's messages)
    6. dp  the strategy averages the slots left               talks on dp  (once per step; ZeRO — 2-3 with tp too —,
                                                                            or the PS shards)
    An MoE model goes through every step but cp: under tp each expert's MLP is split like a dense one (the router
    replicated, so all tp ranks route alike), under ac its blocks return their load-balancing losses from the
    checkpoint. (not yet: cp with sp or ep; ep with cp; MoE with sp; ZeRO 2-3 with pp, sp, cp, ep.)

Files, one idea each:
    compose.py       the ordered axis steps above: one replica, dp × tp × pp × cp (4D), dp × tp × pp × ep
    engine.py        the seam: Engine → Replica (ParamSlot: full-model name, tensor, owner) → SyncStrategy
    mesh.py          dp × pp × cp × ep × tp layout and sub-groups (+ "mp": the ranks of one model replica)
    comm.py          per-engine bytes by kind and by site; the ordered communication thread
    data.py          bucketed, hook-driven, overlapped gradient all-reduce; no_sync()
    local_sgd.py     Local SGD and DiLoCo: local steps, the parameters (or the outer step) averaged every H steps
    compress.py      top-k, sign and PowerSGD compression of the gradients' all-reduce, with error feedback
    tensor.py        Megatron f/g, column/row-parallel Linear, TP MLP and attention
    sequence.py      sequence parallelism on the tp group: LayerNorm on sequence shards, all-gather/reduce-scatter
    ring_attention.py  ring attention: K/V blocks around the cp ring, online softmax, zig-zag causal balance
    context.py       context parallelism: the sequence split over cp ranks (the engine around ring attention)
    schedule.py      GPipe, 1F1B and interleaved 1F1B as data; (p−1)/(v·m+p−1); virtual-time replay
    pipeline.py      stages over send/recv, measured bubble and in-flight activations
    pipeline_measure.py  one padded step of a toy pipeline, its spans and bubble (pslab schedule --run)
    zero.py          ZeRO stages 0–3;  zero_memory.py  the paper's (2+2+K)Ψ … (4+K)Ψ/N formulas
    zero_pack.py     ZeRO's units, buckets and packed buffers: one collective per bucket or unit, not per parameter
    zero_partial.py  ZeRO under sp / cp: partial gradients summed (averaged) after backward, then reduce-scattered
    memory_model.py  bytes per GPU of a layout: model state (ZeRO), activations (Korthikanti et al.) — `pslab memory`
    cluster.py       a cluster for the planner: nodes of GPUs, memory, achieved FLOP/s, intra/inter links; presets
    comm_cost.py     where ranks sit (packed / spread) and the bytes per link and α-β seconds of each collective
    comm_model.py    bytes and α-β seconds per step of each kind of communication, per link class (textbook
                     ring rules, or pslab's own exact ones) under a placement of ranks on nodes
    step_model.py    step time of a layout: FLOPs (Narayanan et al. eq. 3), bubble, exposed comm, memory
    step_replay.py   the step replayed where ranks share CPU cores: programs of cpu / wait / messages, processor sharing
    planner.py       every layout of a model on a cluster, ranked by step time, explained — `pslab plan`
    published.py     Narayanan et al. 2021's Table 1 against the planner — `pslab plan --published`
    moe.py           a mixture-of-experts feed-forward: top-k router, GShard capacity and dropping, Switch aux loss
    expert.py        expert parallelism: experts over the ep ranks, all-to-all dispatch and combine
    checkpointing.py activation checkpointing and the saved-activation meter
    export.py        gather_full_state: the full single-process model reassembled from one replica's ranks
    snapshot.py      a rank's state as pieces of the full tensors (+ optimizer, RNG): capture / restore_into, re-cut
    snapshot_check.py  a snapshot read from a file validated against that schema before use
    state_io.py      sharded engine checkpoints: a file per rank, a manifest commits the step, load re-cuts them
    plot.py          the pipeline timeline picture (`pslab schedule`)
    models.py        small MLP and GPT-style models the engines are tested on

Imports point down only: this package uses `collectives`, never `ps` or `experiments`.
"""

from .checkpointing import ActivationMeter, CheckpointWrapper
from .comm import Comm, CommLog
from .data import DataParallel, DataParallelEngine, GradReducer
from .engine import (AllReduceStrategy, Engine, EngineError, LocalReplica, ParamSlot, Replica, SyncStrategy,
                     train_step)
from .export import gather_full_state
from .snapshot import SnapshotError, capture, restore_into
from .mesh import DeviceMesh, MeshError, MeshLayout
from .pipeline import PipelineEngine, PipelineReplica
from .pipeline_measure import bubble_fraction
from .context import ContextParallelEngine, ContextParallelReplica
from .ring_attention import ring_attention
from .sequence import SequenceParallelReplica
from .schedule import Action, PipelineSchedule, ScheduleError, gpipe, make_schedule, one_f_one_b, simulate
from .tensor import (ColumnParallelLinear, RowParallelLinear, TensorParallelAttention, TensorParallelEngine,
                     TensorParallelMLP, f, g)
from .zero import ZeroEngine, ZeroReplica, ZeroStrategy
from .zero_memory import StateBytes, zero_bytes_per_rank

__all__ = [
    "ActivationMeter", "CheckpointWrapper", "Comm", "CommLog", "DataParallel", "DataParallelEngine", "GradReducer",
    "AllReduceStrategy", "Engine", "EngineError", "LocalReplica", "ParamSlot", "Replica", "SyncStrategy",
    "train_step", "gather_full_state", "SnapshotError", "capture", "restore_into", "DeviceMesh", "MeshError", "MeshLayout", "PipelineEngine", "PipelineReplica",
    "bubble_fraction",
    "Action", "PipelineSchedule", "ScheduleError", "gpipe", "make_schedule", "one_f_one_b", "simulate",
    "ColumnParallelLinear", "RowParallelLinear", "TensorParallelAttention", "TensorParallelEngine",
    "TensorParallelMLP", "f", "g", "ZeroEngine", "ZeroReplica", "ZeroStrategy", "StateBytes",
    "zero_bytes_per_rank", "ContextParallelEngine", "ContextParallelReplica", "ring_attention",
    "SequenceParallelReplica",
]
