"""Sub-commands of `pslab`, one module each with register(subparsers) and run(args) -> int: compare.py, run.py,
sweep.py, report.py, server.py (one PS shard in the foreground), schedule.py (pipeline timelines), bench.py, workloads.py (list the workloads);
common.py holds the arguments several share."""
