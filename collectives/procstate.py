"""What the kernel says about a child process, for the launcher's watch (collectives/launcher.py).

    pidfd(pid)                 a descriptor that becomes readable the instant the process exits (os.pidfd_open):
                               waited on beside the children's pipes, so a death needs no end of file and no
                               forkserver report
    zombie_exit_code(pid)      its exit code while it is a zombie (exited, not yet reaped by its parent, the
                               forkserver): /proc/PID/stat field 52, the wait status
    is_stopped(pid)            stopped (SIGSTOP, a debugger): state T or t -- hung, whatever the machine's load
    cpu_ticks(pid)             CPU time it has used (utime + stime, clock ticks): a child whose beat is late but
                               whose CPU time still grows is busy (starved of its GIL under load), not hung
    CpuProgress.busy(pid, s)   whether it used CPU within the last s seconds (sampled at each call)
    exit_code_after(p, t)      multiprocessing's exit code of `p`, waited for a bounded time after its death

/proc/PID/stat is "pid (comm) state ppid ...": comm may hold spaces and parentheses, so the fields are read after
the last ")"; there field 3 (the state) is the first.
"""

from __future__ import annotations

import os
import time
from typing import Any


def _stat_fields(pid: int | None) -> list[bytes] | None:
    """/proc/PID/stat's fields from field 3 (the state) on, or None (no such process, no /proc)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def is_stopped(pid: int | None) -> bool:
    """Whether process `pid` is stopped (SIGSTOP, a debugger: state T or t)."""
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] in (b"T", b"t")


def cpu_ticks(pid: int | None) -> int | None:
    """Clock ticks of CPU time process `pid` has used so far (/proc/PID/stat fields 14 and 15, utime + stime, all
    its threads), or None (no such process, no /proc)."""
    fields = _stat_fields(pid)
    try:
        return int(fields[14 - 3]) + int(fields[15 - 3]) if fields else None
    except (IndexError, ValueError):
        return None


BUSY_FACTOR = 10.0      # a child whose beat is late but whose CPU time grows is hung only past this x the bound


class CpuProgress:
    """When each watched process's CPU time last grew, as seen by the calls to `busy` (a watch loop's polls)."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[int, float]] = {}       # pid -> (CPU ticks, when they last grew)

    def busy(self, pid: int | None, within_s: float) -> bool:
        """Whether process `pid` used CPU within the last `within_s` seconds (False at the first sample, and for
        a process that is gone or unreadable)."""
        ticks, now = cpu_ticks(pid), time.monotonic()
        if ticks is None or pid is None:
            return False
        seen = self._seen.get(pid)
        if seen is None or ticks != seen[0]:
            self._seen[pid] = (ticks, now)
            return seen is not None
        return now - seen[1] < within_s


def zombie_exit_code(pid: int | None) -> int | None:
    """The exit code of process `pid` if it is a zombie now, as multiprocessing reports it (negative: killed by
    that signal); else None."""
    fields = _stat_fields(pid)
    if not fields or fields[0] != b"Z":
        return None
    try:
        return os.waitstatus_to_exitcode(int(fields[52 - 3]))      # field 52, exit_code (fields[0] is field 3)
    except (IndexError, ValueError):
        return None


def pidfd(pid: int | None) -> int | None:
    """A pidfd of process `pid` (readable once it exits), or None where the kernel or Python has none."""
    if pid is None or not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def exit_code_after(p: Any, died_at: float, wait_s: float = 1.0) -> int | None:
    """The exit code of the multiprocessing Process `p`, which the kernel reported dead at `died_at`: the forkserver
    reports it within milliseconds; wait for it at most `wait_s` after the death, then give up (None)."""
    while True:
        code = p.exitcode
        if code is not None or time.monotonic() - died_at > wait_s:
            return code
        time.sleep(0.005)
