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

from pslab.experiments.errors import ExperimentError
from pslab.experiments.results.rundir import read_jsonl
from pslab.experiments.runner import execute
from tests.detectlog import detected
from tests.experiments.conftest import small_config, traces
from tests.leftovers import held

pytestmark = pytest.mark.under_load        # beside a CPU hog, as CI runs it (tests/conftest.py)


def _held_by_others() -> set[str]:
    """`shm:<name>` of every /dev/shm entry another live process holds open or mapped: a job of someone else on
    this host (another test session), not a leftover of this test's runs (whose processes are gone by then)."""
    me = os.getpid()
    return {f"shm:{n}" for n in held(int(d) for d in os.listdir("/proc") if d.isdigit() and int(d) != me)}


def _left_behind(before: set[str]) -> set[str]:
    """Traces that are new since `before` and that no other live process holds (see `_held_by_others`)."""
    new = traces() - before
    return new - _held_by_others() if new else new


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
    before, kids = traces(), set(_children())     # earlier tests' helpers (a forkserver) are not this test's
    yield
    # what this test's runs left is there at the first look after it and stays; a trace that appears later, or goes
    # within the wait, is not theirs (under pytest -n another under_load test may be killing shards meanwhile: their
    # bells are orphans until its supervisor sweeps them)
    deadline, left = time.monotonic() + 10, _left_behind(before)
    while time.monotonic() < deadline and (set(_children()) - kids or left):
        time.sleep(0.1)
        left &= _left_behind(before)
    assert not set(_children()) - kids, "a run left processes behind"
    assert not left, f"a run left files behind: {sorted(left)}"


def test_the_leftover_check_counts_orphans_not_another_jobs_live_segments():
    """`clean` must not fail a test for a segment another session's live job holds (/dev/shm is the host's), and
    must still count one nobody holds. The old check (everything new under pslab-*) counted both."""
    import subprocess
    import sys
    import uuid
    before = traces()
    live, orphan = (f"/dev/shm/pslab-{uuid.uuid4().hex[:12]}-{k}-test" for k in ("live", "orphan"))
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1], 'w'); "
                               "print('ok', flush=True); time.sleep(60)", live], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ok"
        Path(orphan).write_text("")
        made = {f"shm:{Path(live).name}", f"shm:{Path(orphan).name}"}    # (other tests' come and go meanwhile)
        assert made <= traces() - before                                  # the old check counted both
        assert _left_behind(before) & made == {f"shm:{Path(orphan).name}"}
    finally:
        holder.kill()
        holder.wait(10)
        holder.stdout.close()
        for p in (live, orphan):
            Path(p).unlink(missing_ok=True)


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
    detected(ev[1]["who"], ev[1]["detect_s"], 5.0)
    assert ev[1]["who"] == "worker:1" and ev[1]["detect_s"] < 5.0


def test_a_worker_of_a_split_model_is_its_ranks(tmp_path, clean):
    """tp = 2, 2 workers (ranks 0-1 are worker 0, ranks 2-3 worker 1): kill = "worker:1" kills worker 1's first
    rank (rank 2), and the events name worker 1 (not worker 2, which does not exist, nor rank 1 of worker 0)."""
    with pytest.raises(ExperimentError, match=r"rank 2 died \(was killed by SIGKILL\)"):
        _run(tmp_path, "workload.name=text-transformer", "workload.batch_size=8", "train.optimizer=momentum",
             "train.strategy=allreduce", "train.workers=2", "parallel.tp=2", "faults.on_failure=abort",
             "train.steps=20", 'faults.events=[{kill="worker:1", at_step=3}]', label="tp-abort")
    ev = _events(next((tmp_path / "runs").iterdir()))
    assert [e["event"] for e in ev] == ["inject", "detect", "abort"], ev
    assert {e["who"] for e in ev} == {"worker:1"} and "(rank 2)" in ev[1]["how"], ev


def test_a_hung_worker_is_detected_within_the_bound(tmp_path, clean):
    """SIGSTOP for longer than faults.detect_s is a failure: detected (no heartbeat) within detect_s + a beat."""
    with pytest.raises(ExperimentError, match=r"rank 2 hung: no heartbeat"):
        _run(tmp_path, "train.strategy=allreduce", "faults.on_failure=abort", "train.steps=30",
             "faults.detect_s=2.0", 'faults.events=[{stop="worker:2", at_step=4, for_s=20}]', label="hung")
    ev = _events(next((tmp_path / "runs").iterdir()))
    det = [e for e in ev if e["event"] == "detect"]
    assert len(det) == 1 and det[0]["who"] == "worker:2"
    detected(det[0]["who"], det[0]["detect_s"], 2.0 + 0.5 + 1.0)
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
    from pslab.collectives import elastic     # part of this package: an ImportError fails these tests, never skips them
    return elastic


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
    if det:
        detected(det[0]["who"], det[0]["detect_s"], 5.0)
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
    if det:
        detected(det[0]["who"], det[0]["detect_s"], 5.0)
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


