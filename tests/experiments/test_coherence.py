"""Gradient coherence (experiments/sim/coherence.py) recorded by the staleness emulator, and its study."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pslab.experiments.config import TrainConfig
from pslab.experiments.errors import ConfigError
from pslab.experiments.sim.coherence import CoherenceRecorder, cosine, dai_mu, quadratic_cosine
from pslab.experiments.sim.dai import run_dai
from pslab.experiments.workloads import get_workload
from pslab.experiments.workloads.quadratic import QuadraticWorkload


def test_identical_gradients_have_coherence_one():
    g = [torch.randn(5, 3, generator=torch.Generator().manual_seed(0)), torch.arange(4.0)]
    assert cosine(g, [t.clone() for t in g]) == pytest.approx(1.0, abs=1e-12)
    assert dai_mu(g, g) == pytest.approx(1.0, abs=1e-12)
    assert cosine(g, [-t for t in g]) == pytest.approx(-1.0, abs=1e-12)
    assert dai_mu(torch.ones(3), 2 * torch.ones(3)) == pytest.approx(2.0)   # mu sees length, cos does not
    assert math.isnan(cosine(torch.zeros(3), torch.ones(3)))


def test_one_dimensional_descent_is_perfectly_coherent():
    """On 1/2 h x^2 with eta h < 1 the gradient never changes sign: cos = 1 at every lag."""
    res = run_dai(QuadraticWorkload([2.0], [1.0]), TrainConfig(optimizer="sgd", lr=0.1), 0, 20, math.inf,
                  eval_every=100, coherence_lags=(1, 4), coherence_every=5)
    assert [k for k, _ in res.coherence] == [5, 10, 15, 20]
    assert all(c == pytest.approx(1.0, abs=1e-9) for _, row in res.coherence for c in row.values())


def test_coherence_on_a_quadratic_has_the_analytic_value():
    """F = 1/2 (x_1^2 + 4 x_2^2), GD at eta = 0.1: the gradients turn from the stiff to the flat direction and
    cos_k(m) follows the closed form sum c_i a_i^(2k-m) / sqrt(...), a_i = 1 - eta h_i."""
    h, x0, lr = [1.0, 4.0], [1.0, 1.0], 0.1
    res = run_dai(QuadraticWorkload(h, x0), TrainConfig(optimizer="sgd", lr=lr), 0, 20, math.inf, eval_every=100,
                  coherence_lags=(1, 2, 4, 8), coherence_every=4)
    assert [k for k, _ in res.coherence] == [4, 8, 12, 16, 20]
    for k, row in res.coherence:
        assert set(row) == {m for m in (1, 2, 4, 8) if m <= k}
        for m, c in row.items():
            assert c == pytest.approx(quadratic_cosine(h, x0, lr, k, m), abs=2e-6)
    lowest = min(c for _, row in res.coherence for c in row.values())
    assert lowest < 0.9                                    # the test sees a real turn, not cos = 1 everywhere
    assert quadratic_cosine(h, x0, lr, 7, 0) == pytest.approx(1.0)


def test_recording_coherence_leaves_the_run_unchanged():
    wl = get_workload("digits-mlp1", 2, 16, seed=0)
    tc = TrainConfig(optimizer="sgd", lr=0.1)
    plain = run_dai(wl, tc, 2, 30, 2.0, 10)
    with_coh = run_dai(wl, tc, 2, 30, 2.0, 10, coherence_lags=(1, 8), coherence_every=10, coherence_batch=64)
    assert plain.curve == with_coh.curve and not plain.coherence
    assert [k for k, _ in with_coh.coherence] == [10, 20, 30]
    assert all(-1 <= c <= 1 for _, row in with_coh.coherence for c in row.values())


@pytest.mark.parametrize("kwargs, fragment", [({"lags": ()}, "lags must be integers >= 1"),
                                              ({"lags": (0, 2)}, "lags must be integers >= 1"),
                                              ({"lags": (1,), "every": 0}, "every >= 1")])
def test_bad_coherence_options_are_config_errors(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment):
        CoherenceRecorder(**kwargs)


def test_coherence_study_shows_the_depth_effect(tmp_path):
    """The study on the literature models: the 3-hidden-layer MLP's gradients decorrelate faster than MLR's
    (Dai et al.'s mechanism), and it writes its JSON and PNG."""
    from pslab.experiments.studies.coherence import CoherenceSpec, note, plot, run_coherence_study, save
    spec = CoherenceSpec(models={"mlr": "digits-mlr", "mlp3": "digits-mlp3"}, lags=(1, 4), steps=60, every=10)
    res = run_coherence_study(spec)
    assert res["mlp3"]["mean"][4] < res["mlr"]["mean"][4] and res["mlr"]["mean"][1] > 0.95
    save(res, spec, tmp_path)
    assert plot(res, tmp_path).stat().st_size > 10000
    assert "mlp3 [digits-mlp3]: m=1:" in note(res, spec)
    assert np.isfinite(res["mlp3"]["mean"][1])
