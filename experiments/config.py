"""Run configuration: dataclasses, read from TOML (`tomllib`), overridden by `--set section.key=value`.

    [workload]    name, batch_size, seed
    [train]       strategy, workers, steps (per worker), shards, backend, engine, optimizer, lr, momentum, betas,
                  staleness_lr, dc_asgd, dc_lambda, dc_adaptive, eval_every, base_step_s, timeout_s
    [stragglers]  factors = {"1" = 4.0}, transient_prob, transient_factor, delay, delay_mean_s, delay_sigma
    [simulate]    enabled, compute_s, latency_intra_s, latency_inter_s, bandwidth_intra_Bps,
                  bandwidth_inter_Bps, workers_per_host

Every value is validated here; a bad one raises ConfigError naming the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from experiments.errors import ConfigError
from experiments.strategies import Strategy, parse_strategy
from experiments.stragglers import StragglerConfig

OPTIMIZERS = ("sgd", "momentum", "adam")
BACKENDS = ("zmq", "torch")
ENGINES = ("none", "data")


@dataclass
class WorkloadConfig:
    name: str = "digits-mlp"
    batch_size: int = 32
    seed: int = 0


@dataclass
class TrainConfig:
    strategy: str = "ps-asp"
    workers: int = 4
    steps: int = 100          # clocks (updates) per worker
    shards: int = 1
    backend: str = "zmq"      # allreduce backend
    engine: str = "none"      # allreduce: "none" (one flat all-reduce per step) | "data" (parallelism's DDP-style
                              # engine: bucketed all-reduce overlapped with backward)
    optimizer: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    staleness_lr: bool = False  # lr / tau for tau > 0 (Zhang et al. 2016)
    dc_asgd: bool = False       # delay-compensated ASGD (Zheng et al. 2017) on the PS
    dc_lambda: float = 0.04     # its compensation strength
    dc_adaptive: bool = False
    eval_every: int = 20        # evaluate test accuracy every this many global updates
    base_step_s: float = 0.0    # real runs: pad each step's compute to at least this many seconds
    timeout_s: float = 300.0


@dataclass
class SimulateConfig:
    enabled: bool = False
    compute_s: float = 0.010           # virtual compute time of one step (before straggler factors)
    latency_intra_s: float = 50e-6
    latency_inter_s: float = 500e-6
    bandwidth_intra_Bps: float = 10e9
    bandwidth_inter_Bps: float = 1.25e9  # 10 Gbit/s
    workers_per_host: int = 8            # shards live on host 0


@dataclass
class RunConfig:
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    simulate: SimulateConfig = field(default_factory=SimulateConfig)

    @property
    def strategy(self) -> Strategy:
        return parse_strategy(self.train.strategy)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["stragglers"]["factors"] = {str(k): v for k, v in self.stragglers.factors.items()}
        return d

    def validate(self) -> "RunConfig":
        from experiments.workloads import WORKLOADS
        t, w = self.train, self.workload
        if w.name not in WORKLOADS:
            raise ConfigError(f"workload.name: unknown workload {w.name!r}; choose one of: {', '.join(WORKLOADS)}")
        _positive("workload.batch_size", w.batch_size)
        s = self.strategy  # raises on unknown strategy / negative staleness
        _positive("train.workers", t.workers)
        _positive("train.steps", t.steps)
        _positive("train.shards", t.shards)
        _positive("train.eval_every", t.eval_every)
        if t.backend not in BACKENDS:
            raise ConfigError(f"train.backend must be one of {', '.join(BACKENDS)}, got {t.backend!r}")
        if t.engine not in ENGINES:
            raise ConfigError(f"train.engine must be one of {', '.join(ENGINES)}, got {t.engine!r}")
        if t.engine != "none" and s.kind != "allreduce":
            raise ConfigError(f"train.engine = {t.engine!r} works with strategy allreduce, not {s.label}")
        if t.optimizer not in OPTIMIZERS:
            raise ConfigError(f"train.optimizer must be one of {', '.join(OPTIMIZERS)}, got {t.optimizer!r}")
        if not t.lr > 0:
            raise ConfigError(f"train.lr must be > 0, got {t.lr}")
        if t.dc_lambda < 0:
            raise ConfigError(f"train.dc_lambda must be >= 0, got {t.dc_lambda}")
        if s.kind == "ps-bsp-backup" and s.backup is not None and s.backup >= t.workers:
            raise ConfigError(f"strategy {s.label}: needs more workers than backups (train.workers = {t.workers})")
        self.stragglers.factors = {_worker_key(k): float(v) for k, v in self.stragglers.factors.items()}
        self.stragglers.validate(t.workers)
        m = self.simulate
        for k in ("compute_s", "latency_intra_s", "latency_inter_s"):
            if getattr(m, k) < 0:
                raise ConfigError(f"simulate.{k} must be >= 0")
        for k in ("bandwidth_intra_Bps", "bandwidth_inter_Bps", "workers_per_host"):
            if not getattr(m, k) > 0:
                raise ConfigError(f"simulate.{k} must be > 0")
        return self


def _worker_key(k: Any) -> int:
    try:
        return int(k)
    except (TypeError, ValueError):
        raise ConfigError(f"stragglers.factors: keys are worker numbers, got {k!r}") from None


def _positive(key: str, v: Any) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ConfigError(f"{key} must be a positive integer, got {v!r}")


def _coerce(key: str, value: Any, current: Any) -> Any:
    """Check a value against the type of the default it replaces."""
    if isinstance(current, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
    elif isinstance(current, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
    elif isinstance(current, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        value = float(value)
    elif isinstance(current, str):
        if not isinstance(value, str):
            value = str(value)
    elif isinstance(current, dict) and not isinstance(value, dict):
        raise ConfigError(f"{key} must be a table, e.g. {{\"1\" = 4.0}}, got {value!r}")
    elif isinstance(current, list) and not isinstance(value, list):
        raise ConfigError(f"{key} must be a list, got {value!r}")
    return value


def apply(cfg: RunConfig, data: dict[str, Any], where: str = "config") -> RunConfig:
    for section, values in data.items():
        sub = getattr(cfg, section, None) if section in {f.name for f in dataclasses.fields(cfg)} else None
        if sub is None:
            raise ConfigError(f"{where}: unknown section [{section}]; sections are: "
                              f"{', '.join(f.name for f in dataclasses.fields(cfg))}")
        if not isinstance(values, dict):
            raise ConfigError(f"{where}: [{section}] must be a table")
        known = {f.name for f in dataclasses.fields(sub)}
        for key, value in values.items():
            if key not in known:
                raise ConfigError(f"{where}: unknown key {section}.{key}; keys of [{section}]: {', '.join(sorted(known))}")
            setattr(sub, key, _coerce(f"{section}.{key}", value, getattr(sub, key)))
    return cfg


def parse_override(text: str) -> dict[str, Any]:
    """'train.workers=8' -> {'train': {'workers': 8}}; the value is read as TOML, else taken as a string."""
    key, eq, raw = text.partition("=")
    key = key.strip()
    if not eq or key.count(".") != 1:
        raise ConfigError(f"--set expects section.key=value (e.g. train.strategy=ps-ssp:2), got {text!r}")
    section, name = key.split(".")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return {section: {name: value}}


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                base: RunConfig | None = None) -> RunConfig:
    cfg = base if base is not None else RunConfig()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: not valid TOML: {e}") from None
        apply(cfg, data, str(p))
    for o in overrides:
        apply(cfg, parse_override(o), f"--set {o}")
    return cfg.validate()


def to_toml(d: dict[str, Any]) -> str:
    """Write the resolved config back as TOML (tables of scalars, lists and one level of inline tables)."""
    def val(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(val(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f'"{k}" = {val(x)}' for k, x in v.items()) + "}"
        raise TypeError(type(v))
    out = []
    for section, values in d.items():
        out.append(f"[{section}]")
        out += [f"{k} = {val(v)}" for k, v in values.items()]
        out.append("")
    return "\n".join(out)


def config_from_dict(d: dict[str, Any]) -> RunConfig:
    """Rebuild a RunConfig from `to_dict()` output (e.g. in a child process or from a run's config.toml)."""
    return apply(RunConfig(), d).validate()
