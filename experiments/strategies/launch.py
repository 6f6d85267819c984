"""Real runs on this machine: start the shards (ps-* only), launch world_size(cfg) ranks of `train_worker`, and
turn what the ranks returned into summary fields.

    shards  ps.start_servers(train.shards, num_workers=D, policy, optimizer spec, groups=P·E·T)  (forked, loopback)
    ranks   collectives.launch(train_worker, D·T·P, backend=train.backend)   (local: 1 rank playing all K workers)
            with [topology]: launch(..., topology=Topology) -- each rank's transport emulates its links

A supervisor (experiments/faults/supervisor.py) watches every rank and shard: a dead or hung one is named within
faults.detect_s and handled by faults.on_failure (abort ends every process; continue / shrink / replace go on, see
strategies/elastic.py); train.timeout_s bounds each request, train.run_limit_s (0: none) the whole run. The shards
are always stopped.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from pslab.experiments.config import RunConfig
from pslab.experiments.errors import DIVERGED, DivergedError, ExperimentError
from pslab.experiments.results.rundir import RunDir

# "fork": ranks and shards start in milliseconds with torch and the datasets already loaded (the parent only runs
# torch with one thread, so forking is safe); set PSLAB_START_METHOD=spawn to use fresh interpreters instead.
START_METHOD = os.environ.get("PSLAB_START_METHOD", "fork")

# What a rank imports on its way (lazily, inside the loop's functions), imported here once before the fork instead
# of once per rank: forked ranks inherit this process's modules. Measured on a 4-rank, 4-step run: the ranks'
# own imports were about half of each rank's CPU (pslab's modules are compiled from source in every process where
# no bytecode cache is written, e.g. under PYTHONDONTWRITEBYTECODE); here they cost ~0.1 s once.
RANK_MODULES = ("pslab.experiments.strategies.ps", "pslab.ps.client", "pslab.ps.optim", "pslab.ps.link_delay",
                "pslab.parallelism.compose", "pslab.parallelism.distributed_optimizer", "pslab.parallelism.state_io",
                "pslab.collectives.tensorfile", "zmq.utils.monitor")


def start_shards(cfg: RunConfig, bind_host: str = "127.0.0.1", curve_keys_dir: str | None = None,
                 run_path: str | None = None) -> Any:
    """The run's shard servers: one set of train.shards per slot group (pp × ep × tp), each serving D workers; with
    faults.shard_checkpoint_every = k they checkpoint every k updates into RUN_DIR/shards (a restarted shard
    resumes there)."""
    from pslab import ps
    from pslab.experiments.strategies.spec import shard_optimizer_spec
    every = cfg.faults.shard_checkpoint_every
    return ps.start_servers(cfg.train.shards, cfg.train.workers, cfg.strategy.policy, shard_optimizer_spec(cfg),
                            groups=cfg.parallel.slot_groups, start_method=START_METHOD, bind_host=bind_host,
                            curve_keys_dir=curve_keys_dir, request_timeout=cfg.train.timeout_s,
                            idle_timeout=cfg.train.timeout_s,
                            checkpoint_dir=os.path.join(run_path, "shards") if every and run_path else None,
                            checkpoint_every=every)


def run_ranks(cfg: RunConfig, rd: RunDir) -> list[Any]:
    """Launch the ranks (and the shards) under the run's supervisor; returns each rank's `train_worker` result
    (a `collectives.RankFailure` for a member the run went on without)."""
    from pslab import collectives
    from pslab.experiments.faults.supervisor import RunSupervisor
    from pslab.experiments.strategies.build import world_size
    from pslab.experiments.strategies.loop import train_worker
    from pslab.collectives import flight
    if START_METHOD == "fork":
        for name in RANK_MODULES:
            importlib.import_module(name)
    flight_dir = str(rd.path / "flight")           # every rank's and shard's flight record: `pslab diagnose RUN_DIR`
    env = {flight.ENV_DIR: flight_dir}               # for the shards (their restarts too)
    if cfg.trace.enabled:
        from pslab.collectives import trace
        env[trace.ENV_DIR] = str(rd.path / "trace")
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        servers = start_shards(cfg, run_path=str(rd.path)) if cfg.strategy.uses_ps else None
    except BaseException:
        _restore_env(before)
        raise
    sup = RunSupervisor(cfg, rd, servers)
    try:
        addresses = servers.group_addresses if servers is not None else None
        # one job secret: the ranks get the shards' one (as PSLAB_JOB_SECRET, never through the store)
        # [topology]: every rank's zmq transport emulates the links (init_process_group(topology=))
        links = {"topology": cfg.topology.build(cfg.parallel, cfg.train.workers)} if cfg.topology.enabled else {}
        return collectives.launch(train_worker, world_size=world_size(cfg), backend=cfg.train.backend,
                                  args=(cfg.to_dict(), str(rd.path), addresses), timeout=cfg.train.run_limit_s or None,
                                  group_timeout=cfg.train.timeout_s, start_method=START_METHOD,
                                  secret=servers.secret if servers else None, supervisor=sup,
                                  flight_dir=flight_dir, **links)
    except collectives.LaunchError as e:
        first = str(e).splitlines()[0] + _resume_hint(cfg, rd) + f" (run directory: {rd.path})"
        raise (DivergedError if DIVERGED in first else ExperimentError)(f"{cfg.strategy} run failed: {first}") from e
    finally:
        sup.close()
        if servers is not None:
            servers.stop()
        _restore_env(before)


def _restore_env(before: dict[str, str | None]) -> None:
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def collect(cfg: RunConfig, rd: RunDir, results: list[Any]) -> None:
    """After the ranks ended (or were interrupted): merge the part files, and give every PS update its staleness
    from the shard's own (worker, tau, version) series, which rank 0 returned (results/records.py)."""
    from pslab.experiments.results.records import assign_staleness
    from pslab.experiments.results.rundir import read_jsonl, write_jsonl
    rd.merge_parts("metrics")
    rd.merge_parts("eval")
    if results and cfg.strategy.uses_ps:
        ups = read_jsonl(rd.metrics_path)
        assign_staleness(ups, _first(results, "series") or [],
                         period=cfg.strategy.period if cfg.strategy.ps_periodic else 1)
        write_jsonl(rd.metrics_path, ups)


