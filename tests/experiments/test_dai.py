"""The K-worker staleness emulator (experiments/sim/dai.py) and its delay laws (experiments/sim/delays.py):
BSP bit for bit at s = 0, the constant-delay recursion exactly, the momentum equivalence of geometric delays
statistically (with negative controls that must fail), the single-stream emulator reproduced at K = 1."""

from __future__ import annotations

import dataclasses
import math
from collections import deque

import numpy as np
import pytest
import torch
from torch.func import functional_call

from pslab.experiments.config import TrainConfig
from pslab.experiments.errors import ConfigError
from pslab.experiments.sim.dai import run_dai
from pslab.experiments.sim.delays import DELAYS, DelayModel
from pslab.experiments.strategies.local import LocalStrategy
from pslab.experiments.strategies.spec import optimizer_spec
from pslab.experiments.studies.momentum import MomentumSpec, check, momentum_trajectory, stale_trajectories, z_bound
from pslab.experiments.workloads import get_params, get_workload
from pslab.experiments.workloads.quadratic import QuadraticWorkload
from pslab.parallelism.engine import ParamSlot


class _WholeModel:
    """The one method of a Replica that LocalStrategy uses: the module's parameters as slots."""

    def __init__(self, module):
        self.module = module

    def slots(self):
        return [ParamSlot(n, p, 0) for n, p in self.module.named_parameters()]


def _final_params(wl, tc, s, steps, delay="uniform"):
    box = {}
    run_dai(wl, tc, s, steps, 2.0, eval_every=10, delay=delay, on_step=lambda t, m: box.__setitem__("p", get_params(m)))
    return box["p"]


@pytest.mark.parametrize("optimizer, lr", [("sgd", 0.1), ("momentum", 0.05)])
@pytest.mark.parametrize("delay, workers", [("uniform", 4), ("geometric", 4), ("uniform", 3)])
def test_k_workers_without_staleness_are_bsp_bitwise(optimizer, lr, delay, workers):
    """K = 4 (and 3), s = 0: each step averages the gradients of batch(0..K-1, t) at the current weights — the
    `local` strategy's large-batch reference (LocalStrategy.step on the gradients autograd summed: one division by
    K, one torch.optim step), bit for bit, parameters and accuracy curve. (K = 3 also pins the order: dividing each
    gradient by 3 before summing differs in the last bit; by 4 is exact either way.)"""
    wl = get_workload("digits-mlp1", workers, 16, seed=1)
    tc = TrainConfig(optimizer=optimizer, lr=lr)
    curve = run_dai(wl, tc, 0, 30, 2.0, eval_every=10, delay=delay).curve
    got = _final_params(wl, tc, 0, 30, delay)
    m = wl.make_model()
    local = LocalStrategy(optimizer_spec(tc), workers)          # the real `local` strategy's update
    replica = _WholeModel(m)
    local.attach(replica)
    ref_curve = []
    for t in range(30):
        for w in range(workers):
            x, y, _ = wl.batch(w, t)
            wl.loss(m, x, y).backward()
        local.step(replica)
        if (t + 1) % 10 == 0:
            ref_curve.append((t + 1, wl.evaluate(m)["test_acc"]))
    ref = get_params(m)
    assert curve == ref_curve
    assert all(np.array_equal(got[k], ref[k]) for k in ref)
    assert not np.array_equal(got["0.weight"], get_params(wl.make_model())["0.weight"])   # it did train


@pytest.mark.parametrize("d", [0, 1, 3, 6])
@pytest.mark.parametrize("workers", [1, 3])
def test_constant_delay_on_a_quadratic_is_the_delay_recursion(d, workers):
    """F(x) = h x^2 / 2, SGD lr eta, delay d on every gradient: x_{t+1} = x_t - eta h x_{t-d} (x_j = x_0, j < 0)."""
    h, eta, steps = 1.5, 0.08, 50
    wl = QuadraticWorkload([h], [2.0], workers=workers)
    xs = [2.0]
    run_dai(wl, TrainConfig(optimizer="sgd", lr=eta), d, steps, math.inf, eval_every=100, delay="constant",
            on_step=lambda t, m: xs.append(float(m.x.detach()[0])))
    ref = [2.0]
    for t in range(steps):
        ref.append(ref[t] - eta * h * ref[max(t - d, 0)])
    np.testing.assert_allclose(xs, ref, rtol=1e-5, atol=1e-6)
    if d >= 3:     # a long enough delay overshoots: x goes negative, which undelayed GD (eta h < 1) never does
        assert min(xs) < 0


