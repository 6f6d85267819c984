"""Taking a role from the environment, so one config runs across hosts: under torchrun (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) or SLURM (SLURM_PROCID, SLURM_NTASKS; MASTER_ADDR/PORT must be exported by the batch
script), `pslab run` does not spawn processes: this process is worker RANK of WORLD_SIZE.

Strategies:
  allreduce   the group comes from `collectives.init_process_group`, which reads the same variables;
  ps-*        rank 0 also starts the `train.shards` shard servers (processes on its host) before joining the
              group, broadcasts their addresses, and every rank is then a PS worker, as in a local run.
Every rank writes its part files into OUT/<label> (a shared directory, or one per host); rank 0 writes the config
and environment and, after a final barrier, merges the parts it can see and writes the summary.

Across hosts: sockets bind to 127.0.0.1 unless PSLAB_BIND_HOST names this host's address on the cluster network
(a concrete IP that the other hosts can reach); binding beyond loopback requires PSLAB_CURVE_KEYS, a folder made by
`collectives.curve.generate_keys` and copied to every host (CURVE encryption + authentication for the zmq group and
the shards alike). Ranks whose host ids match talk through ipc sockets and shared memory; the id combines hostname,
boot id, network namespace, temp dir and /dev/shm (`collectives.transport.host_identity`), or is PSLAB_HOST_ID.
Tested for real across two network namespaces in tests/experiments/test_multihost.py.
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


def network() -> tuple[str, str | None]:
    """(bind host, CURVE keys folder) from PSLAB_BIND_HOST / PSLAB_CURVE_KEYS; beyond loopback keys are required."""
    from collectives.curve import is_loopback
    host = os.environ.get("PSLAB_BIND_HOST", "127.0.0.1")
    keys = os.environ.get("PSLAB_CURVE_KEYS") or None
    if not is_loopback(host) and keys is None:
        raise ConfigError(f"PSLAB_BIND_HOST={host} exposes this job beyond the host: set PSLAB_CURVE_KEYS to a folder "
                          "made by collectives.curve.generate_keys (the same on every host)")
    if host in ("0.0.0.0", "*", "::"):
        raise ConfigError("PSLAB_BIND_HOST must be this host's address that the other hosts reach (e.g. 10.0.0.5), "
                          "not a wildcard: the address is handed to the other ranks")
    return host, keys


def run_with_role(cfg: RunConfig, role: Role, out: str, label: str | None) -> int:
    import collectives
    from experiments.allreduce_run import allreduce_worker
    from experiments.metrics import RunDir, read_jsonl, summarize
    from experiments.runner import default_label
    if not (cfg.strategy.kind == "allreduce" or cfg.strategy.uses_ps):
        raise ConfigError(f"under {role.source} (RANK/WORLD_SIZE set) pslab run supports strategies allreduce and "
                          f"ps-*; got {cfg.strategy} — unset RANK/WORLD_SIZE to run it as one local process")
    host, keys = network()
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
    extra: dict = {}
    if cfg.strategy.uses_ps:
        extra = _ps_role(cfg, role, path, host, keys)
    else:
        group = collectives.init_process_group(backend=cfg.train.backend, bind_host=host, curve_keys_dir=keys,
                                               timeout=cfg.train.timeout_s)
        try:
            allreduce_worker(group, cfg.to_dict(), str(path))
            group.barrier()
        finally:
            group.destroy()
    if role.rank == 0:
        rd = RunDir(path)
        rd.merge_parts("metrics")
        rd.merge_parts("eval")
        if cfg.strategy.uses_ps:
            from experiments.ps_run import fill_staleness
            fill_staleness(rd)
        ups, evs = read_jsonl(rd.metrics_path), read_jsonl(rd.eval_path)
        elapsed = max([1e-9] + [u["time_s"] for u in ups])
        rd.write_summary({**summarize(ups, evs, elapsed, label, False), "strategy": cfg.strategy.label,
                          "role": role.source, **extra})
        print(f"run directory: {path}")
    return 0


def _ps_role(cfg: RunConfig, role: Role, path: Path, host: str, keys: str | None) -> dict:
    """Rank 0 starts the shards (before it joins the group: forking later would copy the group's threads), then
    every rank is a PS worker; returns rank 0's view of the shards' own statistics."""
    import json

    import numpy as np

    import collectives
    from experiments.ps_run import Servers, ps_worker, shard_summary
    from experiments.runner import START_METHOD
    servers = Servers(cfg, START_METHOD, bind_host=host, curve_keys_dir=keys) if role.rank == 0 else None
    try:
        group = collectives.init_process_group(backend="zmq", bind_host=host, curve_keys_dir=keys,
                                               timeout=cfg.train.timeout_s)
        try:
            buf = np.zeros(1 << 14, np.uint8)       # the shard addresses, as JSON, from rank 0 to everyone
            if servers is not None:
                raw = json.dumps(servers.addresses).encode()
                buf[:len(raw)] = np.frombuffer(raw, np.uint8)
            group.broadcast(buf, src=0)
            addresses = json.loads(bytes(buf).rstrip(b"\0").decode())
            result = ps_worker(group, cfg.to_dict(), str(path), addresses, curve_keys_dir=keys)
            group.barrier()
        finally:
            group.destroy()
    finally:
        if servers is not None:
            servers.stop()
    return shard_summary([result]) if role.rank == 0 else {}
