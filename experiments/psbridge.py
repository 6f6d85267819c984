"""Where experiments meet the parameter server: config -> ps policy / optimizer, and the partition's
split/join of flat parameter dicts. Everything PS-specific that experiments need goes through here, so the
simulator and the real runs build their `ps` objects the same way.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from experiments.config import RunConfig, TrainConfig
from experiments.strategies import Strategy


def policy_string(strategy: Strategy) -> str:
    """'ps-ssp:3' -> 'ssp:3', 'ps-bsp-backup:1' -> 'bsp-backup:1' (ps.consistency.policy_from_string syntax)."""
    if not strategy.uses_ps:
        raise ValueError(f"{strategy} is not a parameter-server strategy")
    return strategy.label[3:]


def optimizer_spec(t: TrainConfig) -> Any:
    from ps import OptimizerSpec
    return OptimizerSpec(name=t.optimizer, lr=t.lr, momentum=t.momentum, betas=tuple(t.betas),
                         staleness_lr=t.staleness_lr, dc_lambda=t.dc_lambda if t.dc_asgd else None,
                         dc_adaptive=t.dc_adaptive)


def optimizer_string(t: TrainConfig) -> str:
    """The same optimizer as `optimizer_spec`, in ps.optimizer_from_string syntax (ServerConfig carries a string)."""
    d = optimizer_spec(t).to_dict()
    name = d.pop("name")
    parts = []
    for k, v in d.items():
        if v is None:
            continue
        if k == "betas":
            v = "/".join(str(b) for b in v)
        elif isinstance(v, bool):
            v = int(v)
        parts.append(f"{k}={v}")
    return f"{name}:{','.join(parts)}"


def make_partition_for(params: dict[str, np.ndarray], num_shards: int) -> Any:
    from ps import make_partition
    return make_partition({n: v for n, v in params.items()}, num_shards)


def split(partition: Any, flat: dict[str, np.ndarray], num_shards: int) -> list[dict[str, np.ndarray]]:
    """{name: flat array} -> per shard {key: flat piece} (views, no copies)."""
    out: list[dict[str, np.ndarray]] = [dict() for _ in range(num_shards)]
    for sl in partition.slices:
        out[sl.shard][sl.key] = np.asarray(flat[sl.name]).reshape(-1)[sl.start: sl.stop]
    return out


def join(partition: Any, keyed: dict[str, Any]) -> dict[str, np.ndarray]:
    """Per-shard {key: flat piece} (merged) -> {name: flat array}."""
    sizes: dict[str, int] = {}
    for sl in partition.slices:
        sizes[sl.name] = max(sizes.get(sl.name, 0), sl.stop)
    out = {n: np.empty(k, np.float32) for n, k in sizes.items()}
    for sl in partition.slices:
        v = keyed[sl.key]
        out[sl.name][sl.start: sl.stop] = v.numpy() if hasattr(v, "numpy") else np.asarray(v)
    return out


def make_shards(init: dict[str, np.ndarray], partition: Any, cfg: RunConfig) -> list[Any]:
    """One ps.ShardState per shard, holding its slice of the initial parameters."""
    from ps import ShardState
    pieces = split(partition, init, partition.num_shards)
    spec = optimizer_spec(cfg.train)
    policy = policy_string(cfg.strategy)
    return [ShardState({k: v.copy() for k, v in piece.items()}, optimizer=spec, policy=policy,
                       num_workers=cfg.train.workers) for piece in pieces]


def shard_params(st: Any) -> dict[str, Any]:
    """The shard's current parameters without going through the consistency gate (for evaluation only)."""
    return st.params
