"""The client's one future per fan-out: the first error wins; with wait_all (pushes) it is raised only once every
shard has answered, so no refusal of the same push is still unread when the caller sees the error."""

from __future__ import annotations

import pytest

from pslab.ps.futures import Fanout


def _never(fut, timeout):          # a driver with nothing to receive
    return None


def test_first_error_wins_at_once_without_wait_all():
    f = Fanout(_never, 3)
    f.fail(ValueError("shard 1"), 1)
    assert f.done() and isinstance(f.exception(0), ValueError)
    f.settle(0, "late")                                   # ignored
    assert str(f.exception(0)) == "shard 1"


def test_with_wait_all_the_first_error_waits_for_every_answer():
    f = Fanout(_never, 3, wait_all=True)
    f.fail(ValueError("shard 1 refused"), 1)
    assert not f.done()
    f.settle(0, ("ok", None))
    assert not f.done()
    f.fail(KeyError("shard 2 refused too"), 2)
    assert f.done() and str(f.exception(0)) == "shard 1 refused"


def test_with_wait_all_an_error_of_the_whole_request_fails_it_at_once():
    f = Fanout(_never, 2, wait_all=True)
    f.fail(TimeoutError("no answer"))                     # not one shard's answer: the request as a whole
    assert f.done() and isinstance(f.exception(0), TimeoutError)


def test_all_answers_settle_with_finish():
    f = Fanout(_never, 2, finish=lambda replies: [m for m, _ in replies], wait_all=True)
    f.settle(1, ("b", None))
    f.settle(0, ("a", None))
    assert f.result(0) == ["a", "b"]
    with pytest.raises(Exception):
        Fanout(_never, 1).result(0)                       # nothing came: a timeout, not a hang
