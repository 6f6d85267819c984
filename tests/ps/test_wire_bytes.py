"""PS bytes are counted where they cross, on both sides: the client counts the tensor payload it hands to ZeroMQ
frames or writes into its shared segment (push) and what it reads back (pull); each shard counts what it took
from frames or the client's segment (push_bytes) and what it answered with (pull_bytes). For every path — tcp, ipc,
shared memory, shared memory with the doorbell lane, and a tensor split over two shards — the two counts agree and
equal S per push and S per read exactly (2·S per update), and an extra push shows up in both counts. (Not
covered: a request the connection loses after the client handed it over, counted by the client only, and a read
answered after the client gave up on it, counted by the shard only.)"""

from __future__ import annotations

import numpy as np
import pytest

from pslab.ps import lane as lanes, shm_path
from pslab.ps.client import connect
from pslab.ps.processes import start_servers

SHAPES = {"w": (64, 33), "b": (33,), "v": (1000,)}
S = sum(int(np.prod(s)) for s in SHAPES.values()) * 4          # bytes of the model (float32)
STEPS = 5

PATHS = {   # label: (transport, shards, shm, lane, in place: grad_buffers() + push_pull(copy=False))
    "tcp frames": ("tcp", 1, False, False, False),
    "ipc frames": ("ipc", 1, False, False, False),
    "tcp frames, two shards": ("tcp", 2, False, False, False),
    "shm segments": ("ipc", 1, True, False, False),
    "shm + lane": ("ipc", 1, True, True, False),
    "shm + lane, two shards, in place": ("ipc", 2, True, True, True),     # a tensor split: the pull arena too
}


def _tensors(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


@pytest.mark.parametrize("label", list(PATHS))
def test_push_and_pull_bytes_counted_by_client_and_shard_agree(label):
    transport, shards, shm, lane, in_place = PATHS[label]
    if shm and not shm_path.shm.available():
        pytest.skip("/dev/shm is not writable here")
    if lane and not lanes.enabled():
        pytest.skip("the lane needs x86-64 and a writable /dev/shm")
    with start_servers(shards, num_workers=1, policy="asp", optimizer="sgd:lr=0.01", transport=transport,
                       start_method="fork", idle_timeout=60) as servers:
        with connect(servers.addresses, 0, _tensors(0), timeout=30, shm=shm, lane=lane) as c:
            c.init(_tensors(0)).result(30)
            bufs = c.grad_buffers() if in_place else None
            reads = 0
            for step in range(STEPS):                  # push_pull, then push + pull
                grads = _tensors(step + 1)
                if bufs is not None:                   # the strategy's way: gradients in the push segment itself
                    for k, v in grads.items():
                        bufs[k][...] = v
                    grads = bufs
                if step % 2 == 0 or in_place:
                    c.push_pull(grads, copy=not in_place).result(30)
                else:
                    c.push(grads).result(30)
                    c.pull().result(30)
                reads += 1
            c.push(_tensors(99)).result(30)            # one push more than the loop's: both sides see it
            ops = c.wire.snapshot()["by_op"]
            stats = c.stats().result(30)
    pushes = STEPS + 1
    shard_push = sum(s["counters"]["push_bytes"] for s in stats)
    shard_pull = sum(s["counters"]["pull_bytes"] for s in stats)
    assert ops["push"]["sent"] == shard_push == pushes * S, label
    assert ops["pull"]["recv"] == shard_pull == reads * S, label
    assert ops["init"]["sent"] == S
    requests = pushes * shards                         # the path the label names was the one every push took
    assert c.pushes_by_path == ({"shm": requests, "frames": 0} if shm else {"shm": 0, "frames": requests}), label
    assert all(s["links"] == (1 if shm else 0) for s in stats), label
    if lane:
        assert all(s["counters"]["lane"] > 0 for s in stats), label


@pytest.mark.parametrize("shm", [False, True])
def test_a_refused_push_is_counted_on_both_sides(shm):
    """A push the shard refuses (a NaN, nonfinite = reject) still crossed: the client and the shard count it."""
    from pslab.ps.errors import NonFiniteGradientError
    if shm and not shm_path.shm.available():
        pytest.skip("/dev/shm is not writable here")
    with start_servers(1, num_workers=1, policy="asp", optimizer="sgd:lr=0.01", transport="ipc",
                       start_method="fork", idle_timeout=60) as servers:
        with connect(servers.addresses, 0, _tensors(0), timeout=30, shm=shm, lane=False) as c:
            c.init(_tensors(0)).result(30)
            bad = _tensors(1)
            bad["v"][3] = np.nan
            with pytest.raises(NonFiniteGradientError):
                c.push(bad).result(30)
            c.push(_tensors(2)).result(30)
            ops = c.wire.snapshot()["by_op"]
            stats = c.stats().result(30)
    assert ops["push"]["sent"] == stats[0]["counters"]["push_bytes"] == 2 * S
    assert stats[0]["counters"]["nonfinite_refused"] == 1 and stats[0]["version"] == 1
