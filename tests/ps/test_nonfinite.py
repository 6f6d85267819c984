"""Non-finite gradients are refused: a push holding NaN or Inf is rejected whole with an error naming the tensor,
the parameters stay bitwise unchanged, the shard counts it, and the worker's next finite push is applied as usual —
in the sans-IO core, over sockets (frames and the shared-memory path), under ASP and BSP."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pslab.ps import ShardState, connect
from pslab.ps.errors import NonFiniteGradientError

SHAPES = {"w": (64, 8), "b": (8,)}


def _params():
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("policy", ["asp", "bsp"])
def test_core_refuses_a_non_finite_push_and_changes_nothing(bad, policy):
    st = ShardState(_params(), optimizer="sgd:lr=0.1", policy=policy, num_workers=1)
    before = {k: v.clone() for k, v in st.params.items()}
    grads = {k: torch.ones(s) for k, s in SHAPES.items()}
    grads["w"][3, 5] = bad
    with pytest.raises(NonFiniteGradientError, match="gradient 'w' from worker 0 at clock 0 holds NaN or Inf"):
        st.push(0, 0, 0, grads)
    assert st.version == 0 and st.clocks == [0]
    for k in SHAPES:
        assert torch.equal(st.params[k].view(SHAPES[k]), before[k].view(SHAPES[k]))
    st.push(0, 0, 0, {k: torch.ones(s) for k, s in SHAPES.items()})         # the same clock, finite: applied
    assert st.version == 1


def test_large_finite_gradients_are_not_mistaken_for_overflow():
    st = ShardState(_params(), optimizer="sgd:lr=1e-40", policy="asp", num_workers=1)
    st.push(0, 0, 0, {k: torch.full(s, 3e38) for k, s in SHAPES.items()})  # their float32 sum would overflow
    assert st.version == 1


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "frames"])
def test_a_worker_pushing_nan_gets_the_error_and_the_shard_keeps_its_weights(thread_servers, shm):
    servers = thread_servers(1, num_workers=1, optimizer="sgd:lr=0.1")
    with connect(servers.addresses, 0, SHAPES, shm=shm) as c:
        c.init({k: v.numpy() for k, v in _params().items()}).result(30)
        before = c.pull().result(30).params
        bufs = c.grad_buffers()
        for k in SHAPES:
            bufs[k][...] = 1.0
        bufs["b"][2] = np.nan
        with pytest.raises(NonFiniteGradientError, match="gradient 'b'"):
            c.push_pull(bufs, copy=False).result(30)
        c.resync()
        after = c.pull().result(30).params
        for k in SHAPES:
            np.testing.assert_array_equal(after[k], before[k])
        stats = c.stats().result(30)[0]
        assert stats["counters"]["nonfinite_refused"] == 1 and stats["version"] == 0
        bufs["b"][2] = 1.0
        acks, _ = c.push_pull(bufs).result(30)
        assert acks[0]["status"] == "applied"


@pytest.mark.parametrize("policy", ["asp", "bsp"])
def test_core_skip_policy_drops_the_push_and_advances_the_clock(policy):
    """skip_nonfinite: a NaN push is acked "skipped", nothing is applied (parameters bitwise unchanged), the worker's
    clock advances; under BSP the clock completes with the other worker's gradient alone (averaged over one)."""
    st = ShardState(_params(), optimizer="sgd:lr=0.1", policy=policy, num_workers=2)
    before = {k: v.clone() for k, v in st.params.items()}
    bad = {k: torch.ones(s) for k, s in SHAPES.items()}
    bad["b"][1] = float("nan")
    res = st.push(0, 0, 0, bad, skip_nonfinite=True)
    assert res.status == "skipped" and st.clocks == [1, 0] and st.version == 0
    for k in SHAPES:
        assert torch.equal(st.params[k], before[k])
    good = {k: torch.full(s, 2.0) for k, s in SHAPES.items()}
    res = st.push(1, 0, 0, good, skip_nonfinite=True)
    assert res.status == "applied" and st.version == 1 and res.staleness == [(1, 0)]
    for k in SHAPES:      # one SGD step on worker 1's gradient alone (not averaged with a zero)
        assert torch.equal(st.params[k], before[k] - 0.1 * good[k].reshape(before[k].shape))
    with pytest.raises(NonFiniteGradientError, match="gradient 'b' from worker 0 at clock 1"):
        st.push(0, 1, 1, bad)                                           # the default still refuses


def test_skipped_clock_survives_a_checkpoint():
    """A buffered skipped push (BSP, waiting for the other worker) is kept by state_dict / from_state_dict."""
    st = ShardState(_params(), optimizer="sgd:lr=0.1", policy="bsp", num_workers=2)
    bad = {k: torch.full(s, float("inf")) for k, s in SHAPES.items()}
    st.push(0, 0, 0, bad, skip_nonfinite=True)
    back = ShardState.from_state_dict(*st.state_dict())
    assert back.pending[0][0][0] is None and back.clocks == [1, 0]
    back.push(1, 0, 0, {k: torch.ones(s) for k, s in SHAPES.items()})
    assert back.version == 1


def test_a_shard_with_the_skip_policy_acks_skipped_and_counts_it(thread_servers):
    servers = thread_servers(1, num_workers=1, optimizer="sgd:lr=0.1", nonfinite="skip")
    with connect(servers.addresses, 0, SHAPES) as c:
        c.init({k: v.numpy() for k, v in _params().items()}).result(30)
        before = c.pull().result(30).params
        grads = {k: np.ones(s, np.float32) for k, s in SHAPES.items()}
        grads["w"][0, 0] = np.inf
        acks, after = c.push_pull(grads).result(30)
        assert acks[0]["status"] == "skipped" and acks[0]["version"] == 0 and after.clocks == [1]
        for k in SHAPES:
            np.testing.assert_array_equal(after.params[k], before[k])
        grads["w"][0, 0] = 1.0
        assert c.push(grads).result(30)[0]["status"] == "applied"        # clock 1: no resync needed
        stats = c.stats().result(30)[0]
        assert stats["counters"]["nonfinite_skipped"] == 1 and stats["counters"]["nonfinite_refused"] == 0
        assert stats["version"] == 1 and stats["nonfinite"] == "skip"
