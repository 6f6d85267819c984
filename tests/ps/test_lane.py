"""The doorbell lane (ps.lane): negotiated on the same host, it carries push / pull / push_pull headers (the shard
counts them), gives bitwise the same trajectory as ZeroMQ headers, keeps the order of a connection's requests, falls
back where it must, survives a hostile slot, refuses files that are not what they claim, and leaves nothing behind."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from pslab.collectives import shm
from pslab.collectives.errors import WireError
from pslab.ps import lane as lanes, shm_path
from pslab.ps.client import connect
from tests.ps.rawsock import Raw

pytestmark = pytest.mark.skipif(not lanes.enabled(), reason="the lane needs x86-64 and a writable /dev/shm")

SHAPES = {"w": (64, 33), "b": (33,), "v": (1000,)}


def tensors(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def train(addresses, *, lane: bool, steps: int = 12) -> tuple[dict[str, np.ndarray], list[bool]]:
    """push_pull and push + pull alternately; returns the final params and which shards had a lane."""
    with connect(addresses, 0, SHAPES, timeout=30, lane=lane) as c:
        c.init(tensors(0)).result(30)
        c.pull().result(30)
        for step in range(steps):
            g = tensors(100 + step)
            if step % 2:
                c.push_pull(g).result(30)
            else:
                c.push(g).result(30)
                c.pull().result(30)
        on = [x is not None and x.on for x in c._lanes.lanes]
        return c.pull().result(30).params, on


def lane_count(servers) -> int:
    return sum(s.counters["lane"] for s in servers.servers)


@pytest.mark.parametrize("shards", [1, 2])
def test_the_lane_carries_the_requests_and_changes_no_bit(thread_servers, shards):
    a = thread_servers(shards, num_workers=1, optimizer="adam:lr=0.01")
    b = thread_servers(shards, num_workers=1, optimizer="adam:lr=0.01")
    with_lane, on = train(a.addresses, lane=True)
    without, off = train(b.addresses, lane=False)
    assert on == [True] * shards and off == [False] * shards
    # every push, pull and push_pull after the first pull went through the lane (12 steps: 6 x 2 + 6 + final pull)
    assert lane_count(a) == shards * (6 * 2 + 6 + 1 + 1) and lane_count(b) == 0
    for k in SHAPES:
        np.testing.assert_array_equal(with_lane[k], without[k])


def test_a_zmq_request_does_not_overtake_the_lane(thread_servers):
    """Client B puts a push in its lane, then at once sends stats through ZeroMQ (its lane is busy), while the shard
    is still handling client A's request in the same burst of ZeroMQ messages: B's stats still sees B's push."""
    import threading
    s = thread_servers(1, num_workers=2)
    shard = s.servers[0]
    with connect(s.addresses, 0, SHAPES, timeout=30) as a, connect(s.addresses, 1, SHAPES, timeout=30) as b:
        a.init(tensors(0)).result(30)
        b.pull().result(30)
        hold, held = threading.Event(), threading.Event()
        real = shard._on_stats

        def slow_stats(identity, msg, now):
            if not held.is_set():
                held.set()
                hold.wait(10)                                       # the shard is busy with A's request
            real(identity, msg, now)
        shard._on_stats = slow_stats
        first = a.stats()
        assert held.wait(10)
        push = b.push(tensors(1))
        assert b._lanes[0].inflight is not None                     # in the lane
        stats = b.stats()                                           # ZeroMQ, queued behind A's at the shard
        time.sleep(0.3)
        hold.set()
        assert first.result(30)[0]["version"] == 0
        assert stats.result(30)[0]["version"] == 1                  # B's push was served first
        assert push.result(30)[0]["version"] == 1


def test_shards_without_the_lane_serve_as_before(thread_servers, monkeypatch):
    monkeypatch.setenv("PSLAB_PS_LANE", "0")                        # the shard offers no lane
    s = thread_servers(1, num_workers=1)
    monkeypatch.delenv("PSLAB_PS_LANE")
    assert s.servers[0].bell is None
    params, on = train(s.addresses, lane=True)
    assert on == [False] and lane_count(s) == 0 and s.servers[0].counters["pushes"] == 12


def test_a_hostile_slot_is_dropped_and_the_shard_serves_on(thread_servers):
    s = thread_servers(1, num_workers=1)
    shard = s.servers[0]
    with connect(s.addresses, 0, SHAPES, timeout=30) as c:
        c.init(tensors(0)).result(30)
        c.pull().result(30)
        lane = c._lanes[0]
        before = shard.counters["malformed"]

        def malformed_after(write) -> int:
            write()
            lanes.ring(lane.bell)
            deadline = time.monotonic() + 10
            while shard.counters["malformed"] == before and time.monotonic() < deadline:
                time.sleep(0.01)
            return shard.counters["malformed"] - before

        def impossible_length() -> None:
            lane.request.words[1] = lanes.CAPACITY + 1
            lane.request.words[0] = 10 ** 6
        assert malformed_after(impossible_length) == 1
        before += 1
        assert malformed_after(lambda: lane.request.put(10 ** 6 + 1, b"\xc1garbage")) == 1   # no msgpack header
        acks, read = c.push_pull(tensors(1)).result(30)               # the lane still works
        assert acks[0]["version"] == 1 and read.versions == [1]


