"""`pslab compare`: one workload under local, allreduce BSP, ps-bsp, ps-ssp and ps-asp, without and with one
straggler, then report.md + plots. Only the sync strategy and the straggler change between runs: model, data, seed
and batch schedule are identical.

The default workload is `experiments/configs/compare_default.toml`, sized for a 2-core laptop (under a minute):
digits-MLP, 4 workers x 100 steps; each step's compute is padded to 20 ms (sleep) so that a 4x straggler is a real,
visible effect rather than noise on a shared CPU. `--set parallel.tp=2` (etc.) compares the strategies on split
models too.
`local` runs once (a single process has no straggler to wait for), and not at all under --simulate.

Fair by construction (`experiments.studies.fairness`): `train.lr` is the learning rate per gradient, and a
strategy that averages K gradients per step steps with K x lr (linear scaling, train.lr_rule), or `--tune-lr` gives
each strategy its own best lr from a bracketing grid; the report states the rule, shows lr per gradient and per
step, optimizer steps and samples for every run, the time to `--target-acc`, and the seed-noise band of the
reference (`--noise-seeds` runs) that a difference must exceed.

`--preset failure` (`run_failure_compare`): each strategy without and with one failure (default: kill the last
worker when it starts step steps/2; `--failure` or `--set faults.events=[...]` to change it), everything else held
fixed, then the failure report (experiments/results/faults.py): the timeline and, per failure, time to detect, time
to recover, steps or updates lost and the final accuracy next to the no-failure run. Each strategy reacts by its
`[faults] on_failure` policy (auto: ps-* go on with the survivors, allreduce shrinks the ring to N - 1).
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

from pslab.experiments.config import RunConfig, example_config, load_config
from pslab.experiments.errors import ConfigError, ExperimentError
from pslab.experiments.results.rundir import RunDir
from pslab.experiments.results.report import write_report
from pslab.experiments.runner import execute
from pslab.experiments.studies.fairness import band_section, seed_band, tune_lr, tuning_section

DEFAULT_STRATEGIES = ("local", "allreduce", "ps-bsp", "ps-ssp:3", "ps-asp")
FAILURE_STRATEGIES = ("allreduce", "ps-bsp", "ps-ssp:3", "ps-asp")     # local has no worker to lose
DEFAULT_CONFIG = example_config("compare_default.toml")     # package data: found installed or not
STRAGGLER_FACTOR = 4.0
NOISE_SEEDS = 5          # reference runs for the seed-noise band (0: none)
TARGET_ACC = 0.9         # the time-to-accuracy column


def default_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """`path`, or the compare default (experiments/configs/compare_default.toml, its only home), plus overrides."""
    return load_config(path if path is not None else DEFAULT_CONFIG, list(overrides))


def with_straggler(cfg: RunConfig, factor: float = STRAGGLER_FACTOR) -> RunConfig:
    c = copy.deepcopy(cfg)
    c.stragglers.factors = {cfg.train.workers - 1: factor}
    return c.validate()


def run_compare(cfg: RunConfig, out: Path, strategies: tuple[str, ...] = DEFAULT_STRATEGIES,
                straggler: bool = True, simulate: bool = False, quiet: bool = False,
                force: bool = False, noise_seeds: int = NOISE_SEEDS, target_acc: float | None = TARGET_ACC,
                tune: bool = False, trace: bool = False) -> tuple[Path, list[dict]]:
    """Run every strategy without and with a straggler; with `tune`, each at its own tuned lr (fairness.tune_lr),
    else at train.lr per gradient under train.lr_rule. `noise_seeds` reference runs give the seed-noise band.
    `trace`: the runs record their timelines; the report draws the straggler runs' side by side (else all)."""
    out = Path(out)
    planned = [s for s in strategies if not (s == "local" and simulate)]
    if not planned:
        raise ExperimentError("nothing to run: the simulator has no `local` strategy (it simulates workers and "
                              "shards); add a strategy such as ps-asp or allreduce")
    if noise_seeds < 0 or noise_seeds == 1:
        raise ExperimentError(f"--noise-seeds must be 0 (no band) or >= 2 (a spread needs two runs), got {noise_seeds}")
    if tune and cfg.simulate.timing_only:
        raise ExperimentError("--tune-lr compares training losses, which a timing-only simulation does not compute: "
                              "drop --timing-only (or --tune-lr)")
    if cfg.simulate.timing_only:
        noise_seeds = 0                                 # no loss, no accuracy: nothing to band
    if target_acc is not None and not 0 < target_acc <= 1:
        raise ExperimentError(f"--target-acc must be in (0, 1], e.g. 0.9, got {target_acc}")
    t0 = time.perf_counter()
    cfg.stragglers.factors = {}

    def run(c: RunConfig, root: Path, label: str | None = None) -> Any:
        return execute(c, root, label=label, simulate=simulate, quiet=True if label else quiet, force=force)
    tuned: dict[str, tuple[float, list]] = {}
    if tune:
        say = None if quiet else (lambda m: print(f"  tune-lr: {m}", flush=True))
        for s in planned:
            tuned[s] = tune_lr(cfg, s, out / "tune", run, say)
    conditions = [(False, cfg)] + ([(True, with_straggler(cfg))] if straggler else [])
    runs: list[dict[str, Any]] = []
    for strag, base in conditions:
        for s in planned:
            if s == "local" and strag:
                continue
            c = copy.deepcopy(base)
            c.train.strategy = s
            if s in tuned:
                c.train.lr = tuned[s][0]
            if s == "local":          # the single-process reference trains the unsplit model: same updates
                c.parallel = c.parallel.unsplit()
            c.trace.enabled = trace and not simulate
            c.validate()
            rd = run(c, out / "runs")
            runs.append(RunDir(rd.path).load())
    sections = []
    if noise_seeds:
        sections.append(band_section(seed_band(cfg, out / "seeds", run, noise_seeds, simulate), runs))
    if tuned:
        sections.append(tuning_section(tuned))
    elapsed = time.perf_counter() - t0
    stragglers = [r for r in runs if (r.get("summary") or {}).get("straggler")]
    report = write_report(runs, out, "pslab compare: synchronous vs asynchronous training",
                          _intro(cfg, planned, straggler, simulate, tune, elapsed), target_acc, sections,
                          timeline=stragglers or runs)
    return report, runs


