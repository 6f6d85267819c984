"""Failure behaviour: malformed messages are dropped and the rank keeps working; a killed peer makes the others raise
PeerTimeoutError within the timeout; ranks running different collectives are told which rank diverged."""

from __future__ import annotations

import os
import signal
import threading
import time

import msgpack
import numpy as np

from pslab import collectives
from pslab.collectives import wire
from pslab.collectives.errors import CollectiveMismatchError, PeerTimeoutError
from pslab.collectives.launcher import RankFailure

from .hostile import push_to


def inject_garbage(group):
    """Rank 0 fires malformed messages of every kind at rank 1's socket (over a connection authenticated as rank 0:
    a stranger's would be refused at the handshake), then all ranks all-reduce normally."""
    if group.rank == 0:
        s = push_to(group, 1, user="rank:0")
        good = wire.encode("all_reduce", [np.zeros(4, np.float32)], src=0, meta={"k": ["w", 0, 0, 0], "n": 8})
        h = msgpack.unpackb(good[0])
        bad = [
            [os.urandom(50)],                                                       # random bytes
            [good[0], b"\0" * 7],                                                   # truncated frame
            [good[0]],                                                              # missing frame
            [msgpack.packb({**h, "t": [["0", "float99", [4]]]}), bytes(16)],        # wrong dtype
            [msgpack.packb({**h, "t": [["0", "float32", [5]]]}), bytes(16)],        # wrong shape/length
            [b"\x81" + b"\xa1a" * 40000],                                           # oversized / bad header
            [msgpack.packb({**h, "op": ""}), bytes(16)],                            # bad op
            [msgpack.packb({**h, "v": 2}), bytes(16)],                              # wrong protocol version
            [msgpack.packb({**h, "src": 77}), bytes(16)],                           # sender outside the world
            [msgpack.packb({**h, "meta": {}}), bytes(16)],                          # no routing key
        ]
        for frames in bad * 20:
            s.send_multipart(frames)
        s.close()
    group.barrier()
    t = np.full(1000, group.rank + 1.0, np.float32)
    group.all_reduce(t)
    t2 = np.full(100_000, 1.0, np.float32)
    group.all_reduce(t2)
    if group.rank == 1:  # the garbage came over another connection: let the rest of it arrive, then count
        group.tr.timeout = 0.2
        deadline = time.monotonic() + 10
        while group.tr.dropped < 200 and time.monotonic() < deadline:
            try:
                group.tr.recv(0, ("never",), "drain")
            except PeerTimeoutError:
                pass
    return float(t[0]), float(t2[-1]), group.tr.dropped


def test_malformed_messages_are_dropped_and_peer_keeps_working():
    """200 malformed messages at rank 1: all dropped and counted; later all-reduces are still exact."""
    res = collectives.launch(inject_garbage, 3, "zmq", timeout=60)
    assert [(a, b) for a, b, _ in res] == [(6.0, 3.0)] * 3
    assert res[1][2] == 200


def die_mid_collective(group, timeout):
    if group.rank == 2:  # start a large all-reduce and get SIGKILLed partway through it
        threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        group.all_reduce(np.ones(20_000_000, np.float32))
        time.sleep(10)
        return "survived?"
    group.barrier()  # never completes for everyone: rank 2 is gone
    t0 = time.monotonic()
    try:
        group.all_reduce(np.ones(20_000_000, np.float32))
    except PeerTimeoutError as e:
        return ("timeout", time.monotonic() - t0, e.op, e.peer)
    return ("finished", time.monotonic() - t0, "", -1)


def test_killed_peer_raises_timeout_within_limit():
    """Rank 2 is SIGKILLed mid-collective; ranks 0 and 1 raise PeerTimeoutError within the 2 s timeout (+slack)."""
    res = collectives.launch(die_mid_collective, 3, "zmq", args=(2.0,), timeout=60, group_timeout=2.0,
                             return_exceptions=True)
    assert isinstance(res[2], RankFailure) and res[2].exitcode == -signal.SIGKILL
    for r in (0, 1):
        if isinstance(res[r], RankFailure):  # the barrier itself may be where the timeout hits
            assert "PeerTimeoutError" in res[r].error, res[r]
            continue
        kind, elapsed, op, peer = res[r]
        assert kind == "timeout" and op == "all_reduce" and elapsed < 2.0 * 2 + 1.0


def diverge(group):
    try:
        if group.rank == 1:
            group.broadcast(np.ones(10, np.float32), src=0)
        else:
            group.all_reduce(np.ones(10, np.float32))
    except CollectiveMismatchError as e:
        return ("mismatch", str(e))
    except PeerTimeoutError as e:
        return ("timeout", str(e))
    return ("ok", "")


def test_mismatched_collectives_name_the_diverging_rank():
    """Rank 1 calls broadcast while 0 and 2 call all_reduce: a rank reports a mismatch naming rank 1."""
    res = collectives.launch(diverge, 3, "zmq", timeout=30, group_timeout=3.0)
    mism = [msg for kind, msg in res if kind == "mismatch"]
    assert mism, res
    assert any("rank 1 called broadcast" in m or "rank 0 called all_reduce" in m for m in mism), mism
    assert all(kind != "ok" for kind, _ in res)
