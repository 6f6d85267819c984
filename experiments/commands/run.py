"""`pslab run CONFIG.toml [--set key=value ...] [--simulate]` (or `--resume RUN_DIR`): one run, in a run directory.

    pslab run experiments/configs/compare_default.toml --set train.strategy=ps-ssp:2
    pslab run experiments/configs/transformer_tp.toml --set parallel.tp=1 --set parallel.pp=2   # dp=2 x pp=2
    pslab run experiments/configs/transformer_tp.toml --set parallel.sp=true                    # tp=2 + sequence par.
    pslab run experiments/configs/transformer_tp.toml --set parallel.tp=1 --set parallel.cp=2   # ring attention
    pslab run experiments/configs/moe_ep.toml                                 # mixture of experts, experts over ep=2
    pslab run experiments/configs/compare_default.toml --simulate --set train.target_acc=0.9  # stop at 90%
    pslab run experiments/configs/sim64.toml --timing-only --set train.steps=5000    # no gradients: staleness, time
    pslab run experiments/configs/compare_default.toml --set train.strategy=allreduce --set faults.checkpoint_every=20
    pslab run --resume runs/<run> --set train.steps=200 --set train.workers=2   # go on from its newest checkpoint
    pslab run experiments/configs/topology_tp.toml --set topology.placement=spread   # tp across the slow link

The run starts train.workers x parallel.tp x pp x cp x ep processes (train.workers is the data-parallel degree) and
prints the accuracy, the staleness, the bytes per step by kind and the peak saved activations per rank next to their
formulas (and, for the mixture-of-experts workload text-moe, the tokens routed and dropped).

[topology] (hosts, gpus_per_host, placement = packed | spread | an axis order such as tp,dp,pp,
intra/inter_latency_us, intra/inter_bandwidth_GBps)
runs the ranks on emulated hosts: the zmq transport delays each message by its link's latency + bytes/bandwidth;
the run prints the bytes per step on each link class (intra, inter) and the median step time.

--resume RUN_DIR continues a run (allreduce with any engine, or local) from the newest committed checkpoint in
RUN_DIR/checkpoints that verifies (faults.checkpoint_every wrote them; a corrupt one is skipped with a warning) up to
train.steps, with RUN_DIR's own config.toml. --set may change the layout and the length (train.workers,
parallel.tp / pp / zero, train.steps, ...): the state is re-cut for the new layout; at a new train.workers each
worker keeps its batch size and the lr follows train.lr_rule for the new count. Overrides of the workload, its batch
size or seed, or the optimizer are refused. Records are appended to RUN_DIR; summary.json is rewritten.
"""

from __future__ import annotations

import argparse
import json

from pslab.experiments.commands.common import add_config_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run one config (real processes, or --simulate) into a run directory",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p, config_required=True)
    for action in p._actions:           # the config file is optional with --resume (RUN_DIR has its own)
        if action.dest == "config":
            action.nargs, action.default = "?", None
    p.add_argument("--resume", metavar="RUN_DIR", default=None,
                   help="continue RUN_DIR from its newest valid engine checkpoint (see above); no CONFIG then")
    p.add_argument("--out", default="runs", help="parent directory of the run directory (default: runs)")
    p.add_argument("--label", default=None, help="name of the run (default: strategy and conditions)")
    p.add_argument("--trace", action="store_true",
                   help="record a timeline of every rank and shard ([trace] enabled = true) and merge it into "
                        "RUN_DIR/trace.json (Perfetto / chrome://tracing) with its analysis (pslab trace)")
    p.set_defaults(func=run, run_parser=p)


def run(args: argparse.Namespace) -> int:
    from pslab.experiments.config import load_config
    from pslab.experiments.strategies.roles import from_environment
    from pslab.experiments.runner import execute
    if args.resume is not None:
        return _resume(args)
    if args.config is None:                 # a malformed command line: argparse's usage message, exit status 2
        args.run_parser.error("the following arguments are required: config (or --resume RUN_DIR)")
    cfg = load_config(args.config, args.overrides)
    if args.trace:
        cfg.trace.enabled = True
    role = from_environment()
    if role is not None and not args.simulate:
        if cfg.topology.enabled:
            from pslab.experiments.errors import ConfigError
            raise ConfigError("[topology] emulates hosts for the ranks of a local pslab run; under torchrun/SLURM "
                              "drop it (set PSLAB_TOPOLOGY in each rank's environment to emulate links there)")
        from pslab.experiments.strategies.roles import run_with_role
        return run_with_role(cfg, role, args.out, args.label)
    rd = execute(cfg, args.out, label=args.label, simulate=args.simulate or None, quiet=args.quiet, force=args.force)
    code = _report(rd)
    if cfg.trace.enabled:
        from pslab.experiments.results.timeline import format_analysis, merge
        path, analysis = merge(rd.path)
        print(f"\n{format_analysis(analysis)}\ntimeline: {path}  (open in https://ui.perfetto.dev)")
    return code