def _shrink_reference(cfg, gone: int, at: int, back: int | None = None) -> dict[tuple[int, int], float]:
    """One process, the whole model, no elastic code: steps 0..at-1 on the mean gradient of all K workers' batches at
    the step lr for K, then steps at.. on the K-1 survivors' batches (each keeps its own data shard; worker `gone`'s
    is not visited) at the step lr of train.lr_rule for K-1, the optimizer state carried over -- and from step
    `back` on (a replacement joined) all K again. The loss of each (worker, step), as the run records it: what
    docs/tutorial.md section 8 says a shrunken all-reduce computes."""
    import dataclasses
    from pslab.experiments.strategies.spec import optimizer_spec, step_lr, torch_optimizer
    from pslab.experiments.workloads import get_workload
    t = cfg.train
    wl = get_workload(cfg.workload.name, t.workers, cfg.workload.batch_size, cfg.workload.seed,
                      **cfg.workload.overrides())
    model = wl.make_model()
    opt = torch_optimizer(optimizer_spec(t), model.parameters())
    out = {}
    for step in range(t.steps):
        members = [w for w in range(t.workers) if step < at or w != gone or (back is not None and step >= back)]
        for g in opt.param_groups:
            g["lr"] = step_lr(dataclasses.replace(t, workers=len(members)))
        opt.zero_grad()
        for w in members:
            x, y, _ = wl.batch(w, step)
            loss = wl.loss_from_output(model(x), y)
            loss.backward()
            out[(w, step)] = float(loss.detach())
        for p in model.parameters():
            p.grad.div_(len(members))
        opt.step()
    return out


@pytest.mark.parametrize("backend", ["zmq", "torch"])
def test_a_shrunken_ring_trains_like_a_single_process_reference(tmp_path, clean, elastic, backend):
    """The killed all-reduce run against a reference that shares no elastic code (`_shrink_reference`): every
    survivor's loss at every step, before and after the rebuild, equals it to float32 summation order -- so the
    rollback, the state broadcast (momentum buffers included), the new ring and the lr at N-1 are right, not only
    equal to a planned departure that takes the same path."""
    args = ("train.strategy=allreduce", "train.workers=4", "train.steps=14", f"train.backend={backend}",
            "train.optimizer=momentum", 'faults.events=[{kill="worker:2", at_step=6}]')
    rd = _run(tmp_path, *args, label="killed")
    (rec, *_) = [e for e in _events(rd) if e["event"] == "recover"]
    assert rec["world_size"] == 3 and rec["step"] in (5, 6)
    ref = _shrink_reference(small_config(*args), 2, rec["step"])
    got = {(u["worker"], u["step"]): u["loss"] for u in read_jsonl(rd.metrics_path)}   # a redone step: the last
    for w in (0, 1, 3):
        for step in range(14):
            assert got[(w, step)] == pytest.approx(ref[(w, step)], rel=1e-5, abs=1e-6), (w, step)


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
    args = ("train.strategy=allreduce", "train.workers=4", "train.steps=80", "faults.detect_s=1.5",
            "train.base_step_s=0.05", 'faults.events=[{stop="worker:3", at_step=4, for_s=2.5}]')
    rd = _run(tmp_path, *args, label="stop")
    ev = _events(rd)
    kinds = [e["event"] for e in ev]
    assert "detect" in kinds and kinds.count("expel") == 2, ev   # removed, then woke up outside
    ups = read_jsonl(rd.metrics_path)
    assert all(sum(1 for u in ups if u["worker"] == w) >= 80 for w in (0, 1, 2))
    assert max(u["step"] for u in ups if u["worker"] == 3) < 10
    assert torch.isfinite(torch.tensor([u["loss"] for u in ups])).all()
    # not corrupted: the survivors trained, before and after the woken member came back, exactly as a single process
    # shrinking to {0, 1, 2} at the recovery step does (the woken member added nothing to the new ring)
    (rec, *_) = [e for e in ev if e["event"] == "recover"]
    ref = _shrink_reference(small_config(*args), 3, rec["step"])
    got = {(u["worker"], u["step"]): u["loss"] for u in ups}
    for w in (0, 1, 2):
        for step in range(80):
            assert got[(w, step)] == pytest.approx(ref[(w, step)], rel=1e-5, abs=1e-6), (w, step)


