"""`pslab run CONFIG.toml [--set key=value ...] [--simulate]`: one run, written to a run directory.

    pslab run experiments/configs/compare_default.toml --set train.strategy=ps-ssp:2
    pslab run experiments/configs/transformer_tp.toml --set parallel.tp=1 --set parallel.pp=2   # dp=2 x pp=2
    pslab run experiments/configs/compare_default.toml --simulate --set train.target_acc=0.9  # stop at 90%
    pslab run experiments/configs/sim64.toml --timing-only --set train.steps=5000    # no gradients: staleness, time

The run starts train.workers x parallel.tp x parallel.pp processes (train.workers is the data-parallel degree) and
prints the accuracy, the staleness and the bytes per step by kind next to their formulas.
"""

from __future__ import annotations

import argparse
import json

from experiments.commands.common import add_config_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run one config (real processes, or --simulate) into a run directory",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p, config_required=True)
    p.add_argument("--out", default="runs", help="parent directory of the run directory (default: runs)")
    p.add_argument("--label", default=None, help="name of the run (default: strategy and conditions)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from experiments.config import load_config
    from experiments.strategies.roles import from_environment
    from experiments.runner import execute
    cfg = load_config(args.config, args.overrides)
    role = from_environment()
    if role is not None and not args.simulate:
        from experiments.strategies.roles import run_with_role
        return run_with_role(cfg, role, args.out, args.label)
    rd = execute(cfg, args.out, label=args.label, simulate=args.simulate or None, quiet=args.quiet, force=args.force)
    s = json.loads((rd.path / "summary.json").read_text())
    acc = s.get("final_test_acc")
    print(f"{s['label']}: {s['updates']} updates in {s['time_s']:.2f} s{' (virtual)' if s['simulated'] else ''}"
          + (f", test accuracy {100 * acc:.1f}%" if acc is not None else ""), end="")
    if s.get("target_acc") is not None:
        t = s.get("time_to_target_s")
        print(f", {100 * s['target_acc']:g}% reached after {s['updates_to_target']} updates, {t:.3g} s" if t is not None
              else f", {100 * s['target_acc']:g}% not reached", end="")
    if s.get("staleness_mean") is not None:
        print(f", staleness mean {s['staleness_mean']:.2f} max {s['staleness_max']}", end="")
        if s.get("staleness_mean_steady") is not None:
            print(f" (while all workers run: mean {s['staleness_mean_steady']:.2f})", end="")
    for kind, v in (s.get("bytes_by_kind") or {}).items():
        model = v.get("model_per_step")
        print(f"\n  {kind}: {v['measured_per_step'] / 1e3:.1f} kB/step measured"
              + (f", {model / 1e3:.1f} kB/step by formula ({v['formula']})" if model is not None else ""), end="")
    print(f"\nrun directory: {rd.path}   (plots: pslab report {rd.path}, into {rd.path / 'report'})")
    return 0
