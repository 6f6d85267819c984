"""Run one config end to end: make the run directory, run it (real ranks through `strategies.launch`, or the
simulator), show a progress bar, merge the per-process metric files, and write summary.json.

Real runs are the one training loop (`strategies/loop.py`) on every rank; the first failure or the timeout ends
them all, and parameter-server runs always stop their shards. Ctrl-C ends every process, merges what was written,
and leaves the run directory without summary.json — marked interrupted in env.json.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pslab.experiments.config import RunConfig
from pslab.experiments.errors import ConfigError
from pslab.experiments.results.records import summarize
from pslab.experiments.results.rundir import RunDir, read_jsonl
from pslab.experiments.strategies.build import check_layout, check_processes
from pslab.experiments.strategies.launch import collect, run_ranks, summary_fields
from pslab.experiments.strategies.spec import lr_fields
from pslab.experiments.workloads import Workload, get_workload

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
    if cfg.strategy.ring and cfg.train.backend != "zmq":
        lab += f"[{cfg.train.backend}]"
    if cfg.parallel.describe():
        lab += f"[{cfg.parallel.describe()}]"
    if cfg.stragglers.active:
        lab += " +straggler"
    if simulated:
        lab += " (timing-only)" if cfg.simulate.timing_only else " (simulated)"
    return lab


def execute(cfg: RunConfig, root: str | Path = "runs", label: str | None = None, simulate: bool | None = None,
            quiet: bool = False, force: bool = False, resume: RunDir | None = None) -> RunDir:
    """Run `cfg` and return its run directory (summary.json written on success). `force`: allow more processes
    than `check_processes` admits on this machine. `resume`: continue that run directory from its newest valid
    engine checkpoint, appending to its records (`strategies/resume.py`; cfg from `resume.resume_config`)."""
    import torch
    torch.set_num_threads(1)  # this process too (and so the forked workers) — the machines here have 2 cores
    sim = (cfg.simulate.enabled or cfg.simulate.timing_only) if simulate is None else simulate
    if cfg.simulate.timing_only and not sim:
        raise ConfigError("simulate.timing_only is a mode of the simulator: add --simulate (or use --timing-only)")
    if sim:
        cfg.simulate.enabled = True
        cfg.validate()
    if sim and cfg.trace.enabled:
        raise ConfigError("trace.enabled records what real processes did; a simulated run has none: drop --simulate "
                          "(or the trace)")
    if sim and resume is not None:
        raise ConfigError("--resume continues a real run from its engine checkpoints; drop --simulate")
    if cfg.logging.tensorboard:               # before anything runs: the missing package is one line
        from pslab.experiments.results.tensorboard import require_tensorboard
        require_tensorboard()
    if not sim:
        check_processes(cfg, force)
    wl = _preload(cfg)
    if not sim:
        check_layout(cfg, wl)
    label = label or default_label(cfg, sim)
    plan = None
    if resume is not None:
        from pslab.experiments.strategies import resume as resuming
        rd, plan = resume, resuming.prepare(cfg, resume)
        label = json.loads((rd.path / "env.json").read_text()).get("label", label)
    else:
        rd = RunDir.create(root, label, cfg, {"label": label, "simulated": sim})
    total = cfg.train.workers * cfg.train.steps
    bar = tqdm(total=total, desc=label[:34].ljust(34), unit="grad", disable=quiet, leave=not quiet)
    extra: dict[str, Any] = {}
    results: list[Any] = []
    t0 = time.perf_counter()
    ok = False
    try:
        if sim:
            from pslab.experiments.sim.ps import simulate as run_sim
            extra = run_sim(cfg, rd, bar.update)
        else:
            with _FilePoller(rd, bar):
                results = run_ranks(cfg, rd)
            extra = summary_fields(cfg, results)
        ok = True
    finally:
        if plan is not None:
            resuming.append_parts(cfg, rd, plan)
        collect(cfg, rd, results)
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
        elapsed = max([extra["virtual_time_s"]] + [u["time_s"] for u in updates])
    else:
        elapsed = max([1e-9] + [u["time_s"] for u in updates] + [e["time_s"] for e in evals])
    summary = summarize(updates, evals, elapsed, label, sim, target_acc=cfg.train.target_acc)
    summary.update(strategy=cfg.strategy.label, straggler=cfg.stragglers.active, wall_s=wall, **extra,
                   train_examples=wl.data.n_train,
                   **lr_fields(cfg.train, summary["updates"] - summary["dropped"], cfg.workload.batch_size))
    if resume is not None:                # the label is the run's; the layout it was resumed at is this
        summary["resumed_as"] = default_label(cfg, False)
    rd.write_summary(summary)
    if cfg.logging.tensorboard:
        from pslab.experiments.results.tensorboard import write_tensorboard
        write_tensorboard(rd.path)
    return rd


def _preload(cfg: RunConfig) -> Workload:
    """Load the dataset and the lazily-imported parts of torch (torch.optim pulls in torch._dynamo, seconds on a
    busy machine) once here, so forked workers and servers inherit them instead of each importing them again."""
    import torch._dynamo  # noqa: F401
    return get_workload(cfg.workload.name, cfg.train.workers, cfg.workload.batch_size, cfg.workload.seed,
                          **cfg.workload.overrides())