def _resume(args: argparse.Namespace) -> int:
    from pslab.experiments.errors import ConfigError
    from pslab.experiments.results.rundir import RunDir
    from pslab.experiments.runner import execute
    from pslab.experiments.strategies.resume import resume_config
    from pslab.experiments.strategies.roles import from_environment
    if args.config is not None or args.simulate or args.label is not None:
        raise ConfigError("--resume RUN_DIR takes RUN_DIR's own config: drop CONFIG, --simulate and --label "
                          "(change settings with --set)")
    if from_environment() is not None:
        raise ConfigError("--resume under torchrun/SLURM is not supported yet: resume on one host with pslab run")
    cfg = resume_config(args.resume, args.overrides)
    return _report(execute(cfg, quiet=args.quiet, force=args.force, resume=RunDir(args.resume)))


def _report(rd) -> int:
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
        seen = v["measured_per_step"]
        why = v.get("unobserved_why") or "the backend reports no bytes"
        print(f"\n  {kind}: " + (f"{seen / 1e3:.1f} kB/step measured" if seen is not None else
                                 f"measured: not observable ({why})")
              + (f", {model / 1e3:.1f} kB/step by formula ({v['formula']})" if model is not None else ""), end="")
    links = s.get("link_bytes_per_step")
    if links is not None:
        print(f"\n  links ({s.get('topology', '')}): intra {links['intra'] / 1e3:.1f} kB/step, inter "
              f"{links['inter'] / 1e3:.1f} kB/step (all ranks)" + (f"; step time {s['step_time_s'] * 1e3:.1f} ms "
              "(median)" if s.get("step_time_s") is not None else ""), end="")
    act = s.get("activations")
    if act:
        m = act.get("model_bytes")
        print(f"\n  peak saved activations: {act['measured_peak_bytes'] / 1e3:.1f} kB per rank (max) measured"
              + (f", {m / 1e3:.1f} kB by formula ({act['formula']})" if m is not None else ""), end="")
    pipe = s.get("pipeline")
    if pipe:
        v = f", v={pipe['virtual_stages']}" if pipe["virtual_stages"] > 1 else ""
        print(f"\n  pipeline bubble ({pipe['schedule']}, p={pipe['stages']}, m={pipe['micro_batches']}{v}): "
              f"{pipe['bubble_measured']:.3f} measured (the stages' idle share: the bubble and every wait on a "
              f"message), {pipe['formula']} = {pipe['bubble_formula']:.3f} with equal stage times and free "
              "messages", end="")
    moe = s.get("moe")
    if moe:
        print(f"\n  experts: {moe['routed']} token assignments routed, {moe['dropped']} dropped "
              f"({100 * moe['drop_fraction']:.1f} %) at capacity {moe['capacity']} per (sequence, expert); the load "
              f"per expert: expert_load.png in the report", end="")
    _print_failures(rd)
    print(f"\nrun directory: {rd.path}   (plots: pslab report {rd.path}, into {rd.path / 'report'})")
    return 0


def _print_failures(rd) -> None:
    """One line per injected fault: detection, recovery, what was lost (results/faults.py reads events.jsonl)."""
    from pslab.experiments.results.faults import failures, validate_events
    from pslab.experiments.results.rundir import read_jsonl
    for f in failures(validate_events(read_jsonl(rd.path / "events.jsonl"))):
        parts = [f"{f['who']} {f['how'] or ''}".strip()]
        parts.append(f"detected after {f['detect_s']:.3g} s" if f["detect_s"] is not None else
                     f"detected at {f['t_detect']:.3g} s" if f["t_inject"] is None else "not detected (a pause)")
        if f["recover_s"] is not None:
            parts.append(f"training went on {f['recover_s']:.3g} s later")
        if f["world_size"] is not None:
            parts.append(f"world size {f['world_size']}")
        for k in ("lost_steps", "lost_updates"):
            if f[k] is not None:
                parts.append(f"{k.replace('_', ' ')} {f[k]}")
        print("\n  failure: " + ", ".join(parts), end="")
