"""The `[faults]` section: what fails, when, and what the run does about it.

    [faults]
    on_failure = "auto"        # auto | abort | continue | shrink | replace
                               #   auto: ps-* continue with the survivors, allreduce shrinks (new ring at N-1),
                               #   local aborts; replace: shrink/continue, then a replacement worker joins (N again)
    detect_s = 3.0             # a process without a heartbeat for this long is failed (hung); a dead one at once
                               # (its pidfd); under load the bound widens to detect_s + 2 x the launcher's own poll
                               # lateness (collectives/launcher.py), except for a stopped process (state T);
                               # one still using CPU (busy, GIL-starved) is hung only past 10 x that bound
    heartbeat_s = 0.5          # how often every rank and shard beats (detect_s >= 2 x heartbeat_s)
    commit_every = 1           # allreduce: in-memory commit of model + optimizer every k steps (the rollback point)
    checkpoint_every = 0       # engine checkpoints to RUN_DIR/checkpoints every k steps (0: none)
    shard_checkpoint_every = 0 # PS shards checkpoint every k updates (and once at init) to RUN_DIR/shards (0: none:
                               # a dead shard then ends the run); a dead shard restarts from its latest one
    events = [ { kill = "worker:2", at_step = 50 },           # SIGKILL worker 2 when it starts step 50
               { kill = "shard:0", at_s = 3.0 },              # SIGKILL shard 0 three seconds after the start
               { stop = "worker:1", at_step = 20, for_s = 4 },   # SIGSTOP, SIGCONT 4 s later
               { leave = "worker:3", at_step = 30 } ]            # a planned departure (elastic scale-down)

One event: exactly one action key (kill | stop | leave) naming a target "worker:<w>" (data-parallel worker w; when
tp/pp/cp/ep split the model, its first rank, w x model-parallel size) or "shard:<i>" (slot group 0), and exactly one
trigger: at_step (workers only: when that worker begins the step) or at_s (seconds since the start
barrier); `stop` needs for_s > 0. `leave` (workers, at_step) is the planned twin of a kill: every member knows it
from the config, so the survivors change membership at that step boundary without a failure or a rollback -- the
reference a failure run is compared with. The same spec drives real runs (the supervisor sends the signals) and the
simulator (virtual time).

Events of a run (RUN_DIR/events.jsonl, one JSON object per line, EVENT_FIELDS): `event` is one of EVENTS,
`time_s` seconds since the start, `who` the target, and what applies of: how (signal / reason), generation and
world_size (membership after the event), step (the worker step it happened at / rolled back to), lost_steps,
lost_updates, detect_s (time from inject to detect), lr_step (allreduce: the step lr at the new world size), and for
a restarted shard restored_version, version_before, restart_s and checkpoint (the file it restarted from).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pslab.experiments.errors import ConfigError

ON_FAILURE = ("auto", "abort", "continue", "shrink", "replace")
ACTIONS = ("kill", "stop", "leave")
EVENTS = ("inject", "detect", "expel", "recover", "join", "leave", "shard_restart", "checkpoint_failed", "abort")
EVENT_FIELDS = ("time_s", "event", "who", "how", "generation", "world_size", "step", "lost_steps", "lost_updates",
                "detect_s", "lr_step", "restored_version", "version_before", "restart_s", "checkpoint")

NO_SHARD_CHECKPOINT = ("came back without parameters (no checkpoint to restore): set a shard checkpoint interval "
                       "([faults] shard_checkpoint_every = k) to survive a shard failure")   # supervisor, ps strategy


@dataclass(frozen=True)
class FaultEvent:
    """One injected fault (validated)."""

    action: str                 # kill | stop
    kind: str                   # worker | shard
    index: int
    at_step: int | None = None
    at_s: float | None = None
    for_s: float = 0.0

    @property
    def who(self) -> str:
        return f"{self.kind}:{self.index}"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {self.action: self.who}
        if self.at_step is not None:
            d["at_step"] = self.at_step
        if self.at_s is not None:
            d["at_s"] = self.at_s
        if self.action == "stop":
            d["for_s"] = self.for_s
        return d


@dataclass
class FaultsConfig:
    on_failure: str = "auto"
    detect_s: float = 3.0
    heartbeat_s: float = 0.5
    commit_every: int = 1
    checkpoint_every: int = 0
    shard_checkpoint_every: int = 0
    events: list = field(default_factory=list)

    def parsed(self) -> list[FaultEvent]:
        """The events as FaultEvent (validate() has checked them)."""
        return [parse_event(e, i) for i, e in enumerate(self.events)]

    def policy(self, strategy_kind: str, split: bool = False) -> str:
        """on_failure with `auto` resolved for this strategy: abort | continue | shrink | replace. `split`: the
        model is split over ranks (tp, pp or ZeRO), which only an engine checkpoint can re-cut: auto aborts."""
        from pslab.experiments.strategies.spec import PERIODIC_KINDS, PS_PERIODIC_KINDS
        if self.on_failure != "auto":
            return self.on_failure
        if strategy_kind in ("local",) + PERIODIC_KINDS + PS_PERIODIC_KINDS or split:   # periodic: not survived yet
            return "abort"
        return "shrink" if strategy_kind == "allreduce" else "continue"

    def validate(self, workers: int, shards: int, strategy_kind: str, steps: int | None = None) -> None:
        from pslab.experiments.strategies.spec import PS_PERIODIC_KINDS
        if self.on_failure not in ON_FAILURE:
            raise ConfigError(f"faults.on_failure must be one of {', '.join(ON_FAILURE)}, got {self.on_failure!r}")
        for key in ("detect_s", "heartbeat_s"):
            v = getattr(self, key)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and 0 < v <= 600):
                raise ConfigError(f"faults.{key} must be a number of seconds in (0, 600], got {v!r}")
        if self.detect_s < 2 * self.heartbeat_s:
            raise ConfigError(f"faults.detect_s = {self.detect_s:g} must be at least 2 x faults.heartbeat_s = "
                              f"{self.heartbeat_s:g} (one late beat is not a failure)")
        for key in ("commit_every",):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"faults.{key} must be a positive integer, got {v!r}")
        for key in ("checkpoint_every", "shard_checkpoint_every"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"faults.{key} must be an integer >= 0 (0: no checkpoints), got {v!r}")
        if self.checkpoint_every and strategy_kind.startswith("ps") and strategy_kind not in PS_PERIODIC_KINDS:
            raise ConfigError(f"faults.checkpoint_every writes engine checkpoints (allreduce, local); {strategy_kind} "
                              "checkpoints its shards: use faults.shard_checkpoint_every")
        if self.shard_checkpoint_every and not strategy_kind.startswith("ps"):
            raise ConfigError(f"faults.shard_checkpoint_every applies to parameter-server strategies (ps-*), not "
                              f"{strategy_kind}")
        policy = self.policy(strategy_kind)
        if strategy_kind == "local" and policy != "abort":
            raise ConfigError(f"strategy local is one process: faults.on_failure = {self.on_failure!r} needs "
                              "allreduce or ps-*; use abort (or auto)")
        if strategy_kind == "allreduce" and policy == "continue":
            raise ConfigError("faults.on_failure = continue: an all-reduce cannot go on without a member; use shrink "
                              "(rebuild the ring with the survivors), replace, or abort")
        if not isinstance(self.events, list):
            raise ConfigError(f"faults.events must be a list of tables, e.g. [{{kill = \"worker:2\", at_step = 50}}], "
                              f"got {self.events!r}")
        events = self.parsed()
        for i, e in enumerate(events):
            if steps is not None and e.at_step is not None and e.at_step >= steps:
                raise ConfigError(f"faults.events[{i}]: at_step = {e.at_step} is never reached: the run has "
                                  f"train.steps = {steps} (steps 0..{steps - 1})")
            for j, end in enumerate(events):        # nothing happens to a process after its kill or leave
                if j == i or end.who != e.who or end.action not in ("kill", "leave"):
                    continue
                later = (e.action in ("kill", "leave") and j < i) or \
                    (e.at_step is not None and end.at_step is not None and e.at_step > end.at_step) or \
                    (e.at_s is not None and end.at_s is not None and e.at_s > end.at_s)
                if later:
                    raise ConfigError(f"faults.events[{i}]: {e.who} is already gone by then (faults.events[{j}]: "
                                      f"{end.action}); a process takes one kill or leave, any stops before it")
            if e.kind == "worker" and not 0 <= e.index < workers:
                raise ConfigError(f"faults.events[{i}]: {e.who} is out of range (workers 0..{workers - 1})")
            if e.kind == "shard":
                if not strategy_kind.startswith("ps"):
                    raise ConfigError(f"faults.events[{i}]: {e.who} needs a parameter-server strategy (ps-*)")
                if not 0 <= e.index < shards:
                    raise ConfigError(f"faults.events[{i}]: {e.who} is out of range (shards 0..{shards - 1})")
            if e.action == "leave" and policy == "abort":
                raise ConfigError(f"faults.events[{i}]: leave needs an elastic run: faults.on_failure = shrink, "
                                  "continue or replace (auto for allreduce and ps-*)")
            if strategy_kind == "local" and e.kind == "worker":
                raise ConfigError(f"faults.events[{i}]: strategy local plays every worker in one process; "
                                  "inject worker faults into allreduce or ps-* runs")


def parse_event(e: Any, i: int = 0) -> FaultEvent:
    """One `[faults] events` entry -> FaultEvent, or ConfigError naming what is wrong."""
    where = f"faults.events[{i}]"
    if not isinstance(e, dict):
        raise ConfigError(f"{where} must be a table like {{kill = \"worker:2\", at_step = 50}}, got {e!r}")
    known = set(ACTIONS) | {"at_step", "at_s", "for_s"}
    unknown = sorted(set(e) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; keys are kill | stop | leave, at_step | at_s, for_s")
    acts = [a for a in ACTIONS if a in e]
    if len(acts) != 1:
        raise ConfigError(f"{where}: give exactly one of kill = \"worker:<w>\" | stop = \"worker:<w>\" | "
                          "leave = \"worker:<w>\" (kill and stop also take \"shard:<i>\")")
    action, target = acts[0], e[acts[0]]
    kind, sep, num = str(target).partition(":")
    if kind not in ("worker", "shard") or not sep or not num.isdigit():
        raise ConfigError(f"{where}: {action} = {target!r}: the target is \"worker:<w>\" or \"shard:<i>\"")
    trig = [k for k in ("at_step", "at_s") if k in e]
    if len(trig) != 1:
        raise ConfigError(f"{where}: give exactly one trigger: at_step (a worker's step) or at_s (seconds)")
    at_step = e.get("at_step")
    at_s = e.get("at_s")
    if at_step is not None and (isinstance(at_step, bool) or not isinstance(at_step, int) or at_step < 0):
        raise ConfigError(f"{where}: at_step must be an integer >= 0, got {at_step!r}")
    if action == "leave" and (kind != "worker" or at_step is None):
        raise ConfigError(f"{where}: leave is a worker's planned departure at a step: leave = \"worker:<w>\", "
                          "at_step = <n>")
    if at_step is not None and kind == "shard":
        raise ConfigError(f"{where}: shards have no steps: trigger {target} with at_s (seconds since the start)")
    if at_s is not None and (isinstance(at_s, bool) or not isinstance(at_s, (int, float)) or not
                             (math.isfinite(at_s) and at_s >= 0)):
        raise ConfigError(f"{where}: at_s must be a number of seconds >= 0, got {at_s!r}")
    for_s = e.get("for_s", 0.0)
    if action == "stop":
        if isinstance(for_s, bool) or not isinstance(for_s, (int, float)) or not (math.isfinite(for_s)
                                                                                  and 0 < for_s <= 3600):
            raise ConfigError(f"{where}: stop needs for_s, the seconds it stays stopped (0 < for_s <= 3600), "
                              f"got {for_s!r}")
    elif "for_s" in e:
        raise ConfigError(f"{where}: for_s applies to stop, not kill")
    return FaultEvent(action, kind, int(num), at_step, None if at_s is None else float(at_s), float(for_s))
