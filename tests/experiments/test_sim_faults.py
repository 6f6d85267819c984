"""Failures in virtual time (experiments/sim/faults.py): the [faults] events injected into the PS and all-reduce
simulators, detected by the model of real runs (a kill at once, a stop after detect_s), survived by each strategy's
policy, and written to events.jsonl in the one schema; deterministic."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pslab.experiments.errors import ExperimentError
from pslab.experiments.faults.spec import EVENT_FIELDS
from pslab.experiments.results.faults import throughput_series
from pslab.experiments.results.rundir import read_jsonl
from pslab.experiments.runner import execute
from pslab.experiments.sim import faults as fm
from tests.experiments.conftest import small_config

pytestmark = pytest.mark.timeout(300)


def _run(tmp_path, *overrides, label="sim"):
    cfg = small_config("train.workers=4", "train.steps=20", "train.eval_every=1000", *overrides)
    rd = execute(cfg, tmp_path, label=label, simulate=True, quiet=True)
    events = read_jsonl(rd.events_path)
    assert all(list(e) == [k for k in EVENT_FIELDS if k in e] for e in events)      # schema order, no extras
    return rd, read_jsonl(rd.metrics_path), events


def _one(events, kind):
    found = [e for e in events if e["event"] == kind]
    assert len(found) == 1, (kind, events)
    return found[0]


def _applied(ups):
    return [u for u in ups if not u.get("dropped") and u.get("staleness") is not None]


def test_ps_asp_kill_goes_on_at_once_with_the_survivors(tmp_path):
    """kill worker:3 at step 10: it made steps 0..9, the others all 20; detected EXIT_DETECT_S after the kill, the
    membership is then 3; ASP never waits: survivors' updates are applied between the kill and its detection."""
    rd, ups, ev = _run(tmp_path, "train.strategy=ps-asp", 'faults.events=[{kill="worker:3",at_step=10}]')
    per = {w: sorted(u["step"] for u in ups if u["worker"] == w) for w in range(4)}
    assert per[3] == list(range(10)) and all(per[w] == list(range(20)) for w in range(3))
    inj, det, rec = _one(ev, "inject"), _one(ev, "detect"), _one(ev, "recover")
    assert [e["event"] for e in ev] == ["inject", "detect", "recover"]
    assert inj["who"] == "worker:3" and inj["step"] == 10 and inj["world_size"] == 4
    assert det["detect_s"] == pytest.approx(fm.EXIT_DETECT_S) and det["time_s"] - inj["time_s"] == pytest.approx(
        fm.EXIT_DETECT_S)
    assert rec["world_size"] == 3 and rec["generation"] == 1
    between = [u for u in _applied(ups) if inj["time_s"] < u["time_s"] < det["time_s"]]
    assert {u["worker"] for u in between} >= {0, 1, 2}
    assert all(u["step"] == 9 for u in between if u["worker"] == 3)      # its last push was already on the wire
    summary = __import__("json").loads((rd.path / "summary.json").read_text())
    assert summary["world_size_final"] == 3 and summary["fault_events"] == {"inject": 1, "detect": 1, "recover": 1}


def test_ps_bsp_stalls_until_a_stopped_worker_is_detected_then_goes_on_and_expels_it(tmp_path):
    """stop worker:1 at step 5 for 2 s, detect_s = 1: BSP applies nothing from the stop until the detection (the
    timeline's throughput is 0 there), then goes on with 3; when worker 1 comes back it is expelled."""
    rd, ups, ev = _run(tmp_path, "train.strategy=ps-bsp", "faults.detect_s=1.0", "simulate.compute_s=0.1",
                       'faults.events=[{stop="worker:1",at_step=5,for_s=2.0}]')
    inj, det, rec, exp = (_one(ev, k) for k in ("inject", "detect", "recover", "expel"))
    assert det["time_s"] - inj["time_s"] == pytest.approx(1.0) and det["detect_s"] == pytest.approx(1.0)
    assert exp["time_s"] - inj["time_s"] == pytest.approx(2.0) and exp["who"] == "worker:1"
    times = np.array(sorted(u["time_s"] for u in _applied(ups)))
    gap = np.diff(times).max()
    assert gap >= 0.95 and times[np.argmax(np.diff(times)) + 1] >= det["time_s"]    # the stall ends at detection
    grid, rate, window = throughput_series(ups)
    stalled = (grid > inj["time_s"] + window + 0.05) & (grid < det["time_s"])
    assert stalled.any() and (rate[stalled] == 0).all() and rate.max() > 0
    assert sorted(u["step"] for u in ups if u["worker"] == 1) == list(range(5))
    after = [u for u in _applied(ups) if u["time_s"] > rec["time_s"]]
    assert after and {u["worker"] for u in after} == {0, 2, 3}
    assert all(sorted(u["step"] for u in ups if u["worker"] == w) == list(range(20)) for w in (0, 2, 3))


