"""`pslab trace RUN_DIR`: merge a traced run's timelines into RUN_DIR/trace.json and measure from it."""

from __future__ import annotations

import argparse
import json
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "trace", help="merge a traced run's timelines into RUN_DIR/trace.json (Perfetto) and measure from it",
        description="A run made with `pslab run --trace` (or [trace] enabled = true) leaves one timeline per rank "
                    "and PS shard in RUN_DIR/trace/. This merges them into RUN_DIR/trace.json -- open it in "
                    "https://ui.perfetto.dev or chrome://tracing: one track per rank ('rank 3 · dp1 pp1') and "
                    "shard, arrows from each send to its receive and from a PS push to the shard's apply -- and "
                    "prints, per track, compute / communication / exposed communication / waiting / padding and "
                    "the overlap ratio, and the pipeline bubble measured next to (p−1)/(m+p−1). "
                    "`pslab report RUN_DIR` draws the timeline as a picture.")
    p.add_argument("run", help="a run directory made with --trace")
    p.add_argument("--json", action="store_true", help="print the analysis as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pslab.experiments.results.timeline import format_analysis, merge
    path, analysis = merge(args.run)
    if args.json:
        json.dump(analysis, sys.stdout, indent=1)
        print()
        return 0
    print(format_analysis(analysis))
    print(f"\ntrace: {path}  (open in https://ui.perfetto.dev or chrome://tracing)")
    return 0
