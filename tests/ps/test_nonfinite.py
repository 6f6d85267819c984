"""Non-finite gradients are refused: a push holding NaN or Inf is rejected whole with an error naming the tensor,
the parameters stay bitwise unchanged, the shard counts it, and the worker's next finite push is applied as usual —
in the sans-IO core, over sockets (frames and the shared-memory path), under ASP and BSP."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ps import ShardState, connect
from ps.errors import NonFiniteGradientError

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
