"""`pslab bench trace`: what recording a timeline costs -- the same run with [trace] on and off, alternately.

    pslab bench trace                          compare_default.toml, allreduce and ps-asp, 3 pairs each
    pslab bench trace --set train.base_step_s=0 --reps 5     without compute padding: the worst case

Step time = the median, over workers, of the time between a worker's consecutive updates (metrics.jsonl), so
start-up and evaluation are left out. Each rep runs "off" and "on" back to back (alternating which goes first, so
drift in the machine's load hits both alike); the overhead is the median over reps of on / off. The flight
recorder is on in both (it is always on; `pslab bench collectives --peers noflight` prices it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "compare_default.toml"


def step_time(run_dir: Path) -> float:
    """Median over workers of the median time between a worker's consecutive updates."""
    per: dict[int, list[float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        u = json.loads(line)
        per.setdefault(int(u["worker"]), []).append(float(u["time_s"]))
    gaps = [statistics.median(b - a for a, b in zip(ts, ts[1:])) for ts in map(sorted, per.values()) if len(ts) > 2]
    return statistics.median(gaps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pslab bench trace", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(CONFIG), help="the run's config (default: compare_default.toml)")
    p.add_argument("--strategies", default="allreduce,ps-asp", help="comma-separated (default: allreduce,ps-asp)")
    p.add_argument("--reps", type=int, default=3, help="on/off pairs per strategy (default 3)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config overrides, as for pslab run")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args(argv)
    if args.reps < 1:
        raise SystemExit("pslab bench trace: --reps must be >= 1")
    from tqdm import tqdm
    from pslab.experiments.config import load_config
    from pslab.experiments.runner import execute
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    rows = []
    with tempfile.TemporaryDirectory(prefix="pslab-bench-trace-") as tmp:
        bar = tqdm(total=2 * args.reps * len(strategies), desc="runs", file=sys.stderr, disable=args.json)
        for s in strategies:
            times: dict[bool, list[float]] = {False: [], True: []}
            for rep in range(args.reps):
                for on in ((False, True) if rep % 2 == 0 else (True, False)):
                    cfg = load_config(args.config, [*args.overrides, f"train.strategy={s}", f"trace.enabled={str(on).lower()}"])
                    rd = execute(cfg, Path(tmp) / f"{s}-{rep}-{on}", quiet=True)
                    times[on].append(step_time(rd.path))
                    bar.update()
            ratios = [a / b for a, b in zip(times[True], times[False])]
            rows.append({"strategy": s, "off_s": statistics.median(times[False]), "on_s": statistics.median(times[True]),
                         "ratio": statistics.median(ratios), "ratios": ratios, "off_all_s": times[False],
                         "on_all_s": times[True]})
        bar.close()
    if args.json:
        json.dump(rows, sys.stdout, indent=1)
        print()
        return 0
    print(f"{'strategy':<12}{'step off (ms)':>15}{'step on (ms)':>14}{'on / off':>10}   per rep")
    for r in rows:
        print(f"{r['strategy']:<12}{r['off_s'] * 1e3:>15.2f}{r['on_s'] * 1e3:>14.2f}{r['ratio']:>10.3f}   "
              + " ".join(f"{x:.3f}" for x in r["ratios"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
