"""`pslab tour`: the article, claim by claim, in its order — each claim a small real experiment whose measured
figure is printed next to the theory that predicts it, with a paragraph on what it shows and a picture.

    pslab tour                       # every step (about 2.5 minutes on 2 cores); pictures + index.md in tour/
    pslab tour --list                # the steps: key, section, claim, the command that shows it in depth
    pslab tour ps-vs-ring zero-stages    # only these steps
    pslab tour --quick --json -      # small sizes (the test's), the results as JSON on stdout
    pslab tour -o docs/img/tour --index docs/tour.md     # how docs/tour.md was made

A step whose numbers disagree with its theory says so (agrees: NO) rather than hiding it; the exit status is 1
when any step failed or disagreed, 0 otherwise. A step that missed only timed figures (a tolerance or a bound: one
sample of a noisy time, e.g. beside other work) is measured again, once by default (--retries): the last try is
shown, every earlier miss is printed as a note. Counters and parities (= exactly) are never re-measured.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("tour", help="the article claim by claim: each claim measured next to its theory",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("steps", nargs="*", metavar="STEP", help="run only these steps (default: all; see --list)")
    p.add_argument("--list", action="store_true", help="list the steps and exit")
    p.add_argument("--quick", action="store_true", help="small sizes: the whole tour in about a minute and a quarter (the test's)")
    p.add_argument("-o", "--out", default="tour", help="folder for the pictures and index.md (default ./tour)")
    p.add_argument("--index", metavar="FILE", help="write the index page here (default OUT/index.md); its picture "
                                                   "links are relative to it")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON ('-': stdout only)")
    p.add_argument("--retries", type=int, default=1, metavar="N",
                   help="measure a step that missed only timed figures up to N more times (0-5, default 1; 0: "
                        "show every first measurement)")
    p.add_argument("--seed", type=int, default=0, help="seed of every step's workload (default 0)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pslab.experiments import tour
    from pslab.experiments.errors import ConfigError

    try:
        chosen = tour.select(args.steps)
        if not 0 <= args.retries <= 5:
            raise tour.TourError(f"--retries must be between 0 and 5, got {args.retries}")
    except tour.TourError as e:
        raise ConfigError(str(e)) from None
    if args.list:
        for i, s in enumerate(chosen, 1):
            print(f"{i:>2}. {s.key:<22} {s.section}\n    {s.claim}\n    in depth: {s.command}")
        return 0
    out_dir = Path(args.out)
    quiet_out = args.json == "-"
    ctx = tour.Context(out=out_dir, quick=args.quick, seed=args.seed,
                       say=(lambda s: None) if args.quiet or quiet_out else
                       (lambda s: print(s, file=sys.stderr, flush=True)))
    t0 = time.perf_counter()
    stream = open("/dev/null", "w") if quiet_out else sys.stdout
    try:
        results = tour.run_steps(chosen, ctx, stream, retries=args.retries)
    finally:
        if quiet_out:
            stream.close()
    seconds = time.perf_counter() - t0
    index_path = Path(args.index) if args.index else out_dir / "index.md"
    rel = Path(os.path.relpath(out_dir.resolve(), index_path.resolve().parent))
    index = tour.write_index(results, index_path, args.quick, seconds, pictures_rel=rel)
    if args.json:
        tour.write_json(results, args.json, args.quick, seconds)
    if not quiet_out:
        agree = sum(r.agrees for r in results)
        print(f"\n{agree} of {len(results)} steps agree with their theory, in {seconds:.0f} s; "
              f"index: {index}")
    return 0 if all(r.agrees for r in results) else 1
