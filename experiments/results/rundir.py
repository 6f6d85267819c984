"""Run directories and metrics files.

    runs/<UTC time>-<label>/
        config.toml       the resolved config (re-runnable with `pslab run config.toml`)
        env.json          versions (python, torch, numpy, pyzmq, pslab), host, CPU count, git revision, argv
        metrics.jsonl     one `UpdateRecord` per update (experiments/results/records.py: worker, step, clock,
                          time_s, loss, staleness, bytes_sent, bytes_recv, wait_s, batch[, dropped])
        eval.jsonl        periodic test metrics: updates, time_s, test_loss, test_acc
        events.jsonl      failures, when [faults] events were injected: inject, detect, recover, join, ... (one
                          object a line, experiments/faults/spec.py EVENT_FIELDS; experiments/results/faults.py)
        summary.json      totals and rates, written last (its absence means the run was interrupted)

Writers flush every line, so an interrupted run keeps what it wrote. Multi-process runs write one part file per
process (metrics.w<k>.jsonl) and `merge_parts` joins them, ordered by time, when the run ends or is interrupted.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pslab.experiments.config import RunConfig, to_toml

class JsonlWriter:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._f = open(self.path, "a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()

    def __enter__(self) -> "JsonlWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by an interrupt
                pass
    return out


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    """Replace `path` with these records, one JSON object a line."""
    Path(path).write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records))


def git_revision() -> str | None:
    try:
        here = Path(__file__).resolve().parent.parent
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        return r.stdout.strip() or None if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version
    versions: dict[str, str | None] = {"python": sys.version.split()[0]}
    for dist in ("pslab-distributed", "torch", "numpy", "pyzmq", "msgpack", "scikit-learn", "matplotlib", "mlxtend"):
        try:  # metadata only: importing sklearn or matplotlib just for a version costs seconds
            versions[dist] = version(dist)
        except PackageNotFoundError:
            versions[dist] = None
    return {"versions": versions, "host": socket.gethostname(), "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "git_revision": git_revision(), "argv": sys.argv,
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def safe_name(label: str) -> str:
    """A label as one path component: letters, digits, '-', '.' kept, runs of anything else one '_' (so '../x'
    cannot leave the output directory)."""
    safe = "_".join(filter(None, "".join(c if c.isalnum() or c in "-." else "_" for c in label).split("_")))
    return safe.strip(".") or "run"


class RunDir:
    def __init__(self, path: Path):
        self.path = Path(path)

    @classmethod
    def create(cls, root: Path | str, label: str, cfg: RunConfig, extra: dict[str, Any] | None = None) -> "RunDir":
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        safe = safe_name(label)
        base = Path(root) / f"{stamp}-{safe}"
        Path(root).mkdir(parents=True, exist_ok=True)
        path, i = base, 1
        while True:                 # mkdir is the test: two runs with one label in one second never collide
            try:
                path.mkdir()
                break
            except FileExistsError:
                path, i = Path(f"{base}-{i}"), i + 1
        rd = cls(path)
        (path / "config.toml").write_text(to_toml(cfg.to_dict()))
        env = environment()
        if extra:
            env.update(extra)
        (path / "env.json").write_text(json.dumps(env, indent=2))
        return rd

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def eval_path(self) -> Path:
        return self.path / "eval.jsonl"

    @property
    def events_path(self) -> Path:
        """events.jsonl: the run's failures (experiments/faults/spec.py EVENT_FIELDS); absent if none were injected."""
        return self.path / "events.jsonl"

    def part_path(self, kind: str, k: int) -> Path:
        return self.path / f"{kind}.w{k}.jsonl"

    def merge_parts(self, kind: str = "metrics") -> int:
        """Join `<kind>.w*.jsonl` into `<kind>.jsonl` ordered by time; returns the number of records."""
        parts = sorted(self.path.glob(f"{kind}.w*.jsonl"))
        if not parts:
            return len(read_jsonl(self.path / f"{kind}.jsonl"))
        records = [r for p in parts for r in read_jsonl(p)]
        records += read_jsonl(self.path / f"{kind}.jsonl")
        records.sort(key=lambda r: (r.get("time_s", 0.0), r.get("worker", 0), r.get("step", 0)))
        write_jsonl(self.path / f"{kind}.jsonl", records)
        for p in parts:
            p.unlink()
        return len(records)

    def write_summary(self, summary: dict[str, Any]) -> None:
        (self.path / "summary.json").write_text(json.dumps(summary, indent=2))

    def load(self) -> dict[str, Any]:
        """Everything `pslab report` needs from a finished (or interrupted) run."""
        import tomllib
        summary_p = self.path / "summary.json"
        cfg_p = self.path / "config.toml"
        if not cfg_p.exists():
            from pslab.experiments.errors import ExperimentError
            raise ExperimentError(f"{self.path} is not a pslab run directory (no config.toml)")
        return {"path": str(self.path), "config": tomllib.loads(cfg_p.read_text()),
                "summary": json.loads(summary_p.read_text()) if summary_p.exists() else None,
                "updates": read_jsonl(self.metrics_path), "evals": read_jsonl(self.eval_path),
                "events": read_jsonl(self.events_path)}
