"""`pslab run --resume RUN_DIR` through the CLI, leaving nothing behind in its temp directory or of its jobs in
/dev/shm (tests/leftovers.py: the jobs its ranks noted or held while they ran)."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch

from pslab.experiments.cli import main
from pslab.experiments.results.rundir import read_jsonl
from pslab.experiments.runner import execute
from pslab.parallelism.state_io import committed_steps
from tests.experiments.conftest import small_config
from tests.experiments.test_resume import DP, _params
from tests.leftovers import JobWatch, descendants, segments


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """A temp directory of this test only (other sessions share /tmp): the run's processes inherit it."""
    d = tmp_path / "tmp"
    d.mkdir()
    monkeypatch.setenv("TMPDIR", str(d))
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def test_resume_through_the_cli_continues_bitwise(tmp_path, capsys, private_tmp):
    """2-worker allreduce: 6 steps straight == 3 steps, then `pslab run --resume RUN_DIR --set train.steps=6`:
    the step-6 checkpoints hold the same parameters bitwise, the final test loss is the same, and the resumed
    directory holds each (worker, step) record once, in time order, and a summary."""
    with JobWatch(private_tmp, lambda: descendants(os.getpid())) as watch:
        straight = execute(small_config(*DP, "train.steps=6"), tmp_path, label="straight", quiet=True)
        first = execute(small_config(*DP, "train.steps=3"), tmp_path, label="first", quiet=True)
        assert [s for s, _ in committed_steps(first.path / "checkpoints")] == [3]
        assert main(["run", "--resume", str(first.path), "--set", "train.steps=6", "-q"]) == 0
    assert "run directory" in capsys.readouterr().out
    assert [s for s, _ in committed_steps(first.path / "checkpoints")] == [6, 3]
    a, b = _params(straight.path, 6), _params(first.path, 6)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    s_ev, r_ev = read_jsonl(straight.eval_path), read_jsonl(first.eval_path)
    assert s_ev[-1]["updates"] == r_ev[-1]["updates"] == 12 and s_ev[-1]["test_loss"] == r_ev[-1]["test_loss"]
    ups = read_jsonl(first.metrics_path)
    assert sorted((u["worker"], u["step"]) for u in ups) == [(w, t) for w in range(2) for t in range(6)]
    assert [u["time_s"] for u in ups] == sorted(u["time_s"] for u in ups)
    assert max(u["time_s"] for u in ups if u["step"] < 3) <= min(u["time_s"] for u in ups if u["step"] >= 3)
    by_key = lambda us: {(u["worker"], u["step"]): u["loss"] for u in us}
    assert by_key(ups) == by_key(read_jsonl(straight.metrics_path))
    summary = json.loads((first.path / "summary.json").read_text())
    assert summary["updates"] == 12
    env = json.loads((first.path / "env.json").read_text())
    assert env["resumed"][0]["from_step"] == 3 and (first.path / "config.before-step-3.toml").is_file()
    assert not list((first.path / "checkpoints").rglob(".*tmp*"))
    left = [p.name for p in private_tmp.iterdir() if not p.name.startswith("torchinductor_")]  # torch's cache
    assert not left, f"the run left {left[:4]} in the temp directory"
    assert watch.jobs, "the runs made no shared-memory segment: the leftover check would prove nothing"
    left = segments(watch.jobs)
    assert not left, f"left in /dev/shm: {sorted(left)[:4]}"
