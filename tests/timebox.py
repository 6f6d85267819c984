"""`within(seconds, what)`: a step of a test that must end in time, and says what it waited for when it does not.

    with within(5, "the shard's reply to the owner's push"):
        owner.push(...).result(10)

A SIGALRM timer interrupts the step (blocking ZeroMQ and socket calls are interrupted too: pyzmq checks signals on
EINTR) with `StepTimeout("hung for 5 s waiting for the shard's reply to the owner's push")`, so a hang fails the
test in seconds with a message that names the wait, instead of at the suite's timeout with a bare stack. The
timer and handler in place before (pytest-timeout's) are restored after the step, the remaining time included.
Main thread only (signals are delivered there)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class StepTimeout(AssertionError):
    """A bounded test step did not end in time."""


@contextmanager
def within(seconds: float, what: str) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum: int, frame: object) -> None:
        raise StepTimeout(f"hung for {seconds:g} s waiting for {what}")

    started = time.monotonic()
    previous = signal.signal(signal.SIGALRM, expired)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    if 0 < outer < seconds:               # the enclosing timer (pytest-timeout's) is due first: keep its deadline
        signal.setitimer(signal.ITIMER_REAL, outer)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer > 0:                 # the enclosing timer (pytest-timeout's) goes on with what it had left
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - started), 0.001))