def test_geometric_delays_average_to_momentum_and_the_controls_fail():
    """Mitliagkas et al.: the mean of 100 seeded runs with geometric delays (M = 4: mean 3) is momentum SGD with
    mu = 1 - 1/M, lr eta/M (torch SGD(lr=eta, momentum=mu, dampening=mu)) within the Bonferroni bound
    z* = Phi^-1(1 - 1e-3 / 80) = 4.21 at every one of 40 steps; plain SGD (mu = 0) and the momentum of M' = 8 are
    far outside it (the check can fail)."""
    spec = MomentumSpec(m_values=(4,), steps=40, runs=100)
    samples = stale_trajectories(spec, 4)
    good = check(samples, momentum_trajectory(spec.h, spec.lr, 0.75, spec.steps), spec.alpha)
    assert good["bound"] == pytest.approx(z_bound(40, 1e-3)) and 4.2 < good["bound"] < 4.22
    assert good["passed"] and good["max_z"] < good["bound"], good
    plain = check(samples, momentum_trajectory(spec.h, spec.lr, 0.0, spec.steps), spec.alpha)
    wrong = check(samples, momentum_trajectory(spec.h, spec.lr, 1 - 1 / 8, spec.steps), spec.alpha)
    assert not plain["passed"] and plain["max_z"] > 3 * plain["bound"], plain
    assert not wrong["passed"] and wrong["max_z"] > 2 * wrong["bound"], wrong


def test_momentum_equivalence_with_two_noisy_workers():
    """The same law with K = 2 workers (independent geometric delays, averaged) and noisy gradients."""
    spec = MomentumSpec(m_values=(3,), steps=30, runs=80, workers=2, noise=0.3)
    samples = stale_trajectories(spec, 3)
    assert check(samples, momentum_trajectory(spec.h, spec.lr, 2 / 3, spec.steps))["passed"]
    assert not check(samples, momentum_trajectory(spec.h, spec.lr, 0.0, spec.steps))["passed"]


def _single_stream_reference(wl, train, s, max_steps, target, eval_every, seed):
    """The emulator as it was before K workers (one stream, r ~ U{0..s} from default_rng([seed, 0xDA1, s]))."""
    from pslab.experiments.strategies.spec import optimizer_spec
    from pslab.ps.optim import Contribution, build_optimizer
    model = wl.make_model()
    names = [n for n, _ in model.named_parameters()]
    live = [p for _, p in model.named_parameters()]
    opt = build_optimizer(optimizer_spec(train), {n: p.detach() for n, p in zip(names, live)})
    history = deque([[p.detach().clone() for p in live]], maxlen=s + 1)
    rng = np.random.default_rng([seed, 0xDA1, s])
    curve = []
    for step in range(max_steps):
        r = min(int(rng.integers(0, s + 1)), len(history) - 1)
        stale = [h.clone().requires_grad_(True) for h in history[-1 - r]]
        x, y, _ = wl.batch(0, step)
        grads = torch.autograd.grad(wl.loss_from_output(functional_call(model, dict(zip(names, stale)), (x,)), y),
                                    stale)
        opt.step([Contribution(dict(zip(names, grads)), r, dict(zip(names, history[-1 - r])))])
        history.append([p.detach().clone() for p in live])
        if (step + 1) % eval_every == 0:
            curve.append((step + 1, wl.evaluate(model)["test_acc"]))
    return curve


@pytest.mark.parametrize("tc", [TrainConfig(optimizer="momentum", lr=0.05),
                                TrainConfig(optimizer="sgd", lr=0.2, staleness_lr=True, dc_asgd=True)])
def test_one_worker_uniform_is_the_single_stream_emulator(tc):
    wl = get_workload("digits-mlp", 1, 16, seed=2)
    assert run_dai(wl, tc, 6, 60, 2.0, 10, seed=2).curve == _single_stream_reference(wl, tc, 6, 60, 2.0, 10, 2)


@pytest.mark.parametrize("kind", DELAYS)
def test_delay_laws_have_their_stated_mean_and_shape(kind):
    """20,000 draws: the sample mean is within 4 standard errors of DelayModel.mean and the frequencies match the
    pmf; s = 0 draws only 0; the stream is repeatable per seed."""
    dm = DelayModel(kind, 4)
    draw = dm.sampler(7)
    r = np.array([draw() for _ in range(20000)])
    assert abs(r.mean() - dm.mean) < 4 * max(r.std(), 1e-12) / math.sqrt(len(r)) + 1e-12
    for k in range(6):
        assert abs((r == k).mean() - dm.pmf(k)) < 0.015
    assert r.max() <= dm.max_delay
    again = dm.sampler(7)
    assert [again() for _ in range(50)] == r[:50].tolist()
    zero = DelayModel(kind, 0).sampler(7)
    assert {zero() for _ in range(100)} == {0}


