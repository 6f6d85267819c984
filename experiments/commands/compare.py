"""`pslab compare`: the main job — sync vs async on one workload, with and without a straggler, as a report."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from experiments.commands.common import add_config_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="compare local / allreduce / ps-bsp / ps-ssp / ps-asp, with and without "
                                       "a straggler; writes report.md and plots")
    add_config_args(p)
    p.add_argument("--out", default=None, help="output directory (default: runs/compare-<UTC time>)")
    p.add_argument("--strategies", default=None,
                   help="comma-separated strategies (default: local,allreduce,ps-bsp,ps-ssp:3,ps-asp)")
    p.add_argument("--no-straggler", action="store_true", help="skip the runs with a straggler")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from experiments.studies.compare import DEFAULT_STRATEGIES, default_config, run_compare
    from experiments.results.report import summary_table
    from experiments.strategies.spec import parse_strategy
    cfg = default_config(args.config, args.overrides)
    strategies = tuple(s.strip() for s in args.strategies.split(",")) if args.strategies else DEFAULT_STRATEGIES
    for s in strategies:
        parse_strategy(s)
    out = Path(args.out or f"runs/compare-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
    t0 = time.perf_counter()
    report, runs = run_compare(cfg, out, strategies, straggler=not args.no_straggler, simulate=args.simulate,
                               quiet=args.quiet)
    print(summary_table(runs))
    print(f"\nreport: {report}   ({time.perf_counter() - t0:.0f} s)")
    return 0
