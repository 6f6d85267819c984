"""pslab's Python API: `run`, `compare` and `load`, each result with pandas DataFrames — what `pslab run`,
`pslab compare` and `pslab report` do, callable from a script or a Jupyter kernel.

    import pslab
    r = pslab.run("compare_default.toml", set=["train.strategy=ps-asp", "train.steps=50"])
    r.metrics            # one row per update: worker, step, clock, time_s, loss, staleness, bytes_sent, ...
    r.evals              # one row per evaluation: updates, time_s, test_loss, test_acc
    r.summary            # the run's summary.json as a dict (None if the run was interrupted)

    c = pslab.compare(strategies=["allreduce", "ps-asp"], straggler=False, set=["train.steps=50"])
    c.summary            # one row per run: label, strategy, and every scalar of its summary
    c.metrics            # every run's updates, with a `run` column
    pslab.load(c.path)   # the same Comparison again, from its folder (or a Run from a run directory)

The DataFrames are read from the run directory's files (experiments/results/rundir.py: metrics.jsonl, eval.jsonl,
events.jsonl, summary.json), so a loaded result equals the one returned, and the files stay the record.

In a notebook. Ranks and shards are started from a fresh forkserver / spawned interpreter (never a fork of the
kernel), and the functions they run live in pslab's modules, so nothing of the kernel is pickled. A run leaves no
process-wide state behind: torch's intra-op thread count (a run sets 1 for its ranks) is restored, no signal
handler is installed. An interrupt (Ctrl-C, the kernel's stop button) stops every rank and shard, removes their
shared memory, marks the run directory interrupted and re-raises KeyboardInterrupt.

Errors are pslab's exception classes (pslab.experiments.errors.ExperimentError and the layers' own), with the same
one-line messages the command prints.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pslab.experiments.config import RunConfig, apply, load_config
from pslab.experiments.errors import ExperimentError

__all__ = ["Run", "Comparison", "run", "compare", "load"]


def _frame(records: list[dict[str, Any]]) -> Any:
    import pandas as pd
    return pd.DataFrame.from_records(records)


@dataclass
class Run:
    """One run directory, read: `metrics` (per update), `evals`, `events` (failures) as DataFrames; `summary`,
    `config` (the resolved TOML) and `env` (versions, host, argv) as dicts."""
    path: Path
    config: dict[str, Any]
    summary: dict[str, Any] | None
    env: dict[str, Any]
    metrics: Any = field(repr=False)
    evals: Any = field(repr=False)
    events: Any = field(repr=False)

    @property
    def label(self) -> str:
        return str(self.env.get("label") or self.path.name)

    @property
    def strategy(self) -> str:
        return str(self.config.get("train", {}).get("strategy", ""))

    @property
    def interrupted(self) -> bool:
        return self.summary is None or bool(self.env.get("interrupted"))

    def __repr__(self) -> str:
        acc = (self.summary or {}).get("final_test_acc")
        state = "interrupted" if self.interrupted else f"final_test_acc={acc}"
        return f"Run({self.label!r}, {len(self.metrics)} updates, {state}, path={str(self.path)!r})"


def flat_scalars(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A summary's scalars, nested dicts flattened to 'a.b' columns (lists and None-valued dicts dropped)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(flat_scalars(v, f"{prefix}{k}."))
        elif v is None or isinstance(v, (bool, int, float, str)):
            out[f"{prefix}{k}"] = v
    return out


@dataclass
class Comparison:
    """A `compare` folder, read: its runs in the order the report lists them, and the report's path."""
    path: Path
    runs: list[Run]

    @property
    def report(self) -> Path:
        return self.path / "report.md"

    @property
    def summary(self) -> Any:
        """One row per run: label, strategy, then the summary's scalars (straggler, updates_per_s, final_test_acc,
        staleness_mean, ...; nested ones as 'bytes_by_kind.dp gradient sync.measured_per_step')."""
        import pandas as pd
        return pd.DataFrame.from_records([{"label": r.label, "strategy": r.strategy, **flat_scalars(r.summary or {})}
                                          for r in self.runs])

    @property
    def metrics(self) -> Any:
        return stack(self.runs, "metrics")

    @property
    def evals(self) -> Any:
        return stack(self.runs, "evals")

    def __getitem__(self, label: str) -> Run:
        for r in self.runs:
            if r.label == label:
                return r
        raise KeyError(f"no run labelled {label!r}; runs: {', '.join(r.label for r in self.runs)}")

    def __repr__(self) -> str:
        return f"Comparison({len(self.runs)} runs: {', '.join(r.label for r in self.runs)}; path={str(self.path)!r})"


def stack(runs: Sequence[Run], what: str, with_dir: bool = False) -> Any:
    """The runs' `what` frames ("metrics", "evals", "events") as one, each row tagged with its run's label
    (`run`) and, `with_dir`, its directory (`run_dir`)."""
    import pandas as pd
    tags = lambda r: {"run": r.label, **({"run_dir": str(r.path)} if with_dir else {})}    # noqa: E731
    parts = [getattr(r, what).assign(**tags(r)) for r in runs if len(getattr(r, what))]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=["run"] + ["run_dir"] * with_dir)


