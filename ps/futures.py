"""Futures that make progress when waited on: the client has no I/O thread, so `result()` / `exception()` on a
`LazyFuture` run the client's receive loop (its "driver") until the future is done or the timeout passes.

    gather(per_shard_futures)   one future for every shard's reply (first error wins)
    mapped(fut, fn)             a future of fn(fut's result), driven by the same client
    metas(fut)                  mapped to the reply metadata only
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any, Callable


class LazyFuture(Future):
    """A Future whose result()/exception() drive the client's receive loop (no background thread)."""

    def __init__(self, driver: Callable[[Future, float | None], None]) -> None:
        super().__init__()
        self._driver = driver

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            self._driver(self, timeout)
        return super().result(timeout=0 if timeout is not None or self.done() else None)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.done():
            self._driver(self, timeout)
        return super().exception(timeout=0 if timeout is not None or self.done() else None)


def mapped(fut: Future, fn: Callable[[Any], Any]) -> Future:
    """A lazy future of `fn(fut.result())` (or fut's exception, or fn's), driven by the same client as `fut`."""
    out: Future = LazyFuture(lambda f, timeout: fut.exception(timeout) and None)

    def done(f: Future) -> None:
        try:
            out.set_result(fn(f.result()))
        except BaseException as e:
            out.set_exception(e)
    fut.add_done_callback(done)
    return out


def metas(fut: Future) -> Future:
    """[meta of each shard's reply] of a gathered future."""
    return mapped(fut, lambda replies: [m for m, _ in replies])


def gather(futs: list[Future]) -> Future:
    """One future for all shards' replies; waiting on it waits on each shard's future in turn."""

    def drive(_: Future, timeout: float | None) -> None:
        end = None if timeout is None else time.monotonic() + timeout
        for f in futs:
            left = None if end is None else max(0.0, end - time.monotonic())
            try:
                f.exception(left)
            except TimeoutError:
                return
            if out.done():
                return
    out: Future = LazyFuture(drive)
    state = [len(futs), False]           # futures still pending; whether `out` is settled
    lock = threading.Lock()

    def done(f: Future) -> None:         # looks at the future that just finished only (no scan of all of them)
        exc = f.exception()
        with lock:
            state[0] -= 1
            if state[1] or (exc is None and state[0] > 0):
                return
            state[1] = True
        if exc is not None:
            out.set_exception(exc)
        else:
            out.set_result([g.result() for g in futs])
    for f in futs:
        f.add_done_callback(done)
    return out
