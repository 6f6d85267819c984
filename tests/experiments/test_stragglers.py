"""The straggler/delay model: deterministic per (seed, worker, step), and its distributions are what they claim."""

from __future__ import annotations

import numpy as np

from pslab.experiments.stragglers import StragglerConfig, StragglerModel


def test_factor_and_determinism():
    """A per-worker factor multiplies only that worker's time; the same (seed, w, t) gives the same time."""
    m = StragglerModel(StragglerConfig(factors={1: 4.0}), seed=0)
    assert m.step_time(0, 3, 0.01) == 0.01 and m.step_time(1, 3, 0.01) == 0.04
    noisy = StragglerConfig(transient_prob=0.3, transient_factor=5, delay="lognormal", delay_mean_s=0.01)
    a, b = StragglerModel(noisy, 5), StragglerModel(noisy, 5)
    assert [a.step_time(2, t, 0.01) for t in range(50)] == [b.step_time(2, t, 0.01) for t in range(50)]
    assert [a.step_time(2, t, 0.01) for t in range(50)] != [StragglerModel(noisy, 6).step_time(2, t, 0.01)
                                                          for t in range(50)]


def test_transient_probability_and_exponential_mean():
    """Transient slowdowns occur with the configured probability; exponential delays have the configured mean."""
    m = StragglerModel(StragglerConfig(transient_prob=0.2, transient_factor=3.0), seed=1)
    slow = np.mean([m.step_time(0, t, 1.0) > 1.5 for t in range(5000)])
    assert abs(slow - 0.2) < 0.03
    e = StragglerModel(StragglerConfig(delay="exponential", delay_mean_s=0.5), seed=2)
    extra = np.mean([e.step_time(0, t, 0.0) for t in range(5000)])
    assert abs(extra - 0.5) < 0.05