def read_run(path: Path) -> Run:
    from pslab.experiments.results.rundir import RunDir
    d = RunDir(path).load()                       # ExperimentError if it is not a run directory
    env_p = path / "env.json"
    env = json.loads(env_p.read_text()) if env_p.is_file() else {}
    return Run(path=path, config=d["config"], summary=d["summary"], env=env, metrics=_frame(d["updates"]),
               evals=_frame(d["evals"]), events=_frame(d["events"]))


def _run_dirs(folder: Path) -> list[Path]:
    """A compare folder's run directories in the order they ran (each config.toml is written as its run starts)."""
    return sorted((p.parent for p in (folder / "runs").glob("*/config.toml")), key=lambda d: (
        (d / "config.toml").stat().st_mtime_ns, d.name))


def load(path: str | Path) -> Run | Comparison:
    """A run directory (`pslab run`'s output) as a Run, or a `pslab compare` folder as a Comparison."""
    p = Path(path)
    if (p / "config.toml").is_file():
        return read_run(p)
    dirs = _run_dirs(p) if (p / "runs").is_dir() else []
    if dirs:
        return Comparison(path=p, runs=[read_run(d) for d in dirs])
    raise ExperimentError(f"{p} is neither a pslab run directory (config.toml) nor a compare folder (runs/*/)")


def _config(config: str | Path | RunConfig | Mapping[str, Any] | None, overrides: Sequence[str]) -> RunConfig:
    """A RunConfig from a file path (or a shipped example's name), a RunConfig (copied), a dict of sections
    ({'train': {'strategy': 'ps-asp'}}), or None (the compare default); then `overrides` ('train.steps=50')."""
    import copy
    if isinstance(overrides, str):
        raise ExperimentError(f"set= takes a list of 'section.key=value' strings, got the string {overrides!r}")
    if isinstance(config, RunConfig):
        return load_config(None, list(overrides), base=copy.deepcopy(config))
    if isinstance(config, Mapping):
        return load_config(None, list(overrides), base=apply(RunConfig(), dict(config), "config dict"))
    from pslab.experiments.studies.compare import DEFAULT_CONFIG
    return load_config(DEFAULT_CONFIG if config is None else config, list(overrides))


@contextlib.contextmanager
def _no_leftover_state() -> Iterator[None]:
    """Restore what a run changes in the calling process: torch's intra-op thread count."""
    import torch
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run(config: str | Path | RunConfig | Mapping[str, Any] | None = None, *, set: Sequence[str] = (),
        out: str | Path = "runs", label: str | None = None, simulate: bool | None = None, progress: bool = True,
        force: bool = False) -> Run:
    """`pslab run`: one run of `config` (a TOML path or shipped example name, a RunConfig, a dict of sections;
    default: compare's default workload) with `set` overrides, into a new directory under `out`; returns it read.
    `simulate`: the discrete-event simulator (None: as the config says). `force`: more processes than this machine
    admits by default."""
    from pslab.experiments.runner import execute
    cfg = _config(config, set)
    with _no_leftover_state():
        rd = execute(cfg, out, label=label, simulate=simulate, quiet=not progress, force=force)
    return read_run(rd.path)


def compare(config: str | Path | RunConfig | Mapping[str, Any] | None = None, *, set: Sequence[str] = (),
            strategies: Sequence[str] | None = None, straggler: bool = True, simulate: bool = False,
            out: str | Path | None = None, progress: bool = True, noise_seeds: int | None = None,
            target_acc: float | None = None, tune_lr: bool = False, force: bool = False) -> Comparison:
    """`pslab compare`: each of `strategies` (default local, allreduce, ps-bsp, ps-ssp:3, ps-asp) on one workload,
    without and (`straggler`) with a 4x straggler on the last worker, at the fair lr rule (or `tune_lr`); writes
    the report under `out` (default runs/compare-<time>) and returns the Comparison. `noise_seeds` reference runs
    give the seed-noise band (default 5; 0: none)."""
    import time
    from pslab.experiments.strategies.spec import parse_strategy
    from pslab.experiments.studies import compare as cmp
    cfg = _config(config, set)
    chosen = tuple(strategies) if strategies is not None else cmp.DEFAULT_STRATEGIES
    if isinstance(strategies, str) or not chosen:
        raise ExperimentError("strategies= takes a non-empty list, e.g. ['allreduce', 'ps-asp']")
    for s in chosen:
        parse_strategy(s)                               # one line for a bad name, before anything runs
    folder = Path(out) if out is not None else Path("runs") / time.strftime("compare-%Y%m%d-%H%M%S", time.gmtime())
    with _no_leftover_state():
        cmp.run_compare(cfg, folder, chosen, straggler=straggler, simulate=simulate, quiet=not progress,
                        force=force, noise_seeds=cmp.NOISE_SEEDS if noise_seeds is None else noise_seeds,
                        target_acc=cmp.TARGET_ACC if target_acc is None else target_acc, tune=tune_lr)
    return Comparison(path=folder, runs=[read_run(d) for d in _run_dirs(folder)])
