"""Nothing is left behind by a killed process: a rank or a shard that dies by SIGKILL cannot unlink its shared
memory segments or remove its ipc directory, so whoever started it sweeps them (collectives/cleanup.py)."""

from __future__ import annotations

import os
import secrets
import signal
import tempfile
from pathlib import Path

import pytest
import torch

from pslab import collectives
from pslab.collectives import cleanup
from tests.leftovers import JobWatch, descendants, segments


def _all_reduce_then_die(group: collectives.ProcessGroup) -> float:
    t = torch.ones(1 << 20)                       # 4 MiB: the ring streams through shared-memory segments
    group.all_reduce(t)
    if group.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)      # no finally block runs: segments and ipc dir stay ... until swept
    return float(t[0])


def test_a_killed_rank_leaves_no_segment_and_no_ipc_directory(tmp_path, monkeypatch):
    """Its job directory (ipc directories inside) goes from this test's own temp dir, and no segment of the jobs
    the ranks noted or held stays in /dev/shm (other tests' come and go there meanwhile: tests/leftovers.py)."""
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    with JobWatch(private, lambda: descendants(os.getpid())) as watch:
        with pytest.raises(collectives.LaunchError, match="rank 1"):
            collectives.launch(_all_reduce_then_die, 2, timeout=60)
    assert watch.jobs, "the ranks made no segment: the test would prove nothing"
    assert list(private.glob("pslab-*")) == [] and segments(watch.jobs) == set()


def test_sweep_removes_only_the_noted_jobs_segments(tmp_path, monkeypatch):
    d = cleanup.make_dir()
    monkeypatch.setenv(cleanup.ENV, d)
    mine, other = secrets.token_hex(6), secrets.token_hex(6)     # (other tests' jobs may be in /dev/shm meanwhile)
    cleanup.note_shm_job(mine)
    made = [Path("/dev/shm") / f"pslab-{j}-0-1-{g}" for j in (mine, other) for g in (1, 2)]
    for p in made:
        p.write_bytes(b"x")
    try:
        ipc = cleanup.temp_dir()
        assert Path(ipc).parent == Path(d)
        assert cleanup.sweep(d) == 2
        assert not any(p.exists() for p in made[:2]) and all(p.exists() for p in made[2:]) and not Path(d).exists()
    finally:
        for p in made:
            p.unlink(missing_ok=True)
