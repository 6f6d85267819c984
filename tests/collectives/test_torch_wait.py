"""The torch backend's interruptible wait (collectives/torch_group.py `_wait`): a gloo work is waited for in slices,
calling the elastic interrupt between them. A slice's timeout can race with the work completing; a work that
completed *well* right after its slice timed out must count as done — not as a peer's failure, which waits for a
new membership that never comes (under load this once stalled a healthy ring for the whole group timeout).

Fake works make the race deterministic: no processes, no timing."""

from __future__ import annotations

import pytest

from pslab.collectives.errors import PeerFailedError
from pslab.collectives.torch_group import TorchGroup


class RacingWork:
    """Times out the first sliced wait and completes during it (`error`: with that error, else well)."""

    def __init__(self, error: str | None = None) -> None:
        self.done, self.error, self.waits = False, error, []

    def wait(self, timeout=None) -> bool:
        self.waits.append(timeout)
        if timeout is not None and not self.done:
            self.done = True                        # completes while the slice's timeout is being raised
            raise RuntimeError("Operation timed out!")
        if self.error:
            raise RuntimeError(self.error)
        return True

    def is_completed(self) -> bool:
        return self.done


def _group(timeout: float = 0.3) -> TorchGroup:
    g = TorchGroup(pg=None, ranks=[0, 1], rank_global=0, timeout=timeout)
    g.interrupt, g.interrupt_every = (lambda: None), 0.01
    return g


def test_a_work_that_completed_well_after_its_slice_timed_out_is_done():
    g, work = _group(), RacingWork()
    g._wait(work, "all_reduce")                     # before the fix: PeerFailedError after the group timeout
    assert work.waits[0] is not None and work.waits[-1] is None and g._inflight == []


def test_a_work_that_failed_is_a_peer_failure_with_its_own_error():
    g, work = _group(), RacingWork("Connection closed by peer [127.0.0.1]:4242")
    with pytest.raises(PeerFailedError, match="Connection closed by peer") as e:
        g._wait(work, "all_reduce")
    assert "Operation timed out" not in str(e.value)
