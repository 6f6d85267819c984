"""What a process leaves behind is swept by whoever started it.

A rank or a shard killed by SIGKILL (or stopped by SIGTERM without running its `finally` blocks) cannot remove its
ipc socket directory or its /dev/shm segments. So the process that starts others (`collectives.launch`,
`ps.start_servers`) makes one private directory (0700) and names it in the children's environment as
PSLAB_CLEANUP_DIR. There a child

    - makes its ipc socket directories (`temp_dir`), and
    - notes every shared-memory job id it creates segments under (`note_shm_job`: an empty file `shm-<job>`),

and when the children are gone the starter calls `sweep(dir)`: every `/dev/shm/pslab-<job>-*` of a noted job is
unlinked, then the directory is removed. Segment names are `pslab-<12 hex job>-<src>-<dst>-<generation>`
(collectives/shm.py), and job ids are random per process, so a sweep only touches its own children's segments.
Outside a starter (no PSLAB_CLEANUP_DIR) nothing is noted and processes clean up after themselves as before.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

ENV = "PSLAB_CLEANUP_DIR"
SHM_DIR = "/dev/shm"
_JOB = re.compile(r"^shm-([0-9a-f]{12})$")


def make_dir(prefix: str = "pslab-job-") -> str:
    """A fresh 0700 directory for the children of this process to leave their traces in."""
    return tempfile.mkdtemp(prefix=prefix)


def temp_dir(prefix: str = "pslab-") -> str:
    """A 0700 temporary directory, inside PSLAB_CLEANUP_DIR when a starter set one (so it is swept even if this
    process dies without cleaning up), else in the system temp directory."""
    parent = os.environ.get(ENV)
    if parent and os.path.isdir(parent):
        return tempfile.mkdtemp(prefix=prefix, dir=parent)
    return tempfile.mkdtemp(prefix=prefix)


def note_shm_job(job: str) -> None:
    """Record that this process creates /dev/shm segments `pslab-<job>-*` (no-op without PSLAB_CLEANUP_DIR)."""
    parent = os.environ.get(ENV)
    if not parent or not re.fullmatch(r"[0-9a-f]{12}", job):
        return
    try:
        os.close(os.open(os.path.join(parent, f"shm-{job}"), os.O_CREAT | os.O_WRONLY, 0o600))
    except OSError:
        pass                 # the starter is gone or its directory too: nobody left to sweep for


def sweep(directory: str | None) -> int:
    """Unlink the /dev/shm segments of every job noted in `directory`, then remove it; returns segments removed."""
    if not directory or not os.path.isdir(directory):
        return 0
    jobs = [m.group(1) for n in os.listdir(directory) if (m := _JOB.match(n))]
    removed = 0
    if jobs:
        try:
            names = os.listdir(SHM_DIR)
        except OSError:
            names = []
        prefixes = tuple(f"pslab-{j}-" for j in jobs)
        for n in names:
            if n.startswith(prefixes):
                try:
                    os.unlink(os.path.join(SHM_DIR, n))
                    removed += 1
                except OSError:
                    pass
    shutil.rmtree(directory, ignore_errors=True)
    return removed


def start_sweeper(directory: str, also: list[str] | None = None) -> "subprocess.Popen[bytes]":
    """A watchdog for a process that may be SIGKILLed with its own segments open (`pslab server` in the
    foreground): a small separate process that waits for end of file on its stdin -- the pipe this process holds
    and the kernel closes when it dies, however -- then `sweep(directory)` and removes the folders in `also`.
    It imports nothing of pslab's packages (this file is loaded by path) and runs in a session of its own, so the
    terminal's signals (Ctrl-C, a hang-up) and a kill of the owner's process group do not reach it; it sweeps once
    its owner is gone. Close its stdin to let it finish."""
    import subprocess
    import sys
    code = ("import importlib.util, os, shutil, signal, sys\n"
            "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "spec = importlib.util.spec_from_file_location('pslab_cleanup', sys.argv[1])\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            "while sys.stdin.buffer.read(65536):\n"
            "    pass\n"
            "m.sweep(sys.argv[2])\n"
            "for d in sys.argv[3:]:\n"
            "    shutil.rmtree(d, ignore_errors=True)\n")
    return subprocess.Popen([sys.executable, "-c", code, os.path.abspath(__file__), directory, *(also or [])],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            close_fds=True, start_new_session=True)

