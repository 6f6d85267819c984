"""The load harness: tests marked `under_load` run beside a CPU hog, as CI runs them.

The failure, elastic, admission and interrupt tests promise bounds (a death named within faults.detect_s, a hang
failing with a message in seconds) that users need on a busy node -- the normal case on a shared cluster -- and
that CI needs on a loaded machine. A bound that holds only on an idle machine is not a bound. So every test marked

    pytestmark = pytest.mark.under_load          (a module)   or   @pytest.mark.under_load   (one test)

runs with `HOG_PROCS` busy processes beside it (pure-Python spin loops at nice 0, one per core of the 2-core CI
machine: the test's own processes then get about half of each core), started before the test and killed after it.
Busy processes the machine already runs count (`busy_elsewhere`: the fewest runnable processes besides this one in
a few looks at /proc/stat): beside CI's own two busy loops a marked test starts none, so it runs under the load it
promises, not twice it (measured beside two loops: the 93 tests that run alone took 195 s with two hogs more, 159 s
idle with theirs). Each hog also ends by itself after `HOG_LIMIT_S` seconds or as soon as this pytest process is
gone, so none outlives the run. PSLAB_TEST_LOAD=0 turns the hog off (e.g. to time a test alone);
PSLAB_TEST_LOAD=N runs exactly N hogs, whatever else runs.

Parallel runs (`pytest -n 2`, pytest-xdist, as the README and CI run the suite): two workers share the 2 cores,
and most tests do not mind the other worker's test beside them -- their results are exact, never timed. Two kinds
do mind, and run alone: a test marked under_load (its bound is promised beside *its* hog, not beside the hog plus
another test) and a test marked `exclusive` (it checks machine-wide state -- every pslab-* entry in /dev/shm or
the temp dir, every process -- that another worker's run would change). Each test takes a readers-writer lock
(flock on two files in the run's base temp folder) around its whole protocol: shared for most tests, exclusive
for those two kinds; a turnstile lets a waiting exclusive test in before the next shared one, so it never starves.
Without xdist the lock is not taken at all.

The queue's order (under xdist) keeps those turns from waiting for long shared tests. Measured beside two busy
loops: the 93 tests that run alone took 195 s, and their workers waited 203 s more for the other worker's shared
test to end first -- 87 s of it for the quick tour. So the files holding tests that run alone are queued first
(their turns then mostly alternate with each other; within such a file its alone tests come first), then files with
a test marked `long` (half a minute or more: queued early, they do not make the run's tail), then the rest in
pytest's order (xdist's own reordering by test count is off). Only the quick tour is `long`: its timing figures are
measured beside whatever the other worker runs, and queued next to the engine runs (~55 runs of 2-8 processes) two
of four runs had a figure miss its rule.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

HOG_PROCS = 2
HOG_LIMIT_S = 900
_HOG = ("import os, time\n"
        "parent, end = os.getppid(), time.monotonic() + {limit}\n"
        "while time.monotonic() < end and os.getppid() == parent:\n"
        "    for _ in range(20000): pass\n")


def hog_count() -> int:
    """How many hog processes a marked test gets (PSLAB_TEST_LOAD, default HOG_PROCS)."""
    raw = os.environ.get("PSLAB_TEST_LOAD", str(HOG_PROCS)).strip()
    try:
        n = int(raw)
    except ValueError:
        raise pytest.UsageError(f"PSLAB_TEST_LOAD must be a whole number of hog processes (0: none); got {raw!r}")
    if not 0 <= n <= 16:
        raise pytest.UsageError(f"PSLAB_TEST_LOAD must be between 0 and 16; got {n}")
    return n


def busy_elsewhere(looks: int = 8, gap_s: float = 0.005) -> int:
    """How many processes besides this one are running: the fewest of `looks` reads of /proc/stat's procs_running
    (less this process), so a process that ran for an instant is not counted; a busy loop runs at every look."""
    fewest = None
    for i in range(looks):
        try:
            with open("/proc/stat") as f:
                running = next(int(line.split()[1]) for line in f if line.startswith("procs_running"))
        except (OSError, StopIteration, ValueError, IndexError):
            return 0                                  # (no /proc: count nothing, start every hog)
        fewest = running - 1 if fewest is None else min(fewest, running - 1)
        if i + 1 < looks:
            time.sleep(gap_s)
    return max(0, fewest or 0)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "under_load: runs beside a CPU hog (tests/conftest.py); PSLAB_TEST_LOAD=0 "
                                       "turns it off")
    config.addinivalue_line("markers", "exclusive: checks machine-wide state, so under pytest -n it runs while no "
                                       "other test does (tests/conftest.py)")
    config.addinivalue_line("markers", "long: a test (or module fixture) of half a minute or more: under pytest -n "
                                       "its file is queued early (tests/conftest.py)")
    hog_count()                   # a bad PSLAB_TEST_LOAD is one line at start-up, not an error in every test
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False      # the queue follows pytest_collection_modifyitems' order


class CpuHog:
    """`n` busy processes until `stop()` (or HOG_LIMIT_S, or this process's exit); `already`: how many busy
    processes the machine ran besides them when they started (counted towards the load, `busy_elsewhere`)."""

    def __init__(self, n: int, limit_s: float = HOG_LIMIT_S, already: int = 0) -> None:
        code = _HOG.format(limit=float(limit_s))
        self.already = already
        self.procs: list[subprocess.Popen] = []
        try:
            for _ in range(n):
                self.procs.append(subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        except BaseException:
            self.stop()
            raise

    def running(self) -> int:
        return sum(p.poll() is None for p in self.procs)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass                      # (SIGKILLed: it goes; the next ones are still waited for)


@pytest.fixture(autouse=True)
def _cpu_hog(request: pytest.FixtureRequest) -> Iterator[CpuHog | None]:
    """The hog beside each test marked under_load (nothing for the others)."""
    n = hog_count()
    if n == 0 or request.node.get_closest_marker("under_load") is None:
        yield None
        return
    already = 0 if "PSLAB_TEST_LOAD" in os.environ else min(n, busy_elsewhere())    # (an explicit N: exactly N)
    hog = CpuHog(n - already, already=already)
    try:
        yield hog
    finally:
        hog.stop()


# ---- parallel runs: shared or exclusive turns (see the module docstring) --------------------------------------------

def _lock_dir(config: pytest.Config) -> Path | None:
    """The folder of this xdist run's lock files (None when not running under xdist): the run's base temp folder,
    which the workers' own (popen-gw0, popen-gw1, ...) sit in and which pytest removes with its old runs."""
    if getattr(config, "workerinput", None) is None:
        return None
    return config._tmp_path_factory.getbasetemp().parent      # (pytest's own tmp_path_factory; stable since 3.9)


def runs_alone(item: pytest.Item) -> bool:
    """Whether `item` must run while no other test does (under_load or exclusive)."""
    return any(item.get_closest_marker(m) is not None for m in ("under_load", "exclusive"))


@contextlib.contextmanager
def _turn(folder: Path, alone: bool) -> Iterator[None]:
    """Hold the room shared (or exclusively when `alone`) for the duration; the turnstile orders arrivals."""
    with open(folder / "turnstile", "a") as gate, open(folder / "room", "a") as room:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(room, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Under xdist, each test's setup, call and teardown run inside its turn (outside pytest-timeout's clock)."""
    folder = _lock_dir(item.config)
    if folder is None:
        yield
        return
    with _turn(folder, runs_alone(item)):
        yield


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist, files holding tests that run alone first, then files with a `long` test (module docstring)."""
    if getattr(config, "workerinput", None) is None:
        return
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)

    def rank(tests: list[pytest.Item]) -> int:
        if any(runs_alone(t) for t in tests):
            return 0
        return 1 if any(t.get_closest_marker("long") is not None for t in tests) else 2

    order = sorted(files, key=lambda f: rank(files[f]))           # (stable: pytest's order within each rank)
    # within a file, its tests that run alone first: a long shared test of the same file (a notebook run, 12 s
    # beside the hog) then no longer sits between them, where the other worker's alone test must wait it out
    items[:] = [item for f in order for item in sorted(files[f], key=lambda t: not runs_alone(t))]
