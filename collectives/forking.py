"""How pslab starts a child process: forked from a forkserver that has imported torch once, and with the parent's
stop signals held until the child has its own handlers.

The forkserver (`forkserver_context`): a spawned process spends ~3-4 s of CPU importing torch; a child of
multiprocessing's forkserver is a fork of an interpreter that already has it. A process has one forkserver, and the
preload list of whichever context starts it first stays: take the context from here.

The signals (`start`, `release`): a forked child begins as a copy of its parent, Python signal handlers included. The
`pslab` command turns SIGTERM into KeyboardInterrupt (so `kill PID` cleans up like Ctrl-C) and Python's own SIGINT
handler raises it too. A SIGINT or SIGTERM that reaches a child between `fork()` and the moment its entry function
installs its handlers -- e.g. a start that fails half-way stops the shards it had already forked, microseconds old --
then raises KeyboardInterrupt *inside the child's copy of the parent's stack*: the child unwinds through the parent's
`except` and `finally` blocks and goes on running the parent's program (in a test run, a second pytest worker
reporting for the first).

So the parent blocks SIGINT and SIGTERM in the starting thread for the length of `Process.start()` (`start`), the
child inherits that mask, and the child's entry function unblocks them once its own handlers are in place
(`release`); a signal sent in between is held by the kernel and delivered then, to the child's handler. (The hold
protects the child, not the parent: a signal sent to the whole process may be taken by another of its threads, and
its Python handler runs in the main thread whatever that thread's mask. So a starter keeps its Process whether
`start` returned or raised: once its pid is set, the starter's stop() can end it.)

A process started by spawn is a fresh interpreter with the default SIGTERM action, which is what a child should do
before it has handlers (end); the mask survives exec, so for spawn only SIGINT is held (every entry ignores SIGINT: a
Ctrl-C is for the parent, which stops its children), which also keeps a Ctrl-C from printing a traceback out of a
spawned child's imports. A forkserver's children inherit the *forkserver's* mask, so it is started, like
multiprocessing's resource tracker (which unblocks SIGINT/SIGTERM in the thread that starts it), before the hold.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import sys
from typing import Any


def held(method: str) -> frozenset[signal.Signals]:
    """The signals `start` holds for a process started by `method` ("fork", "spawn" or "forkserver")."""
    return frozenset({signal.SIGINT, signal.SIGTERM} if method == "fork" else {signal.SIGINT})


def start(process: Any, method: str) -> None:
    """`process.start()` (a multiprocessing Process of start method `method`) with `held(method)` blocked in this
    thread meanwhile, the mask restored after, raised or not; what arrived meanwhile is delivered right after."""
    if method == "forkserver":
        from multiprocessing import forkserver
        forkserver.ensure_running()          # (it starts the resource tracker too)
    elif method == "spawn":
        from multiprocessing import resource_tracker
        resource_tracker.ensure_running()
    # read the mask first: pthread_sigmask runs pending Python handlers after it changes the mask, so a block that
    # raised KeyboardInterrupt would leave the mask blocked with nothing to restore it
    before = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, held(method))
        process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def release() -> None:
    """In the child, once its SIGINT/SIGTERM handlers are installed: deliver what `start` held back (the most any
    start method holds)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, held("fork"))


PRELOAD = ("torch", "torch.optim", "torch._dynamo", "numpy", "zmq", "pslab.collectives.init",
           "pslab.collectives.zmq_group")


def forkserver_context(also: tuple[str, ...] = ()) -> Any:
    """multiprocessing's forkserver context, its server (one per process, started at its first use) importing once
    what its children would otherwise each import: each process it starts is then a fork of an interpreter that has
    torch, not a fresh one (a spawned process spends ~3-4 s of CPU importing them). Also for process pools (the
    studies' cells).

    The server imports PRELOAD, every pslab module this process has imported by then (what a plain fork would have
    handed down: a rank of the parallelism engines otherwise compiles ~45 of them, ~0.13 s of CPU each rank where
    no bytecode is cached, e.g. under PYTHONDONTWRITEBYTECODE), and `also` (launch passes the module of the
    function it runs). A name that fails to import is skipped by the server, as multiprocessing does.

    A process has one forkserver, and the preload of whichever context starts it first stays (multiprocessing
    ignores a later `set_forkserver_preload`): code that starts processes beside `launch` in the same interpreter
    should take its context from here, not make its own (one without torch.optim left every later rank importing
    torch._dynamo itself, ~1.5 s of CPU each)."""
    ctx = mp.get_context("forkserver")
    inherited = sorted(m for m in sys.modules if m.startswith("pslab.") and m != "pslab.__main__")
    extra = [m for m in also if m and m != "__main__"]
    ctx.set_forkserver_preload(list(dict.fromkeys([*PRELOAD, *inherited, *extra])))
    return ctx
