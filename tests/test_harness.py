"""The test harness itself: the CPU hog runs exactly beside tests marked under_load and is gone after them, and a
bounded step (tests/timebox.py) interrupts a blocked ZeroMQ call with a message naming what it waited for."""

from __future__ import annotations

import os
import time

import pytest
import zmq

from pslab.collectives.procstate import cpu_ticks

from .conftest import CpuHog, _pool_join, _pool_leave, busy_elsewhere, hog_count
from .timebox import StepTimeout, within


@pytest.mark.under_load
def test_a_marked_test_runs_beside_the_hog(_cpu_hog):
    if hog_count() == 0:
        assert _cpu_hog is None                   # PSLAB_TEST_LOAD=0: switched off on purpose
        return
    assert _cpu_hog.running() + _cpu_hog.already == hog_count()     # (busy processes already there count)
    assert _cpu_hog.running() == hog_count() or "PSLAB_TEST_LOAD" not in os.environ
    pytest.harness_hog = _cpu_hog                 # the next test checks it is gone


def test_an_unmarked_test_has_no_hog_and_the_last_one_was_stopped(_cpu_hog):
    assert _cpu_hog is None
    last = getattr(pytest, "harness_hog", None)
    if last is not None:                          # (under xdist the pool's: the last under_load test stopped it)
        assert last.running() == 0 and all(p.returncode is not None for p in getattr(last, "procs", []))


def test_the_hog_pool_is_started_by_the_first_under_load_test_and_stopped_by_the_last(tmp_path, monkeypatch):
    """Under xdist, under_load tests running side by side share one pool: the second starts no hog of its own, and
    the hogs outlive the first to leave, not the last."""
    monkeypatch.setenv("PSLAB_TEST_LOAD", "2")                    # exactly 2, whatever else runs
    first = _pool_join(tmp_path, 2)
    second = _pool_join(tmp_path, 2)
    try:
        assert first.running() == 2 and second.pids == first.pids and second.already == 0
        _pool_leave(tmp_path)
        assert first.running() == 2 and (tmp_path / "hogs.json").exists()     # one test still runs beside them
    finally:
        _pool_leave(tmp_path)
    assert first.running() == 0 and not (tmp_path / "hogs.json").exists()


def test_busy_processes_already_running_are_counted():
    """busy_elsewhere sees two spin loops (so beside CI's own two a marked test starts no hog of its own)."""
    hog = CpuHog(2)
    try:
        deadline = time.monotonic() + 20
        while not all((cpu_ticks(p.pid) or 0) > 5 for p in hog.procs):     # > 5 ticks of CPU: in its loop
            assert time.monotonic() < deadline, "the spin loops never started"
            time.sleep(0.05)
        assert busy_elsewhere() >= 2
    finally:
        hog.stop()


def test_a_blocked_receive_fails_in_time_naming_its_wait():
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:0")
    t0 = time.monotonic()
    try:
        with pytest.raises(StepTimeout, match=r"hung for 0.5 s waiting for a message nobody sends"):
            with within(0.5, "a message nobody sends"):
                sock.recv()
    finally:
        sock.close(0)
    assert time.monotonic() - t0 < 10