def test_a_stopped_worker_replaced_then_woken_does_not_touch_the_run(tmp_path, clean, elastic):
    """on_failure = replace and a SIGSTOP longer than detect_s: the hung worker 1 is expelled and replaced; the
    replacement has its member id, so only its incarnation tells the woken original apart. The original gets its
    SIGCONT (not the replacement), wakes up outside the membership (expel) instead of joining the replacement's
    ring, and records nothing: every (worker, step) is recorded (once, or twice for a step the join rolled back;
    worker 1's steps between the recovery and the join by nobody),
    and every recorded loss equals the single-process reference that drops worker 1 at the first recovery and takes
    it back at the join. (Before: SIGCONT went to the replacement, so the original never woke up during the run;
    woken, it joined the new generation as member 1.)"""
    args = ("train.strategy=allreduce", "train.workers=4", "train.steps=80", "faults.detect_s=1.5",
            "train.base_step_s=0.05", "faults.on_failure=replace",
            'faults.events=[{stop="worker:1", at_step=4, for_s=2.5}]')
    rd = _run(tmp_path, *args, label="stop-replace")
    ev = _events(rd)
    (join,) = [e for e in ev if e["event"] == "join"]
    recs = [e for e in ev if e["event"] == "recover"]
    assert join["who"] == "worker:1" and join["world_size"] == 4 and recs[-1]["how"] == join["how"], ev
    expels = [e for e in ev if e["event"] == "expel"]
    assert [e["how"] for e in expels] == ["left the membership", "woke up outside the membership"], ev
    assert expels[1]["time_s"] > join["time_s"]
    ups = read_jsonl(rd.metrics_path)
    # worker 1's data shard is not visited between the first recovery and the join (no member holds it then): how
    # many steps that is depends on how soon the replacement is up (under load the survivors may finish a step in
    # the 3-member ring first); the reference below drops exactly those steps
    gap = {(1, t) for t in range(recs[0]["step"], join["step"])}
    assert {(u["worker"], u["step"]) for u in ups} == {(w, t) for w in range(4) for t in range(80)} - gap
    assert len(ups) <= 4 * 80 + 3 * (join["step"] - recs[0]["step"] + 1)     # redone: the survivors' rolled-back
    ref = _shrink_reference(small_config(*args), 1, recs[0]["step"], join["step"])
    for u in ups:
        assert u["loss"] == pytest.approx(ref[(u["worker"], u["step"])], rel=1e-5, abs=1e-6), u


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


@pytest.mark.parametrize("strategy", ["ps-bsp", "ps-asp", "ps-ssp:2"])
def test_a_killed_shard_restarts_from_its_checkpoint(tmp_path, clean, elastic, strategy):
    """kill -9 of the shard in mid-run with shard_checkpoint_every = 10: restarted automatically from its latest
    checkpoint, updates lost <= 10, and the run completes every step."""
    rd = _run(tmp_path, f"train.strategy={strategy}", "train.workers=3", "train.steps=60", "train.base_step_s=0.02",
              "faults.shard_checkpoint_every=10", 'faults.events=[{kill="shard:0", at_s=0.6}]', label="shard-kill")
    ev = _events(rd)
    restarts = [e for e in ev if e["event"] == "shard_restart"]
    assert len(restarts) == 1 and 0 <= restarts[0]["lost_updates"] <= 10, ev
    assert restarts[0]["restored_version"] % 10 == 0
    # the report's figures: detect_s is inject -> detect (as for a worker), and detect is written before the
    # restart, so detect -> shard_restart (the report's time to recover) covers the restart (restart_s, ms)
    (inject,), (detect,) = ([e for e in ev if e["event"] == k] for k in ("inject", "detect"))
    detected(detect["who"], detect["detect_s"], 5.0)
    assert detect["who"] == "shard:0" and detect["detect_s"] < 5.0
    assert abs(detect["detect_s"] - (detect["time_s"] - inject["time_s"])) < 1e-5, (inject, detect)   # one clock
    assert restarts[0]["time_s"] - detect["time_s"] >= restarts[0]["restart_s"] - 1e-3, (detect, restarts)
    s = json.loads((rd.path / "summary.json").read_text())
    ups = read_jsonl(rd.metrics_path)
    assert {u["worker"] for u in ups} == {0, 1, 2} and max(u["step"] for u in ups) == 59
    assert s["final_test_acc"] is not None


