"""Run one config end to end: make the run directory, dispatch to the strategy (or the simulator), show a progress
bar, merge the per-process metric files, and write summary.json.

Real multi-process runs go through `collectives.launch` (spawned processes, first failure or timeout kills them all);
the parameter-server runs also start (and always stop) the shard servers. Ctrl-C ends every process, merges what
was written, and leaves the run directory without summary.json — marked interrupted in env.json.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from tqdm import tqdm

from experiments.config import RunConfig
from experiments.errors import ExperimentError
from experiments.metrics import RunDir, read_jsonl, summarize


# "fork": workers start in milliseconds with torch and the datasets already loaded (the parent only ever runs torch
# with one thread, so forking is safe); set PSLAB_START_METHOD=spawn to use fresh interpreters instead.
START_METHOD = os.environ.get("PSLAB_START_METHOD", "fork")

# Forking while another thread holds a lock copies the lock held into the child. Our only extra thread is the
# progress poller (tqdm writes to stderr under a lock), so it works under _FORK_LOCK and no fork happens meanwhile.
_FORK_LOCK = threading.Lock()
os.register_at_fork(before=_FORK_LOCK.acquire, after_in_parent=_FORK_LOCK.release,
                    after_in_child=_FORK_LOCK.release)


def _count_lines(paths: list[Path]) -> int:
    n = 0
    for p in paths:
        try:
            with open(p, "rb") as f:
                n += sum(1 for _ in f)
        except OSError:
            pass
    return n


class _FilePoller:
    """Moves a progress bar by the number of metric lines the worker processes have written so far."""

    def __init__(self, rundir: RunDir, bar: tqdm):
        self.rundir, self.bar, self._stop = rundir, bar, threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        seen = 0
        while not self._stop.wait(0.25):
            n = _count_lines(sorted(self.rundir.path.glob("metrics.w*.jsonl")))
            if n > seen:
                with _FORK_LOCK:
                    self.bar.update(n - seen)
                seen = n

    def __enter__(self) -> "_FilePoller":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


def default_label(cfg: RunConfig, simulated: bool) -> str:
    lab = cfg.strategy.label
    if cfg.strategy.kind == "allreduce" and cfg.train.backend != "zmq":
        lab += f"[{cfg.train.backend}]"
    if cfg.train.engine != "none":
        lab += f"[{cfg.train.engine} engine]"
    if cfg.stragglers.active:
        lab += " +straggler"
    if simulated:
        lab += " (simulated)"
    return lab


def steady_throughput(updates: list[dict[str, Any]]) -> float | None:
    """Updates per second while every worker is still working: count up to the time the first worker finishes.
    With a straggler this separates BSP (everyone held to the straggler's pace) from ASP (the others run on)."""
    applied = [u for u in updates if not u.get("dropped")]
    if not applied:
        return None
    last: dict[int, float] = {}
    for u in applied:
        last[u["worker"]] = max(last.get(u["worker"], 0.0), u["time_s"])
    t_end = min(last.values())
    n = sum(1 for u in applied if u["time_s"] <= t_end)
    return n / t_end if t_end > 0 else None


def execute(cfg: RunConfig, root: str | Path = "runs", label: str | None = None, simulate: bool | None = None,
            quiet: bool = False) -> RunDir:
    """Run `cfg` and return its run directory (summary.json written on success)."""
    import torch
    torch.set_num_threads(1)  # this process too (and so the forked workers) — the machines here have 2 cores
    sim = cfg.simulate.enabled if simulate is None else simulate
    _preload(cfg)
    if sim:
        cfg.simulate.enabled = True
    strategy = cfg.strategy
    label = label or default_label(cfg, sim)
    rd = RunDir.create(root, label, cfg, {"label": label, "simulated": sim})
    total = cfg.train.workers * cfg.train.steps
    bar = tqdm(total=total, desc=label[:34].ljust(34), unit="grad", disable=quiet, leave=not quiet)
    extra: dict[str, Any] = {}
    t0 = time.perf_counter()
    ok = False
    try:
        if sim:
            from experiments.simulator import simulate as run_sim
            extra = run_sim(cfg, rd, bar.update)
            elapsed = extra["virtual_time_s"]
        elif strategy.kind == "local":
            elapsed = _run_local(cfg, rd, bar.update)
        else:
            with _FilePoller(rd, bar):
                if strategy.kind == "allreduce":
                    elapsed = _run_allreduce(cfg, rd)
                else:
                    from experiments.ps_run import run_ps
                    extra = run_ps(cfg, rd)
                    elapsed = 0.0
        ok = True
    finally:
        rd.merge_parts("metrics")
        rd.merge_parts("eval")
        done = _count_lines([rd.metrics_path])       # the poller samples; end the bar on the true count
        if done > bar.n:
            bar.update(done - bar.n)
        bar.close()
        if not ok:
            env_p = rd.path / "env.json"
            env = json.loads(env_p.read_text())
            env["interrupted"] = True
            env_p.write_text(json.dumps(env, indent=2))
    wall = time.perf_counter() - t0
    updates, evals = read_jsonl(rd.metrics_path), read_jsonl(rd.eval_path)
    if sim:
        elapsed = max([elapsed] + [u["time_s"] for u in updates])
    else:
        elapsed = max([1e-9] + [u["time_s"] for u in updates] + [e["time_s"] for e in evals])
    summary = summarize(updates, evals, elapsed, label, sim)
    summary.update(strategy=strategy.label, straggler=cfg.stragglers.active, wall_s=wall,
                   updates_per_s_total=summary["updates_per_s"], updates_per_s=steady_throughput(updates),
                   dropped=sum(1 for u in updates if u.get("dropped")), **{k: v for k, v in extra.items()})
    rd.write_summary(summary)
    return rd


def _preload(cfg: RunConfig) -> None:
    """Load the dataset and the lazily-imported parts of torch (torch.optim pulls in torch._dynamo, seconds on a
    busy machine) once here, so forked workers and servers inherit them instead of each importing them again."""
    import torch._dynamo  # noqa: F401
    from experiments.workloads import get_workload
    get_workload(cfg.workload.name, cfg.train.workers, cfg.workload.batch_size, cfg.workload.seed)


def _run_local(cfg: RunConfig, rd: RunDir, progress: Callable[[int], None]) -> float:
    from experiments.local import run_local
    return run_local(cfg, rd, progress)


def _run_allreduce(cfg: RunConfig, rd: RunDir) -> float:
    import collectives
    from experiments.allreduce_run import allreduce_worker
    t = time.perf_counter()
    try:
        collectives.launch(allreduce_worker, world_size=cfg.train.workers, backend=cfg.train.backend,
                           args=(cfg.to_dict(), str(rd.path)), timeout=cfg.train.timeout_s,
                           start_method=START_METHOD)
    except collectives.LaunchError as e:
        raise ExperimentError(f"allreduce run failed: {str(e).splitlines()[0]}") from e
    return time.perf_counter() - t
