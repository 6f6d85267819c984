"""`pslab diagnose RUN_DIR`: match the ranks' flight records (collectives/flight.py) and say what went wrong."""

from __future__ import annotations

import argparse
import json
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "diagnose", help="say which rank never joined which call, after a hang or a failed run (flight records)",
        description="Every rank (and PS shard) of a run keeps its last PSLAB_FLIGHT_ENTRIES (default 2000) "
                    "collective, point-to-point and PS calls in a memory-mapped ring file, RUN_DIR/flight/flight-"
                    "<who>.ring, that outlives a killed process; a JSON record (flight-<who>.json, with error texts "
                    "and a PS shard's gate state) is added when a call fails, when a rank ends, and on SIGUSR1 "
                    "(kill -USR1 PID). This matches them across ranks by group "
                    "and sequence number and names: ranks missing from a collective, type / size / dtype "
                    "mismatches, a receive nobody sent, a read parked at a PS gate and the straggler it waits for. "
                    "Exit status: 0 no problem found, 1 problems found (or unreadable records).")
    p.add_argument("run", help="a run directory (its flight/ folder is read) or a folder of flight records")
    p.add_argument("--json", action="store_true", help="print {problems, notes, records} as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pslab.collectives.diagnose import diagnose_dir
    d = diagnose_dir(args.run)
    if args.json:
        json.dump({"problems": d.problems, "notes": d.notes, "records": d.records}, sys.stdout, indent=1)
        print()
        return 1 if d.problems else 0
    if not d.problems:
        print(f"no problem found in {d.records} flight record(s): every collective matched on every member, every "
              "receive had its send")
    for line in d.problems:
        print(f"problem: {line}")
    for line in d.notes:
        print(f"  where: {line}")
    return 1 if d.problems else 0
