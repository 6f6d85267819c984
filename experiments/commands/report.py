"""`pslab report RUN_DIR... [--out DIR]`: re-render plots and the summary table from saved runs (overlaid)."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="re-render report.md and plots from saved run directories (overlaid)")
    p.add_argument("runs", nargs="+", help="run directories, or directories that contain run directories "
                                           "(e.g. a compare output)")
    p.add_argument("--out", default=None, help="where to write report.md and the PNGs (default: RUNS/report for one "
                                               "directory argument, else ./report)")
    p.add_argument("--title", default="pslab report")
    p.set_defaults(func=run)


def find_runs(paths: list[str]) -> list[Path]:
    from pslab.experiments.errors import ExperimentError
    found: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise ExperimentError(f"no such run directory: {p}")
        if (p / "config.toml").exists():
            found.append(p)
            continue
        subs = sorted(q.parent for q in p.glob("**/config.toml"))
        if not subs:
            raise ExperimentError(f"{p} holds no pslab runs (no config.toml below it)")
        found += subs
    return found


def run(args: argparse.Namespace) -> int:
    from pslab.experiments.results.rundir import RunDir
    from pslab.experiments.results.report import summary_table, write_report
    import sys
    runs = [RunDir(p).load() for p in find_runs(args.runs)]
    for r in runs:
        if r["summary"] is None:
            print(f"pslab: warning: {r['path']} has no summary.json (interrupted or still running): plotted from the "
                  "records it has", file=sys.stderr)
    out = Path(args.out) if args.out else (Path(args.runs[0]) / "report" if len(args.runs) == 1 else Path("report"))
    report = write_report(runs, out, args.title)
    print(summary_table(runs))
    print(f"\nreport: {report}")
    return 0
