"""`pslab schedule`: draw a pipeline schedule (GPipe, 1F1B, interleaved 1F1B) as a timeline picture, with its
bubble fraction.

    pslab schedule --stages 4 --micro-batches 8 --schedule 1f1b -o pipe.png          # the schedule, replayed
    pslab schedule --stages 4 --micro-batches 8 --schedule 1f1b --run -o run.png     # measured on p processes
    pslab schedule --stages 4 --micro-batches 8 --virtual-stages 2 -o inter.png      # interleaved 1F1B, v = 2

With --run, p local processes execute one pipeline step of a small MLP over the zmq backend, every forward padded
to --forward-ms and every backward to --backward-ratio times that (equal stage times; interleaved: each chunk's
action 1/v of it), and the picture shows the measured spans; the printed bubble is measured, next to
(p−1)/(v·m+p−1) ((p−1)/(m+p−1) without interleaving). The formula ignores message latency, so the measured bubble
is a little larger, the more so the shorter an action (each of the ~2(v·m+p−1) hops of the critical path adds a
wake-up delay).
"""

from __future__ import annotations

import argparse

from pslab.experiments.errors import ConfigError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("schedule", help="draw a pipeline schedule (gpipe / 1f1b) as a timeline picture",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", "-p", type=int, default=4, help="pipeline stages p (default 4)")
    p.add_argument("--micro-batches", "-m", type=int, default=8, help="micro-batches m per step (default 8)")
    p.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b"), help="schedule (default 1f1b)")
    p.add_argument("--virtual-stages", "-v", type=int, default=1,
                   help="model chunks per stage: v > 1 is interleaved 1F1B (m a multiple of p; default 1)")
    p.add_argument("--backward-ratio", type=float, default=2.0,
                   help="backward time / forward time, equal on every stage (default 2)")
    p.add_argument("-o", "--output", default="pipe.png", help="picture to write (default pipe.png)")
    p.add_argument("--run", action="store_true", help="measure the schedule on --stages local processes")
    p.add_argument("--forward-ms", type=float, default=50.0, help="with --run: forward time per stage (default 50)")
    p.add_argument("--backend", default="zmq", choices=("zmq", "torch"), help="with --run: collectives backend")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pslab.parallelism.plot import draw_schedule
    from pslab.parallelism.schedule import ScheduleError, make_schedule, simulate

    if args.backward_ratio <= 0:
        raise ConfigError(f"--backward-ratio must be > 0, got {args.backward_ratio}")
    try:
        sched = make_schedule(args.schedule, args.stages, args.micro_batches, args.virtual_stages)
    except ScheduleError as e:
        raise ConfigError(str(e)) from None
    if args.run:
        return _run_measured(args, sched)
    timeline = simulate(sched, 1.0, args.backward_ratio)
    out = draw_schedule(timeline, args.output)
    peaks = sched.peak_in_flight()
    print(f"{_sizes(sched)} bubble={timeline.bubble_fraction():.4f} "
          f"(theory {_formula(sched)}={sched.theoretical_bubble():.4f}) peak in-flight per stage={peaks}"
          f"{_unit(sched)} -> {out}")
    return 0


def _sizes(sched) -> str:
    v = f" v={sched.virtual_stages}" if sched.virtual_stages > 1 else ""
    return f"{sched.name}: p={sched.stages} m={sched.micro_batches}{v}"


def _formula(sched) -> str:
    return "(p-1)/(v*m+p-1)" if sched.virtual_stages > 1 else "(p-1)/(m+p-1)"


def _unit(sched) -> str:
    return f" (chunk-micro-batches, 1/{sched.virtual_stages} of a stage's each)" if sched.virtual_stages > 1 else ""


def _run_measured(args: argparse.Namespace, sched) -> int:
    from pslab import collectives
    from pslab.parallelism.pipeline_measure import bubble_fraction, gather_spans, measure_step
    from pslab.parallelism.plot import draw_timeline

    if not 1 <= args.stages <= 8:
        raise ConfigError(f"--run starts one process per stage; use 1..8 stages, got {args.stages}")
    if args.forward_ms <= 0:
        raise ConfigError(f"--forward-ms must be > 0, got {args.forward_ms}")
    tf = args.forward_ms / 1000.0
    results = collectives.launch(measure_step, args.stages, backend=args.backend, timeout=300,
                                 args=(args.schedule, sched.micro_batches, (tf, tf * args.backward_ratio), 32, 64,
                                       sched.virtual_stages))
    spans = gather_spans(results)
    measured = bubble_fraction(spans)
    v = f", v={sched.virtual_stages}" if sched.virtual_stages > 1 else ""
    out = draw_timeline(spans, args.output, title=f"{sched.name} measured: p={sched.stages}, m={sched.micro_batches}"
                        f"{v}", theoretical_bubble=sched.theoretical_bubble(), xlabel="seconds")
    peaks = [r["peak_in_flight"] for r in results]
    print(f"{_sizes(sched)} measured bubble={measured:.4f} (theory {_formula(sched)}="
          f"{sched.theoretical_bubble():.4f}) measured peak in-flight per stage={peaks}{_unit(sched)} -> {out}")
    return 0
