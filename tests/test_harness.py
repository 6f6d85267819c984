"""The test harness itself: the CPU hog runs exactly beside tests marked under_load and is gone after them, and a
bounded step (tests/timebox.py) interrupts a blocked ZeroMQ call with a message naming what it waited for."""

from __future__ import annotations

import time

import pytest
import zmq

from .conftest import hog_count
from .timebox import StepTimeout, within


@pytest.mark.under_load
def test_a_marked_test_runs_beside_the_hog(_cpu_hog):
    if hog_count() == 0:
        assert _cpu_hog is None                   # PSLAB_TEST_LOAD=0: switched off on purpose
        return
    assert _cpu_hog.running() == hog_count()
    pytest.harness_hog = _cpu_hog                 # the next test checks it is gone


def test_an_unmarked_test_has_no_hog_and_the_last_one_was_stopped(_cpu_hog):
    assert _cpu_hog is None
    last = getattr(pytest, "harness_hog", None)
    if last is not None:
        assert last.running() == 0 and all(p.returncode is not None for p in last.procs)


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
