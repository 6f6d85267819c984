"""A run's records as TensorBoard scalars (`[logging] tensorboard = true`, or `pslab export RUN_DIR --tensorboard`).

Written after the run from its run directory's files (rundir.py) with torch's SummaryWriter, into
RUN_DIR/tensorboard/, so `tensorboard --logdir runs/` shows every run:

    per update (x: the run's update index, 1..U, in time order)
        loss/worker<k>, staleness/worker<k>, wait_s/worker<k>, bytes/worker<k> (sent + received)
    per evaluation (x: the updates applied when it was taken)
        eval/test_loss, eval/test_acc (and a user workload's other metrics)
    once (x: the last update)
        summary/updates_per_s, summary/time_s, summary/final_test_acc, summary/staleness_mean

A worker's series is its own rows, in order. Writing after the run keeps the writers out of the ranks (one file,
one process); an interrupted run is written with what it recorded. tensorboard is an optional extra
(`pip install tensorboard`); without it, one line says so.
"""

from __future__ import annotations

from pathlib import Path

from pslab.experiments.errors import MissingDependencyError
from pslab.experiments.results.rundir import RunDir, read_jsonl

SUMMARY_KEYS = ("updates_per_s", "time_s", "final_test_acc", "staleness_mean")


def require_tensorboard() -> None:
    """MissingDependencyError (one line) unless the tensorboard package is importable."""
    import importlib.util
    if importlib.util.find_spec("tensorboard") is None:
        raise MissingDependencyError("[logging] tensorboard needs the tensorboard package: pip install tensorboard "
                                     "(in a checkout: pip install -e '.[tensorboard]')")


def summary_writer(logdir: Path):  # noqa: ANN201 (torch.utils.tensorboard.SummaryWriter)
    require_tensorboard()
    from torch.utils.tensorboard import SummaryWriter
    return SummaryWriter(log_dir=str(logdir))


def write_tensorboard(run_dir: Path) -> Path:
    """Write RUN_DIR's records as TensorBoard scalars into RUN_DIR/tensorboard; returns that folder."""
    rd = RunDir(Path(run_dir))
    d = rd.load()                                            # ExperimentError if it is not a run directory
    out = rd.path / "tensorboard"
    w = summary_writer(out)
    try:
        for i, u in enumerate(d["updates"], start=1):
            k = u.get("worker", 0)
            for tag, v in (("loss", u.get("loss")), ("staleness", u.get("staleness")), ("wait_s", u.get("wait_s")),
                           ("bytes", None if u.get("bytes_sent") is None or u.get("bytes_recv") is None
                            else u["bytes_sent"] + u["bytes_recv"])):
                if v is not None:
                    w.add_scalar(f"{tag}/worker{k}", float(v), i)
        for e in read_jsonl(rd.eval_path):
            for key, v in e.items():
                if key not in ("updates", "time_s") and isinstance(v, (int, float)) and v is not None:
                    w.add_scalar(f"eval/{key}", float(v), int(e.get("updates", 0)))
        last = max(1, len(d["updates"]))
        for key in SUMMARY_KEYS:
            v = (d["summary"] or {}).get(key)
            if isinstance(v, (int, float)):
                w.add_scalar(f"summary/{key}", float(v), last)
    finally:
        w.close()
    return out