def test_geometric_law_is_mitliagkas_and_cut_far_in_the_tail():
    dm = DelayModel("geometric", 3)
    assert dm.q == pytest.approx(0.75) and dm.mean == 3
    assert dm.q ** (dm.max_delay + 1) <= 1e-9 < dm.q ** dm.max_delay
    assert sum(dm.pmf(k) for k in range(dm.max_delay + 1)) == pytest.approx(1.0, abs=1e-8)


def test_workers_draw_independent_delays():
    """K = 3 uniform: the run's mean delay is s/2 (capped at t early on), and the workers' delays differ: a run
    with 3 workers is not 3 copies of one stream (its trajectory differs from the same run with equal delays)."""
    wl = get_workload("digits-mlr", 3, 16, seed=0)
    res = run_dai(wl, TrainConfig(optimizer="sgd", lr=0.1), 8, 200, 2.0, eval_every=50)
    assert res.workers == 3 and abs(res.mean_delay - 4.0) < 0.4
    taus = []
    from pslab.ps import optim
    real = optim.ServerOptimizer.step
    def spy(self, contributions):
        taus.append([c.tau for c in contributions])
        return real(self, contributions)
    optim.ServerOptimizer.step = spy
    try:
        run_dai(wl, TrainConfig(optimizer="sgd", lr=0.1), 8, 30, 2.0, eval_every=50)
    finally:
        optim.ServerOptimizer.step = real
    assert all(len(t) == 3 for t in taus) and sum(len(set(t)) > 1 for t in taus) > 15


def test_staleness_aware_lr_and_dc_asgd_reach_the_k_worker_step():
    """With K = 2 and s > 0 both options change the run; at s = 0 (tau = 0) they change nothing."""
    wl = get_workload("digits-mlr", 2, 16, seed=0)
    plain = TrainConfig(optimizer="sgd", lr=0.2)
    aware = TrainConfig(optimizer="sgd", lr=0.2, staleness_lr=True)
    dc = TrainConfig(optimizer="sgd", lr=0.2, dc_asgd=True, dc_lambda=2.0)
    assert run_dai(wl, plain, 0, 20, 2.0, 5).curve == run_dai(wl, aware, 0, 20, 2.0, 5).curve
    base = run_dai(wl, plain, 6, 40, 2.0, 5).curve
    assert run_dai(wl, aware, 6, 40, 2.0, 5).curve != base
    # K = 2 gradients of different staleness per step: the per-gradient rule is not the old lr / mean tau
    mean_rule = dataclasses.replace(aware, staleness_rule="mean")
    assert optimizer_spec(mean_rule).staleness_rule == "mean" and optimizer_spec(aware).staleness_rule == "gradient"
    assert _final_params(wl, aware, 6, 40)["weight"].tolist() != _final_params(wl, mean_rule, 6, 40)["weight"].tolist()
    with_dc, without = _final_params(wl, dc, 6, 40), _final_params(wl, plain, 6, 40)
    assert not np.array_equal(with_dc["weight"], without["weight"])
    assert np.isfinite(with_dc["weight"]).all()


@pytest.mark.parametrize("kind, s, fragment", [
    ("poisson", 2, "unknown delay distribution"), ("uniform", -1, "s must be a finite number >= 0"),
    ("constant", 2.5, "integer s"), ("geometric", float("inf"), "finite number")])
def test_bad_delays_are_config_errors(kind, s, fragment):
    with pytest.raises(ConfigError, match=fragment):
        DelayModel(kind, s)
    with pytest.raises(ConfigError, match=fragment):
        run_dai(QuadraticWorkload([1.0], [1.0]), TrainConfig(), s, 5, 2.0, delay=kind)


def test_the_emulator_step_lr_is_train_lr_whatever_the_real_run_lr_rule():
    """train.strategy/workers/lr_rule scale the step lr of real runs; the emulator steps at train.lr."""
    wl = get_workload("digits-mlr", 2, 16, seed=0)
    a = run_dai(wl, TrainConfig(optimizer="sgd", lr=0.1), 2, 20, 2.0, 5).curve
    b = run_dai(wl, TrainConfig(optimizer="sgd", lr=0.1, strategy="local", workers=4, lr_rule="linear"), 2, 20, 2.0,
                5).curve
    assert a == b


def test_train_staleness_rule_is_validated():
    from pslab.experiments.config import load_config
    assert load_config(overrides=["train.staleness_rule=mean"]).train.staleness_rule == "mean"
    with pytest.raises(ConfigError, match="train.staleness_rule must be one of gradient, mean"):
        load_config(overrides=["train.staleness_rule=median"])