def _intro(cfg: RunConfig, planned: list[str], straggler: bool, simulate: bool, tune: bool, elapsed: float) -> str:
    K, t = cfg.train.workers, cfg.train
    rule = {"linear": f"the linear scaling rule: a step that averages the K = {K} workers' gradients uses K x the "
                      f"per-gradient lr (Goyal et al. 2017)",
            "sqrt": f"square-root scaling: a step that averages K = {K} gradients uses sqrt(K) x the per-gradient lr",
            "none": "one step lr for every strategy (train.lr_rule = none): averaging strategies learn K times less "
                    "per gradient"}[t.lr_rule]
    lr = (f"learning rate: each strategy's own, tuned (section below; steps follow {rule})" if tune else
          f"learning rate {t.lr} per gradient, by {rule}")
    return (f"Workload `{cfg.workload.name}`, {K} workers x {t.steps} steps, batch {cfg.workload.batch_size} per "
            f"worker, optimizer {t.optimizer}, {lr}; seed {cfg.workload.seed}. "
            "**Held fixed**: model, initial weights, data, each worker's batch sequence, steps per worker, compute "
            "per step and the lr rule; only the synchronisation changes (and, in the straggler runs, one worker's "
            "speed). " +
            (f"Straggler runs (dashed / hatched): worker {K - 1} is {STRAGGLER_FACTOR:g}x slower. " if straggler else "") +
            ("Simulated in virtual time. " if simulate else
             "Real processes on this machine; " + (f"each step's compute padded to {t.base_step_s * 1e3:g} ms. "
                                                   if t.base_step_s > 0 else "no compute padding. ")) +
            (f"Model split: {cfg.parallel.describe()} (`local` trains the unsplit model). "
             if cfg.parallel.describe() else "") +
            ("`local` is one process doing the same updates with no communication" +
             (" (its steps are padded like the workers', so it is ideal BSP; it runs once, having no straggler to "
              "wait for). " if straggler and t.base_step_s > 0 else
              " (its steps are padded like the workers', so it is ideal BSP). " if t.base_step_s > 0 else
              " (it computes the K gradients one after another). ")
             if "local" in planned else "") +
            "Throughput counts updates while all workers are still running. "
            f"Total time {elapsed:.0f} s.")


def default_failure(cfg: RunConfig) -> list[dict[str, Any]]:
    """The preset's failure: kill the last worker when it starts step steps // 2."""
    return [{"kill": f"worker:{cfg.train.workers - 1}", "at_step": cfg.train.steps // 2}]


def parse_failure(text: str) -> list[dict[str, Any]]:
    """--failure: "kill=worker:3,at_step=50" (one event, key=value pairs) or TOML: one inline table
    {kill = "worker:3", at_step = 50} or a list of them. Values are checked by the [faults] validation."""
    import tomllib
    text = text.strip()
    if text.startswith(("[", "{")):
        try:
            v = tomllib.loads(f"x = {text}")["x"]
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"--failure {text!r} is not a TOML table or list of tables: {e}") from None
        return v if isinstance(v, list) else [v]
    event: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--failure: {item!r} is not key=value; e.g. --failure \"kill=worker:3,at_step=50\"")
        value = value.strip()
        try:
            event[key.strip()] = int(value)
        except ValueError:
            try:
                event[key.strip()] = float(value)
            except ValueError:
                event[key.strip()] = value
    if not event:
        raise ConfigError("--failure needs an event, e.g. --failure \"kill=worker:3,at_step=50\"")
    return [event]


