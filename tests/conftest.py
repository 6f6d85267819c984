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
and most tests ("shared") do not mind the other worker's test beside them -- their results are exact, never timed.
Two kinds do mind. A test marked under_load promises its bound beside busy processes, not beside another worker's
engine runs: it never runs beside a shared test, but it may run beside another under_load test (that one is itself
mostly waiting on detection timers, and both stand beside the same busy processes: one hog pool, started by the
first under_load test to come in and stopped by the last to leave; beside CI's own two busy loops the pool starts
none). A test marked `exclusive` (it checks machine-wide state -- every pslab-* entry in /dev/shm or the temp dir,
every process -- that any other test's run would change) runs alone, beside the hog pool if it is also under_load;
a test that checks only its own processes' segments (attributed by job: tests/leftovers.py) need not.
Each test takes flocks on files in the run's base temp folder around its whole protocol: "room" (shared; exclusive
for an exclusive test), then, for the two other kinds, "S" or "L" shared after waiting for the other kind's file to
be free; a turnstile orders arrivals, so a waiting test never starves. Without xdist no lock is taken and each
under_load test has its own hog.

The queue's order (under xdist) keeps those turns from waiting for long shared tests. Measured beside two busy
loops: the 93 tests that run alone took 195 s, and their workers waited 203 s more for the other worker's shared
test to end first -- 87 s of it for the quick tour. So the files holding under_load or exclusive tests are queued
first (both workers then run under_load tests side by side; within such a file they come first), then files with
a test marked `long` (a test, module fixture or file of half a minute or more: queued early, they do not make the
run's tail; the quick tour, the engine-layout file, the packaging file), then the rest in pytest's order (xdist's
own reordering by test count is off).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import multiprocessing.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

HOG_PROCS = 2
HOG_LIMIT_S = 900
HOG_MARK = "pslab-test-hog"        # in each hog's command line: how the pool recognises its own (never another pid)
_HOG = ("import os, time  # " + HOG_MARK + "\n"
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
    config.addinivalue_line("markers", "long: a test, module fixture or file of half a minute or more: under pytest "
                                       "-n its file is queued early (tests/conftest.py)")
    hog_count()                   # a bad PSLAB_TEST_LOAD is one line at start-up, not an error in every test
    # multiprocessing's own temp dir (its forkserver's socket lives there) is chosen once per process: made now, in
    # the real temp dir. Several tests point tempfile at a folder of their tmp_path; the first to start this worker's
    # forkserver then put its socket there, past the 107-byte limit of a socket path under a 3-digit pytest-NNN
    # ("AF_UNIX path too long").
    multiprocessing.util.get_temp_dir()
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
            # Popen returns while exec may still be setting up the new program: on a busy machine its command line
            # reads empty for a moment, and the pool would not know it for a hog (`_is_hog`)
            deadline = time.monotonic() + 10
            while (any(p.poll() is None and not _is_hog(p.pid) for p in self.procs)
                   and time.monotonic() < deadline):
                time.sleep(0.001)
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


class PooledHog:
    """Under xdist: the hog processes the under_load tests running at the same time share (`_turn`): started by the
    first of them, stopped by the last; `already` as CpuHog's, measured when the first started them."""

    def __init__(self, pids: list[int], already: int) -> None:
        self.pids, self.already = pids, already

    def running(self) -> int:
        return sum(_is_hog(p) for p in self.pids)


def _is_hog(pid: int) -> bool:
    """Whether `pid` is a live hog process of this test run: its command line holds HOG_MARK (a zombie's is empty)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return HOG_MARK.encode() in f.read()
    except OSError:
        return False


@pytest.fixture(autouse=True)
def _cpu_hog(request: pytest.FixtureRequest) -> Iterator[CpuHog | PooledHog | None]:
    """The hog beside each test marked under_load (nothing for the others); under xdist the turn's shared pool."""
    n = hog_count()
    if n == 0 or request.node.get_closest_marker("under_load") is None:
        yield None
        return
    if _lock_dir(request.config) is not None:
        yield request.node.stash.get(_POOL, None)
        return
    already = _already(n)
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
    """Whether `item` never runs beside a shared test (under_load or exclusive): its file is queued first."""
    return turn_kind(item) != "S"


def turn_kind(item: pytest.Item) -> str:
    """"X": exclusive (alone); "L": under_load (beside the hog and other under_load tests); "S": shared."""
    if item.get_closest_marker("exclusive") is not None:
        return "X"
    return "L" if item.get_closest_marker("under_load") is not None else "S"


_POOL = pytest.StashKey["PooledHog | None"]()


def _already(n: int) -> int:
    """How many of the `n` hogs busy processes already running stand for (an explicit PSLAB_TEST_LOAD: none)."""
    return 0 if "PSLAB_TEST_LOAD" in os.environ else min(n, busy_elsewhere())


def _read_pool(path: Path) -> dict | None:
    """The pool file's record, None when there is none (or it cannot be read)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _pool_join(folder: Path, n: int) -> PooledHog:
    """Join the under_load tests' hog pool (the caller holds pool.lock): the first starts the hogs, counting the
    busy processes already running (CpuHog's `already`; an explicit PSLAB_TEST_LOAD: exactly N)."""
    path = folder / "hogs.json"
    pool = _read_pool(path) or {"pids": [], "users": 0, "already": _already(n)}
    pids = [p for p in pool["pids"] if _is_hog(p)]
    hog = CpuHog(max(0, n - pool["already"] - len(pids)))        # (tops up a pool whose hog died)
    pids += [p.pid for p in hog.procs]
    path.write_text(json.dumps({"pids": pids, "already": pool["already"], "users": pool["users"] + 1}))
    return PooledHog(pids, pool["already"])


def _pool_leave(folder: Path) -> None:
    """An under_load test has ended (the caller holds pool.lock); the last one stops the pool's hogs."""
    path = folder / "hogs.json"
    pool = _read_pool(path)
    if pool is None:
        return
    if pool["users"] > 1:
        path.write_text(json.dumps({**pool, "users": pool["users"] - 1}))
        return
    pids = pool["pids"]
    for p in pids:
        if _is_hog(p):
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(_is_hog(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.01)                 # (killed: a zombie of the worker that started it, not counted as a hog)
    path.unlink(missing_ok=True)


@contextlib.contextmanager
def _turn(folder: Path, kind: str, hogs: int = 0) -> Iterator[PooledHog | None]:
    """Hold the room for the duration: shared by "S" tests, shared by "L" tests (never beside an "S" one), alone for
    "X". The turnstile orders arrivals (a waiting test lets nobody in before it); with `hogs` (an under_load test)
    it joins the hog pool on its way in, and the last one out stops it."""
    with open(folder / "turnstile", "a") as gate, open(folder / "room", "a") as room, \
            open(folder / "S", "a") as s_gate, open(folder / "L", "a") as l_gate:
        mine, other = (s_gate, l_gate) if kind == "S" else (l_gate, s_gate)
        pool = None
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(room, fcntl.LOCK_EX if kind == "X" else fcntl.LOCK_SH)
            if kind != "X":
                fcntl.flock(other, fcntl.LOCK_EX)       # until no test of the other kind runs
                fcntl.flock(mine, fcntl.LOCK_SH)
                fcntl.flock(other, fcntl.LOCK_UN)
            if hogs:
                with _held(folder / "pool.lock"):
                    pool = _pool_join(folder, hogs)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield pool
        finally:
            if pool is not None:         # before the gate opens to shared tests (not the turnstile: a waiting one
                with _held(folder / "pool.lock"):                                                 # holds it)
                    _pool_leave(folder)
            if kind != "X":
                fcntl.flock(mine, fcntl.LOCK_UN)
            fcntl.flock(room, fcntl.LOCK_UN)


@contextlib.contextmanager
def _held(path: Path) -> Iterator[None]:
    """An exclusive flock on `path` for the duration."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Under xdist, each test's setup, call and teardown run inside its turn (outside pytest-timeout's clock)."""
    folder = _lock_dir(item.config)
    if folder is None:
        yield
        return
    hogs = hog_count() if item.get_closest_marker("under_load") is not None else 0
    with _turn(folder, turn_kind(item), hogs) as pool:
        item.stash[_POOL] = pool
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
