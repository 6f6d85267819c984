"""Consistency policies: when may a worker's read proceed, and how are pushes turned into updates.

Clocks. Worker w's clock c_w is the number of pushes it has made; its push for clock c is "stamped c", and its read
"at clock c" is the read that feeds the clock-c gradient. `min_clock` = min_w c_w (the slowest worker).

    ASP        a read never waits; every push is applied at once as one optimizer step (one version).
               Hogwild! (Niu et al. 2011) proves convergence for *sparse* updates touching few coordinates at a
               time; dense updates here are applied whole and serially, so ASP is plain asynchronous SGD.
    BSP        a read at clock c waits until every worker has pushed clock c-1 (min_clock >= c); the K gradients of
               clock c are averaged and applied as ONE step when the last arrives (so it equals local training on
               the concatenated K*b batch). Staleness is always 0.
    SSP(s)     (Ho et al., NIPS 2013) a read at clock c may proceed only while min_clock >= c - s, so no worker is
               ever more than s clocks ahead of the slowest. A read at clock c contains every update stamped
               <= c - s - 1.
               "ssp:s" is Ho et al.'s SSP: every push is applied at once as one step, as under ASP, so a worker
               always reads its own writes (read-my-writes) and fast workers move the model on without waiting for
               a straggler's clock; only the gate differs from ASP. Per-update staleness in versions is bounded by
               tau <= (K - 1)(2s + 1): at the read, every other worker has pushed >= c - s times; when the push
               lands, none has pushed more than c + s + 1 times. With lr eta/K, SSP(0) equals BSP(eta) for SGD
               (the K clock-c gradients are all computed on the version holding every clock c-1 push).
               "ssp-agg:s" (aggregate): clock c's gradients are averaged and applied as one step once all K have
               arrived, clocks in order -- exactly BSP's update, only the gate is looser, so ssp-agg:0 is BSP for
               every optimizer and tau <= s (in clocks = versions). A worker then sees its own writes only once
               their clock is complete, and the model only advances when the slowest worker completes a clock.
    BackupBSP  (Chen et al. 2016, "Revisiting distributed synchronous SGD") N + b workers; clock c is applied as the
               average of the FIRST N gradients stamped c; later ones are dropped and counted. A read at clock c
               waits until clock c-1 is committed; a worker that fell behind is moved up to the committed clock.

Staleness of an update: tau = (shard version when applied) - (version the gradient was computed on).
Averaged gradients are summed in worker order, not arrival order, so a run's floats do not depend on timing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ConfigError


@dataclass(frozen=True)
class Policy:
    """Base policy. `aggregate`: pushes of one clock are averaged into one step; else each push is one step."""

    name: str = field(default="policy", kw_only=True)
    aggregate: bool = field(default=False, kw_only=True)
    backups: int = field(default=0, kw_only=True)

    def may_read(self, clock: int, clocks: list[int], committed_clock: int) -> bool:
        """True if a read at `clock` may proceed given every worker's clock and the number of committed clocks."""
        raise NotImplementedError

    def bound(self) -> int | None:
        """How many clocks a worker may run ahead of the slowest (None: unbounded)."""
        return None

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class ASP(Policy):
    name: str = field(default="asp", kw_only=True)

    def may_read(self, clock: int, clocks: list[int], committed_clock: int) -> bool:
        return True


@dataclass(frozen=True)
class SSP(Policy):
    """Ho et al.'s SSP (eager=True: each push is one step, read-my-writes); eager=False: the aggregate variant."""

    staleness: int = 0
    eager: bool = True
    name: str = field(default="ssp", kw_only=True)
    aggregate: bool = field(default=True, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.staleness, int) or self.staleness < 0:
            raise ConfigError(f"SSP staleness bound must be an integer >= 0, got {self.staleness!r}")
        object.__setattr__(self, "aggregate", not self.eager)
        object.__setattr__(self, "name", f"ssp{'' if self.eager else '-agg'}:{self.staleness}")

    def may_read(self, clock: int, clocks: list[int], committed_clock: int) -> bool:
        return min(clocks) >= clock - self.staleness

    def bound(self) -> int | None:
        return self.staleness


@dataclass(frozen=True)
class BSP(SSP):
    """SSP with s = 0 and clock aggregation."""

    eager: bool = False

    def __post_init__(self) -> None:
        if self.staleness != 0 or self.eager:
            raise ConfigError("BSP has staleness 0 and aggregates each clock; use SSP(s) for a looser bound")
        super().__post_init__()
        object.__setattr__(self, "name", "bsp")


@dataclass(frozen=True)
class BackupBSP(Policy):
    backups: int = 1
    name: str = field(default="bsp-backup", kw_only=True)
    aggregate: bool = field(default=True, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.backups, int) or self.backups < 0:
            raise ConfigError(f"number of backup workers must be an integer >= 0, got {self.backups!r}")
        object.__setattr__(self, "name", f"bsp-backup:{self.backups}")

    def may_read(self, clock: int, clocks: list[int], committed_clock: int) -> bool:
        return committed_clock >= clock

    def bound(self) -> int | None:
        return 0


def policy_from_string(text: str | Policy) -> Policy:
    """Parse "asp", "bsp", "ssp:S" (Ho et al.), "ssp-agg:S" or "bsp-backup:B" (a Policy passes through unchanged)."""
    if isinstance(text, Policy):
        return text
    t = str(text).strip().lower()
    name, _, arg = t.partition(":")
    try:
        if name == "asp" and not arg:
            return ASP()
        if name == "bsp" and not arg:
            return BSP()
        if name in ("ssp", "ssp-agg") and arg:
            return SSP(staleness=int(arg), eager=name == "ssp")
        if name == "bsp-backup":
            return BackupBSP(backups=int(arg) if arg else 1)
    except ValueError:
        pass
    raise ConfigError(f"unknown consistency policy {text!r}; expected asp, bsp, ssp:S, ssp-agg:S or "
                      f"bsp-backup:B with integers S, B >= 0")
