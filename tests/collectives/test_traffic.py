"""Traffic accounting shows the textbook figure: ring all-reduce sends 2(N-1)/N x bytes per rank, for every N,
while gather-to-root + broadcast pushes (N-1) x bytes through the root."""

from __future__ import annotations

import numpy as np
import pytest

import collectives

ELEMS = 250_007  # float32, not divisible by any N here


def measure(group, algorithm):
    t = np.ones(ELEMS, np.float32)
    group.reset_traffic()
    group.all_reduce(t, algorithm=algorithm)
    tr = group.traffic()
    return tr["sent_total"], tr["recv_total"], float(t[0])


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_ring_bytes_per_rank(world):
    """Each rank's sent and received payload equals 2(N-1)/N x tensor bytes, to the rounding of uneven chunks."""
    res = collectives.launch(measure, world, "zmq", args=("ring",), timeout=60)
    nbytes = ELEMS * 4
    ideal = 2 * (world - 1) / world * nbytes
    for sent, recv, val in res:
        assert val == world
        assert abs(sent - ideal) <= 2 * (world - 1) * 4, (sent, ideal)   # at most one element per uneven step
        assert abs(recv - ideal) <= 2 * (world - 1) * 4
    assert sum(s for s, _, _ in res) == sum(r for _, r, _ in res)


@pytest.mark.parametrize("world", [2, 4])
def test_root_pattern_grows_with_n(world):
    """Gather-to-root + broadcast: the root sends and receives (N-1) x bytes, growing with N."""
    res = collectives.launch(measure, world, "zmq", args=("root",), timeout=60)
    nbytes = ELEMS * 4
    root_sent, root_recv, _ = res[0]
    assert root_sent == root_recv == (world - 1) * nbytes
    assert all(s == nbytes and r == nbytes for s, r, _ in res[1:])
