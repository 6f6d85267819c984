"""Nothing is left behind by a killed process: a rank or a shard that dies by SIGKILL cannot unlink its shared
memory segments or remove its ipc directory, so whoever started it sweeps them (collectives/cleanup.py)."""

from __future__ import annotations

import os
import signal
import tempfile
from pathlib import Path

import pytest
import torch

from pslab import collectives
from pslab.collectives import cleanup

pytestmark = pytest.mark.exclusive         # checks every pslab-* entry on the machine: alone under pytest -n (tests/conftest.py)


def _traces() -> set[str]:
    tmp = Path(tempfile.gettempdir())
    return {str(p) for p in tmp.glob("pslab-*")} | {f"shm:{n}" for n in os.listdir("/dev/shm") if n.startswith("pslab-")}


def _all_reduce_then_die(group: collectives.ProcessGroup) -> float:
    t = torch.ones(1 << 20)                       # 4 MiB: the ring streams through shared-memory segments
    group.all_reduce(t)
    if group.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)      # no finally block runs: segments and ipc dir stay ... until swept
    return float(t[0])


def test_a_killed_rank_leaves_no_segment_and_no_ipc_directory():
    before = _traces()
    with pytest.raises(collectives.LaunchError, match="rank 1"):
        collectives.launch(_all_reduce_then_die, 2, timeout=60)
    assert _traces() - before == set()


def test_sweep_removes_only_the_noted_jobs_segments(tmp_path, monkeypatch):
    d = cleanup.make_dir()
    monkeypatch.setenv(cleanup.ENV, d)
    mine, other = "0123456789ab", "ba9876543210"
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
