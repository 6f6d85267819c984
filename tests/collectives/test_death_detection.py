"""A rank's death is known to the launcher at once, from the kernel (a pidfd per child), whatever else is going on:
another process holding the dead rank's pipe open, other ranks chattering to the supervisor without pause, or a
survivor reporting "a peer failed" -- the dead rank is named first, within the detection bound."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from pslab import collectives
from pslab.collectives.errors import LaunchError
from pslab.collectives.launcher import RankFailure, notify
from tests.detectlog import detected

pytestmark = pytest.mark.under_load        # these bounds must hold on a busy machine too (tests/conftest.py)

BOUND_S = 5.0                                # faults.detect_s's ceiling, the promise


def _kill_self_leaving_the_pipe_open(group: Any, pid_file: str) -> None:
    """Rank 1 forks a sleeper (which inherits every fd, the launcher's pipe included), then SIGKILLs itself."""
    if group.rank == 1:
        pid = os.fork()
        if pid == 0:                                  # the grandchild: holds the pipe's write end, does nothing
            try:
                time.sleep(60)
            finally:
                os._exit(0)
        with open(pid_file, "w") as f:
            f.write(str(pid))
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def test_a_killed_rank_is_named_at_once_though_its_pipe_stays_open(tmp_path):
    """Its pipe never reaches end of file (a grandchild holds it): the death is still seen at once."""
    pid_file = str(tmp_path / "sleeper.pid")
    t0 = time.monotonic()
    try:
        with pytest.raises(LaunchError, match=r"rank 1 died \(was killed by SIGKILL\)"):
            collectives.launch(_kill_self_leaving_the_pipe_open, 2, args=(pid_file,), timeout=40)
        took = time.monotonic() - t0
    finally:
        if os.path.exists(pid_file):
            try:
                os.kill(int(open(pid_file).read()), signal.SIGKILL)
            except (OSError, ValueError):
                pass
    assert took < 30, f"the death was seen only after {took:.1f} s (the grandchild sleeps 60 s)"


class _Watcher:
    """A supervisor that only records: which rank was named first, how, and when."""

    heartbeat_s, detect_s, elastic = 0.1, BOUND_S, False

    def __init__(self) -> None:
        self.named: list[tuple[int, str, float]] = []
        self.messages = 0

    def started(self, job: Any) -> None:
        pass

    def failed(self, job: Any, rank: int, how: str, hung: bool) -> bool:
        self.named.append((rank, how, time.time()))
        return True                                   # go on: the rest report what they report

    def message(self, job: Any, rank: int, payload: Any) -> None:
        self.messages += 1
        time.sleep(self.per_message_s)                # slower than the ranks write: a backlog that never empties

    per_message_s = 0.0

    def tick(self, job: Any) -> None:
        pass


def _chatter_while_rank_1_dies(group: Any, died_file: str, quiet_file: str) -> str:
    """Ranks 0 and 2 notify the supervisor without pause; rank 1 is SIGKILLed after 0.3 s; rank 2 then reports a
    survivor's inference as an error, as a collective would after the death; rank 0 chatters 3 s more and notes
    when it fell quiet."""
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        notify({"kind": "noise"})
    if group.rank == 1:
        with open(died_file, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    if group.rank == 2:
        time.sleep(0.5)
        raise RuntimeError("PeerFailedError: a peer of this 3-rank group failed")
    end = time.monotonic() + 3.0
    while time.monotonic() < end:                     # the launcher must not starve its watch on these messages
        notify({"kind": "noise"})
    with open(quiet_file, "w") as f:
        f.write(repr(time.time()))
    return "done"


@pytest.mark.parametrize("per_message_s", [0.0, 0.001], ids=["keeping-up", "falling-behind"])
def test_the_dead_rank_is_named_first_while_others_keep_talking(tmp_path, per_message_s):
    """Messages never stop arriving, and a survivor blames "a peer": the dead rank 1 is named first, as killed,
    within the bound of its death, and while rank 0 is still talking -- also when the supervisor handles messages
    more slowly than the ranks write them (a pipe then never runs dry: the launcher reads it in batches)."""
    sup = _Watcher()
    sup.per_message_s = per_message_s
    died_file, quiet_file = str(tmp_path / "died"), str(tmp_path / "quiet")
    out = collectives.launch(_chatter_while_rank_1_dies, 3, args=(died_file, quiet_file), timeout=60,
                             supervisor=sup, return_exceptions=True)
    assert sup.messages > 100, sup.messages
    assert [r for r, _, _ in sup.named][:1] == [1], sup.named
    assert "killed by SIGKILL" in sup.named[0][1], sup.named
    died_at, quiet_at = float(open(died_file).read()), float(open(quiet_file).read())
    detected(f"rank {sup.named[0][0]}", sup.named[0][2] - died_at, BOUND_S)
    assert sup.named[0][2] - died_at < BOUND_S, sup.named
    assert sup.named[0][2] < quiet_at, f"named {sup.named[0][2] - quiet_at:.2f} s after rank 0 fell quiet"
    assert out[0] == "done" and isinstance(out[1], RankFailure) and isinstance(out[2], RankFailure)


def test_a_silent_heartbeat_is_judged_against_the_measured_load():
    """The parent's own poll lateness widens the hang bound (detect_s + LAG_FACTOR x lag over the last window);
    old lateness is forgotten; a stopped process is recognised from /proc whatever the load."""
    import subprocess
    import sys
    from pslab.collectives.launcher import LAG_FACTOR, LAG_WINDOW_S, Job, _stopped_state
    job = Job(_kill_self_leaving_the_pipe_open, 1, "zmq", (), 10, group_timeout=None, start_method="fork",
              secret=None, supervisor=None, group_options={})
    assert job.hang_bound_s(3.0) == 3.0
    now = time.monotonic()
    job._lags = [(now - LAG_WINDOW_S - 1, 9.0), (now, 0.5), (now, 0.2)]
    assert job.hang_bound_s(3.0) == pytest.approx(3.0 + LAG_FACTOR * 0.5)
    assert job._lags == [(now, 0.5), (now, 0.2)]
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not _stopped_state(p.pid)
        os.kill(p.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not _stopped_state(p.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _stopped_state(p.pid)
        os.kill(p.pid, signal.SIGCONT)
    finally:
        p.kill()
        p.wait(10)


def _hold_the_gil(group: Any) -> str:
    """Rank 1 runs one C call that keeps the GIL ~2 s of CPU (a regular expression's backtracking): its heartbeat
    thread cannot beat meanwhile, though the process works the whole time."""
    import re
    if group.rank == 1:
        re.match(r"(a+)+$", "a" * 25 + "b")
    else:
        time.sleep(1.0)
    return "done"


def test_a_rank_that_holds_its_gil_while_working_is_busy_not_hung():
    """Its beat is seconds late (detect_s = 1 s), but its CPU time grows: the launcher waits (procstate.CpuProgress,
    up to BUSY_FACTOR x the bound) instead of naming it hung, and the job ends normally. (A stopped process is hung
    after detect_s whatever its CPU: tests/experiments/test_failures.py.)"""
    sup = _Watcher()
    sup.detect_s = 1.0
    out = collectives.launch(_hold_the_gil, 2, timeout=60, supervisor=sup)
    assert out == ["done", "done"] and sup.named == [], sup.named


def test_cpu_progress_tells_a_working_process_from_an_idle_one():
    import subprocess
    import sys
    from pslab.collectives.procstate import CpuProgress
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.5)                               # (the idle one's start-up CPU is behind it)
        cpu = CpuProgress()
        assert not cpu.busy(spin.pid, 1.0) and not cpu.busy(idle.pid, 1.0)    # a first sample says nothing
        deadline = time.monotonic() + 20
        while not cpu.busy(spin.pid, 1.0) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cpu.busy(spin.pid, 1.0)
        time.sleep(1.2)
        assert not cpu.busy(idle.pid, 1.0)
        assert not cpu.busy(None, 1.0) and not cpu.busy(2 ** 22 + 12345, 1.0)
    finally:
        for p in (spin, idle):
            p.kill()
            p.wait(10)
