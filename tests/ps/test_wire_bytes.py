"""PS bytes are counted where they cross, on both sides: the client counts the tensor payload it hands to ZeroMQ
frames or writes into its shared segment (push) and what it reads back (pull); each shard counts what it took
from frames or the client's segment (push_bytes) and what it answered with (pull_bytes). For every path — tcp, ipc,
shared memory, shared memory with the doorbell lane, and a tensor split over two shards — the two counts agree and
equal S per push and S per read exactly (2·S per update), and an extra push shows up in both counts."""

from __future__ import annotations

import numpy as np
import pytest

from ps import lane as lanes, shm_path
from ps.client import connect
from ps.processes import start_servers

SHAPES = {"w": (64, 33), "b": (33,), "v": (1000,)}
S = sum(int(np.prod(s)) for s in SHAPES.values()) * 4          # bytes of the model (float32)
STEPS = 5

PATHS = {   # label: (transport, shards, shm, lane)
    "tcp frames": ("tcp", 1, False, False),
    "ipc frames": ("ipc", 1, False, False),
    "shm segments": ("ipc", 1, True, False),
    "shm + lane": ("ipc", 1, True, True),
    "tcp, two shards": ("tcp", 2, None, None),
}


def _tensors(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


@pytest.mark.parametrize("label", list(PATHS))
def test_push_and_pull_bytes_counted_by_client_and_shard_agree(label):
    transport, shards, shm, lane = PATHS[label]
    if shm and not shm_path.shm.available():
        pytest.skip("/dev/shm is not writable here")
    if lane and not lanes.enabled():
        pytest.skip("the lane needs x86-64 and a writable /dev/shm")
    with start_servers(shards, num_workers=1, policy="asp", optimizer="sgd:lr=0.01", transport=transport,
                       start_method="fork", idle_timeout=60) as servers:
        with connect(servers.addresses, 0, _tensors(0), timeout=30, shm=shm, lane=lane) as c:
            c.init(_tensors(0)).result(30)
            reads = 0
            for step in range(STEPS):                  # push_pull, then push + pull
                if step % 2 == 0:
                    c.push_pull(_tensors(step + 1)).result(30)
                    reads += 1
                else:
                    c.push(_tensors(step + 1)).result(30)
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
    if shm:                                            # the path the label names was the one taken
        assert all(s["links"] == 1 for s in stats), label
    if lane:
        assert all(s["counters"]["lane"] > 0 for s in stats), label
    if shm is False:
        assert all(s["links"] == 0 for s in stats), label
