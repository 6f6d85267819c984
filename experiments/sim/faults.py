"""Failures in virtual time: the `[faults]` events of a run (experiments/faults/spec.py) injected into the PS and the
all-reduce simulators, detected and recovered from as real runs do, and written to RUN_DIR/events.jsonl in the one
event schema (`spec.EVENT_FIELDS`).

Detection (the model of real runs: the supervisor watches exit codes and heartbeats):

    kill  (SIGKILL)   noticed by its parent at once:            t_detect = t_inject + EXIT_DETECT_S  (its poll period)
    stop  (SIGSTOP)   noticed when heartbeats stop:              t_detect = t_inject + faults.detect_s
                      a stop with for_s <= detect_s is no failure: the process only pauses for for_s (BSP stalls)

Recovery costs (seconds of virtual time; L = simulate latency of the link used, B = its bandwidth):

    membership change at the shards (ps-*)   T_member  = 2 L                     one control round trip
    ring rebuild (allreduce shrink)          T_ring    = RENDEZVOUS_RTTS x 2 L + RECONNECT_S
                                                         (agree on generation g+1 in the store, connect the new ring)
    replacement joins (replace)              T_join    = PROCESS_START_S + T_ring + M / B
                                                         (start a process, rendezvous, receive the model of M bytes
                                                          from a healthy peer, not from disk)
    shard restart (ps-*, shard kill)         T_restart = PROCESS_START_S + C / DISK_BPS
                                                         (start the shard, load its checkpoint of C bytes; C = the
                                                          initial state's size when shard_checkpoint_every = 0)

Semantics (what real runs do):
  - ps-asp / ps-ssp / ps-bsp (`continue`): the shards' membership (ps.ShardState.set_members, versioned by the
    generation) drops the dead worker at t_detect + T_member; until then the gates of ps-bsp / ps-ssp still wait for
    it (the visible stall), ps-asp never waits. Its buffered gradients are dropped; a clock already holding every
    remaining member's gradient is committed at that moment, averaged over the live G' with the step lr unchanged.
    A stopped worker that comes back after detection is expelled (its later pushes refused), unless on_failure =
    replace.
  - allreduce (`shrink`): at t_detect the survivors drop the step in progress, roll back to the last commit (every
    faults.commit_every completed steps, in memory: model + optimizer), rebuild the ring (T_ring) and continue with
    N - 1 workers; the per-worker batch is unchanged and the step lr follows train.lr_rule at the new size
    (`spec.step_lr` with G = N - 1). lost_steps = completed steps - committed steps.
  - `replace`: a replacement for the failed slot (same worker id, so the same data) joins at t_detect + T_join, at
    the next step boundary (allreduce) or at the shards' rejoin clock (ps-*: ShardState.rejoin_clock, the committed
    clock under aggregating policies, else the slowest live worker's), from which it runs the slot's remaining
    steps. A stopped worker that returns before its
    replacement has joined is re-admitted instead (the replacement is not started); after, it is expelled.
  - shard kill (ps-*): messages to the dead shard are lost; at t_detect + T_restart it is back with its latest
    checkpoint (taken every faults.shard_checkpoint_every applied updates; 0: its initial state, i.e. every update
    lost) and every worker resyncs: it drops the step in flight and adopts the shard's clock (client.resync()), so
    it redoes the steps the shard lost. lost_updates = version at the kill - checkpoint version <= the interval.
    The simulator models this with train.shards = 1 (several shards would need per-shard clocks per worker).

`leave` (a planned departure at a step): no failure and no detection; the membership changes at that boundary
(ps-*: once the shards have the leaver's last push; allreduce: after T_ring, nothing rolled back) and a `leave`
event records it -- the reference a failure run is compared with.

Determinism: fault events are heap events with sequence numbers like any other; the same config gives
byte-identical metrics.jsonl and events.jsonl.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

from pslab.experiments.config import RunConfig, SimulateConfig
from pslab.experiments.errors import ExperimentError
from pslab.experiments.faults.spec import FaultEvent
from pslab.ps import ShardState

EXIT_DETECT_S = 0.05        # the launcher polls its children's exit codes every 50 ms (collectives/launcher.py)
PROCESS_START_S = 1.0       # a fresh rank or shard: Python + torch imports, connect
RENDEZVOUS_RTTS = 2         # round trips to the rendezvous store to agree on a new generation
RECONNECT_S = 0.02          # connecting the new ring's sockets
DISK_BPS = 500e6            # checkpoint read bandwidth (bytes/s): a local SSD


def link(sim: SimulateConfig, multi_host: bool) -> tuple[float, float]:
    """(latency, bandwidth) of the link recovery traffic uses."""
    return (sim.latency_inter_s, sim.bandwidth_inter_Bps) if multi_host else (sim.latency_intra_s,
                                                                              sim.bandwidth_intra_Bps)


def detect_delay(ev: FaultEvent, detect_s: float) -> float | None:
    """Seconds from inject to detect (None: a stop no longer than detect_s is a pause, not a failure)."""
    if ev.action == "kill":
        return EXIT_DETECT_S
    return detect_s if ev.for_s > detect_s else None


def membership_s(sim: SimulateConfig, multi_host: bool) -> float:
    return 2 * link(sim, multi_host)[0]


def ring_rebuild_s(sim: SimulateConfig, multi_host: bool) -> float:
    return RENDEZVOUS_RTTS * 2 * link(sim, multi_host)[0] + RECONNECT_S


def join_s(sim: SimulateConfig, multi_host: bool, model_bytes: int) -> float:
    lat, bw = link(sim, multi_host)
    return PROCESS_START_S + ring_rebuild_s(sim, multi_host) + lat + model_bytes / bw


def shard_restart_s(checkpoint_bytes: int) -> float:
    return PROCESS_START_S + checkpoint_bytes / DISK_BPS


def check_supported(cfg: RunConfig) -> None:
    """Raise ExperimentError for fault configs the simulator does not model (with what to do instead)."""
    events = cfg.faults.parsed()
    if not events:
        return
    if cfg.faults.policy(cfg.strategy.kind) == "abort":
        raise ExperimentError("faults.on_failure = abort ends the run at the first failure; the simulator models "
                              "surviving it: use auto (or continue / shrink / replace)")
    if cfg.strategy.uses_ps and cfg.simulate.timing_only:
        raise ExperimentError("[faults] events are simulated with gradients (the PS training simulator), not in "
                              "timing-only mode: drop --timing-only (allreduce supports both)")
    if any(e.kind == "shard" for e in events) and cfg.train.shards != 1:
        raise ExperimentError(f"a shard kill is simulated with train.shards = 1 (got {cfg.train.shards}): resync "
                              "across several shards is not modelled; use --set train.shards=1 or a real run")


def snapshot(st: ShardState) -> tuple[dict[str, torch.Tensor], dict[str, Any], int]:
    """A shard checkpoint in memory: (tensors cloned, metadata, bytes a checkpoint file would hold)."""
    tensors, meta = st.state_dict()
    tensors = {k: v.detach().clone() for k, v in tensors.items()}
    return tensors, meta, sum(int(v.numel()) * v.element_size() for v in tensors.values())


def restore(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], members: Iterable[int],
            generation: int) -> ShardState:
    """The shard restarted from a snapshot, told the current membership (generation `generation`)."""
    st = ShardState.from_state_dict({k: v.clone() for k, v in tensors.items()}, meta)
    st.set_members(sorted(members), generation)
    return st
