"""Starting a child process with the parent's stop signals held until the child has its own handlers.

A forked child begins as a copy of its parent, Python signal handlers included. The `pslab` command turns SIGTERM
into KeyboardInterrupt (so `kill PID` cleans up like Ctrl-C) and Python's own SIGINT handler raises it too. A SIGINT
or SIGTERM that reaches a child between `fork()` and the moment its entry function installs its handlers — e.g. a
start that fails half-way stops the shards it had already forked, microseconds old — then raises KeyboardInterrupt
*inside the child's copy of the parent's stack*: the child unwinds through the parent's `except` and `finally`
blocks and goes on running the parent's program (in a test run, a second pytest worker reporting for the first).

So the parent blocks SIGINT and SIGTERM in the starting thread for the length of `Process.start()` (`start`), the
child inherits that mask, and the child's entry function unblocks them once its own handlers are in place
(`release`); a signal sent in between is held by the kernel and delivered then, to the child's handler. The parent
gains too: a KeyboardInterrupt in the middle of `start()` could leave a child the Process object has no pid of yet.

A process started by spawn or forkserver is a fresh interpreter (or a fork of the forkserver's), with the default
SIGTERM action, which is what a child should do before it has handlers (end); the mask survives exec, so for those
methods only SIGINT is held (every entry ignores SIGINT: a Ctrl-C is for the parent, which stops its children).
"""

from __future__ import annotations

import signal
from typing import Any


def held(method: str) -> frozenset[signal.Signals]:
    """The signals `start` holds for a process started by `method` ("fork", "spawn" or "forkserver")."""
    return frozenset({signal.SIGINT, signal.SIGTERM} if method == "fork" else {signal.SIGINT})


def start(process: Any, method: str) -> None:
    """`process.start()` (a multiprocessing Process of start method `method`) with `held(method)` blocked in this
    thread meanwhile, the mask restored after, raised or not; what arrived meanwhile is delivered right after."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, held(method))
    try:
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def release() -> None:
    """In the child, once its SIGINT/SIGTERM handlers are installed: deliver what `start` held back."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
