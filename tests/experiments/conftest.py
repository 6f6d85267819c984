"""Shared helpers for the experiments tests: small configs that run in seconds on a 2-core machine, and what a run
started as a user starts it leaves behind (its session's processes, temp directories, /dev/shm segments)."""

from __future__ import annotations

import os
import signal
import tempfile
from pathlib import Path

import pytest
import torch

from pslab.experiments.config import load_config
from tests.leftovers import job_of

torch.set_num_threads(1)


def small_config(*overrides: str):
    base = ["workload.name=digits-logreg", "train.workers=3", "train.steps=12", "train.lr=0.1",
            "train.eval_every=12", "train.timeout_s=60"]
    return load_config(None, base + list(overrides))


@pytest.fixture
def cfg_factory():
    return small_config


def as_from_a_terminal() -> None:
    """The child's SIGINT as a terminal's foreground job has it (default). A test runner started in the background
    of a non-interactive shell inherits SIGINT ignored, and so would the `pslab run` under test: Ctrl-C would then
    never reach it, by the shell's rule, not pslab's."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def session_processes(sid: int) -> list[int]:
    """The live (not zombie) processes of session `sid`."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                pids.append(int(d.name))
    return pids


def own_traces(tmp: Path, jobs: set[str]) -> set[str]:
    """What one run left: the pslab temp directories in its own temp dir `tmp`, and the /dev/shm segments of its
    jobs `jobs` (gathered while it ran: tests/leftovers.py). Under pytest -n another test's segments come and go in
    /dev/shm meanwhile (a killed shard's bell stays until its supervisor sweeps it): not this run's."""
    return {t for t in traces(tmp) if not t.startswith("shm:") or job_of(t[4:]) in jobs}


def traces(tmp: Path | None = None) -> set[str]:
    """What runs may leave behind: pslab temp directories (in `tmp`, default the temp dir) and /dev/shm segments."""
    tmp = tmp or Path(tempfile.gettempdir())
    return {str(p) for p in tmp.glob("pslab-*")} | {f"shm:{n}" for n in os.listdir("/dev/shm") if n.startswith("pslab-")}