def test_a_stop_shorter_than_detect_s_is_only_a_pause(tmp_path):
    """for_s <= detect_s: no detection, nobody expelled, every worker makes every step; BSP waits for_s."""
    _, ups, ev = _run(tmp_path, "train.strategy=ps-bsp", "faults.detect_s=1.0",
                      'faults.events=[{stop="worker:1",at_step=5,for_s=0.5}]')
    assert [e["event"] for e in ev] == ["inject"]
    assert all(sorted(u["step"] for u in ups if u["worker"] == w) == list(range(20)) for w in range(4))
    gap = np.diff(np.array(sorted(u["time_s"] for u in _applied(ups)))).max()
    assert 0.5 <= gap < 0.6


def _ring_lrs(tmp_path, *overrides):
    """Run the all-reduce simulator, recording (world size, lr) at every optimizer step."""
    from pslab.experiments.results.rundir import RunDir
    from pslab.experiments.sim.allreduce import _Ring
    cfg = small_config("train.workers=4", "train.steps=12", "train.eval_every=1000", "train.strategy=allreduce",
                       *overrides)
    cfg.simulate.enabled = True
    cfg.validate()
    tmp_path.mkdir(parents=True, exist_ok=True)
    ring = _Ring(cfg, RunDir(tmp_path), None)
    seen, step = [], ring.opt.step

    def recording_step(*a, **k):
        seen.append((len(ring.members), ring.opt.param_groups[0]["lr"]))
        return step(*a, **k)
    ring.opt.step = recording_step
    ring.run()
    return seen, read_jsonl(tmp_path / "metrics.jsonl"), read_jsonl(tmp_path / "events.jsonl")


@pytest.mark.parametrize("rule", ["linear", "sqrt"])
def test_allreduce_shrink_rolls_back_to_the_commit_and_steps_at_the_new_size(tmp_path, rule):
    """kill worker:3 at step 7, commit every 3: the survivors roll back to step 6 (1 step lost), redo it from the
    committed state (the same losses, bitwise), and finish with 3 workers, each step's lr = the rule at G = 3."""
    seen, ups, ev = _ring_lrs(tmp_path / rule, f"train.lr_rule={rule}", "faults.commit_every=3",
                              'faults.events=[{kill="worker:3",at_step=7}]')
    rec = _one(ev, "recover")
    assert rec["step"] == 6 and rec["lost_steps"] == 1 and rec["world_size"] == 3 and rec["generation"] == 1
    scale = {"linear": lambda g: g, "sqrt": math.sqrt}[rule]
    assert seen == [(4, pytest.approx(0.1 * scale(4)))] * 7 + [(3, pytest.approx(0.1 * scale(3)))] * 6
    assert len(ups) == 4 * 7 + 3 * 6
    for w in range(3):
        step6 = [u for u in ups if u["worker"] == w and u["step"] == 6]
        assert len(step6) == 2 and step6[0]["loss"] == step6[1]["loss"] and step6[1]["time_s"] > rec["time_s"]
    assert {u["worker"] for u in ups if u["time_s"] > rec["time_s"]} == {0, 1, 2}


def test_allreduce_replace_brings_the_world_size_back(tmp_path):
    """on_failure = replace: a replacement for worker 3 joins at the first step boundary after detect + T_join;
    from then on 4 workers again, at the lr of G = 4."""
    seen, ups, ev = _ring_lrs(tmp_path, "faults.on_failure=replace", "simulate.compute_s=0.2", "train.steps=20",
                              'faults.events=[{kill="worker:3",at_step=5}]')
    det, join = _one(ev, "detect"), _one(ev, "join")
    t_join = fm.join_s(small_config().simulate, False, 0)
    assert join["world_size"] == 4 and join["generation"] == 2 and join["time_s"] >= det["time_s"] + t_join
    assert seen[-1] == (4, pytest.approx(0.4)) and (3, pytest.approx(0.3)) in seen
    assert any(u["worker"] == 3 and u["time_s"] > join["time_s"] for u in ups)


def test_ps_bsp_replace_rejoins_at_the_committed_clock(tmp_path):
    rd, ups, ev = _run(tmp_path, "train.strategy=ps-bsp", "faults.on_failure=replace", "simulate.compute_s=0.2",
                       'faults.events=[{kill="worker:3",at_step=5}]')
    join = _one(ev, "join")
    assert join["world_size"] == 4 and join["step"] > 5
    mine = sorted(u["step"] for u in ups if u["worker"] == 3)
    assert mine == list(range(5)) + list(range(join["step"], 20))


def test_a_stopped_worker_back_before_its_replacement_is_readmitted(tmp_path):
    _, ups, ev = _run(tmp_path, "train.strategy=ps-asp", "faults.on_failure=replace", "faults.detect_s=1.0",
                      "simulate.compute_s=0.2", 'faults.events=[{stop="worker:1",at_step=3,for_s=1.5}]')
    join = _one(ev, "join")
    assert "readmitted" in join["how"] and join["world_size"] == 4
    assert not [e for e in ev if e["event"] == "expel"]
    assert max(u["step"] for u in ups if u["worker"] == 1) == 19


