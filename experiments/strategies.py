"""Synchronisation strategies, selected by one config string.

    local              single process; with K workers it averages the K workers' gradients per step
                       (large-batch SGD — what BSP must reproduce)
    allreduce          ring all-reduce BSP over `collectives` (backend zmq or torch)
    ps-bsp             parameter server, bulk synchronous: read at clock c waits for all clock c-1 pushes
    ps-asp             parameter server, asynchronous: nobody waits
    ps-ssp:<s>         stale synchronous parallel, bound s >= 0 (s = 0 is BSP)
    ps-bsp-backup:<b>  BSP that proceeds on the first N of N+b gradients per clock (b >= 1 backup workers)
"""

from __future__ import annotations

from dataclasses import dataclass

from experiments.errors import ConfigError

KINDS = ("local", "allreduce", "ps-bsp", "ps-asp", "ps-ssp", "ps-bsp-backup")
_HELP = "local, allreduce, ps-bsp, ps-asp, ps-ssp:<s>, ps-bsp-backup:<b>"


@dataclass(frozen=True)
class Strategy:
    kind: str
    staleness: int | None = None  # ps-ssp
    backup: int | None = None     # ps-bsp-backup

    @property
    def uses_ps(self) -> bool:
        return self.kind.startswith("ps-")

    @property
    def consistency(self) -> str:
        """The PS consistency model name: asp, bsp, ssp, bsp-backup."""
        return self.kind[3:] if self.uses_ps else ""

    @property
    def label(self) -> str:
        if self.kind == "ps-ssp":
            return f"ps-ssp:{self.staleness}"
        if self.kind == "ps-bsp-backup":
            return f"ps-bsp-backup:{self.backup}"
        return self.kind

    def __str__(self) -> str:
        return self.label


def _int_arg(text: str, arg: str, what: str) -> int:
    try:
        v = int(arg)
    except ValueError:
        raise ConfigError(f"strategy {text!r}: {what} must be an integer, got {arg!r}") from None
    return v


def parse_strategy(text: str) -> Strategy:
    """Parse e.g. 'ps-ssp:4'; raises ConfigError naming the allowed forms."""
    t = str(text).strip().lower()
    kind, _, arg = t.partition(":")
    if kind not in KINDS:
        raise ConfigError(f"unknown strategy {text!r}; choose one of: {_HELP}")
    if kind == "ps-ssp":
        if not arg:
            raise ConfigError(f"strategy {text!r} needs a staleness bound, e.g. ps-ssp:2")
        s = _int_arg(text, arg, "the staleness bound")
        if s < 0:
            raise ConfigError(f"strategy {text!r}: staleness bound must be >= 0, got {s}")
        return Strategy(kind, staleness=s)
    if kind == "ps-bsp-backup":
        if not arg:
            raise ConfigError(f"strategy {text!r} needs a number of backup workers, e.g. ps-bsp-backup:1")
        b = _int_arg(text, arg, "the number of backup workers")
        if b < 1:
            raise ConfigError(f"strategy {text!r}: number of backup workers must be >= 1, got {b}")
        return Strategy(kind, backup=b)
    if arg:
        raise ConfigError(f"strategy {kind!r} takes no argument (got {text!r}); choose one of: {_HELP}")
    return Strategy(kind)
