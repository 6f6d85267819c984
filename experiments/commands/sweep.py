"""`pslab sweep`: one knob over values and seeds (`--knob train.strategy --values ps-bsp,ps-asp`), or a preset study
of the staleness emulator (`experiments.sim.dai`):

    --preset staleness            steps-to-target vs s (Dai et al. 2019)              studies/staleness.py
    --preset staleness-remedies   the same on the deep model: plain vs staleness-aware lr (Zhang et al. 2016)
                                  and DC-ASGD (Zheng et al. 2017)                     studies/staleness.py
    --preset momentum     mean stale trajectory vs momentum 1 - 1/M        studies/momentum.py (Mitliagkas et al. 2016)
    --preset coherence    gradient coherence per model depth               studies/coherence.py (Dai et al. 2019)
    --preset ssp-straggler  time to target vs s for Ho's ps-ssp:s under a persistent 4x straggler, simulated
                            (not the emulator: the PS simulator)              studies/ssp_straggler.py

The presets share the emulator's options: --workers K (gradients averaged per step, each with its own delay),
--delay uniform|constant|geometric|exponential, --models [label=]workload,..., and the study-specific --lags, --runs,
and for the staleness presets --target, --max-steps, --worker-counts and --jobs. ssp-straggler takes --seeds
(default 0..399; --quick: 0..29 and s = 0, 1, 4), --target (0.9), --jobs, --tune-lr and --set (the compare
default's keys, e.g. train.workers=8).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from pslab.experiments.commands.common import add_config_args

PRESETS = ("staleness", "staleness-remedies", "momentum", "coherence", "ssp-straggler")
_STALENESS = ("staleness", "staleness-remedies")
_DELAYS = ("uniform", "constant", "geometric", "exponential")   # = experiments.sim.delays.DELAYS (a test checks)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="sweep one config knob over values and seeds, or --preset staleness|"
                                     "staleness-remedies|momentum|coherence|ssp-straggler")
    add_config_args(p)
    p.add_argument("--preset", choices=PRESETS,
                   help="staleness: steps-to-target vs s per model, optimizer and worker count, lr bracketed "
                        "per cell, medians over seeds with censoring (Dai et al. 2019); staleness-remedies: the "
                        "deep model with plain SGD/momentum/Adam next to the staleness-aware lr (Zhang et al. 2016) and "
                        "DC-ASGD (Zheng et al. 2017); momentum: the mean trajectory under "
                        "geometric delays next to momentum SGD with mu = 1 - 1/M, with z scores (Mitliagkas et al. "
                        "2016); coherence: cos(grad F(x_k), grad F(x_k-m)) per model depth (Dai et al. 2019); "
                        "ssp-straggler: simulated time to target vs s for Ho's ps-ssp:0,1,2,4 and ps-asp under a "
                        "persistent 4x straggler, medians over seeds, with the fast workers' lead (K-1) s T_slow / K")
    p.add_argument("--knob", default=None, help="config key to vary, e.g. train.strategy")
    p.add_argument("--values", default="", help="comma-separated values of the knob")
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default: 0; staleness: 0..24, "
                                                 "staleness-remedies: 0..8, ssp-straggler: 0..399, "
                                                 "--quick 0,1,2; not for --preset momentum, which uses --runs seeds)")
    p.add_argument("--quick", action="store_true",
                   help="preset only: a small version for a smoke test (staleness: digits-mlr and digits-mlp3, "
                        "s in 0,4,16, SGD and Adam, K = 4 on the deep model, target 90%% instead of 95%%, at most "
                        "300 steps instead of 1000; staleness-remedies: the same target and budget, SGD, s in 0,16. "
                        "momentum: M in 2,4, 60 "
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
                        "shallow=digits-mlp1,deep=digits-mlp3 (see `pslab workloads`); staleness presets: ordered "
                        "shallow to deep, the last is the deep model of the claims and the worker-count rows")
    p.add_argument("--target", type=float, default=None, metavar="ACC",
                   help="staleness presets: the test accuracy whose first step is counted (default 0.95)")
    p.add_argument("--max-steps", type=int, default=None, metavar="N",
                   help="staleness presets: a seed not at the target after N steps is censored at N (default 1000)")
    p.add_argument("--worker-counts", default=None, metavar="K,...",
                   help="staleness preset: extra worker counts whose rows run on the deepest model with SGD, for "
                        "the worker-count claim (default 4,8; 'none' for no such rows)")
    p.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="staleness presets: cells run in N processes of one torch thread each (default: the "
                        "cores available); the numbers do not depend on N")
    p.add_argument("--lags", default=None, metavar="M,...",
                   help="coherence preset: the lags m of cos(grad F(x_k), grad F(x_k-m)) (default 1,2,4,8)")
    p.add_argument("--tune-lr", action="store_true",
                   help="ssp-straggler preset: each strategy at its own lr (lr x 2^(k/2), k = -2..2, widened past "
                        "a winning edge; smallest median time to target on the first half of the seeds), reported "
                        "on the held-out other half")
    p.add_argument("--runs", type=int, default=None, metavar="N",
                   help="momentum preset: seeded emulator runs per M whose mean trajectory is tested (default 200)")
    p.add_argument("--out", default=None, help="output directory (default: runs/sweep-<UTC time>)")
    p.set_defaults(func=run)


def _ints(text: str, what: str) -> list[int]:
    from pslab.experiments.errors import ConfigError
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{what} must be comma-separated integers, got {text!r}") from None


def parse_models(text: str) -> dict[str, str]:
    """'shallow=digits-mlp1,deep=digits-mlp3' or 'digits-mlr,digits-mlp3' -> {label: workload}."""
    from pslab.experiments.errors import ConfigError
    from pslab.experiments.workloads import WORKLOADS
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
    from pslab.experiments.errors import ConfigError
    p = args.preset
    given = [f"--{k.replace('_', '-')}" for k in ("workers", "delay", "models", "lags", "runs", "target", "max_steps",
                                                   "worker_counts", "jobs") if getattr(args, k) is not None]
    if p is None:
        opts = (["--quick"] if args.quick else []) + (["--tune-lr"] if args.tune_lr else []) + given
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
    own = [f"--{k.replace('_', '-')}" for k in ("target", "max_steps", "worker_counts", "jobs")
           if getattr(args, k) is not None]
    if getattr(args, "tune_lr", False) and p != "ssp-straggler":
        raise ConfigError("--tune-lr applies to --preset ssp-straggler only")
    if p == "ssp-straggler":
        bad = [g for g in given if g not in ("--target", "--jobs")]
        if bad:
            raise ConfigError(f"{bad[0]} does not apply to --preset ssp-straggler (it simulates the compare "
                              "default; change it with --set, e.g. --set train.workers=8)")
        if any(o.split("=", 1)[0].strip() == "train.strategy" for o in args.overrides):
            raise ConfigError("--preset ssp-straggler runs ps-ssp:0,1,2,4 and ps-asp itself: drop --set "
                              "train.strategy")
    elif own and p not in _STALENESS:
        raise ConfigError(f"{own[0]} applies to --preset staleness|staleness-remedies only")
    if args.target is not None and not 0 < args.target <= 1:
        raise ConfigError(f"--target must be a test accuracy in (0, 1], e.g. 0.95; got {args.target}")
    if args.max_steps is not None and args.max_steps < 1:
        raise ConfigError(f"--max-steps must be >= 1, got {args.max_steps}")
    if args.jobs is not None and args.jobs < 1:
        raise ConfigError(f"--jobs must be >= 1 (processes running cells), got {args.jobs}")
    if args.worker_counts is not None and p != "staleness":
        raise ConfigError("--worker-counts applies to --preset staleness only (the remedies preset runs K = --workers)")
    if args.models is not None and p == "momentum":
        raise ConfigError("--preset momentum runs on its own quadratic; --models applies to staleness and coherence")
    if p == "momentum" and args.delay not in (None, "geometric"):
        raise ConfigError(f"--preset momentum needs geometric delays (its law), got --delay {args.delay}")
    if p == "momentum" and args.seeds is not None:
        raise ConfigError("--preset momentum seeds its runs 0..N-1: use --runs N instead of --seeds")
    if p == "coherence" and args.delay is not None:
        raise ConfigError("--preset coherence measures the undelayed trajectory (s = 0); drop --delay")


def run(args: argparse.Namespace) -> int:
    from pslab.experiments.errors import ConfigError
    _check_preset_options(args)
    out = Path(args.out or f"runs/sweep-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
    seeds = _ints(args.seeds if args.seeds is not None else "0", "--seeds")
    if not seeds:
        raise ConfigError(f"--seeds needs at least one integer, got {args.seeds!r}")
    t0 = time.perf_counter()
    if args.preset in _STALENESS:
        return _staleness(args, out, seeds if args.seeds is not None else None, t0)
    if args.preset == "momentum":
        return _momentum(args, out, t0)
    if args.preset == "coherence":
        return _coherence(args, out, seeds, t0)
    if args.preset == "ssp-straggler":
        return _ssp(args, out, seeds if args.seeds is not None else None, t0)
    if not args.knob:
        raise ConfigError("pslab sweep needs --knob SECTION.KEY --values A,B,... or --preset "
                          f"{'|'.join(PRESETS)}")
    from pslab.experiments.studies.compare import default_config
    from pslab.experiments.results.report import summary_table
    from pslab.experiments.studies.sweep import run_knob_sweep
    cfg = default_config(args.config, args.overrides)
    values = [v.strip() for v in args.values.split(",") if v.strip()]
    report, runs = run_knob_sweep(cfg, args.knob, values, seeds, out, args.simulate, args.quiet, force=args.force)
    print(summary_table(runs))
    print(f"\nreport: {report}   ({time.perf_counter() - t0:.0f} s)")
    return 0


def _worker_counts(text: str) -> tuple[int, ...]:
    from pslab.experiments.errors import ConfigError
    if text.strip().lower() == "none":
        return ()
    ks = tuple(_ints(text, "--worker-counts"))
    if not ks or min(ks) < 1:
        raise ConfigError(f"--worker-counts must be integers >= 1 (or 'none'), e.g. 4,8; got {text!r}")
    return ks


def _staleness(args: argparse.Namespace, out: Path, seeds: list[int] | None, t0: float) -> int:
    from tqdm import tqdm
    from pslab.experiments.studies.compare import default_config
    from pslab.experiments.studies.staleness import default_jobs, preset_spec, rows, run_staleness_sweep, save
    from pslab.experiments.studies.staleness_report import claims, plot_curve, tables, trend_note
    base = default_config(args.config, args.overrides).train  # e.g. --set train.momentum=0.95
    spec = preset_spec(args.preset, args.quick, base=base, workers=args.workers, delay=args.delay,
                       seeds=tuple(seeds) if seeds is not None else None, target_acc=args.target,
                       max_steps=args.max_steps,
                       worker_counts=None if args.worker_counts is None else _worker_counts(args.worker_counts),
                       models=None if args.models is None else parse_models(args.models))
    spec.validate()
    jobs = args.jobs or default_jobs()
    n = len(rows(spec)) * len(spec.staleness)
    with tqdm(total=n, desc=f"{spec.preset} sweep ({jobs} process{'es' if jobs > 1 else ''})", unit="cell",
              disable=args.quiet) as bar:
        cells = run_staleness_sweep(spec, bar.update, jobs=jobs)
    wall = time.perf_counter() - t0
    found = claims(cells, spec)
    data = save(cells, spec, out, {"claims": found, "wall_s": round(wall, 1), "jobs": jobs})
    png = plot_curve(cells, spec, out)
    note, table = trend_note(cells, spec), tables(cells, spec)
    models = ", ".join(f"{k} = {v}" for k, v in spec.models.items())
    variants = ", ".join(f"{k} {v or '(the optimizer as configured)'}" for k, v in spec.variants.items())
    (out / "report.md").write_text(
        f"# Staleness sweep, preset {spec.preset} (Dai et al. 2019 emulation)\n\n"
        f"Exact steps to reach {100 * spec.target_acc:g}% test accuracy ({models}); per cell the learning rate with "
        f"the fewest median steps over seeds {list(spec.seeds)} from a grid of ratio {spec.lr_factor:g} widened "
        f"until it brackets the optimum; a seed not at the target after {spec.max_steps} steps is censored. "
        f"{spec.workers} emulated worker(s) per step, {spec.delay} delays with parameter s"
        + (f", and rows with K = {', '.join(map(str, spec.worker_counts))} on the deep model" if spec.worker_counts
           else "") + f". Variants: {variants}. Optimizer options: momentum {base.momentum}, betas "
        f"{list(base.betas)}, staleness-aware lr {base.staleness_lr} (rule where used: {base.staleness_rule}, "
        f"'gradient' = each gradient at lr / max(τ, 1)), DC-ASGD {base.dc_asgd}.\n\n"
        f"![staleness curve]({png.name})\n\n{table}\n\n{note}\n\nData: `{data.name}`, `staleness_sweep.csv`. "
        f"Wall time {wall:.0f} s on {jobs} process(es).\n")
    print(table + "\n\n" + note)
    print(f"\nreport: {out / 'report.md'}   data: {data}   ({wall:.0f} s)")
    return 0


def _momentum(args: argparse.Namespace, out: Path, t0: float) -> int:
    from tqdm import tqdm
    from pslab.experiments.studies.momentum import MomentumSpec, note, plot_momentum, run_momentum_study, save
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
    from pslab.experiments.errors import ConfigError
    from pslab.experiments.studies.coherence import CoherenceSpec, note, plot, run_coherence_study, save
    from pslab.experiments.studies.compare import default_config
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


def _ssp(args: argparse.Namespace, out: Path, seeds: list[int] | None, t0: float) -> int:
    from pslab.experiments.studies.staleness import default_jobs
    from pslab.experiments.studies.ssp_straggler import SSPSpec, report, run_ssp_study, save
    spec = SSPSpec(tune=args.tune_lr, overrides=tuple(args.overrides))
    if args.quick:
        spec.strategies, spec.seeds = ("ps-ssp:0", "ps-ssp:1", "ps-ssp:4"), tuple(range(30))
    if seeds is not None:
        spec.seeds = tuple(seeds)
    if args.target is not None:
        spec.target_acc = args.target
    say = None if args.quiet else (lambda m: print(f"  {m}", flush=True))
    data = run_ssp_study(spec, jobs=args.jobs or default_jobs(), progress=say)
    wall = time.perf_counter() - t0
    data["wall_s"] = round(wall, 1)
    path = save(data, out)
    text = report(data)
    (out / "report.md").write_text(
        "# Ho et al.'s SSP under a persistent straggler (simulated)\n\n" + text +
        f"\n\nData: `{path.name}`. Wall time {wall:.0f} s. The setting, the lr rule and the mechanism: "
        "experiments/studies/ssp_straggler.py.\n")
    print(text)
    print(f"\nreport: {out / 'report.md'}   data: {path}   ({wall:.0f} s)")
    return 0
