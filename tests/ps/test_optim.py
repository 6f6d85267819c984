"""Server-side optimizers on the sans-IO shard: the staleness-aware rate and DC-ASGD reduce exactly to the plain
update (tau = 0, lambda = 0), and otherwise follow their formulas."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pslab.ps.errors import ConfigError
from pslab.ps.optim import Contribution, OptimizerSpec, ServerOptimizer, optimizer_from_string
from pslab.ps.shard import ShardState

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


# --- the staleness-aware rate is per gradient (Zhang et al. 2016): theta -= (1/K) sum_k eta / max(tau_k, 1) g_k ---
# float64 throughout: the optimizer and the independent references compute the same sums in different orders, so
# they differ by a few ulp of O(1) numbers (~1e-15); 1e-12 leaves room for that and is far below any rule's effect.
ETA, TAUS = 0.3, [0, 2, 5]
TOL = dict(rtol=1e-12, atol=1e-12)


def _contribs(seed: int, taus=TAUS) -> list[Contribution]:
    g = torch.Generator().manual_seed(seed)
    return [Contribution({"w": torch.randn(7, 3, generator=g, dtype=torch.float64),
                          "b": torch.randn(4, generator=g, dtype=torch.float64)}, t) for t in taus]


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    return {"w": torch.randn(7, 3, generator=g, dtype=torch.float64), "b": torch.randn(4, generator=g,
                                                                                    dtype=torch.float64)}


def _weighted_mean(cs: list[Contribution], k: str) -> np.ndarray:
    return sum(c.grads[k].numpy() / max(c.tau, 1) for c in cs) / len(cs)


def test_sgd_applies_each_gradients_own_rate():
    init, cs = _params(), _contribs(1)
    opt = ServerOptimizer(OptimizerSpec("sgd", lr=ETA, staleness_lr=True), {k: v.clone() for k, v in init.items()})
    lr = opt.step(cs)
    for k in init:
        expect = init[k].numpy() - sum((ETA / max(c.tau, 1)) * c.grads[k].numpy() for c in cs) / len(cs)
        np.testing.assert_allclose(opt.params[k].numpy(), expect, **TOL)
    assert lr == pytest.approx((ETA + ETA / 2 + ETA / 5) / 3, rel=1e-15)        # the mean effective rate


def test_momentum_buffer_takes_the_per_gradient_rates():
    """Two steps = torch.optim.SGD(momentum) at eta fed the weighted average (1/K) sum_k g_k / max(tau_k, 1)."""
    init = _params()
    opt = ServerOptimizer(OptimizerSpec("momentum", lr=ETA, momentum=0.9, staleness_lr=True),
                          {k: v.clone() for k, v in init.items()})
    ref = {k: v.clone() for k, v in init.items()}
    torch_opt = torch.optim.SGD(list(ref.values()), lr=ETA, momentum=0.9, foreach=False)
    for seed, taus in [(2, TAUS), (3, [3, 1, 4])]:
        cs = _contribs(seed, taus)
        opt.step(cs)
        for k, p in ref.items():
            p.grad = torch.from_numpy(_weighted_mean(cs, k))
        torch_opt.step()
        for k in init:
            np.testing.assert_allclose(opt.params[k].numpy(), ref[k].numpy(), **TOL)


def test_adam_steps_at_the_mean_of_the_per_gradient_rates():
    init, cs = _params(), _contribs(4)
    opt = ServerOptimizer(OptimizerSpec("adam", lr=ETA, staleness_lr=True), {k: v.clone() for k, v in init.items()})
    rate = float(np.mean([ETA / max(t, 1) for t in TAUS]))
    ref = {k: v.clone() for k, v in init.items()}
    torch_opt = torch.optim.Adam(list(ref.values()), lr=rate, foreach=False)
    for k, p in ref.items():
        p.grad = torch.from_numpy(sum(c.grads[k].numpy() for c in cs) / len(cs))
    torch_opt.step()
    assert opt.step(cs) == pytest.approx(rate, rel=1e-15)
    for k in init:
        np.testing.assert_allclose(opt.params[k].numpy(), ref[k].numpy(), **TOL)


def test_mean_rule_keeps_the_step_lr_over_mean_tau():
    init, cs = _params(), _contribs(5)
    opt = ServerOptimizer(OptimizerSpec("sgd", lr=ETA, staleness_lr=True, staleness_rule="mean"),
                          {k: v.clone() for k, v in init.items()})
    assert opt.step(cs) == ETA / (7 / 3)
    for k in init:
        expect = init[k].numpy() - ETA / (7 / 3) * (sum(c.grads[k].numpy() for c in cs) / 3)
        np.testing.assert_allclose(opt.params[k].numpy(), expect, **TOL)
    # taus [0, 1]: the mean rule raises the lr to 2 eta; the per-gradient rule keeps eta for both
    assert opt.learning_rate([0, 1]) == 2 * ETA
    gradient_rule = ServerOptimizer(OptimizerSpec("sgd", lr=ETA, staleness_lr=True), _params())
    assert gradient_rule.learning_rate([0, 1]) == ETA and gradient_rule.learning_rate([1, 1, 1]) == ETA


@pytest.mark.parametrize("tau", [0, 1, 2, 3, 4, 5])
def test_one_contribution_fast_path_equals_the_general_path(tau):
    """Plain SGD, one contribution: the fast path's lr eta / max(tau, 1) = the general path's gradient weighting
    (here: the same contribution twice, averaged). Bitwise where max(tau, 1) is a power of 2 (dividing by it is exact),
    else within float32 rounding; both fast paths (tensor and numpy gradients) agree bitwise."""
    g = torch.Generator().manual_seed(tau)
    init = {"w": torch.randn(37, 11, generator=g)}
    grads = {"w": torch.randn(37, 11, generator=g)}
    spec = OptimizerSpec("sgd", lr=0.05, staleness_lr=True)
    fast, numpy_fast, general = (ServerOptimizer(spec, {"w": init["w"].clone()}) for _ in range(3))
    assert fast.step([Contribution(grads, tau)]) == 0.05 / max(tau, 1)
    numpy_fast.step([Contribution({"w": grads["w"].numpy()}, tau)])
    general.step([Contribution(grads, tau), Contribution(grads, tau)])
    assert torch.equal(fast.params["w"], numpy_fast.params["w"])
    if max(tau, 1) in (1, 2, 4):
        assert torch.equal(fast.params["w"], general.params["w"])
    else:
        torch.testing.assert_close(fast.params["w"], general.params["w"], rtol=2e-7, atol=2e-7)
    if tau <= 1:
        plain = ServerOptimizer(OptimizerSpec("sgd", lr=0.05), {"w": init["w"].clone()})
        plain.step([Contribution(grads, tau)])
        assert torch.equal(plain.params["w"], fast.params["w"])


def test_dc_asgd_compensates_each_gradient_before_its_weight():
    """g~_k = g_k + lambda g_k^2 (w - w_bak,k), then the step applies (eta / K) sum_k g~_k / max(tau_k, 1)."""
    init = _params()
    backs = [{k: v + 0.1 * (i + 1) for k, v in init.items()} for i in range(len(TAUS))]
    cs = [Contribution(c.grads, c.tau, backs[i]) for i, c in enumerate(_contribs(6))]
    opt = ServerOptimizer(OptimizerSpec("sgd", lr=ETA, staleness_lr=True, dc_lambda=0.7),
                          {k: v.clone() for k, v in init.items()})
    opt.step(cs)
    for k in init:
        w = init[k].numpy()
        comp = [c.grads[k].numpy() + 0.7 * c.grads[k].numpy() ** 2 * (w - c.backup[k].numpy()) for c in cs]
        expect = w - ETA * sum(gk / max(c.tau, 1) for gk, c in zip(comp, cs)) / len(cs)
        np.testing.assert_allclose(opt.params[k].numpy(), expect, **TOL)


def test_staleness_rule_round_trips_and_rejects_unknown_values():
    s = OptimizerSpec("momentum", lr=0.1, staleness_lr=True, staleness_rule="mean")
    assert s.to_string() == "momentum:lr=0.1,staleness_lr=1,staleness_rule=mean"
    assert optimizer_from_string(s.to_string()) == s
    assert OptimizerSpec.from_dict(s.to_dict()) == s
    default = OptimizerSpec("sgd", lr=0.1, staleness_lr=True)
    assert default.staleness_rule == "gradient" and default.to_string() == "sgd:lr=0.1,staleness_lr=1"
    assert optimizer_from_string("sgd:lr=0.1,staleness_rule=gradient") == OptimizerSpec("sgd", lr=0.1)
    for bad in (lambda: OptimizerSpec("sgd", staleness_rule="median"),
                lambda: optimizer_from_string("sgd:lr=0.1,staleness_rule=median")):
        with pytest.raises(ConfigError, match="staleness_rule must be one of gradient, mean, got 'median'"):
            bad()
