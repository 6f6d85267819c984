"""Synchronisation strategies, selected by one config string, and the one optimizer spec every strategy uses.

    local              single process; with K workers it averages the K workers' gradients per step
                       (large-batch SGD — what BSP must reproduce)
    allreduce          ring all-reduce BSP over `collectives` (backend zmq or torch)
    ps-bsp             parameter server, bulk synchronous: read at clock c waits for all clock c-1 pushes
    ps-asp             parameter server, asynchronous: nobody waits
    ps-ssp:<s>         stale synchronous parallel (Ho et al. 2013), bound s >= 0: every push applied at once
                       (read-my-writes), a read waits only while it is more than s clocks ahead of the slowest
    ps-ssp-agg:<s>     SSP with each clock's K gradients averaged into one step once all have arrived (ssp-agg:0
                       is BSP bitwise; the model advances only as the slowest worker completes a clock)
    ps-bsp-backup:<b>  BSP that proceeds on the first N of N+b gradients per clock (b >= 1 backup workers)
    local-sgd:<H>      Local SGD (Lin et al. 2020): every worker steps on its own gradient, the parameters are
                       averaged over the ring every H steps (parallelism/local_sgd.py)
    diloco:<H>         DiLoCo (Douillard et al. 2023): H inner steps per worker, then an outer optimizer ([outer])
                       steps on the averaged pseudo-gradient θ_outer − mean θ_i
    ps-local:<H>       Local SGD through the shards, asynchronous: every H local steps a worker pushes its
                       pseudo-gradient θ_read − θ_i, the shard applies 1/K of it at once (SGD), the worker reads
                       the result and goes on (strategies/ps_local.py)
    ps-diloco:<H>      the same with the shard's optimizer DiLoCo's outer one ([outer]: Nesterov, lr, momentum)

Learning rates (`train.lr_rule`, Goyal et al. 2017's linear scaling rule by default). `train.lr` is the learning
rate PER GRADIENT. A strategy whose optimizer step averages G gradients (G = K for local, allreduce, ps-bsp and
ps-ssp-agg; K - b for ps-bsp-backup:b; 1 for ps-asp and ps-ssp) steps with

    linear:  lr_step = G * lr      (the same distance per gradient as one-gradient steps: BSP(G lr) = SSP(0)(lr)
                                    for SGD, so a comparison changes only the synchronisation)
    sqrt:    lr_step = sqrt(G) * lr (Krizhevsky 2014 / Hoffer et al. 2017; often used with Adam)
    none:    lr_step = lr          (every strategy steps with the same lr: averaging strategies then learn
                                    G times less per gradient)

The optimizer is described once, as `ps.OptimizerSpec` (`optimizer_spec(train)`): the shards run it server-side,
and `local` / `allreduce` build the same torch.optim optimizer from it (`torch_optimizer`), so a comparison never
re-types its hyper-parameters. The simulator and the Dai emulator take the same spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

import torch

from pslab.experiments.errors import ConfigError

if TYPE_CHECKING:
    from pslab.experiments.config import RunConfig, TrainConfig
    from pslab.ps.optim import OptimizerSpec

KINDS = ("local", "allreduce", "ps-bsp", "ps-asp", "ps-ssp", "ps-ssp-agg", "ps-bsp-backup", "local-sgd", "diloco",
         "ps-local", "ps-diloco")
RING_KINDS = ("allreduce", "local-sgd", "diloco")     # the strategies that talk over the dp ring, not the shards
PERIODIC_KINDS = ("local-sgd", "diloco")              # average every H steps over the dp group
PS_PERIODIC_KINDS = ("ps-local", "ps-diloco")         # push a pseudo-gradient every H steps to the shards
_HELP = ("local, allreduce, ps-bsp, ps-asp, ps-ssp:<s>, ps-ssp-agg:<s>, ps-bsp-backup:<b>, local-sgd:<H>, "
         "diloco:<H>, ps-local:<H>, ps-diloco:<H>")
LR_RULES = ("linear", "sqrt", "none")


@dataclass(frozen=True)
class Strategy:
    kind: str
    staleness: int | None = None  # ps-ssp, ps-ssp-agg
    backup: int | None = None     # ps-bsp-backup
    period: int | None = None     # local-sgd, diloco, ps-local, ps-diloco: local steps between syncs (H)

    @property
    def uses_ps(self) -> bool:
        return self.kind.startswith("ps-")

    @property
    def ring(self) -> bool:
        """Whether the workers synchronise over the dp ring (allreduce, local-sgd, diloco)."""
        return self.kind in RING_KINDS

    @property
    def periodic(self) -> bool:
        """Whether the workers average every `period` steps instead of every step (local-sgd, diloco)."""
        return self.kind in PERIODIC_KINDS

    @property
    def ps_periodic(self) -> bool:
        """Whether the workers push a pseudo-gradient every `period` local steps (ps-local, ps-diloco)."""
        return self.kind in PS_PERIODIC_KINDS

    @property
    def policy(self) -> str:
        """The shards' consistency policy in `ps.policy_from_string` syntax: 'ps-ssp:3' -> 'ssp:3',
        'ps-ssp-agg:3' -> 'ssp-agg:3'; ps-local / ps-diloco: 'asp' (each pseudo-gradient applied on arrival)."""
        if not self.uses_ps:
            raise ConfigError(f"{self.label} is not a parameter-server strategy")
        return "asp" if self.ps_periodic else self.label[3:]

    @property
    def label(self) -> str:
        if self.kind in ("ps-ssp", "ps-ssp-agg"):
            return f"{self.kind}:{self.staleness}"
        if self.kind == "ps-bsp-backup":
            return f"ps-bsp-backup:{self.backup}"
        if self.period is not None:
            return f"{self.kind}:{self.period}"
        return self.kind

    def __str__(self) -> str:
        return self.label

    def gradients_per_step(self, workers: int) -> int:
        """How many gradients one optimizer step averages: K for the averaging strategies, K - b with b backups
        (the first K - b gradients of a clock), 1 for those that apply every gradient at once. Local SGD and
        DiLoCo: K — each worker's step moves its own copy, and the average divides every step's move by K; so do
        ps-local / ps-diloco, whose shard applies 1/K of each pseudo-gradient."""
        if self.kind in ("ps-asp", "ps-ssp"):
            return 1
        if self.kind == "ps-bsp-backup":
            return max(1, workers - int(self.backup or 0))
        return workers


# strategies that take an integer argument: kind -> (what it is, its minimum, an example)
_ARGS = {"ps-ssp": ("a staleness bound", 0, "ps-ssp:2"), "ps-ssp-agg": ("a staleness bound", 0, "ps-ssp-agg:2"),
         "ps-bsp-backup": ("a number of backup workers", 1, "ps-bsp-backup:1"),
         "local-sgd": ("a period H (steps between averages)", 1, "local-sgd:4"),
         "diloco": ("a period H (inner steps per outer step)", 1, "diloco:16"),
         "ps-local": ("a period H (local steps per push)", 1, "ps-local:4"),
         "ps-diloco": ("a period H (inner steps per push)", 1, "ps-diloco:16")}


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
    if kind in PERIODIC_KINDS + PS_PERIODIC_KINDS:
        return Strategy(kind, period=n)
    return Strategy(kind, backup=n) if kind == "ps-bsp-backup" else Strategy(kind, staleness=n)


def step_lr(t: "TrainConfig") -> float:
    """The learning rate of one optimizer step under `t.lr_rule` (module docstring): lr x G, lr x sqrt(G) or lr."""
    g = parse_strategy(t.strategy).gradients_per_step(t.workers)
    rule = t.lr_rule
    return t.lr * g if rule == "linear" else t.lr * g ** 0.5 if rule == "sqrt" else t.lr


def lr_fields(t: "TrainConfig", applied: int, batch_size: int) -> dict[str, float | int | str]:
    """What a fair comparison states per run: the rule, lr per step and per gradient, gradients averaged per step,
    optimizer steps taken and samples seen (`applied` gradients of `batch_size` samples)."""
    g = parse_strategy(t.strategy).gradients_per_step(t.workers)
    lr = step_lr(t)
    return {"lr_rule": t.lr_rule, "lr_step": lr, "lr_per_gradient": lr / g,
            "gradients_per_step": g, "optimizer_steps": applied // g, "samples": applied * batch_size}


def optimizer_spec(t: "TrainConfig") -> "OptimizerSpec":
    """The run's optimizer as the one spec type (`ps.OptimizerSpec`) that every strategy consumes; its lr is the
    step lr of `t.lr_rule` for the run's strategy (`step_lr`)."""
    from pslab.ps.optim import OptimizerSpec
    return OptimizerSpec(name=t.optimizer, lr=step_lr(t), momentum=t.momentum, betas=tuple(t.betas),
                         staleness_lr=t.staleness_lr, staleness_rule=t.staleness_rule,
                         dc_lambda=t.dc_lambda if t.dc_asgd else None,
                         dc_adaptive=t.dc_adaptive)


