"""`pslab bench sim`: simulated updates per wall second of the timing-only PS simulator (`experiments.sim.timing`)
against its peer in the same run, the training-mode simulator (`experiments.sim.ps`, real gradients and optimizer) on
the same config, and a check that both give the same records on the peer's schedule.

    pslab bench sim                                  # 64 workers, ps-asp, 2000 steps each (128,000 updates), 3 reps
    pslab bench sim --strategy ps-ssp:2 --set 'stragglers.factors={"63" = 4.0}'

Timed: `run()` of each simulator (the event loop and writing metrics.jsonl), not its construction (loading the
workload) nor the run directory's summary. Reported: the median over `--reps` runs, each rep's figure, and the ratio
of the medians. Compute times that need a random draw per step (stragglers.delay, transient_prob) cost one seeded
generator per (worker, step), 10-15 us, in both modes.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from pslab.experiments.config import RunConfig, load_config
from pslab.experiments.results.rundir import RunDir, read_jsonl

SKIP = ("loss", "batch")      # what a timing-only record leaves null


def _config(args: argparse.Namespace, steps: int, timing: bool) -> RunConfig:
    return load_config(None, [f"train.workers={args.workers}", f"train.strategy={args.strategy}",
                              f"train.steps={steps}", f"workload.name={args.workload}", "train.eval_every=1000000",
                              "simulate.enabled=true", f"simulate.timing_only={'true' if timing else 'false'}",
                              *args.overrides])


def _timed(cfg: RunConfig, root: Path) -> tuple[float, Path]:
    """Seconds of one simulator run (the timing-only one if cfg says so), and its metrics file."""
    from pslab.experiments.sim.ps import Simulator
    from pslab.experiments.sim.timing import TimingSimulator
    rd = RunDir(Path(tempfile.mkdtemp(dir=root)))
    sim = TimingSimulator(cfg) if cfg.simulate.timing_only else Simulator(cfg)
    t0 = time.perf_counter()
    sim.run(rd)
    return time.perf_counter() - t0, rd.metrics_path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pslab bench sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=64, help="simulated workers (default 64)")
    p.add_argument("--strategy", default="ps-asp", help="a ps-* strategy (default ps-asp)")
    p.add_argument("--steps", type=int, default=2000, help="steps per worker, timing-only (default 2000)")
    p.add_argument("--peer-steps", type=int, default=3, help="steps per worker of the training-mode peer (default 3)")
    p.add_argument("--workload", default="digits-mlp", help="workload: sets the bytes per message (default digits-mlp)")
    p.add_argument("--reps", type=int, default=3, help="repetitions; the median is reported (default 3)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="any other config override (stragglers, [simulate] network, train.shards ...)")
    args = p.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    fast, slow = _config(args, args.steps, True), _config(args, args.peer_steps, False)
    n_fast, n_slow = args.workers * args.steps, args.workers * args.peer_steps
    with tempfile.TemporaryDirectory(prefix="pslab-bench-sim-") as tmp:
        root = Path(tmp)
        rates = [n_fast / _timed(fast, root)[0] for _ in range(max(1, args.reps))]
        peer = [n_slow / _timed(slow, root)[0] for _ in range(max(1, args.reps))]
        _, a = _timed(slow, root)
        _, b = _timed(_config(args, args.peer_steps, True), root)
        strip = [[{k: v for k, v in r.items() if k not in SKIP} for r in read_jsonl(x)] for x in (a, b)]
    med, med_peer = statistics.median(rates), statistics.median(peer)
    print(f"pslab bench sim: {args.strategy}, {args.workers} workers, {fast.workload.name}, {fast.train.shards} "
          f"shard(s){', ' + ', '.join(args.overrides) if args.overrides else ''}")
    print(f"  timing-only  {n_fast:>9,} updates per run   median {med:>11,.0f} updates/s   "
          f"(reps: {', '.join(f'{r:,.0f}' for r in rates)})")
    print(f"  training     {n_slow:>9,} updates per run   median {med_peer:>11,.0f} updates/s   "
          f"(reps: {', '.join(f'{r:,.0f}' for r in peer)})")
    print(f"  ratio        {med / med_peer:.0f}x;  records identical on the peer's schedule ({n_slow} updates, "
          f"all fields but {' and '.join(SKIP)}): {'yes' if strip[0] == strip[1] else 'NO'}")
    return 0 if strip[0] == strip[1] else 1