@pytest.mark.parametrize("strategy", ["ps-bsp", "ps-asp"])
@pytest.mark.parametrize("every", [3, 0])
def test_a_killed_shard_restarts_from_its_checkpoint_losing_at_most_the_interval(tmp_path, strategy, every):
    """kill shard:0 mid-run with shard_checkpoint_every = k: it restarts after PROCESS_START_S + load time, the
    updates since its checkpoint are lost (<= k; every one with k = 0, its initial state), the workers resync and
    every worker still finishes all its steps."""
    rd, ups, ev = _run(tmp_path, f"train.strategy={strategy}", f"faults.shard_checkpoint_every={every}",
                       'faults.events=[{kill="shard:0",at_s=0.1}]')
    det, restart, rec = _one(ev, "detect"), _one(ev, "shard_restart"), _one(ev, "recover")
    assert restart["time_s"] - det["time_s"] >= fm.PROCESS_START_S
    before = [u for u in _applied(ups) if u["time_s"] <= 0.1]
    versions = len(before) // (4 if strategy == "ps-bsp" else 1)
    if every:
        assert 0 <= restart["lost_updates"] <= every and "checkpoint" in restart["how"]
    else:
        assert restart["lost_updates"] == versions > 0 and "initial state" in restart["how"]
    assert rec["lost_steps"] >= restart["lost_updates"]
    for w in range(4):
        assert max(u["step"] for u in _applied(ups) if u["worker"] == w) == 19


def test_faults_are_deterministic(tmp_path):
    """The same config with faults gives byte-identical metrics, eval and events files (PS and all-reduce)."""
    for strategy, events in (("ps-bsp", '[{stop="worker:1",at_step=4,for_s=2.0},{kill="worker:2",at_s=0.05}]'),
                             ("allreduce", '[{kill="worker:2",at_step=6},{stop="worker:0",at_s=0.2,for_s=0.1}]')):
        a = _run(tmp_path / strategy / "a", f"train.strategy={strategy}", "faults.detect_s=1.0",
                 "train.eval_every=8", f"faults.events={events}")[0]
        b = _run(tmp_path / strategy / "b", f"train.strategy={strategy}", "faults.detect_s=1.0",
                 "train.eval_every=8", f"faults.events={events}")[0]
        for p in ("metrics.jsonl", "eval.jsonl", "events.jsonl"):
            assert (a.path / p).read_bytes() == (b.path / p).read_bytes(), (strategy, p)
        assert (a.path / "events.jsonl").stat().st_size > 0


def test_no_faults_no_events_file(tmp_path):
    rd, _, ev = _run(tmp_path, "train.strategy=ps-asp")
    assert not rd.events_path.exists() and ev == []


@pytest.mark.parametrize("overrides, message", [
    (("train.strategy=ps-asp", "simulate.timing_only=true", 'faults.events=[{kill="worker:1",at_step=2}]'),
     "timing-only"),
    (("train.strategy=ps-asp", "train.shards=2", 'faults.events=[{kill="shard:0",at_s=0.1}]'), "train.shards = 1"),
    (("train.strategy=ps-asp", "faults.on_failure=abort", 'faults.events=[{kill="worker:1",at_step=2}]'), "abort"),
])
def test_unsupported_fault_configs_are_refused_clearly(tmp_path, overrides, message):
    with pytest.raises(ExperimentError, match=message):
        _run(tmp_path, *overrides)


def test_allreduce_timing_only_simulates_faults_too(tmp_path):
    _, ups, ev = _run(tmp_path, "train.strategy=allreduce", "simulate.timing_only=true", "faults.commit_every=4",
                      'faults.events=[{kill="worker:3",at_step=6}]')
    assert _one(ev, "recover")["lost_steps"] == 2 and len(ups) == 4 * 6 + 3 * (20 - 4)


def test_a_planned_leave_changes_the_membership_without_loss(tmp_path):
    """leave = worker:3 at step 7 (the reference of a failure run): allreduce rebuilds the ring at that boundary
    with no rollback (each step once, lr at G = 3 after); ps-bsp applies the leaver's last push, then goes on."""
    seen, ups, ev = _ring_lrs(tmp_path / "ar", 'faults.events=[{leave="worker:3",at_step=7}]')
    assert [e["event"] for e in ev] == ["leave"] and ev[0]["world_size"] == 3 and ev[0]["step"] == 7
    assert seen == [(4, pytest.approx(0.4))] * 7 + [(3, pytest.approx(0.3))] * 5
    assert len(ups) == len({(u["worker"], u["step"]) for u in ups}) == 4 * 7 + 3 * 5
    _, ups, ev = _run(tmp_path / "ps", "train.strategy=ps-bsp", 'faults.events=[{leave="worker:3",at_step=7}]')
    assert [e["event"] for e in ev] == ["leave"]
    assert sorted(u["step"] for u in _applied(ups) if u["worker"] == 3) == list(range(7))
    assert not [u for u in ups if u.get("dropped")]
