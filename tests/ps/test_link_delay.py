"""pslab.ps.link_delay: the emulated link between a PS client and its shards (the model collectives/topology.py uses)."""

from __future__ import annotations

import time

import pytest

from pslab.ps.link_delay import EmulatedLink


def test_a_message_is_delivered_after_its_bytes_and_the_latency_and_messages_queue():
    """due = max(now, busy) + B/bandwidth + latency; a second message handed over while the first still occupies
    the link starts when it is free (the bandwidth is shared, the latency paid by each)."""
    link = EmulatedLink(0.010, 1e6)                        # 10 ms, 1 MB/s
    assert link.due(5_000, now=100.0) == pytest.approx(100.0 + 0.005 + 0.010)
    assert link.due(5_000, now=100.001) == pytest.approx(100.010 + 0.010)     # queued behind the first
    assert link.due(0, now=200.0) == pytest.approx(200.010)                   # idle again: latency only


def test_carry_waits_at_least_the_modelled_time_and_bad_links_are_refused():
    """carry() returns no earlier than the delivery time (a lower bound: a loaded machine only adds to it)."""
    link = EmulatedLink(0.02, float("inf"))
    t0 = time.monotonic()
    link.carry(10**9)
    assert time.monotonic() - t0 >= 0.02 and link.messages == 1 and link.delayed_s == pytest.approx(0.02)
    for lat, bw in ((-1.0, 1e6), (0.0, 0.0), (float("nan"), 1e6)):
        with pytest.raises(ValueError, match="latency >= 0 s and bandwidth > 0"):
            EmulatedLink(lat, bw)