def test_a_lane_offered_for_another_worker_or_a_wrong_file_is_refused(thread_servers, tmp_path):
    s = thread_servers(1, num_workers=2)
    shard = s.servers[0]
    wrong = lanes.ClientLane(1, 0, "ab" * 6, 1)                     # made for worker 1 ...
    bell = lanes.Bell("w0")
    raw = Raw(s.addresses[0], user="worker:0")                      # ... offered by worker 0
    link = shm_path.ClientLink(0, 0, True)
    try:
        r = raw.request("register", seq=1, meta=dict({"worker": 0}, **link.probe(), **wrong.offer(bell)))
        assert r.op == "ok" and r.meta["shm"] is True and "lane" not in r.meta and shard.lanes == {}
    finally:
        raw.close()
        link.close()
        wrong.close()
        bell.close()
    with pytest.raises(WireError, match="not the bell of w1"):
        lanes.open_bell(bell.name, "w1")
    plain = os.path.join(shm.SHM_DIR, f"pslab-{'ab' * 6}-w3-bell")  # a regular file under a bell's name
    with open(plain, "w"):
        pass
    try:
        with pytest.raises(WireError, match="not a private FIFO"):
            lanes.open_bell(os.path.basename(plain), "w3")
    finally:
        os.unlink(plain)
    good = lanes.ClientLane(0, 0, "cd" * 6, 1)
    try:
        assert lanes.ServerLane.accept(0, 0, {"lane": [good.name, lanes.SIZE + 1], "lane_bell": "x"}, None) is None
        assert lanes.ServerLane.accept(1, 0, {"lane": [good.name, lanes.SIZE], "lane_bell": "x"}, None) is None
    finally:
        good.close()


@pytest.mark.exclusive               # every pslab-* segment on the machine: alone under pytest -n
def test_nothing_is_left_in_dev_shm(thread_servers):
    before = shm_path.segments()
    s = thread_servers(2, num_workers=1)
    train(s.addresses, lane=True, steps=3)
    s.stop()
    assert shm_path.segments() <= before, shm_path.segments() - before


def wait_for(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_an_answer_in_the_lane_at_resync_is_still_delivered(thread_servers):
    """A push in the lane that the shard has answered, then resync() before the push's result is read: the answer
    (left in the old lane) reaches the push's future, and the new lane serves the next request."""
    s = thread_servers(1, num_workers=1)
    shard = s.servers[0]
    with connect(s.addresses, 0, SHAPES, timeout=8) as c:
        c.init(tensors(0)).result(8)
        c.pull().result(8)
        f = c.push(tensors(1))
        old = c._lanes[0]
        wait_for(lambda: shard.state.version == 1 and old.reply.seq() == old.inflight, "the shard answers")
        c.resync()
        assert f.result(8)[0]["version"] == 1
        assert c._lanes[0] is not old and c._lanes.old == [] and old.mm is None     # delivered, then closed
        acks, read = c.push_pull(tensors(2)).result(8)
        assert acks[0]["version"] == 2 and read.versions == [2] and shard.counters["lane"] >= 3


def test_an_answer_in_the_lane_before_a_drop_is_a_good_answer(thread_servers, monkeypatch):
    """The shard answers a push through the lane and then goes away: the client sees the drop and the answer at
    once; the answer counts (as ZeroMQ answers that came before a drop do), later requests fail as lost."""
    monkeypatch.setenv("PSLAB_SHM_SPIN_US", "0")                   # no spin: the poll sees both at once
    s = thread_servers(1, num_workers=1)
    shard = s.servers[0]
    c = connect(s.addresses, 0, SHAPES, timeout=8)
    try:
        c.init(tensors(0)).result(8)
        c.pull().result(8)
        f = c.push(tensors(1))
        lane = c._lanes[0]
        wait_for(lambda: shard.state.version == 1 and lane.reply.seq() == lane.inflight, "the shard answers")
        s.stop()                                                    # the connection drops
        time.sleep(0.5)                                             # the monitor has the event before we look
        assert f.result(8)[0]["version"] == 1
        wait_for(lambda: c.lost == [0] or (c.push(tensors(2)).exception(1) is not None and c.lost == [0]),
                 "the drop is seen")
    finally:
        c.close()