def summary_fields(cfg: RunConfig, results: list[Any]) -> dict[str, Any]:
    """What the ranks measured beyond the records: bytes per step by kind (with the formula), and for PS runs the
    shards' own statistics (slot group 0, shard 0)."""
    from pslab.experiments.results.bytes import bytes_by_kind
    from pslab.experiments.workloads import get_workload
    finished = [r for r in results if isinstance(r, dict) and "bytes_sent" in r]   # not the failed or expelled
    wl = get_workload(cfg.workload.name, cfg.train.workers, cfg.workload.batch_size, cfg.workload.seed,
                          **cfg.workload.overrides())
    from pslab.experiments.results.memory import activation_memory
    out: dict[str, Any] = {"world_size": len(results), "parallel": cfg.parallel.describe() or "data",
                           "bytes_by_kind": bytes_by_kind(cfg, wl, finished),
                           "activations": activation_memory(cfg, wl, finished)}
    from pslab.experiments.results.moe import moe_summary
    moe = moe_summary(cfg, wl, finished)
    if moe:
        out["moe"] = moe
    from pslab.experiments.results.pipeline import pipeline_summary
    pipe = pipeline_summary(cfg, finished)
    if pipe:
        out["pipeline"] = pipe
    if len(finished) < len(results):
        out["finished_ranks"] = len(finished)
    if cfg.topology.enabled:        # bytes per link class over the training steps, summed over ranks (loop.py)
        steps = max([1] + [int(r.get("steps", 0)) for r in finished])
        out["link_bytes_per_step"] = {c: sum(float((r.get("link_bytes") or {}).get(c, 0)) for r in finished) / steps
                                      for c in ("intra", "inter")}
        out["topology"] = cfg.topology.describe()
    if cfg.strategy.uses_ps and results:
        st = ((_first(results, "shard_stats") or [{}])[0]).get("stats") or {}
        out.update(shard_staleness_mean=st.get("mean"), shard_staleness_max=st.get("max"),
                   gate_wait_s_total=sum(float(v) for v in (st.get("wait_seconds") or {}).values()),
                   shard_dropped=sum(int(v) for v in (st.get("dropped") or {}).values()))
    return out


def _first(results: list[Any], key: str) -> Any:
    """`key` of the first rank result that has it (rank 0 of the last generation reports the shards' stats)."""
    for r in results:
        if isinstance(r, dict) and r.get(key) is not None:
            return r[key]
    return None


def _resume_hint(cfg: RunConfig, rd: RunDir) -> str:
    """'; resume ...' when the failed run left a committed engine checkpoint to continue from."""
    if not cfg.faults.checkpoint_every or cfg.strategy.uses_ps:
        return ""
    from pslab.experiments.strategies.resume import checkpoint_root
    from pslab.parallelism.state_io import committed_steps
    steps = committed_steps(checkpoint_root(rd.path))
    if not steps:
        return ""
    return f"; its step-{max(s for s, _ in steps)} checkpoint goes on with: pslab run --resume {rd.path}"
