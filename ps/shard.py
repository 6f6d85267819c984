"""The sans-IO shard: named flat parameters, their optimizer state, a version counter, every worker's clock, the
consistency gate and the staleness statistics. No sockets and no clock of its own: the ZeroMQ server loop and the
experiments' discrete-event simulator both drive this object and pass `now` when they want time series.

Driving it:
    if st.may_read(w, c, now):  r = st.read(w, c, now)      # else park the request, retry after every push
    res = st.push(w, c, r.version, grads, now)               # then retry parked reads

Versions. Each optimizer step bumps `version` by one: one per push under ASP / eager SSP, one per clock under BSP /
SSP / backup-BSP. Staleness of an update: tau = version (before the step) - version the gradient was read at.
Read guarantee (SSP(s)): a read at clock c is allowed only when min_w clock_w >= c - s, and then contains every
update stamped <= c - s - 1 (aggregate mode: version == number of complete clocks >= c - s).
Membership (`set_members`, versioned; versions only increase; each change appended to `membership_log`): the gates
and the clock commit of aggregating policies count only the live members, so a read blocked only by a removed worker
proceeds and a clock commits when every live worker pushed it, averaged over those G' live gradients with the
configured step lr unchanged (under `linear`, lr x K fixed at start: the per-gradient lr becomes lr x K / G'; the
log records G'). A removed worker's buffered gradients are dropped; its pushes and reads are refused
(NotAMemberError). Re-admitted (a later `set_members` naming it again), it starts at `rejoin_clock()`: the committed
clock under aggregating policies, the slowest live worker's clock otherwise.
A push is validated completely before anything changes: all-or-nothing. A push holding NaN/Inf is refused
(NonFiniteGradientError naming the tensor) or, with push(..., skip_nonfinite=True), skipped: the worker's clock
advances and nothing is applied (an aggregating policy averages that clock over the gradients it did get).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import torch

from . import flat
from .consistency import Policy, policy_from_string
from .errors import (ClockError, ConfigError, MembershipError, NonFiniteGradientError, NotAMemberError, ProtocolError,
                     ShapeError, UnknownKeyError)
from .optim import Contribution, OptimizerSpec, ServerOptimizer, optimizer_from_string
from .staleness import StalenessStats


@dataclass
class ReadResult:
    version: int
    clock: int                                  # the worker's clock after the read (backup-BSP may move it up)
    params: dict[str, torch.Tensor]             # copies, flat or in the shape given at construction
    committed_clock: int = 0


@dataclass
class PushResult:
    status: str                                 # "applied" | "buffered" | "dropped"
    version: int                                # shard version after this push
    clock: int                                  # the worker's clock after this push
    staleness: list[tuple[int, int]] = field(default_factory=list)   # (worker, tau) of updates applied now


def _as_tensor(v: Any) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        return v.detach().to("cpu").clone().contiguous()
    return torch.from_numpy(np.array(v, copy=True, order="C"))


def _all_finite(v: Any) -> bool:
    """No NaN or Inf, without a copy: NaN and Inf propagate through a sum, so a finite sum (one vectorised pass,
    ~0.05 ms per 1M float32) proves every element finite; only a non-finite sum (or a finite-value overflow) takes
    the exact element-wise check."""
    if isinstance(v, torch.Tensor):     # .item() + math.isfinite: ~3 µs a tensor, torch.isfinite + bool: ~9 µs
        return math.isfinite(v.sum().item()) or bool(torch.isfinite(v).all())
    return bool(np.isfinite(np.sum(v))) or bool(np.isfinite(v).all())


def _dtype_name(v: Any) -> str:
    return str(v.dtype).replace("torch.", "")


class ShardState:
    """One shard's parameters, optimizer state, versions, clocks, consistency gate and staleness stats."""

    def __init__(self, params: Mapping[str, Any], optimizer: OptimizerSpec | str = "sgd",
                 policy: Policy | str = "asp", num_workers: int = 1, *, shard_id: int = 0,
                 initial_version: int = 0) -> None:
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ConfigError(f"num_workers must be an integer >= 1, got {num_workers!r}")
        self.policy = policy_from_string(policy)
        if self.policy.backups >= num_workers:
            raise ConfigError(f"{self.policy} needs more workers than backups: got {num_workers} workers")
        if not params:
            raise ConfigError("a shard needs at least one parameter")
        self.spec = optimizer_from_string(optimizer)
        self.num_workers = num_workers
        self.shard_id = shard_id
        self.params: dict[str, torch.Tensor] = {}
        for k, v in params.items():
            t = _as_tensor(v)
            if not t.is_floating_point():
                raise ConfigError(f"parameter {k!r} has dtype {t.dtype}; the optimizers need floating point")
            self.params[str(k)] = t
        self.params = flat.pack(self.params)      # one buffer per dtype: runs of tensors take one torch call
        self._flat: dict[str, torch.Tensor] | None = None   # flat_params()' views, until unshare_params
        self._runs = flat.RunCache()
        self._fused: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.shapes = {k: tuple(t.shape) for k, t in self.params.items()}
        self.optimizer = ServerOptimizer(self.spec, self.params)
        self.version = int(initial_version)
        self.clocks = [0] * num_workers
        self._committed = 0
        # clock -> worker -> (gradients, or None for a skipped push; version read; DC backup)
        self.pending: dict[int, dict[int, tuple[dict[str, torch.Tensor] | None, int, Any]]] = {}
        self.backups: dict[int, dict[str, torch.Tensor]] = {}
        self._blocked_since: dict[tuple[int, int], float | None] = {}
        self.stats = StalenessStats(num_workers)
        self.reads = 0
        self.pushes = 0
        self.members: list[int] = list(range(num_workers))     # live workers, sorted
        self.membership_version = 0
        self.membership_log: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ membership
    def live_clocks(self) -> list[int]:
        return [self.clocks[w] for w in self.members]

    def rejoin_clock(self) -> int:
        """Where a (re-)admitted worker starts: the committed clock (aggregating policies), else the slowest live
        worker's clock."""
        if self.policy.aggregate:
            return self._committed
        live = self.live_clocks()
        return min(live) if live else max(self.clocks)

    def set_members(self, alive: Any, version: Any, now: float | None = None) -> list[tuple[int, int]]:
        """Make `alive` (worker ids) the membership, numbered `version` (> the current one; the same version with
        the same set is a no-op). Removed workers' buffered gradients are dropped; re-admitted ones start at
        `rejoin_clock()`; clocks now complete with the live workers commit. Returns the (worker, tau) applied."""
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise MembershipError(f"membership version must be an integer >= 0, got {version!r:.40}")
        if not isinstance(alive, (list, tuple)) or not all(isinstance(w, int) and not isinstance(w, bool)
                                                           and 0 <= w < self.num_workers for w in alive):
            raise MembershipError(f"members must be a list of worker ids in 0..{self.num_workers - 1}, got "
                                  f"{alive!r:.80}")
        members = sorted(set(alive))
        if version == self.membership_version and members == self.members:
            return []
        if version <= self.membership_version:
            raise MembershipError(f"membership version {version} is not newer than shard {self.shard_id}'s "
                                  f"{self.membership_version}: generations only increase")
        if len(members) <= self.policy.backups:
            raise MembershipError(f"{self.policy} needs more than {self.policy.backups} live workers; got "
                                  f"{members}")
        removed = [w for w in self.members if w not in members]
        added = [w for w in members if w not in self.members]
        for contribs in self.pending.values():
            for w in removed:
                contribs.pop(w, None)
        self.members = [w for w in members if w not in added]     # where the newcomers start: the others' clock
        start = self.rejoin_clock() if self.members else max(self.clocks)
        self.members = members
        for w in added:
            self.clocks[w] = start
            self.backups.pop(w, None)
        self._blocked_since = {k: v for k, v in self._blocked_since.items() if k[0] in members}
        self.membership_version = version
        applied = self._commit_ready(now) if self.policy.aggregate else []
        self.membership_log.append({"version": version, "members": members, "removed": removed, "added": added,
                                    "rejoin_clock": start, "committed": self.committed_clock,
                                    "shard_version": self.version, "gradients_per_step": self._needed(),
                                    "time": now})
        return applied

    def _check_member(self, worker: int, what: str) -> None:
        if worker not in self.members:
            raise NotAMemberError(f"worker {worker} is not a member of shard {self.shard_id}'s membership version "
                                  f"{self.membership_version} (live: {self.members}); its {what} is refused: the "
                                  "job's controller re-admits it (set_members), then the worker calls resync()")

    def _needed(self) -> int:
        """Gradients that complete a clock: the live workers less the backups."""
        return max(1, len(self.members) - self.policy.backups)

    # ------------------------------------------------------------------ queries
    @property
    def keys(self) -> list[str]:
        return list(self.params)

    @property
    def committed_clock(self) -> int:
        """Clocks whose updates are all applied (aggregate modes); min worker clock otherwise."""
        return self._committed if self.policy.aggregate else min(self.clocks)

    def _check_worker(self, worker: Any) -> int:
        if not isinstance(worker, int) or isinstance(worker, bool) or not 0 <= worker < self.num_workers:
            raise ProtocolError(f"worker id {worker!r} is not registered: this shard serves workers "
                                f"0..{self.num_workers - 1}")
        return worker

    def _check_clock(self, worker: int, clock: Any, what: str) -> int:
        if not isinstance(clock, int) or isinstance(clock, bool) or clock != self.clocks[worker]:
            raise ClockError(f"{what} from worker {worker} is stamped clock {clock!r} but the worker is at clock "
                             f"{self.clocks[worker]} on shard {self.shard_id}; pushes must advance one clock at a time")
        return clock

    def may_read(self, worker: int, clock: int, now: float | None = None) -> bool:
        """Whether worker's read at `clock` may proceed now; a refusal remembers `now` to measure the wait."""
        self._check_clock(self._check_worker(worker), clock, "read")
        self._check_member(worker, "read")
        ok = self.policy.may_read(clock, self.live_clocks(), self._committed)
        if not ok:
            self._blocked_since.setdefault((worker, clock), now)
        return ok

    def blocking_workers(self, clock: int) -> list[int]:
        """Workers whose progress a read at `clock` is waiting for (empty if it may proceed)."""
        if self.policy.may_read(clock, self.live_clocks(), self._committed):
            return []
        bound = self.policy.bound() or 0
        if self.policy.backups:
            return [w for w in self.members if self.clocks[w] <= self._committed]
        return [w for w in self.members if self.clocks[w] < clock - bound]

    # ------------------------------------------------------------------ read
    def read(self, worker: int, clock: int, now: float | None = None, *, copy: bool = True) -> ReadResult:
        """Answer a pull (call only when `may_read` is True); records the gate wait of this read."""
        if not self.may_read(worker, clock, now):
            raise ProtocolError(f"worker {worker}'s read at clock {clock} is not allowed yet under {self.policy}; "
                                f"waiting for workers {self.blocking_workers(clock)} (check may_read first)")
        t0 = self._blocked_since.pop((worker, clock), "never")
        waited = 0.0 if t0 == "never" or t0 is None or now is None else max(0.0, now - t0)
        self.stats.record_wait(worker, waited)
        if self.policy.backups and self.clocks[worker] < self._committed:
            self.clocks[worker] = self._committed          # a straggler joins the current clock
        if self.spec.delay_compensated:
            self.backups[worker] = {k: p.clone() for k, p in self.params.items()}
        out = {k: (p.clone() if copy else p) for k, p in self.params.items()}
        self.reads += 1
        return ReadResult(self.version, self.clocks[worker], out, self.committed_clock)

    # ------------------------------------------------------------------ push
    def validate_push(self, worker: int, clock: int, read_version: int, grads: Mapping[str, Any]) -> None:
        """Raise a ProtocolError subclass if the push is not acceptable; changes nothing."""
        self._check_clock(self._check_worker(worker), clock, "push")
        self._check_member(worker, "push")
        if not isinstance(read_version, int) or isinstance(read_version, bool) or not 0 <= read_version <= self.version:
            raise ProtocolError(f"push from worker {worker} claims read version {read_version!r}, but shard "
                                f"{self.shard_id} is at version {self.version}")
        unknown = [k for k in grads if k not in self.params]
        if unknown:
            raise UnknownKeyError(f"shard {self.shard_id} does not own parameter(s) {sorted(unknown)[:5]}; "
                                  f"it owns {sorted(self.params)[:8]}")
        missing = [k for k in self.params if k not in grads]
        if missing:
            raise ProtocolError(f"push must carry a gradient for every parameter of shard {self.shard_id}; "
                                f"missing {sorted(missing)[:5]}")
        for k, g in grads.items():
            p = self.params[k]
            if tuple(g.shape) not in (self.shapes[k], (p.numel(),)):
                raise ShapeError(f"gradient {k!r} has shape {tuple(g.shape)}, expected {self.shapes[k]}")
            if _dtype_name(g) != _dtype_name(p):
                raise ShapeError(f"gradient {k!r} has dtype {_dtype_name(g)}, expected {_dtype_name(p)}")
        if self.fused(grads) is not None:   # one check per run of adjacent gradients (ps.flat)
            if all(_all_finite(g) for _, g in self._fused):
                return
            self._fused = None
        for k, g in grads.items():     # a finite sum proves every element finite; else the exact check says which
            if not _all_finite(g):
                raise NonFiniteGradientError(f"gradient {k!r} from worker {worker} at clock {clock} holds NaN or "
                                             f"Inf: push refused, parameters unchanged (lower the learning rate?)")

    def fused(self, grads: Mapping[str, Any]) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """(parameter, gradient) flat pairs, merged into runs where both sides are adjacent (ps.flat), for
        gradients that are all torch tensors of this shard's keys, shapes and dtypes (check those first); else
        None. Remembered as `self._fused` for the optimizer step of the same push."""
        self._fused = None
        if len(grads) == len(self.params) and all(isinstance(g, torch.Tensor) for g in grads.values()):
            keys = list(grads)
            self._fused = self._runs.get([self.params[k] for k in keys], [grads[k] for k in keys])
        return self._fused

    def push(self, worker: int, clock: int, read_version: int, grads: Mapping[str, Any],
             now: float | None = None, *, skip_nonfinite: bool = False) -> PushResult:
        """Apply (or buffer, or drop) one worker's gradients for `clock`, computed on `read_version`.
        `skip_nonfinite`: a push holding NaN/Inf is skipped (status "skipped": the worker's clock advances, nothing
        is applied; under aggregating policies its clock completes without it) instead of refused."""
        try:
            self.validate_push(worker, clock, read_version, grads)
        except NonFiniteGradientError:
            if not skip_nonfinite:
                raise
            grads = None
        self.pushes += 1
        backup = self.backups.get(worker)
        if not self.policy.aggregate:
            self.clocks[worker] += 1
            if grads is None:
                return PushResult("skipped", self.version, self.clocks[worker])
            tau = self.version - read_version
            runs, self._fused = self._fused, None          # (views of the push: not kept beyond it)
            self.optimizer.step([Contribution(grads, tau, backup, runs)])
            self.stats.record(worker, tau, self.version, now)
            self.version += 1
            return PushResult("applied", self.version, self.clocks[worker], [(worker, tau)])
        self.clocks[worker] += 1
        self._fused = None
        if clock < self._committed:                      # backup-BSP: this clock was completed without it
            self.stats.record_drop(worker)
            return PushResult("dropped", self.version, self.clocks[worker])
        grads_copy = None if grads is None else {k: _as_tensor(g).reshape(self.shapes[k]) for k, g in grads.items()}
        self.pending.setdefault(clock, {})[worker] = (grads_copy, read_version, backup)
        applied = self._commit_ready(now)
        status = "skipped" if grads is None else "applied" if applied else "buffered"
        return PushResult(status, self.version, self.clocks[worker], applied)

    def _commit_ready(self, now: float | None) -> list[tuple[int, int]]:
        needed = self._needed()
        applied: list[tuple[int, int]] = []
        while len(self.pending.get(self._committed, ())) >= needed:
            contribs = self.pending.pop(self._committed)    # only live members' (removal drops the others')
            chosen = sorted(list(contribs.items())[:needed])   # the first N to arrive, summed in worker order so
                                                               # the float result does not depend on arrival order
            steps, now_applied = [], []
            for w, (g, read_version, backup) in chosen:
                if g is None:                                  # a skipped (non-finite) push: counted, not averaged
                    continue
                tau = self.version - read_version
                steps.append(Contribution(g, tau, backup))
                now_applied.append((w, tau))
            if steps:
                self.optimizer.step(steps)
            for w, tau in now_applied:
                self.stats.record(w, tau, self.version, now)
            applied += now_applied
            self.version += 1
            self._committed += 1
        return applied

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(named tensors, msgpack-able metadata) holding everything needed to resume exactly."""
        tensors: dict[str, torch.Tensor] = {f"param\x00{k}": p for k, p in self.params.items()}
        opt_t, opt_meta = self.optimizer.state_tensors()
        tensors.update({f"opt\x00{k}": v for k, v in opt_t.items()})
        pending_meta = []
        for clock, contribs in self.pending.items():
            for w, (grads, read_version, _) in contribs.items():
                pending_meta.append([clock, w, read_version] if grads is not None else [clock, w, read_version, 1])
                tensors.update({f"pend\x00{clock}\x00{w}\x00{k}": g for k, g in (grads or {}).items()})
        for w, b in self.backups.items():
            tensors.update({f"bak\x00{w}\x00{k}": t for k, t in b.items()})
        meta = {"version": self.version, "clocks": list(self.clocks), "committed": self._committed,
                "policy": str(self.policy), "num_workers": self.num_workers, "shard_id": self.shard_id,
                "shapes": {k: list(s) for k, s in self.shapes.items()}, "optimizer": opt_meta,
                "pending": pending_meta, "backups": sorted(self.backups), "stats": self.stats.state(),
                "reads": self.reads, "pushes": self.pushes,
                "members": list(self.members), "membership_version": self.membership_version}
        return tensors, meta

    @classmethod
    def from_state_dict(cls, tensors: Mapping[str, Any], meta: Mapping[str, Any]) -> "ShardState":
        params = {k: torch.as_tensor(tensors[f"param\x00{k}"]).reshape(s) for k, s in meta["shapes"].items()}
        st = cls(params, OptimizerSpec.from_dict(meta["optimizer"]["spec"]), meta["policy"], meta["num_workers"],
                 shard_id=meta["shard_id"], initial_version=meta["version"])
        opt_t = {k[4:]: v for k, v in tensors.items() if k.startswith("opt\x00")}
        st.optimizer.load_state_tensors(opt_t, meta["optimizer"])
        st.clocks = [int(c) for c in meta["clocks"]]
        st._committed = int(meta["committed"])
        for w in meta["backups"]:
            st.backups[int(w)] = {k: _as_tensor(tensors[f"bak\x00{w}\x00{k}"]) for k in params}
        for clock, w, rv, *skipped in meta["pending"]:      # [clock, w, rv] or [clock, w, rv, 1] (a skipped push)
            grads = None if skipped and skipped[0] else {k: _as_tensor(tensors[f"pend\x00{clock}\x00{w}\x00{k}"]).reshape(
                st.shapes[k]) for k in params}
            st.pending.setdefault(int(clock), {})[int(w)] = (grads, int(rv), st.backups.get(int(w)))
        st.stats = StalenessStats.from_state(st.num_workers, meta["stats"])
        st.reads, st.pushes = int(meta.get("reads", 0)), int(meta.get("pushes", 0))
        st.members = sorted(int(w) for w in meta.get("members", range(st.num_workers)))
        st.membership_version = int(meta.get("membership_version", 0))
        return st

    def unshare_params(self) -> None:
        """Give every parameter fresh storage (copy-on-write): buffers handed out by `read(copy=False)` keep the
        old values while later pushes update the new ones. The optimizer state is unaffected."""
        flat.repack(self.params)
        self._flat = None

    def flat_params(self) -> dict[str, torch.Tensor]:
        """Every parameter as a 1-D view of its current storage: the same view objects read after read, until
        `unshare_params` (so the reply's copy runs are found at once, ps.flat.RunCache)."""
        if self._flat is None:
            self._flat = {k: (p if p.dim() == 1 else p.view(-1)) for k, p in self.params.items()}
        return self._flat

    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params.values())

    def __repr__(self) -> str:
        return (f"ShardState(shard={self.shard_id}, keys={len(self.params)}, bytes={self.param_bytes()}, "
                f"policy={self.policy}, version={self.version}, clocks={self.clocks})")

