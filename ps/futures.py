"""Futures that make progress when waited on: the client has no I/O thread, so `result()` / `exception()` on a
`LazyFuture` run the client's receive loop (its "driver") until the future is done or the timeout passes.

    Fanout(driver, n, finish)   the client's one future per fan-out request (one reply slot per shard): it settles
                                with finish([reply_0, ..., reply_{n-1}]) once every slot is in, or with the first
                                error (`wait_all`: with the first error once every slot has answered, so that
                                nothing of the request is still unread when its caller sees the failure -- a
                                push's refusals each move a clock back); one Future per call, not one per shard
                                plus a gather and a map (each concurrent.futures.Future costs a Condition, locks
                                and callbacks: ~40 µs an update)
    reply_metas(replies)        a Fanout's finish: the metadata of each shard's reply
"""

from __future__ import annotations

from concurrent.futures import Future, InvalidStateError
from typing import Any, Callable, Sequence


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


class Fanout(LazyFuture):
    """One request to each of `n` shards as one future (module docstring). `settle` and `fail` are called by the
    client's receive loop under its lock; a slot settled after the future failed is ignored."""

    def __init__(self, driver: Callable[[Future, float | None], None], n: int,
                 finish: Callable[[list[Any]], Any] | None = None, wait_all: bool = False) -> None:
        super().__init__(driver)
        self._slots: list[Any] = [None] * n
        self._left = n
        self._finish = finish
        self._wait_all = wait_all
        self._error: BaseException | None = None      # (wait_all) the first error, raised once all answered

    def settle(self, slot: int, value: Any) -> None:
        if self.done():
            return
        self._slots[slot] = value
        self._left -= 1
        if self._left:
            return
        if self._error is not None:
            self._set_error(self._error)
            return
        try:
            out = self._finish(self._slots) if self._finish is not None else self._slots
        except BaseException as e:            # finish's own error is the future's (e.g. a reply it cannot use)
            self.fail(e)
            return
        try:
            self.set_result(out)
        except InvalidStateError:
            pass

    def fail(self, exc: BaseException, slot: int | None = None) -> None:
        """The first error wins; later ones (other shards' failures of the same request) are dropped. `slot`: the
        error is that shard's answer (with wait_all, the future fails once every slot has answered); None: the
        whole request failed at once."""
        if self.done():
            return
        if slot is None or not self._wait_all:
            self._set_error(exc)
            return
        if self._error is None:
            self._error = exc
        self._left -= 1
        if not self._left:
            self._set_error(self._error)

    def _set_error(self, exc: BaseException) -> None:
        try:
            if not self.done():
                self.set_exception(exc)
        except InvalidStateError:
            pass


def reply_metas(replies: Sequence[Any]) -> list[Any]:
    """[meta of each shard's reply] (a Fanout's finish)."""
    return [m for m, _ in replies]
