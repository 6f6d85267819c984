"""`pslab sweep`: one knob over values and seeds (`--knob train.strategy --values ps-bsp,ps-asp`), or a preset study
of the staleness emulator (`experiments.sim.dai`):

    --preset staleness    steps-to-target vs s (Dai et al. 2019)            studies/staleness.py
    --preset momentum     mean stale trajectory vs momentum 1 - 1/M        studies/momentum.py (Mitliagkas et al. 2016)
    --preset coherence    gradient coherence per model depth               studies/coherence.py (Dai et al. 2019)

The presets share the emulator's options: --workers K (gradients averaged per step, each with its own delay),
--delay uniform|constant|geometric|exponential, --models [label=]workload,..., and the study-specific --lags, --runs.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from experiments.commands.common import add_config_args

PRESETS = ("staleness", "momentum", "coherence")
_DELAYS = ("uniform", "constant", "geometric", "exponential")   # = experiments.sim.delays.DELAYS (a test checks)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="sweep one config knob over values and seeds, or --preset staleness|momentum|"
                                     "coherence")
    add_config_args(p)
    p.add_argument("--preset", choices=PRESETS,
                   help="staleness: steps-to-target vs s (Dai et al. 2019); momentum: the mean trajectory under "
                        "geometric delays next to momentum SGD with mu = 1 - 1/M, with z scores (Mitliagkas et al. "
                        "2016); coherence: cos(grad F(x_k), grad F(x_k-m)) per model depth (Dai et al. 2019)")
    p.add_argument("--knob", default=None, help="config key to vary, e.g. train.strategy")
    p.add_argument("--values", default="", help="comma-separated values of the knob")
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default: 0; not for --preset momentum, "
                                                 "which uses --runs seeds)")
    p.add_argument("--quick", action="store_true",
                   help="preset only: a small version for a smoke test (staleness: s in 0,4,16; SGD and Adam; "
                        "target 80%% instead of 85%%; at most 600 steps instead of 1000. momentum: M in 2,4, 60 "
                        "runs of 40 steps. coherence: 100 steps)")
    p.add_argument("--workers", type=int, default=None, metavar="K",
                   help="preset only: K emulated workers, each computing its gradient on its own batch at its own "
                        "delay; the K gradients are averaged into one step (default 1)")
    p.add_argument("--delay", choices=_DELAYS, default=None,
                   help="preset only: delay distribution with parameter s: uniform U{0..s} (Dai et al., the "
                        "default), constant s, geometric with mean s (M = s+1 workers; the momentum preset's law), "
                        "exponential with mean s rounded to steps")
    p.add_argument("--models", default=None, metavar="[LABEL=]WORKLOAD,...",
                   help="staleness and coherence presets: the workloads to compare, e.g. "
                        "shallow=digits-mlp1,deep=digits-mlp3 (see `pslab workloads`)")
    p.add_argument("--lags", default=None, metavar="M,...",
                   help="coherence preset: the lags m of cos(grad F(x_k), grad F(x_k-m)) (default 1,2,4,8)")
    p.add_argument("--runs", type=int, default=None, metavar="N",
                   help="momentum preset: seeded emulator runs per M whose mean trajectory is tested (default 200)")
    p.add_argument("--out", default=None, help="output directory (default: runs/sweep-<UTC time>)")
    p.set_defaults(func=run)


def _ints(text: str, what: str) -> list[int]:
    from experiments.errors import ConfigError
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{what} must be comma-separated integers, got {text!r}") from None


def parse_models(text: str) -> dict[str, str]:
    """'shallow=digits-mlp1,deep=digits-mlp3' or 'digits-mlr,digits-mlp3' -> {label: workload}."""
    from experiments.errors import ConfigError
    from experiments.workloads import WORKLOADS
    out: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        label, eq, name = item.partition("=")
        label, name = (label.strip(), name.strip()) if eq else (item, item)
        if name not in WORKLOADS:
            raise ConfigError(f"--models: unknown workload {name!r}; choose from: {', '.join(WORKLOADS)}")
        if not label or label in out:
            raise ConfigError(f"--models: empty or repeated label {label!r} in {text!r}")
        out[label] = name
    if not out:
        raise ConfigError("--models needs at least one workload, e.g. --models shallow=digits-mlp1,deep=digits-mlp3")
    return out


def _check_preset_options(args: argparse.Namespace) -> None:
    from experiments.errors import ConfigError
    p = args.preset
    given = [f"--{k}" for k in ("workers", "delay", "models", "lags", "runs") if getattr(args, k) is not None]
    if p is None:
        opts = (["--quick"] if args.quick else []) + given
        if opts:
            raise ConfigError(f"{' '.join(opts)} appl{'ies' if len(opts) == 1 else 'y'} to a preset "
                              f"(--preset {'|'.join(PRESETS)}) only; a knob sweep takes --set, e.g. "
                              "--set train.workers=8")
        return
    if args.knob or args.values:
        raise ConfigError(f"--preset {p} sweeps its own knob; drop --knob/--values, or drop --preset to sweep a "
                          "knob of your choice")
    if args.workers is not None and args.workers < 1:
        raise ConfigError(f"--workers must be >= 1 (gradients averaged per emulator step), got {args.workers}")
    if args.runs is not None and (p != "momentum" or args.runs < 2):
        raise ConfigError("--runs applies to --preset momentum only" if p != "momentum"
                          else f"--runs must be >= 2 (a mean needs a spread), got {args.runs}")
    if args.lags is not None and p != "coherence":
        raise ConfigError("--lags applies to --preset coherence only")
    if args.models is not None and p == "momentum":
        raise ConfigError("--preset momentum runs on its own quadratic; --models applies to staleness and coherence")
    if p == "momentum" and args.delay not in (None, "geometric"):
        raise ConfigError(f"--preset momentum needs geometric delays (its law), got --delay {args.delay}")
    if p == "momentum" and args.seeds is not None:
        raise ConfigError("--preset momentum seeds its runs 0..N-1: use --runs N instead of --seeds")
    if p == "coherence" and args.delay is not None:
        raise ConfigError("--preset coherence measures the undelayed trajectory (s = 0); drop --delay")


def run(args: argparse.Namespace) -> int:
    from experiments.errors import ConfigError
    _check_preset_options(args)
    out = Path(args.out or f"runs/sweep-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
    seeds = _ints(args.seeds if args.seeds is not None else "0", "--seeds")
    t0 = time.perf_counter()
    if args.preset == "staleness":
        return _staleness(args, out, seeds, t0)
    if args.preset == "momentum":
        return _momentum(args, out, t0)
    if args.preset == "coherence":
        return _coherence(args, out, seeds, t0)
    if not args.knob:
        raise ConfigError("pslab sweep needs --knob SECTION.KEY --values A,B,... or --preset "
                          f"{'|'.join(PRESETS)}")
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
    emulator = {"workers": args.workers or 1, "delay": args.delay or "uniform"}
    spec = SweepSpec(seeds=tuple(seeds), base=base, **emulator)
    if args.quick:
        spec = SweepSpec(models={"shallow": "digits-mlp", "deep": "digits-deep-mlp"},
                         optimizers={"sgd": (0.1, 0.2), "adam": (0.003, 0.01)}, staleness=(0, 4, 16),
                         seeds=tuple(seeds), target_acc=0.8, max_steps=600, base=base, **emulator)
    if args.models is not None:
        spec.models = parse_models(args.models)
    n = len(spec.models) * len(spec.optimizers) * len(spec.staleness)
    with tqdm(total=n, desc="staleness sweep", unit="cell", disable=args.quiet) as bar:
        cells = run_staleness_sweep(spec, bar.update)
    data = save(cells, spec, out)
    png = plot_curve(cells, spec, out)
    note = trend_note(cells, spec)
    models = ", ".join(f"{k} = {v}" for k, v in spec.models.items())
    (out / "report.md").write_text(
        "# Staleness sweep (Dai et al. 2019 emulation)\n\n"
        f"Steps to reach {100 * spec.target_acc:.0f}% test accuracy ({models}), learning rate picked per cell from "
        f"a small grid, seeds {list(spec.seeds)}, at most {spec.max_steps} steps, {spec.workers} emulated "
        f"worker(s) per step, {spec.delay} delays with parameter s. Optimizer options: "
        f"momentum {base.momentum}, betas {list(base.betas)}, staleness-aware lr {base.staleness_lr}, "
        f"DC-ASGD {base.dc_asgd}" + (f" (lambda {base.dc_lambda}, adaptive {base.dc_adaptive})" if base.dc_asgd else "")
        + ".\n\n"
        f"![staleness curve]({png.name})\n\n{note}\n\nData: `{data.name}`, `staleness_sweep.csv`.\n")
    print(note)
    print(f"\nreport: {out / 'report.md'}   data: {data}   ({time.perf_counter() - t0:.0f} s)")
    return 0


def _momentum(args: argparse.Namespace, out: Path, t0: float) -> int:
    from tqdm import tqdm
    from experiments.studies.momentum import MomentumSpec, note, plot_momentum, run_momentum_study, save
    spec = MomentumSpec(m_values=(2, 4) if args.quick else (2, 4, 8), steps=40 if args.quick else 60,
                        runs=args.runs or (60 if args.quick else 200), workers=args.workers or 1)
    with tqdm(total=spec.runs * len(spec.m_values), desc="momentum study", unit="run", disable=args.quiet) as bar:
        results = run_momentum_study(spec, bar.update)
    data = save(results, spec, out)
    png = plot_momentum(results, spec, out)
    text = note(results, spec)
    (out / "report.md").write_text(
        "# Asynchrony begets momentum (Mitliagkas et al. 2016), in the staleness emulator\n\n"
        "Mean trajectory of stale SGD with geometric delays (P(r = l) = (1 - q) q^l, q = 1 - 1/M) against momentum "
        "SGD with mu = 1 - 1/M and lr eta/M (torch SGD(lr=eta, momentum=mu, dampening=mu)); z = (mean - momentum) "
        "/ standard error at each step, bounded by the Bonferroni z*. Negative controls (plain SGD, and the momentum "
        "of 2M workers) must fall outside it.\n\n"
        f"![momentum]({png.name})\n\n{text}\n\nData: `{data.name}`.\n")
    print(text)
    print(f"\nreport: {out / 'report.md'}   data: {data}   ({time.perf_counter() - t0:.0f} s)")
    return 0


def _coherence(args: argparse.Namespace, out: Path, seeds: list[int], t0: float) -> int:
    import dataclasses
    from tqdm import tqdm
    from experiments.errors import ConfigError
    from experiments.studies.coherence import CoherenceSpec, note, plot, run_coherence_study, save
    from experiments.studies.compare import default_config
    if len(seeds) != 1:
        raise ConfigError(f"--preset coherence runs one seed, got --seeds {args.seeds}")
    spec = CoherenceSpec(workers=args.workers or 1, seed=seeds[0], steps=100 if args.quick else 300)
    keys = {o.partition("=")[0].strip() for o in args.overrides}
    if keys & {"train.optimizer", "train.lr"}:       # the study's SGD lr 0.1 unless --set asks otherwise
        base = default_config(args.config, args.overrides).train
        spec = dataclasses.replace(spec, base=base, lr=base.lr)
    if args.models is not None:
        spec.models = parse_models(args.models)
    if args.lags is not None:
        lags = tuple(_ints(args.lags, "--lags"))
        if not lags or min(lags) < 1:
            raise ConfigError(f"--lags must be integers >= 1, e.g. 1,2,4,8; got {args.lags!r}")
        spec.lags = lags
    with tqdm(total=len(spec.models), desc="coherence", unit="model", disable=args.quiet) as bar:
        results = run_coherence_study(spec, bar.update)
    data = save(results, spec, out)
    png = plot(results, out)
    text = note(results, spec)
    (out / "report.md").write_text(
        "# Gradient coherence per model depth (Dai et al. 2019)\n\n"
        "cos(grad F(x_k), grad F(x_{k-m})) on a fixed evaluation batch (the first 512 training examples), along "
        "one training run per model. Lower coherence at a lag means a gradient that many steps stale points "
        "further from the current one.\n\n"
        f"![coherence]({png.name})\n\n{text}\n\nData: `{data.name}`.\n")
    print(text)
    print(f"\nreport: {out / 'report.md'}   data: {data}   ({time.perf_counter() - t0:.0f} s)")
    return 0
