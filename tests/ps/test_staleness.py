"""Staleness bookkeeping on the sans-IO shard: tau = version when applied - version read, exactly."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pslab.ps.shard import ShardState
from pslab.ps.staleness import StalenessStats


def _grad(v: float = 1.0) -> dict[str, np.ndarray]:
    return {"w": np.full(4, v, np.float32)}


def test_hand_computed_sequence():
    """Server at version 100 gets gradients read at 98, 99, 97, 100 -> tau = 2, 2, 5, 3 (one update per push)."""
    st = ShardState({"w": np.zeros(4, np.float32)}, "sgd:lr=0.1", "asp", num_workers=4, initial_version=100)
    taus = []
    for w, read in enumerate([98, 99, 97, 100]):
        res = st.push(w, 0, read, _grad())
        taus.append(res.staleness[0][1])
    assert taus == [2, 2, 5, 3]
    assert st.version == 104
    assert st.stats.histogram() == {2: 2, 3: 1, 5: 1}
    assert [t for _, _, t, _ in st.stats.series] == [2, 2, 5, 3]
    assert [v for _, _, _, v in st.stats.series] == [100, 101, 102, 103]
    assert st.stats.mean() == pytest.approx(3.0)
    assert st.stats.percentile(50) == 2 and st.stats.percentile(100) == 5


@pytest.mark.parametrize("k", [2, 4, 8])
def test_balanced_asp_mean_staleness_is_k_minus_1(k):
    """K equally fast workers (random order within each round) under ASP: mean tau ~ K-1; histogram sums to pushes."""
    rng = random.Random(k)
    st = ShardState({"w": np.zeros(4, np.float32)}, "sgd:lr=0.01", "asp", num_workers=k)
    reads = {w: st.read(w, 0).version for w in range(k)}
    rounds = 60
    for _ in range(rounds):
        order = list(range(k))
        rng.shuffle(order)
        for w in order:   # push the gradient computed on the last read, then read again
            st.push(w, st.clocks[w], reads[w], _grad())
            reads[w] = st.read(w, st.clocks[w]).version
    s = st.stats
    assert s.count == k * rounds == sum(s.histogram().values())
    assert sum(sum(s.histogram(w).values()) for w in range(k)) == s.count
    assert abs(s.mean() - (k - 1)) < 0.15 * k, s.mean()
    assert all(wait == 0 for ws in s.waits.values() for wait in ws)   # ASP never waits


def test_staleness_stats_reject_negative_tau():
    with pytest.raises(ValueError):
        StalenessStats(1).record(0, -1, 0)


def test_bsp_staleness_is_zero_and_versions_count_clocks():
    """BSP: one update per clock (averaged), every tau = 0."""
    st = ShardState({"w": np.zeros(4, np.float32)}, "sgd:lr=1", "bsp", num_workers=3)
    for c in range(5):
        reads = [st.read(w, c).version for w in range(3)]
        assert reads == [c] * 3
        for w in range(3):
            res = st.push(w, c, reads[w], _grad(w + 1.0))
            assert res.status == ("applied" if w == 2 else "buffered")
    assert st.version == 5
    assert st.stats.histogram() == {0: 15}
    np.testing.assert_array_equal(st.params["w"].numpy(), np.full(4, -10.0, np.float32))  # 5 * mean(1,2,3)


def test_wait_records_are_bounded_and_the_totals_count_every_read():
    """A long-running shard records a wait per read: the per-read list stops at max_series, the totals in the summary
    (and in a checkpoint's state) still count every read."""
    s = StalenessStats(2, max_series=3)
    for x in (0.0, 0.5, 0.0, 0.25, 1.0):
        s.record_wait(1, x)
    assert s.waits[1] == [0.0, 0.5, 0.0]
    summary = s.summary()
    assert summary["wait_seconds"][1] == 1.75 and summary["waits"][1] == 3 and summary["waits"][0] == 0
    back = StalenessStats.from_state(2, s.state())
    assert back.summary()["wait_seconds"][1] == 1.75
