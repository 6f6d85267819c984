"""Real runs that lose a process (issue 9): the supervisor names it within faults.detect_s, writes events.jsonl,
and per faults.on_failure the run ends (abort) or goes on: ps-asp with the survivors, allreduce on a rebuilt ring
(rolled back to the last commit, bitwise equal to a planned departure at the same step), a replacement that joins
with the survivors' parameters; a stopped worker is expelled and, woken up, ends cleanly. No process, shm segment
or temp directory outlives a run."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import pytest
import torch

from experiments.errors import ExperimentError
from experiments.results.rundir import read_jsonl
from experiments.runner import execute
from tests.experiments.conftest import small_config


def _traces() -> set[str]:
    tmp = Path(tempfile.gettempdir())    # the test's own (see `clean`), so other jobs on the host do not count
    return {str(p) for p in tmp.glob("pslab-*")} | {f"shm:{n}" for n in os.listdir("/dev/shm")
                                                     if n.startswith("pslab-")}


def _children() -> list[int]:
    """Live child processes of this test process (zombies excluded)."""
    me, out = os.getpid(), []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == me and fields[0] != "Z":
                out.append(int(d))
    return out


@pytest.fixture
def clean(tmp_path, monkeypatch):
    """Every run's temp directories go to a fresh folder; after the test, no child process and nothing new in it
    or in /dev/shm."""
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    before, kids = _traces(), set(_children())     # earlier tests' helpers (a forkserver) are not this test's
    yield
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (set(_children()) - kids or _traces() - before):
        time.sleep(0.1)
    assert not set(_children()) - kids, "a run left processes behind"
    assert not (_traces() - before), f"a run left files behind: {sorted(_traces() - before)}"


def _events(rd) -> list[dict]:
    return read_jsonl(getattr(rd, "path", rd) / "events.jsonl")


def _run(tmp_path, *overrides, label=None):
    return execute(small_config(*overrides), tmp_path / "runs", label=label, quiet=True)


def test_abort_names_a_killed_worker_at_once(tmp_path, clean):
    """on_failure = abort: a SIGKILLed worker ends the run with one line naming it; detect event < 5 s."""
    t = time.monotonic()
    with pytest.raises(ExperimentError, match=r"rank 1 died \(was killed by SIGKILL\)"):
        _run(tmp_path, "train.strategy=allreduce", "faults.on_failure=abort", "train.steps=30",
             'faults.events=[{kill="worker:1", at_step=5}]', label="abort")
    assert time.monotonic() - t < 60
    ev = _events(next((tmp_path / "runs").iterdir()))
    kinds = [e["event"] for e in ev]
    assert kinds == ["inject", "detect", "abort"], ev
    assert ev[1]["who"] == "worker:1" and ev[1]["detect_s"] < 5.0


def test_a_hung_worker_is_detected_within_the_bound(tmp_path, clean):
    """SIGSTOP for longer than faults.detect_s is a failure: detected (no heartbeat) within detect_s + a beat."""
    with pytest.raises(ExperimentError, match=r"rank 2 hung: no heartbeat"):
        _run(tmp_path, "train.strategy=allreduce", "faults.on_failure=abort", "train.steps=30",
             "faults.detect_s=2.0", 'faults.events=[{stop="worker:2", at_step=4, for_s=20}]', label="hung")
    ev = _events(next((tmp_path / "runs").iterdir()))
    det = [e for e in ev if e["event"] == "detect"]
    assert len(det) == 1 and det[0]["who"] == "worker:2"
    assert 1.0 < det[0]["detect_s"] < 2.0 + 0.5 + 1.0, det


def test_the_run_limit_is_not_the_request_timeout(tmp_path, clean):
    """train.timeout_s bounds one request, not the run: a 2 s timeout does not end a run of about 3 s."""
    rd = _run(tmp_path, "train.strategy=allreduce", "train.timeout_s=2", "train.base_step_s=0.12",
              "train.steps=25", label="long")
    s = json.loads((rd.path / "summary.json").read_text())
    assert s["updates"] == 3 * 25 and s["time_s"] > 2.0


def test_run_limit_ends_a_run(tmp_path, clean):
    """train.run_limit_s ends a run that outlives it, naming the ranks still running."""
    with pytest.raises(ExperimentError, match="timed out after 1.5s"):
        _run(tmp_path, "train.strategy=allreduce", "train.run_limit_s=1.5", "train.base_step_s=0.2",
             "train.steps=40", label="limit")


# ---------------------------------------------------------------------------------------------- elastic runs
@pytest.fixture
def elastic():
    return pytest.importorskip("collectives.elastic", reason="elastic process groups not available")


def test_ps_asp_goes_on_with_the_survivors(tmp_path, clean, elastic):
    """kill -9 of one of 4 ps-asp workers: the run completes with 3; detection < 5 s; the survivors' updates are
    all there; the final accuracy is within noise (0.1) of a run whose worker 3 left by plan at the same step."""
    rd = _run(tmp_path, "train.strategy=ps-asp", "train.workers=4", "train.steps=30", "train.base_step_s=0.01",
              'faults.events=[{kill="worker:3", at_step=10}]', label="asp-kill")
    s = json.loads((rd.path / "summary.json").read_text())
    ups = read_jsonl(rd.metrics_path)
    assert sum(1 for u in ups if u["worker"] == 3) == 10
    assert all(sum(1 for u in ups if u["worker"] == w) == 30 for w in (0, 1, 2))
    det = [e for e in _events(rd) if e["event"] == "detect"]
    assert det and det[0]["who"] == "worker:3" and det[0]["detect_s"] < 5.0
    # the reference: the same run in which worker 3 leaves by plan at that step (3 workers from step 10 on)
    ref = _run(tmp_path, "train.strategy=ps-asp", "train.workers=4", "train.steps=30", "train.base_step_s=0.01",
               'faults.events=[{leave="worker:3", at_step=10}]', label="asp-leave")
    r = json.loads((ref.path / "summary.json").read_text())
    assert abs(s["final_test_acc"] - r["final_test_acc"]) < 0.1, (s["final_test_acc"], r["final_test_acc"])


def _final_params(rd) -> dict:
    return json.loads((rd.path / "summary.json").read_text())


@pytest.mark.parametrize("backend", ["zmq", "torch"])
def test_allreduce_shrinks_and_equals_a_planned_departure(tmp_path, clean, elastic, backend):
    """kill -9 of worker 2 at step 6 under allreduce: detected, ring rebuilt with 3, rolled back to the last step
    every survivor committed (6, or 5 when a survivor's last all-reduce lost worker 2's final chunk), and the run goes
    on; the committed state after the rebuild and every later loss equal, bitwise, a run in which worker 2 left by
    plan at that step."""
    common = ("train.strategy=allreduce", "train.workers=4", "train.steps=14", f"train.backend={backend}",
              "train.optimizer=momentum")
    killed = _run(tmp_path, *common, 'faults.events=[{kill="worker:2", at_step=6}]', label="killed")
    ek = _events(killed)
    det = [e for e in ek if e["event"] == "detect"]
    assert det and det[0]["who"] == "worker:2" and det[0]["detect_s"] < 5.0
    rk = [e for e in ek if e["event"] == "recover"]
    assert rk and rk[-1]["world_size"] == 3 and rk[-1]["step"] in (5, 6), ek
    c = rk[-1]["step"]
    planned = _run(tmp_path, *common, f'faults.events=[{{leave="worker:2", at_step={c}}}]', label="planned")
    rp = [e for e in _events(planned) if e["event"] == "recover"]
    assert rp and rp[-1]["step"] == c and rp[-1]["world_size"] == 3
    assert rk[-1]["how"] == rp[-1]["how"]          # the digest of the committed state after the rebuild

    def survivors(rd):    # the last record of each (worker, step): a rolled-back step counts as redone
        return {(u["worker"], u["step"]): u["loss"] for u in read_jsonl(rd.metrics_path) if u["worker"] != 2}
    lk, lp = survivors(killed), survivors(planned)
    assert len(lk) == 3 * 14 and lk == lp         # the same bytes trained on, after the rebuild too
    assert _final_params(killed)["final_test_loss"] == _final_params(planned)["final_test_loss"]


def test_replacement_joins_with_the_survivors_parameters(tmp_path, clean, elastic):
    """on_failure = replace: worker 1 is killed, a replacement joins; world size back to 4, and the parameters
    it received equal the survivors' (the digests of join and recover match)."""
    rd = _run(tmp_path, "train.strategy=allreduce", "train.workers=4", "train.steps=14",
              "faults.on_failure=replace", 'faults.events=[{kill="worker:1", at_step=5}]', label="replace")
    ev = _events(rd)
    joins = [e for e in ev if e["event"] == "join"]
    recs = [e for e in ev if e["event"] == "recover"]
    assert joins and joins[-1]["world_size"] == 4 and joins[-1]["who"] == "worker:1"
    assert recs[-1]["world_size"] == 4 and recs[-1]["how"] == joins[-1]["how"]
    ups = read_jsonl(rd.metrics_path)
    assert {u["step"] for u in ups if u["worker"] == 1} >= set(range(joins[-1]["step"], 14))