def run_failure_compare(cfg: RunConfig, out: Path, strategies: tuple[str, ...] = FAILURE_STRATEGIES,
                        events: list[dict[str, Any]] | None = None, simulate: bool = False, quiet: bool = False,
                        force: bool = False, target_acc: float | None = TARGET_ACC) -> tuple[Path, list[dict]]:
    """Every strategy without and with `events` (default `default_failure`), then report.md with the failure
    report. Real runs by default (experiments.runner.execute with the [faults] section), virtual time with
    `simulate`."""
    out = Path(out)
    if "local" in strategies:
        raise ExperimentError("--preset failure: strategy local is one process, it has no worker to lose; use "
                              "allreduce and ps-* strategies")
    if not strategies:
        raise ExperimentError("--preset failure needs at least one strategy, e.g. --strategies allreduce,ps-asp")
    if target_acc is not None and not 0 < target_acc <= 1:
        raise ExperimentError(f"--target-acc must be in (0, 1], e.g. 0.9, got {target_acc}")
    events = events if events is not None else (list(cfg.faults.events) or default_failure(cfg))
    t0 = time.perf_counter()
    cfg.stragglers.factors = {}
    for s in strategies:                 # every (strategy, failure) checked before the first run starts
        c = copy.deepcopy(cfg)
        c.train.strategy, c.faults.events = s, copy.deepcopy(events)
        c.validate()
    runs: list[dict[str, Any]] = []
    for s in strategies:
        for failing in (False, True):
            c = copy.deepcopy(cfg)
            c.train.strategy = s
            c.faults.events = copy.deepcopy(events) if failing else []
            c.validate()
            what = ", ".join(_describe(e) for e in c.faults.parsed())
            label = f"{s}" + (f" + {what}" if failing else "") + (" (simulated)" if simulate else "")
            rd = execute(c, out / "runs", label=label, simulate=simulate, quiet=quiet, force=force)
            runs.append(RunDir(rd.path).load())
    elapsed = time.perf_counter() - t0
    report = write_report(runs, out, "pslab compare --preset failure: surviving a failure",
                          _failure_intro(cfg, list(strategies), events, simulate, elapsed), target_acc)
    return report, runs


def _describe(e: Any) -> str:
    trig = f"step {e.at_step}" if e.at_step is not None else f"{e.at_s:g} s"
    return f"{e.action} {e.who} at {trig}" + (f" for {e.for_s:g} s" if e.action == "stop" else "")


def _failure_intro(cfg: RunConfig, strategies: list[str], events: list[dict[str, Any]], simulate: bool,
                   elapsed: float) -> str:
    from pslab.experiments.strategies.spec import parse_strategy
    f, t = cfg.faults, cfg.train
    c = copy.deepcopy(cfg)
    c.faults.events = copy.deepcopy(events)
    what = "; ".join(_describe(e) for e in c.faults.parsed())
    policies = ", ".join(f"{s}: {f.policy(parse_strategy(s).kind)}" for s in strategies)
    return (f"Workload `{cfg.workload.name}`, {t.workers} workers x {t.steps} steps, batch "
            f"{cfg.workload.batch_size} per worker, lr {t.lr} per gradient ({t.lr_rule} rule). Each strategy runs "
            f"twice, identical but for the failure: **{what}**. What each does about it (`[faults] on_failure` = "
            f"{f.on_failure}): {policies} -- continue: the PS goes on with the survivors (ps-bsp / ps-ssp gates stop "
            f"waiting for the dead worker once it is detected); shrink: the all-reduce survivors roll back to their "
            f"last commit (every {f.commit_every} step(s)) and rebuild the ring at N - 1, whose steps use the lr "
            f"rule at G = N - 1; replace: a replacement joins and N returns. Detection: a killed process at once "
            f"(its exit code), a hung one after faults.detect_s = {f.detect_s:g} s without heartbeats. " +
            ("Simulated in virtual time (experiments/sim/faults.py states the detection and recovery cost model). "
             if simulate else "Real processes on this machine; the supervisor injects the signals. ") +
            "The article's last section: at thousands of GPUs a failure is a near-certainty, so what a failure costs "
            "-- the time to notice it, the time to recover, the work lost -- decides whether training survives it. "
            f"Total time {elapsed:.0f} s.")