def shard_optimizer_spec(cfg: "RunConfig") -> "OptimizerSpec":
    """What the shards run: the run's optimizer (`optimizer_spec`) for ps-*; for ps-local / ps-diloco the outer
    step on each pushed pseudo-gradient, at 1/K of the outer lr so that one push from each of the K workers moves θ
    as one average would (strategies/ps_local.py): ps-local SGD at lr 1/K; ps-diloco [outer] at outer.lr / K
    (nesterov: SGD with Nesterov momentum; sgd: heavy-ball momentum, plain SGD at momentum 0)."""
    from pslab.ps.optim import OptimizerSpec
    s, K = cfg.strategy, cfg.train.workers
    if not s.ps_periodic:
        return optimizer_spec(cfg.train)
    if s.kind == "ps-local":
        return OptimizerSpec(name="sgd", lr=1.0 / K)
    o = cfg.outer
    if o.optimizer == "sgd" and o.momentum == 0:
        return OptimizerSpec(name="sgd", lr=o.lr / K)
    return OptimizerSpec(name="momentum", lr=o.lr / K, momentum=o.momentum, nesterov=o.optimizer == "nesterov")


def torch_optimizer(spec: "OptimizerSpec", params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """The torch.optim optimizer with the spec's update rule (what `local` and `allreduce` replicas run)."""
    params = list(params)
    if spec.name == "sgd":
        return torch.optim.SGD(params, lr=spec.lr, weight_decay=spec.weight_decay)
    if spec.name == "momentum":
        return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum, nesterov=spec.nesterov,
                               weight_decay=spec.weight_decay)
    return torch.optim.Adam(params, lr=spec.lr, betas=tuple(spec.betas), eps=spec.eps, weight_decay=spec.weight_decay)