def test_a_stopped_worker_is_expelled_and_ends_cleanly_when_woken(tmp_path, clean, elastic):
    """SIGSTOP of worker 3 for longer than detect_s: expelled, the others go on at 3; SIGCONT later: it finds
    itself outside the membership and ends cleanly (expel event), the run's records are not corrupted."""
    rd = _run(tmp_path, "train.strategy=allreduce", "train.workers=4", "train.steps=80", "faults.detect_s=1.5",
              "train.base_step_s=0.05", 'faults.events=[{stop="worker:3", at_step=4, for_s=2.5}]', label="stop")
    ev = _events(rd)
    kinds = [e["event"] for e in ev]
    assert "detect" in kinds and kinds.count("expel") == 2, ev   # removed, then woke up outside
    ups = read_jsonl(rd.metrics_path)
    assert all(sum(1 for u in ups if u["worker"] == w) >= 80 for w in (0, 1, 2))
    assert max(u["step"] for u in ups if u["worker"] == 3) < 10
    assert torch.isfinite(torch.tensor([u["loss"] for u in ups])).all()


def test_ps_bsp_gate_stops_waiting_for_a_dead_worker(tmp_path, clean, elastic):
    """kill -9 of worker 3 under ps-bsp: the shards are told the new membership, the gate stops waiting, the three
    survivors finish every clock."""
    rd = _run(tmp_path, "train.strategy=ps-bsp", "train.workers=4", "train.steps=30", "train.base_step_s=0.01",
              'faults.events=[{kill="worker:3", at_step=8}]', label="bsp-kill")
    ups = read_jsonl(rd.metrics_path)
    assert all(sum(1 for u in ups if u["worker"] == w) == 30 for w in (0, 1, 2))
    ev = _events(rd)
    assert [e["who"] for e in ev if e["event"] == "detect"] == ["worker:3"]
    assert any(e["event"] == "recover" and e["world_size"] == 3 for e in ev)


