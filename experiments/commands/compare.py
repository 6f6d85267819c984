"""`pslab compare`: the main job — sync vs async on one workload, with and without a straggler, as a report.

    pslab compare                                              # experiments/configs/compare_default.toml
    pslab compare --strategies allreduce,ps-ssp:1,ps-asp --set train.workers=8
    pslab compare --config experiments/configs/transformer_tp.toml --no-straggler     # on a tp-split model
    pslab compare --tune-lr                                    # each strategy at its own tuned lr (minutes)
    pslab compare --preset failure --simulate                  # each strategy without and with one failure
    pslab compare --preset failure --failure "stop=worker:1,at_step=20,for_s=5"
    pslab compare --preset failure --failure '[{kill = "worker:3", at_step = 50}, {kill = "shard:0", at_s = 1.0}]'
    pslab compare --preset communication                       # Local SGD, DiLoCo, top-k, PowerSGD vs BSP/SSP/ASP
    pslab compare --preset communication --seeds 5 --no-straggler --sim-workers 0

Only the strategy (and, in the second half, one 4x straggler on the last worker) changes between runs: model, data,
seed, batch schedule and [parallel] layout are the same (`local`, the single-process reference, trains the unsplit
model). Learning rates are fair by a stated rule: train.lr is per gradient, and a strategy that averages the K
workers' gradients into one step uses K x lr (train.lr_rule = linear | sqrt | none), or with --tune-lr each
strategy gets its best lr from a grid that brackets the optimum. Writes report.md with a summary table (lr per
gradient and per step, optimizer steps, samples, time to --target-acc), the seed-noise band of the reference, bytes
per step by kind, and the plots.

--preset failure: allreduce, ps-bsp, ps-ssp:3 and ps-asp (or --strategies), each without and with one failure
(default: kill the last worker when it starts step steps/2), real runs or --simulate (virtual time). Each reacts by
[faults] on_failure (auto: ps-* continue with the survivors, allreduce shrinks the ring to N-1 after rolling back to
its last commit; --set faults.on_failure=replace: a replacement joins). The report adds the failure timeline (world
size, throughput, loss across the failure) and a table: time to detect, time to recover, steps or updates lost,
final accuracy next to the no-failure run; the summary table gains the same columns.

--preset communication: bsp (allreduce), ssp:3, asp, local-sgd:4/16, diloco:16/64, ps-local:16, top-k 1 % with and
without error feedback and PowerSGD rank 2, every arm on --seeds N seeds (a count, >= 2: workload.seed, +1, ...;
default 3), without and with a 4x straggler, each worker on an emulated host joined by a 2 ms / 2 MB/s link (fixed
by the study: a --set topology.* is overwritten; train.steps 128 and train.base_step_s 0.01 unless --set), then
every arm in the simulator at --sim-workers workers (default 64; 0: none). report.md: bytes per sample, time to
--target-acc, final test loss next to bsp's seed band, the verdicts with a seed bootstrap, loss against bytes / time
/ samples (experiments/studies/communication.py). --strategies, --tune-lr, --noise-seeds and --simulate do not
apply to it. On the text transformer: --config experiments/configs/communication_lm.toml.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from pslab.experiments.commands.common import add_config_args

PRESETS = ("failure", "communication")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="compare local / allreduce / ps-bsp / ps-ssp / ps-asp, with and without "
                                       "a straggler; writes report.md and plots",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    p.add_argument("--out", default=None, help="output directory (default: runs/compare-<UTC time>)")
    p.add_argument("--strategies", default=None,
                   help="comma-separated strategies (default: local,allreduce,ps-bsp,ps-ssp:3,ps-asp)")
    p.add_argument("--no-straggler", action="store_true", help="skip the runs with a straggler")
    p.add_argument("--tune-lr", action="store_true",
                   help="tune each strategy's per-gradient lr (grid train.lr x 1/4..4, widened until the best is "
                        "inside; lowest final train loss without a straggler) and use it; ~25 extra runs")
    p.add_argument("--noise-seeds", type=int, default=None,
                   help="reference runs (seeds seed..seed+N-1) for the seed-noise band in the report; 0: none "
                        "(default: 5; not with --preset failure)")
    p.add_argument("--preset", choices=PRESETS, default=None,
                   help="failure: each strategy (default allreduce,ps-bsp,ps-ssp:3,ps-asp) without and with one "
                        "failure, and the failure report (timeline; time to detect, time to recover, lost, final "
                        "accuracy vs the no-failure run); communication: Local SGD, DiLoCo and compressed "
                        "all-reduce next to BSP / SSP / ASP on a slow link, loss against bytes, time and samples, "
                        "verdicts with a seed bootstrap (minutes: docs/tutorial.md §4)")
    p.add_argument("--seeds", type=int, default=None,
                   help="--preset communication: how many seeds per arm, >= 2 (workload.seed, +1, ...; default 3; "
                        "the verdicts' bootstrap resamples them)")
    p.add_argument("--sim-workers", type=int, default=None,
                   help="--preset communication: workers of its simulated part (default 64; 0: skip it)")
    p.add_argument("--failure", default=None, metavar="EVENT",
                   help="--preset failure: the failure, as key=value pairs (\"kill=worker:3,at_step=50\", "
                        "\"stop=worker:1,at_s=2.0,for_s=5\", \"kill=shard:0,at_s=1.5\") or TOML (one table or a "
                        "list of tables, the [faults] events syntax); default: --set faults.events if given, else "
                        "kill the last worker at step steps/2")
    p.add_argument("--trace", action="store_true",
                   help="record every run's timeline (pslab trace) and draw the straggler runs' side by side in the "
                        "report: where the all-reduce waits for the straggler, where the PS does not")
    p.add_argument("--target-acc", type=float, default=0.9,
                   help="test accuracy for the time-to-accuracy column, in (0, 1] (default: 0.9)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pslab.experiments.studies.compare import DEFAULT_STRATEGIES, default_config, run_compare
    from pslab.experiments.results.report import summary_table
    from pslab.experiments.strategies.spec import parse_strategy
    from pslab.experiments.errors import ConfigError
    if any(o.split("=", 1)[0].strip() == "train.strategy" for o in args.overrides):
        raise ConfigError("pslab compare sets train.strategy itself, one run per strategy: use --strategies "
                          "A,B,... instead of --set train.strategy=...")
    if args.preset is None and args.failure is not None:
        raise ConfigError("--failure applies to --preset failure (each strategy without and with that failure)")
    if args.preset != "communication":
        for flag, given in (("--seeds", args.seeds is not None), ("--sim-workers", args.sim_workers is not None)):
            if given:
                raise ConfigError(f"{flag} applies to --preset communication")
    if args.trace and (args.preset is not None or args.simulate):
        raise ConfigError("--trace records the real runs of the default comparison; drop --preset / --simulate")
    if args.preset == "failure":
        return _failure(args)
    if args.preset == "communication":
        return _communication(args)
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
                               quiet=args.quiet, force=args.force,
                               noise_seeds=5 if args.noise_seeds is None else args.noise_seeds,
                               target_acc=args.target_acc, tune=args.tune_lr, trace=args.trace)
    print(summary_table(runs, args.target_acc))
    print(f"\nreport: {report}   ({time.perf_counter() - t0:.0f} s)")
    return 0


def _failure(args: argparse.Namespace) -> int:
    from pslab.experiments.errors import ConfigError
    from pslab.experiments.results.report import summary_table
    from pslab.experiments.strategies.spec import parse_strategy
    from pslab.experiments.studies.compare import FAILURE_STRATEGIES, default_config, parse_failure, run_failure_compare
    for flag, given in (("--no-straggler", args.no_straggler), ("--tune-lr", args.tune_lr),
                        ("--noise-seeds", args.noise_seeds is not None)):
        if given:
            raise ConfigError(f"{flag} applies to the default comparison; --preset failure runs each strategy "
                              "without and with one failure (no straggler, no seed band, train.lr as set)")
    cfg = default_config(args.config, args.overrides)
    strategies = FAILURE_STRATEGIES if args.strategies is None else tuple(
        s.strip() for s in args.strategies.split(",") if s.strip())
    for s in strategies:
        parse_strategy(s)
    events = parse_failure(args.failure) if args.failure is not None else None
    out = Path(args.out or f"runs/compare-failure-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
    t0 = time.perf_counter()
    report, runs = run_failure_compare(cfg, out, strategies, events, simulate=args.simulate, quiet=args.quiet,
                                       force=args.force, target_acc=args.target_acc)
    print(summary_table(runs, args.target_acc))
    print(f"\nreport: {report}   ({time.perf_counter() - t0:.0f} s)")
    return 0


def _communication(args: argparse.Namespace) -> int:
    from pslab.experiments.errors import ConfigError
    from pslab.experiments.studies.communication import PRESET_OVERRIDES, SEEDS, SIM_WORKERS, run_communication
    from pslab.experiments.studies.compare import default_config
    for flag, given in (("--strategies", args.strategies is not None), ("--tune-lr", args.tune_lr),
                        ("--noise-seeds", args.noise_seeds is not None), ("--failure", args.failure is not None),
                        ("--simulate", args.simulate)):
        if given:
            raise ConfigError(f"{flag} does not apply to --preset communication: its arms, seeds and simulated part "
                              "are fixed (--seeds, --sim-workers, --no-straggler and --set change them)")
    cfg = default_config(args.config, list(PRESET_OVERRIDES) + list(args.overrides))
    out = Path(args.out or f"runs/compare-communication-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
    report, data = run_communication(cfg, out, seeds=SEEDS if args.seeds is None else args.seeds,
                                     straggler=not args.no_straggler,
                                     sim_workers=SIM_WORKERS if args.sim_workers is None else args.sim_workers,
                                     quiet=args.quiet, force=args.force, target_acc=args.target_acc)
    from pslab.experiments.studies.communication_report import verdict_lines
    for cond, vs in data["verdicts"].items():
        print(f"\n{'without' if cond == 'none' else 'with'} a straggler:")
        print("\n".join(verdict_lines(vs, args.target_acc)))
    print(f"\nreport: {report}   ({data['elapsed_s']:.0f} s)")
    return 0
