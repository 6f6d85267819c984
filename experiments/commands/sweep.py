"""`pslab sweep`: one knob over values and seeds (`--knob train.strategy --values ps-bsp,ps-asp`), or the
staleness-curve preset (`--preset staleness`)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from experiments.commands.common import add_config_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="sweep one config knob over values and seeds, or --preset staleness")
    add_config_args(p)
    p.add_argument("--preset", choices=["staleness"], help="staleness: steps-to-target vs s (Dai et al. 2019)")
    p.add_argument("--knob", default=None, help="config key to vary, e.g. train.strategy")
    p.add_argument("--values", default="", help="comma-separated values of the knob")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (default: 0)")
    p.add_argument("--quick", action="store_true",
                   help="preset only: a small version for a smoke test (s in 0,4,16; SGD and Adam; target 80%% "
                        "instead of 85%%; at most 600 steps instead of 1000)")
    p.add_argument("--out", default=None, help="output directory (default: runs/sweep-<UTC time>)")
    p.set_defaults(func=run)


def _ints(text: str, what: str) -> list[int]:
    from experiments.errors import ConfigError
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{what} must be comma-separated integers, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    from experiments.errors import ConfigError
    out = Path(args.out or f"runs/sweep-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
    seeds = _ints(args.seeds, "--seeds")
    t0 = time.perf_counter()
    if args.preset == "staleness":
        if args.knob or args.values:
            raise ConfigError("--preset staleness sweeps its own knob (the staleness bound); drop --knob/--values, "
                              "or drop --preset to sweep a knob of your choice")
        return _staleness(args, out, seeds, t0)
    if args.quick:
        raise ConfigError("--quick applies to --preset staleness only")
    if not args.knob:
        raise ConfigError("pslab sweep needs --knob SECTION.KEY --values A,B,... or --preset staleness")
    from experiments.studies.compare import default_config
    from experiments.results.report import summary_table
    from experiments.studies.sweep import run_knob_sweep
    cfg = default_config(args.config, args.overrides)
    values = [v.strip() for v in args.values.split(",") if v.strip()]
    report, runs = run_knob_sweep(cfg, args.knob, values, seeds, out, args.simulate, args.quiet, force=args.force)
    print(summary_table(runs))
    print(f"\nreport: {report}   ({time.perf_counter() - t0:.0f} s)")
    return 0


def _staleness(args: argparse.Namespace, out: Path, seeds: list[int], t0: float) -> int:
    from tqdm import tqdm
    from experiments.studies.staleness import SweepSpec, plot_curve, run_staleness_sweep, save, trend_note
    from experiments.studies.compare import default_config
    base = default_config(args.config, args.overrides).train  # e.g. --set train.staleness_lr=true
    spec = SweepSpec(seeds=tuple(seeds), base=base)
    if args.quick:
        spec = SweepSpec(models={"shallow": "digits-mlp", "deep": "digits-deep-mlp"},
                         optimizers={"sgd": (0.1, 0.2), "adam": (0.003, 0.01)}, staleness=(0, 4, 16),
                         seeds=tuple(seeds), target_acc=0.8, max_steps=600, base=base)
    n = len(spec.models) * len(spec.optimizers) * len(spec.staleness)
    with tqdm(total=n, desc="staleness sweep", unit="cell", disable=args.quiet) as bar:
        cells = run_staleness_sweep(spec, bar.update)
    data = save(cells, spec, out)
    png = plot_curve(cells, spec, out)
    note = trend_note(cells, spec)
    (out / "report.md").write_text(
        "# Staleness sweep (Dai et al. 2019 emulation)\n\n"
        f"Steps to reach {100 * spec.target_acc:.0f}% test accuracy on digits, learning rate picked per cell from "
        f"a small grid, seeds {list(spec.seeds)}, at most {spec.max_steps} steps. Optimizer options: "
        f"momentum {base.momentum}, betas {list(base.betas)}, staleness-aware lr {base.staleness_lr}, "
        f"DC-ASGD {base.dc_asgd}" + (f" (lambda {base.dc_lambda}, adaptive {base.dc_adaptive})" if base.dc_asgd else "")
        + ".\n\n"
        f"![staleness curve]({png.name})\n\n{note}\n\nData: `{data.name}`, `staleness_sweep.csv`.\n")
    print(note)
    print(f"\nreport: {out / 'report.md'}   data: {data}   ({time.perf_counter() - t0:.0f} s)")
    return 0
