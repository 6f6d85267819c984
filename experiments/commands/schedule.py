"""`pslab schedule`: draw a pipeline schedule (GPipe or 1F1B) as a timeline picture, with its bubble fraction.

    pslab schedule --stages 4 --micro-batches 8 --schedule 1f1b -o pipe.png
"""

from __future__ import annotations

import argparse

from experiments.errors import ConfigError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("schedule", help="draw a pipeline schedule (gpipe / 1f1b) as a timeline picture",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", "-p", type=int, default=4, help="pipeline stages p (default 4)")
    p.add_argument("--micro-batches", "-m", type=int, default=8, help="micro-batches m per step (default 8)")
    p.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b"), help="schedule (default 1f1b)")
    p.add_argument("--backward-ratio", type=float, default=2.0,
                   help="backward time / forward time, equal on every stage (default 2)")
    p.add_argument("-o", "--output", default="pipe.png", help="picture to write (default pipe.png)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from parallelism.plot import draw_schedule
    from parallelism.schedule import ScheduleError, make_schedule, simulate

    if args.backward_ratio <= 0:
        raise ConfigError(f"--backward-ratio must be > 0, got {args.backward_ratio}")
    try:
        sched = make_schedule(args.schedule, args.stages, args.micro_batches)
    except ScheduleError as e:
        raise ConfigError(str(e)) from None
    timeline = simulate(sched, 1.0, args.backward_ratio)
    out = draw_schedule(timeline, args.output)
    peaks = sched.peak_in_flight()
    print(f"{sched.name}: p={sched.stages} m={sched.micro_batches} bubble={timeline.bubble_fraction():.4f} "
          f"(theory (p-1)/(m+p-1)={sched.theoretical_bubble():.4f}) peak in-flight per stage={peaks} -> {out}")
    return 0
