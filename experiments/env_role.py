"""Taking a role from the environment, so one config runs across hosts: under torchrun (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) or SLURM (SLURM_PROCID, SLURM_NTASKS; MASTER_ADDR/PORT must be exported by the batch
script), `pslab run` does not spawn processes: this process is worker RANK of WORLD_SIZE.

Supported here: `allreduce` (the group comes from `collectives.init_process_group`, which reads the same variables).
Every rank writes its part files into OUT/<label> (a shared directory, or one per host); rank 0 writes the config
and environment and, after a final barrier, merges the parts it can see and writes the summary. Parameter-server
strategies across hosts need `pslab server` on the server hosts and are not launched from here yet.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from experiments.config import RunConfig
from experiments.errors import ConfigError


@dataclass(frozen=True)
class Role:
    rank: int
    world_size: int
    source: str  # "torchrun" | "slurm"


def from_environment() -> Role | None:
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return Role(int(env["RANK"]), int(env["WORLD_SIZE"]), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and int(env["SLURM_NTASKS"]) > 1:
        os.environ.setdefault("RANK", env["SLURM_PROCID"])
        os.environ.setdefault("WORLD_SIZE", env["SLURM_NTASKS"])
        return Role(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), "slurm")
    return None


def run_with_role(cfg: RunConfig, role: Role, out: str, label: str | None) -> int:
    import collectives
    from experiments.allreduce_run import allreduce_worker
    from experiments.metrics import RunDir, read_jsonl, summarize
    from experiments.runner import default_label
    if cfg.strategy.kind != "allreduce":
        raise ConfigError(f"under {role.source} (RANK/WORLD_SIZE set) pslab run supports strategy allreduce; got "
                          f"{cfg.strategy} — unset RANK/WORLD_SIZE to launch local processes instead")
    if cfg.train.workers != role.world_size:
        cfg.train.workers = role.world_size  # the environment decides how many workers there are
        cfg.validate()
    label = label or default_label(cfg, False)
    path = Path(out) / label.replace(" ", "_")
    path.mkdir(parents=True, exist_ok=True)
    if role.rank == 0:
        from experiments.config import to_toml
        from experiments.metrics import environment
        import json
        (path / "config.toml").write_text(to_toml(cfg.to_dict()))
        (path / "env.json").write_text(json.dumps({**environment(), "label": label, "role": role.source}, indent=2))
    group = collectives.init_process_group(backend=cfg.train.backend)
    try:
        allreduce_worker(group, cfg.to_dict(), str(path))
        group.barrier()
    finally:
        group.destroy()
    if role.rank == 0:
        rd = RunDir(path)
        rd.merge_parts("metrics")
        rd.merge_parts("eval")
        ups, evs = read_jsonl(rd.metrics_path), read_jsonl(rd.eval_path)
        elapsed = max([1e-9] + [u["time_s"] for u in ups])
        rd.write_summary({**summarize(ups, evs, elapsed, label, False), "strategy": cfg.strategy.label})
        print(f"run directory: {path}")
    return 0