def test_a_killed_shard_restarts_from_its_checkpoint(tmp_path, clean, elastic):
    """kill -9 of the shard under ps-bsp with shard_checkpoint_every = 10: restarted automatically from its latest
    checkpoint, updates lost <= 10, and the run completes every step."""
    rd = _run(tmp_path, "train.strategy=ps-bsp", "train.workers=3", "train.steps=60", "train.base_step_s=0.02",
              "faults.shard_checkpoint_every=10", 'faults.events=[{kill="shard:0", at_s=0.6}]', label="shard-kill")
    ev = _events(rd)
    restarts = [e for e in ev if e["event"] == "shard_restart"]
    assert len(restarts) == 1 and 0 <= restarts[0]["lost_updates"] <= 10, ev
    assert restarts[0]["restored_version"] % 10 == 0
    s = json.loads((rd.path / "summary.json").read_text())
    ups = read_jsonl(rd.metrics_path)
    assert {u["worker"] for u in ups} == {0, 1, 2} and max(u["step"] for u in ups) == 59
    assert s["final_test_acc"] is not None


def test_fault_specs_that_could_never_happen_are_refused():
    """An at_step past the run, or anything after a process's kill / leave, is one ConfigError line, not silence."""
    from experiments.errors import ConfigError
    with pytest.raises(ConfigError, match="never reached"):
        small_config("train.strategy=allreduce", 'faults.events=[{kill="worker:1", at_step=12}]')
    with pytest.raises(ConfigError, match="already gone"):
        small_config("train.strategy=allreduce",
                     'faults.events=[{kill="worker:1", at_step=4}, {kill="worker:1", at_step=6}]')
    with pytest.raises(ConfigError, match="already gone"):
        small_config("train.strategy=allreduce",
                     'faults.events=[{kill="worker:1", at_step=4}, {stop="worker:1", at_step=6, for_s=1}]')
    ok = small_config("train.strategy=allreduce",
                      'faults.events=[{kill="worker:1", at_step=8}, {stop="worker:1", at_step=4, for_s=1}]')
    assert len(ok.faults.parsed()) == 2


def test_a_failure_nobody_injected_is_reported():
    """A detect without an inject (a process killed from outside) is a failure of the report and of the summary."""
    from experiments.results.faults import failures
    ev = [{"time_s": 1.0, "event": "detect", "who": "worker:2", "how": "died (was killed by SIGKILL)"},
          {"time_s": 1.2, "event": "recover", "who": "worker:2", "world_size": 3, "step": 40, "lost_steps": 1}]
    (f,) = failures(ev)
    assert f["who"] == "worker:2" and f["t_inject"] is None and f["t_detect"] == 1.0
    assert abs(f["recover_s"] - 0.2) < 1e-9 and f["lost_steps"] == 1 and f["world_size"] == 3


def test_resume_after_an_abort_does_not_replay_the_fault(tmp_path, clean):
    """A checkpointed run aborted by an injected kill resumes (at another size) from its checkpoint without killing
    the worker again: the injected faults happened already."""
    from experiments.results.rundir import RunDir
    from experiments.strategies.resume import resume_config
    with pytest.raises(ExperimentError, match="rank 1 died"):
        _run(tmp_path, "train.strategy=allreduce", "train.workers=2", "faults.on_failure=abort",
             "faults.checkpoint_every=4", 'faults.events=[{kill="worker:1", at_step=6}]', label="aborted")
    run = next((tmp_path / "runs").iterdir())
    cfg = resume_config(run, ["train.workers=3"])
    assert cfg.faults.events == [] and cfg.train.workers == 3
    rd = execute(cfg, quiet=True, resume=RunDir(run))
    s = json.loads((rd.path / "summary.json").read_text())
    assert s["final_test_acc"] is not None
    assert max(u["step"] for u in read_jsonl(rd.metrics_path)) == 11
