"""`pslab compare`: the main job — sync vs async on one workload, with and without a straggler, as a report.

    pslab compare                                              # experiments/configs/compare_default.toml
    pslab compare --strategies allreduce,ps-ssp:1,ps-asp --set train.workers=8
    pslab compare --config experiments/configs/transformer_tp.toml --no-straggler     # on a tp-split model

Only the strategy (and, in the second half, one 4x straggler on the last worker) changes between runs: model, data,
seed, batch schedule and [parallel] layout are the same (`local`, the single-process reference, trains the unsplit
model). Writes report.md with a summary table, bytes per step by kind, and eight plots.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from experiments.commands.common import add_config_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="compare local / allreduce / ps-bsp / ps-ssp / ps-asp, with and without "
                                       "a straggler; writes report.md and plots",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    from experiments.errors import ConfigError
    if any(o.split("=", 1)[0].strip() == "train.strategy" for o in args.overrides):
        raise ConfigError("pslab compare sets train.strategy itself, one run per strategy: use --strategies "
                          "A,B,... instead of --set train.strategy=...")
    cfg = default_config(args.config, args.overrides)
    if args.strategies is None:
        strategies = DEFAULT_STRATEGIES
    else:
        strategies = tuple(s.strip() for s in args.strategies.split(",") if s.strip())
        if not strategies:
            raise ConfigError("--strategies needs at least one strategy, e.g. --strategies allreduce,ps-asp")
    for s in strategies:
        parse_strategy(s)
    out = Path(args.out or f"runs/compare-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
    t0 = time.perf_counter()
    report, runs = run_compare(cfg, out, strategies, straggler=not args.no_straggler, simulate=args.simulate,
                               quiet=args.quiet, force=args.force)
    print(summary_table(runs))
    print(f"\nreport: {report}   ({time.perf_counter() - t0:.0f} s)")
    return 0
