"""Synchronisation strategies, selected by one config string, and the one optimizer spec every strategy uses.

    local              single process; with K workers it averages the K workers' gradients per step
                       (large-batch SGD — what BSP must reproduce)
    allreduce          ring all-reduce BSP over `collectives` (backend zmq or torch)
    ps-bsp             parameter server, bulk synchronous: read at clock c waits for all clock c-1 pushes
    ps-asp             parameter server, asynchronous: nobody waits
    ps-ssp:<s>         stale synchronous parallel, bound s >= 0 (s = 0 is BSP)
    ps-bsp-backup:<b>  BSP that proceeds on the first N of N+b gradients per clock (b >= 1 backup workers)

The optimizer is described once, as `ps.OptimizerSpec` (`optimizer_spec(train)`): the shards run it server-side,
and `local` / `allreduce` build the same torch.optim optimizer from it (`torch_optimizer`), so a comparison never
re-types its hyper-parameters. The simulator and the Dai emulator take the same spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

import torch

from experiments.errors import ConfigError

if TYPE_CHECKING:
    from experiments.config import TrainConfig
    from ps.optim import OptimizerSpec

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
    def policy(self) -> str:
        """The shards' consistency policy in `ps.policy_from_string` syntax: 'ps-ssp:3' -> 'ssp:3'."""
        if not self.uses_ps:
            raise ConfigError(f"{self.label} is not a parameter-server strategy")
        return self.label[3:]

    @property
    def label(self) -> str:
        if self.kind == "ps-ssp":
            return f"ps-ssp:{self.staleness}"
        if self.kind == "ps-bsp-backup":
            return f"ps-bsp-backup:{self.backup}"
        return self.kind

    def __str__(self) -> str:
        return self.label


# strategies that take an integer argument: kind -> (what it is, its minimum, an example)
_ARGS = {"ps-ssp": ("a staleness bound", 0, "ps-ssp:2"), "ps-bsp-backup": ("a number of backup workers", 1,
                                                                          "ps-bsp-backup:1")}


def parse_strategy(text: str) -> Strategy:
    """Parse e.g. 'ps-ssp:4'; raises ConfigError naming the allowed forms."""
    t = str(text).strip().lower()
    kind, _, arg = t.partition(":")
    if kind not in KINDS:
        raise ConfigError(f"unknown strategy {text!r}; choose one of: {_HELP}")
    if kind not in _ARGS:
        if arg:
            raise ConfigError(f"strategy {kind!r} takes no argument (got {text!r}); choose one of: {_HELP}")
        return Strategy(kind)
    what, least, example = _ARGS[kind]
    if not arg:
        raise ConfigError(f"strategy {text!r} needs {what}, e.g. {example}")
    try:
        n = int(arg)
    except ValueError:
        raise ConfigError(f"strategy {text!r}: {what[2:]} must be an integer, got {arg!r}") from None
    if n < least:
        raise ConfigError(f"strategy {text!r}: {what[2:]} must be >= {least}, got {n}")
    return Strategy(kind, staleness=n) if kind == "ps-ssp" else Strategy(kind, backup=n)


def optimizer_spec(t: "TrainConfig") -> "OptimizerSpec":
    """The run's optimizer as the one spec type (`ps.OptimizerSpec`) that every strategy consumes."""
    from ps.optim import OptimizerSpec
    return OptimizerSpec(name=t.optimizer, lr=t.lr, momentum=t.momentum, betas=tuple(t.betas),
                         staleness_lr=t.staleness_lr, dc_lambda=t.dc_lambda if t.dc_asgd else None,
                         dc_adaptive=t.dc_adaptive)


def torch_optimizer(spec: "OptimizerSpec", params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """The torch.optim optimizer with the spec's update rule (what `local` and `allreduce` replicas run)."""
    params = list(params)
    if spec.name == "sgd":
        return torch.optim.SGD(params, lr=spec.lr, weight_decay=spec.weight_decay)
    if spec.name == "momentum":
        return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum, nesterov=spec.nesterov,
                               weight_decay=spec.weight_decay)
    return torch.optim.Adam(params, lr=spec.lr, betas=tuple(spec.betas), eps=spec.eps, weight_decay=spec.weight_decay)
