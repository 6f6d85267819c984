"""Server-side optimizers on the sans-IO shard: the staleness-aware rate and DC-ASGD reduce exactly to the plain
update (tau = 0, lambda = 0), and otherwise follow their formulas."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ps.errors import ConfigError
from ps.optim import OptimizerSpec, optimizer_from_string
from ps.shard import ShardState

RNG = np.random.default_rng(0)
GRADS = [RNG.standard_normal(16).astype(np.float32) for _ in range(40)]
INIT = RNG.standard_normal(16).astype(np.float32)


def run_async(spec: OptimizerSpec, k: int = 1, steps: int = 40) -> np.ndarray:
    """k workers round-robin under ASP: each pushes a gradient computed on its previous read (tau = k-1)."""
    st = ShardState({"w": INIT}, spec, "asp", num_workers=k)
    reads = {w: st.read(w, 0).version for w in range(k)}
    for i in range(steps):
        w = i % k
        st.push(w, st.clocks[w], reads[w], {"w": GRADS[i]})
        reads[w] = st.read(w, st.clocks[w]).version
    return st.params["w"].numpy().copy()


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam"])
def test_staleness_lr_with_tau_zero_is_plain(name):
    """One worker (tau = 0 always): staleness_lr gives bitwise the plain trajectory."""
    plain = run_async(OptimizerSpec(name, lr=0.05))
    aware = run_async(OptimizerSpec(name, lr=0.05, staleness_lr=True))
    np.testing.assert_array_equal(plain, aware)


def test_staleness_lr_divides_by_tau():
    """Two round-robin workers (tau = 1 after the first push, then steady): SGD with alpha0/tau matches by hand."""
    k = 3
    st = ShardState({"w": INIT}, OptimizerSpec("sgd", lr=0.3, staleness_lr=True), "asp", num_workers=k)
    reads = {w: st.read(w, 0).version for w in range(k)}
    expect = INIT.astype(np.float32).copy()
    for i in range(12):
        w = i % k
        tau = st.version - reads[w]
        lr = np.float32(0.3 / tau if tau > 0 else 0.3)
        expect = expect - lr * GRADS[i]
        st.push(w, st.clocks[w], reads[w], {"w": GRADS[i]})
        reads[w] = st.read(w, st.clocks[w]).version
    np.testing.assert_allclose(st.params["w"].numpy(), expect, rtol=1e-6, atol=1e-7)
    assert set(st.stats.histogram()) == {0, 1, 2}


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_dc_asgd_with_lambda_zero_is_plain(name, adaptive):
    """Three workers (stale gradients, w_now != w_bak): DC-ASGD with lambda = 0 gives bitwise the plain run."""
    plain = run_async(OptimizerSpec(name, lr=0.05), k=3)
    dc = run_async(OptimizerSpec(name, lr=0.05, dc_lambda=0.0, dc_adaptive=adaptive), k=3)
    np.testing.assert_array_equal(plain, dc)
    assert not np.array_equal(plain, run_async(OptimizerSpec(name, lr=0.05, dc_lambda=0.5, dc_adaptive=adaptive), k=3))


def test_dc_asgd_formula_constant_and_adaptive():
    """One stale SGD step by hand: g~ = g + lambda g*g*(w_now - w_bak); adaptive lambda = l0/sqrt(MS + eps)."""
    for adaptive in (False, True):
        spec = OptimizerSpec("sgd", lr=0.1, dc_lambda=0.7, dc_adaptive=adaptive, dc_decay=0.9)
        st = ShardState({"w": INIT}, spec, "asp", num_workers=2)
        st.read(0, 0)
        bak = st.read(1, 0).params["w"].numpy().copy()
        st.push(0, 0, 0, {"w": GRADS[0]})                    # moves w away from worker 1's backup
        w_now = st.params["w"].numpy().copy()
        st.push(1, 0, 0, {"w": GRADS[1]})
        g = GRADS[1].astype(np.float64)
        if adaptive:
            ms0 = 0.1 * GRADS[0].astype(np.float64) ** 2        # the first step updated the mean square too
            ms = 0.9 * ms0 + 0.1 * g * g
            lam = 0.7 / np.sqrt(ms + 1e-7)
        else:
            lam = 0.7
        expect = w_now - 0.1 * (g + lam * g * g * (w_now - bak))
        np.testing.assert_allclose(st.params["w"].numpy(), expect, rtol=1e-5, atol=1e-6)


def test_optimizer_strings_and_errors():
    s = optimizer_from_string("adam:lr=1e-3,betas=0.8/0.9,staleness_lr=1,dc_lambda=0.04")
    assert s.name == "adam" and s.betas == (0.8, 0.9) and s.staleness_lr and s.dc_lambda == 0.04
    with pytest.raises(ConfigError, match="unknown optimizer"):
        optimizer_from_string("rmsprop")
    with pytest.raises(ConfigError, match="key=value"):
        optimizer_from_string("sgd:lr")
    with pytest.raises(ConfigError, match="learning rate"):
        OptimizerSpec("sgd", lr=0)


def test_same_as_torch_optim_locally():
    """ShardState with one worker = torch.optim.Adam on the same gradients, bitwise."""
    p = torch.nn.Parameter(torch.from_numpy(INIT.copy()))
    opt = torch.optim.Adam([p], lr=0.01)
    st = ShardState({"w": INIT}, "adam:lr=0.01", "asp")
    for i, g in enumerate(GRADS):
        p.grad = torch.from_numpy(g.copy())
        opt.step()
        st.push(0, i, i, {"w": g})
    assert torch.equal(p.detach(), st.params["w"])
