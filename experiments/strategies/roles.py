"""Taking a role from the environment, so one config runs across hosts: under torchrun (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) or SLURM (SLURM_PROCID, SLURM_NTASKS; MASTER_ADDR/PORT must be exported by the batch
script), `pslab run` does not spawn processes: this process is worker RANK of WORLD_SIZE.

Every rank runs the one training loop (`loop.train_worker`), as in a local run, on a group from
`collectives.init_process_group` (which reads the same variables); WORLD_SIZE = train.workers x tp x pp (the
environment decides train.workers). For ps-* rank 0 also starts the shard servers (processes on its host, one set
per slot group) before joining the group and broadcasts their addresses. The shards admit only holders of the
job secret: PSLAB_JOB_SECRET / PSLAB_JOB_SECRET_FILE if every rank has it (a 0600 file on a shared file system),
else rank 0 makes one and sends it with the addresses over the group (CURVE-encrypted beyond loopback).
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

from pslab.experiments.config import RunConfig
from pslab.experiments.errors import ConfigError


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
    from pslab.collectives.curve import is_loopback
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
    """This process is rank `role.rank` of a torchrun/SLURM job: run the one training loop (`loop.train_worker`)
    as that rank; rank 0 also starts the shards (ps-*) and writes the summary."""
    import json

    from pslab import collectives
    from pslab.experiments.config import to_toml
    from pslab.experiments.results.records import summarize
    from pslab.experiments.results.rundir import RunDir, environment, read_jsonl, safe_name
    from pslab.experiments.runner import default_label
    from pslab.experiments.strategies.build import check_layout
    from pslab.experiments.strategies.launch import collect, start_shards, summary_fields
    from pslab.experiments.strategies.loop import train_worker
    from pslab.experiments.strategies.spec import lr_fields
    from pslab.experiments.workloads import get_workload
    if cfg.strategy.kind == "local":
        raise ConfigError(f"under {role.source} (RANK/WORLD_SIZE set) pslab run supports strategies allreduce and "
                          f"ps-*; got {cfg.strategy} — unset RANK/WORLD_SIZE to run it as one local process")
    host, keys = network()
    mp = cfg.parallel.model_parallel
    if role.world_size % mp:
        raise ConfigError(f"{role.source} started {role.world_size} processes, but parallel.tp x parallel.pp = {mp} "
                          f"ranks per worker: start a multiple of {mp} processes")
    if cfg.train.workers != role.world_size // mp:
        cfg.train.workers = role.world_size // mp   # the environment decides how many workers there are
        cfg.validate()
    wl = get_workload(cfg.workload.name, cfg.train.workers, cfg.workload.batch_size, cfg.workload.seed,
                          **cfg.workload.overrides())
    check_layout(cfg, wl)
    label = label or default_label(cfg, False)
    path = Path(out) / safe_name(label)
    path.mkdir(parents=True, exist_ok=True)
    if role.rank == 0:
        (path / "config.toml").write_text(to_toml(cfg.to_dict()))
        (path / "env.json").write_text(json.dumps({**environment(), "label": label, "role": role.source}, indent=2))
    # rank 0 starts the shards before it joins the group: forking later would copy the group's threads. Their job
    # secret is PSLAB_JOB_SECRET[_FILE] when the ranks have it (a zmq group needs it anyway), else one start_shards
    # makes; rank 0 then sends it with the addresses, over the group, never through the store
    from pslab.ps.admission import job_secret
    from pslab.collectives import flight, trace
    os.environ.setdefault(flight.ENV_DIR, str(path / "flight"))   # this rank's flight ring (pslab diagnose RUN_DIR)
    if cfg.trace.enabled:
        os.environ.setdefault(trace.ENV_DIR, str(path / "trace"))     # the shards' timelines (the ranks': loop.py)
    had_secret = job_secret() is not None
    servers = start_shards(cfg, bind_host=host, curve_keys_dir=keys) if cfg.strategy.uses_ps and role.rank == 0 \
        else None
    try:
        group = collectives.init_process_group(backend=cfg.train.backend, bind_host=host, curve_keys_dir=keys,
                                               timeout=cfg.train.timeout_s)
        try:
            addresses, secret = None, None
            if cfg.strategy.uses_ps:     # the shards' addresses, and their secret to ranks that lack one
                shared = json.loads(_share(group, json.dumps(
                    {"addresses": servers.group_addresses, "secret": None if had_secret else servers.secret}
                    if servers else None))[0])
                addresses, secret = shared["addresses"], shared["secret"]
            try:
                result = train_worker(group, cfg.to_dict(), str(path), addresses, keys, secret)
            except Exception as e:
                flight.dump(f"failed: {type(e).__name__}: {e}")
                raise
            flight.dump("finished")
            slim = {k: v for k, v in result.items() if k not in ("series", "shard_stats")}
            results = [json.loads(r) for r in _share(group, json.dumps(slim), every=True)]
            results[0] = result if role.rank == 0 else results[0]
            group.barrier()
        finally:
            group.destroy()
    finally:
        if servers is not None:
            servers.stop()
    if role.rank == 0:
        rd = RunDir(path)
        collect(cfg, rd, results)
        ups, evs = read_jsonl(rd.metrics_path), read_jsonl(rd.eval_path)
        elapsed = max([1e-9] + [u["time_s"] for u in ups] + [e["time_s"] for e in evs])   # as runner.execute
        summary = summarize(ups, evs, elapsed, label, False)
        rd.write_summary({**summary, "strategy": cfg.strategy.label, "role": role.source,
                          **summary_fields(cfg, results), "train_examples": wl.data.n_train,
                          **lr_fields(cfg.train, summary["updates"] - summary["dropped"], cfg.workload.batch_size)})
        print(f"run directory: {path}")
    return 0


def _share(group: object, text: str, every: bool = False, size: int = 1 << 16) -> list[str]:
    """Rank 0's text to every rank (broadcast), or with `every` each rank's text to every rank (all_gather)."""
    import numpy as np
    raw = text.encode()
    if len(raw) > size:
        raise ConfigError(f"{len(raw)} bytes of run metadata exceed the {size}-byte exchange buffer")
    buf = np.zeros(size, np.uint8)
    buf[:len(raw)] = np.frombuffer(raw, np.uint8)
    if not every:
        group.broadcast(buf, src=0)                                       # type: ignore[attr-defined]
        return [bytes(buf).rstrip(b"\0").decode()]
    out = np.zeros(size * group.world_size, np.uint8)                     # type: ignore[attr-defined]
    group.all_gather(out, buf)                                            # type: ignore[attr-defined]
    return [bytes(out[i * size:(i + 1) * size]).rstrip(b"\0").decode() for i in range(group.world_size)]  # type: ignore[attr-defined]
