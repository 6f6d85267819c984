"""`pslab export RUN_DIR... [--out DIR] [--parquet | --tensorboard]`: a run's records for other tools.

Tables (CSV, or Parquet): metrics (one row per update), evals, events (failures) and summary (one row per run,
nested fields flattened to 'a.b' columns), every row tagged with its run's label and directory — for pandas, R, a
spreadsheet. `--tensorboard` writes each run's scalars into RUN_DIR/tensorboard instead (results/tensorboard.py).
The data are the run directory's JSON lines (experiments/results/rundir.py documents the layout); `pslab.load`
gives them as DataFrames without a file in between."""

from __future__ import annotations

import argparse
from pathlib import Path

TABLES = ("metrics", "evals", "events", "summary")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write runs' metrics, evaluations, events and summaries as CSV (or Parquet)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directories, or directories that contain run directories "
                                           "(e.g. a compare output)")
    p.add_argument("--out", default=None, help="where to write the tables (default: RUN/export for one directory "
                                               "argument, else ./export)")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--csv", dest="fmt", action="store_const", const="csv", help="CSV files (the default)")
    fmt.add_argument("--parquet", dest="fmt", action="store_const", const="parquet",
                     help="Parquet files (needs pyarrow: pip install pyarrow)")
    fmt.add_argument("--tensorboard", dest="fmt", action="store_const", const="tensorboard",
                     help="TensorBoard scalars into each RUN_DIR/tensorboard (needs tensorboard; "
                          "then: tensorboard --logdir RUN_DIR)")
    p.set_defaults(func=run, fmt="csv")


def tables(run_dirs: list[Path]) -> dict[str, object]:
    """{'metrics' | 'evals' | 'events' | 'summary': DataFrame} over `run_dirs`, each row with `run` and `run_dir`."""
    import pandas as pd
    from pslab.experiments.api import flat_scalars, read_run, stack
    runs = [read_run(d) for d in run_dirs]
    out: dict[str, object] = {name: stack(runs, name, with_dir=True) for name in ("metrics", "evals", "events")}
    out["summary"] = pd.DataFrame.from_records([{"run": r.label, "run_dir": str(r.path), "strategy": r.strategy,
                                                 "interrupted": r.interrupted, **flat_scalars(r.summary or {})}
                                                for r in runs])
    return out


def run(args: argparse.Namespace) -> int:
    from pslab.experiments.commands.report import find_runs
    from pslab.experiments.errors import MissingDependencyError
    if args.fmt == "parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise MissingDependencyError("--parquet needs pyarrow: pip install pyarrow (or export --csv)") from None
    dirs = find_runs(args.runs)
    if args.fmt == "tensorboard":
        from pslab.experiments.results.tensorboard import write_tensorboard
        for d in dirs:
            print(f"{write_tensorboard(d)}")
        return 0
    out = Path(args.out) if args.out else (Path(args.runs[0]) / "export" if len(args.runs) == 1 else Path("export"))
    out.mkdir(parents=True, exist_ok=True)
    for name, frame in tables(dirs).items():
        path = out / f"{name}.{args.fmt}"
        frame.to_csv(path, index=False) if args.fmt == "csv" else frame.to_parquet(path, index=False)
        print(f"{path}  ({len(frame)} rows)")
    return 0
