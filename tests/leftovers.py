"""What a test's own processes leave in /dev/shm, told apart from what other tests leave there meanwhile.

/dev/shm is the machine's: under pytest -n another test's processes make and remove pslab-* segments while this
one runs (a killed shard's bell stays until its supervisor sweeps it). A segment's name carries its job id,
`pslab-<12 hex>-...` (collectives/cleanup.py), random per process, so a test attributes segments by job: the jobs
its processes hold (open or mapped, read in /proc) or note (`cleanup.note_shm_job`: an empty `shm-<job>` in the
cleanup directory its starter made, in the test's own temp dir) while they run. A check over those jobs alone can
run beside other tests; one over every pslab-* entry must run alone (tests/conftest.py: exclusive)."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Callable, Iterable

SHM = "/dev/shm"
_JOB = re.compile(r"pslab-([0-9a-f]{12})-")


def job_of(name: str) -> str | None:
    """The job id of a /dev/shm name (`pslab-<job>-...`), None for another name."""
    m = _JOB.match(name)
    return m.group(1) if m else None


def held(pids: Iterable[int]) -> set[str]:
    """The /dev/shm names processes `pids` have open or mapped now (a process gone meanwhile counts none)."""
    names: set[str] = set()
    for pid in pids:
        lines = []
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            lines += Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:
            continue
        for fd in fds:
            try:
                lines.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:                 # closed meanwhile (the listing's own descriptor, for one)
                pass
        for line in lines:
            at = line.find(SHM + "/")
            if at >= 0:
                names.add(line[at + len(SHM) + 1:].removesuffix(" (deleted)"))
    return names


def descendants(pid: int) -> set[int]:
    """The processes below `pid` (children, theirs, ...; zombies included), from /proc/PID/task/*/children."""
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(x) for x in (task / "children").read_text().split()]
            except OSError:
                continue
            todo += [k for k in kids if k not in out]
            out.update(kids)
    return out


def jobs_held(pids: Iterable[int]) -> set[str]:
    """The job ids of the segments processes `pids` have open or mapped now."""
    return {j for n in held(pids) if (j := job_of(n))}


def jobs_noted(tmp: Path) -> set[str]:
    """The job ids noted in the cleanup directories under `tmp` (`shm-<job>` files). The directories come and go
    while this reads them: one removed meanwhile is skipped (os.walk's way; Path.glob raised, which ended a
    JobWatch's thread)."""
    out: set[str] = set()
    for top in tmp.glob("pslab-*"):
        for _, _, files in os.walk(top):
            out.update(f[4:] for f in files if re.fullmatch(r"shm-[0-9a-f]{12}", f))
    return out


def segments(jobs: set[str]) -> set[str]:
    """The /dev/shm entries of jobs `jobs` now."""
    return {n for n in os.listdir(SHM) if job_of(n) in jobs} if jobs else set()


class JobWatch:
    """Gathers, every `every` s in a thread while in its `with` block, the jobs noted under `tmp` and held by the
    processes `pids()` returns: for code that runs inside the test's own process (pslab.run, execute), whose
    cleanup directories are gone once it returns."""

    def __init__(self, tmp: Path, pids: Callable[[], Iterable[int]] = lambda: (), every: float = 0.02) -> None:
        self.tmp, self.pids, self.every = tmp, pids, every
        self.jobs: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="test-jobwatch")

    def look(self) -> set[str]:
        self.jobs |= jobs_noted(self.tmp) | jobs_held(self.pids())
        return self.jobs

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.look()

    def __enter__(self) -> "JobWatch":
        self.look()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