@pytest.mark.parametrize("strategy", ["ps-asp", "ps-bsp", "ps-ssp:2"])
def test_a_shard_killed_before_its_first_checkpoint_comes_back_with_the_initial_parameters(tmp_path, clean, elastic,
                                                                                          strategy):
    """kill -9 of the shard long before its first checkpoint_every interval: the shard wrote a version-0 checkpoint
    at init, so it restarts holding the initial parameters (not empty), the workers go on from there, and the run
    completes every step; updates lost <= the interval (here: every update before the kill)."""
    every = 100_000
    rd = _run(tmp_path, f"train.strategy={strategy}", "train.workers=3", "train.steps=40", "train.base_step_s=0.02",
              f"faults.shard_checkpoint_every={every}", 'faults.events=[{kill="shard:0", at_s=0.3}]',
              label="early-shard-kill")
    ev = _events(rd)
    restarts = [e for e in ev if e["event"] == "shard_restart"]
    assert len(restarts) == 1 and restarts[0]["restored_version"] == 0, ev
    assert restarts[0]["checkpoint"].endswith("ckpt-000000000000.pslab"), restarts
    assert restarts[0]["lost_updates"] == restarts[0]["version_before"] <= every
    ups = read_jsonl(rd.metrics_path)
    assert {u["worker"] for u in ups} == {0, 1, 2} and max(u["step"] for u in ups) == 39
    assert json.loads((rd.path / "summary.json").read_text())["final_test_acc"] is not None


def test_a_shard_lost_without_checkpoints_ends_the_run_with_one_line_at_once(tmp_path, clean, elastic):
    """No shard checkpoints at all: the restarted shard is empty, and the workers say so at once (they used to wait
    for an init nobody sends, train.timeout_s, and fail on an unrelated message)."""
    t0 = time.monotonic()
    with pytest.raises(ExperimentError, match=r"came back without parameters .*shard_checkpoint_every"):
        _run(tmp_path, "train.strategy=ps-asp", "train.workers=2", "train.steps=400", "train.base_step_s=0.02",
             "train.timeout_s=120", 'faults.events=[{kill="shard:0", at_s=0.3}]', label="no-ckpt")
    assert time.monotonic() - t0 < 60


def test_fault_specs_that_could_never_happen_are_refused():
    """An at_step past the run, or anything after a process's kill / leave, is one ConfigError line, not silence."""
    from pslab.experiments.errors import ConfigError
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
    from pslab.experiments.results.faults import failures
    ev = [{"time_s": 1.0, "event": "detect", "who": "worker:2", "how": "died (was killed by SIGKILL)"},
          {"time_s": 1.2, "event": "recover", "who": "worker:2", "world_size": 3, "step": 40, "lost_steps": 1}]
    (f,) = failures(ev)
    assert f["who"] == "worker:2" and f["t_inject"] is None and f["t_detect"] == 1.0
    assert abs(f["recover_s"] - 0.2) < 1e-9 and f["lost_steps"] == 1 and f["world_size"] == 3


def test_a_worker_killed_from_outside_is_detected_and_survived(tmp_path, clean, elastic):
    """No [faults] events: a kill -9 from outside (another thread here, as a user's shell would) of one of the 4
    ranks of a running allreduce: the supervisor names it (a detect without an inject), the ring is rebuilt at 3,
    the survivors finish every step, and the report and pslab run's line say it was not injected."""
    import signal
    import threading
    from pslab.experiments.results.faults import failure_table, failures
    from pslab.experiments.results.rundir import RunDir
    kids, killed = set(_children()), []

    def shoot():
        end = time.monotonic() + 60
        while time.monotonic() < end and len(set(_children()) - kids) < 4:
            time.sleep(0.05)
        time.sleep(1.0)                                # the run is training by then (steps of 20 ms, 200 of them)
        ranks = sorted(set(_children()) - kids)
        if ranks:
            killed.append(ranks[-1])
            os.kill(ranks[-1], signal.SIGKILL)
    t = threading.Thread(target=shoot, daemon=True)
    t.start()
    rd = _run(tmp_path, "train.strategy=allreduce", "train.workers=4", "train.steps=200", "train.base_step_s=0.02",
              label="outside")
    t.join(5)
    assert killed, "the run ended before the test could kill a rank"
    ev = _events(rd)
    assert "inject" not in [e["event"] for e in ev]
    (det,) = [e for e in ev if e["event"] == "detect"]
    assert "SIGKILL" in det["how"] and det.get("detect_s") is None
    gone = int(det["who"].split(":")[1])
    assert any(e["event"] == "recover" and e["world_size"] == 3 for e in ev), ev
    ups = read_jsonl(rd.metrics_path)
    assert all({u["step"] for u in ups if u["worker"] == w} == set(range(200)) for w in range(4) if w != gone)
    assert max(u["step"] for u in ups if u["worker"] == gone) < 199
    (f,) = failures(ev)
    assert f["t_inject"] is None and f["world_size"] == 3
    assert "— (not injected)" in failure_table([RunDir(rd.path).load()])


def test_resume_after_an_abort_does_not_replay_the_fault(tmp_path, clean):
    """A checkpointed run aborted by an injected kill resumes (at another size) from its checkpoint without killing
    the worker again: the injected faults happened already."""
    from pslab.experiments.results.rundir import RunDir
    from pslab.experiments.strategies.resume import resume_config
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
