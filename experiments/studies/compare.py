"""`pslab compare`: one workload under local, allreduce BSP, ps-bsp, ps-ssp and ps-asp, without and with one
straggler, then report.md + plots. Only the sync strategy and the straggler change between runs: model, data, seed
and batch schedule are identical.

The default workload is `experiments/configs/compare_default.toml`, sized for a 2-core laptop (under a minute):
digits-MLP, 4 workers x 100 steps; each step's compute is padded to 20 ms (sleep) so that a 4x straggler is a real,
visible effect rather than noise on a shared CPU. `--set parallel.tp=2` (etc.) compares the strategies on split
models too.
`local` runs once (a single process has no straggler to wait for), and not at all under --simulate.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

from experiments.config import ParallelConfig, RunConfig, load_config
from experiments.errors import ExperimentError
from experiments.results.rundir import RunDir
from experiments.results.report import write_report
from experiments.runner import execute

DEFAULT_STRATEGIES = ("local", "allreduce", "ps-bsp", "ps-ssp:3", "ps-asp")
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "compare_default.toml"
STRAGGLER_FACTOR = 4.0


def default_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """`path`, or the compare default (experiments/configs/compare_default.toml, its only home), plus overrides."""
    return load_config(path if path is not None else DEFAULT_CONFIG, list(overrides))


def with_straggler(cfg: RunConfig, factor: float = STRAGGLER_FACTOR) -> RunConfig:
    c = copy.deepcopy(cfg)
    c.stragglers.factors = {cfg.train.workers - 1: factor}
    return c.validate()


def run_compare(cfg: RunConfig, out: Path, strategies: tuple[str, ...] = DEFAULT_STRATEGIES,
                straggler: bool = True, simulate: bool = False, quiet: bool = False,
                force: bool = False) -> tuple[Path, list[dict]]:
    out = Path(out)
    planned = [s for s in strategies if not (s == "local" and simulate)]
    if not planned:
        raise ExperimentError("nothing to run: the simulator has no `local` strategy (it simulates workers and "
                              "shards); add a strategy such as ps-asp or allreduce")
    t0 = time.perf_counter()
    cfg.stragglers.factors = {}
    conditions = [(False, cfg)] + ([(True, with_straggler(cfg))] if straggler else [])
    runs: list[dict[str, Any]] = []
    for strag, base in conditions:
        for s in strategies:
            if s == "local" and (strag or simulate):
                continue
            c = copy.deepcopy(base)
            c.train.strategy = s
            if s == "local":          # the single-process reference trains the unsplit model: same updates
                c.parallel = ParallelConfig(activation_checkpointing=c.parallel.activation_checkpointing)
            c.validate()
            rd = execute(c, out / "runs", simulate=simulate, quiet=quiet, force=force)
            runs.append(RunDir(rd.path).load())
    elapsed = time.perf_counter() - t0
    K = cfg.train.workers
    intro = (f"Workload `{cfg.workload.name}`, {K} workers x {cfg.train.steps} steps, batch "
             f"{cfg.workload.batch_size} per worker, optimizer {cfg.train.optimizer} (lr {cfg.train.lr}), seed "
             f"{cfg.workload.seed}. " + (f"Straggler runs (dashed / hatched): worker {K - 1} is "
             f"{STRAGGLER_FACTOR:g}x slower. " if straggler else "") +
             ("Simulated in virtual time. " if simulate else
              "Real processes on this machine; " + (f"each step's compute padded to {cfg.train.base_step_s * 1e3:g} ms. "
                                                    if cfg.train.base_step_s > 0 else "no compute padding. ")) +
             (f"Model split: {cfg.parallel.describe()} (`local` trains the unsplit model). "
              if cfg.parallel.describe() else "") +
             ("`local` is one process doing the same updates with no communication" +
              (" (its steps are padded like the workers', so it is ideal BSP; it runs once, having no straggler to "
               "wait for). " if straggler and cfg.train.base_step_s > 0 else
               " (its steps are padded like the workers', so it is ideal BSP). " if cfg.train.base_step_s > 0 else
               " (it computes the K gradients one after another). ")
              if "local" in planned else "") +
             "Throughput counts updates while all workers are still running. "
             f"Total time {elapsed:.0f} s.")
    report = write_report(runs, out, "pslab compare: synchronous vs asynchronous training", intro)
    return report, runs
