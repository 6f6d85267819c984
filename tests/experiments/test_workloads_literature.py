"""The literature-standard workloads: standardised digits (training statistics only), He-normal init, named models
that train to > 90 % test accuracy; the old workloads untouched."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pslab.experiments.cli import main
from pslab.experiments.config import load_config
from pslab.experiments.workloads import WORKLOADS, get_workload
from pslab.experiments.workloads import data as wdata

LITERATURE = {"digits-mlr": 0, "digits-mlp1": 1, "digits-mlp3": 3}


def test_digits_are_sklearns_read_without_importing_it():
    """The digits come from the CSV scikit-learn ships, read directly (its import costs seconds of CPU in every
    process that loads data): the same images and labels, bit for bit, as `load_digits`, and sklearn not imported."""
    import subprocess
    import sys
    code = ("import sys\nfrom pslab.experiments.workloads import data\nd = data.digits()\n"
            "print(len(d.x_train), len(d.x_test), 'sklearn' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["1438", "359", "False"], r.stderr[-2000:]
    from sklearn.datasets import load_digits
    d = load_digits()
    x, y = wdata._digits_raw()
    assert x.dtype == d.data.dtype and np.array_equal(x, d.data) and np.array_equal(y, d.target)
    assert not x.flags.writeable                     # (cached, shared by every caller)


def test_standardised_digits_use_training_statistics_only():
    """Train features: mean 0, std 1 (constant pixels: 0); test features use the TRAIN mean/std (so their mean is
    not exactly 0); changing the test images changes nothing in the training split; same split as `digits`."""
    std, raw = wdata.digits_std(), wdata.digits()
    assert (len(std.x_train), len(std.x_test)) == (1438, 359)
    assert np.array_equal(std.y_train, raw.y_train) and np.array_equal(std.y_test, raw.y_test)
    pixels_train = raw.x_train.astype(np.float64) * 16
    sd = pixels_train.std(0)
    live = sd > 0
    assert (~live).sum() == 3 and np.all(std.x_train[:, ~live] == 0)
    np.testing.assert_allclose(std.x_train[:, live].mean(0), 0, atol=1e-5)
    np.testing.assert_allclose(std.x_train[:, live].std(0), 1, atol=1e-4)
    mu = pixels_train.mean(0)
    expect_test = (raw.x_test.astype(np.float64) * 16 - mu) / np.where(live, sd, 1)
    np.testing.assert_allclose(std.x_test, expect_test, atol=1e-5)
    assert np.abs(std.x_test[:, live].mean(0)).max() > 0.01        # not re-centred on the test set
    a_train, _ = wdata.standardise(pixels_train, raw.x_test * 16)
    b_train, _ = wdata.standardise(pixels_train, raw.x_test * 16 + 100.0)
    assert np.array_equal(a_train, b_train)


@pytest.mark.parametrize("name", list(LITERATURE))
def test_init_is_he_normal(name):
    """Every weight matrix ~ N(0, 2/fan_in): sample std within 8 % of sqrt(2/fan_in), mean ~ 0, and normal-shaped
    (about 68 % of weights within one std; a uniform law of the same std has 58 %); biases 0; seeded."""
    m = get_workload(name, 1, 32, seed=3).make_model()
    weights = [p for n, p in m.named_parameters() if p.dim() == 2]
    assert len(weights) == LITERATURE[name] + 1
    for w in weights:
        target = math.sqrt(2.0 / w.shape[1])
        x = w.detach().numpy().ravel()
        assert abs(x.std() / target - 1) < 0.08 and abs(x.mean()) < 4 * target / math.sqrt(x.size)
        assert abs(np.mean(np.abs(x) < x.std()) - 0.683) < 0.05
    assert all(torch.count_nonzero(p) == 0 for n, p in m.named_parameters() if p.dim() == 1)
    again = get_workload(name, 1, 32, seed=3).make_model()
    other = get_workload(name, 1, 32, seed=4).make_model()
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), again.parameters()))
    assert not torch.equal(weights[0], next(other.parameters()))


@pytest.mark.parametrize("name", list(LITERATURE))
def test_literature_workloads_train_past_90_percent(name):
    """300 SGD steps (lr 0.1, batch 32) reach > 90 % test accuracy."""
    torch.set_num_threads(1)
    wl = get_workload(name, 1, 32, seed=0)
    m = wl.make_model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for t in range(300):
        x, y, _ = wl.batch(0, t)
        opt.zero_grad()
        wl.loss(m, x, y).backward()
        opt.step()
    assert wl.evaluate(m)["test_acc"] > 0.90


def test_names_resolve_everywhere_and_old_workloads_are_unchanged(capsys):
    """The names are in the registry, accepted by a config, listed by `pslab workloads` with their description;
    the old digits workloads keep [0, 1] pixels and their uniform init."""
    for name in LITERATURE:
        assert WORKLOADS[name].dataset == "digits-std" and "He-normal" in WORKLOADS[name].description
        assert load_config(None, [f"workload.name={name}"]).workload.name == name
    assert "3 hidden layers" in WORKLOADS["digits-mlp3"].description
    assert main(["workloads"]) == 0
    out = capsys.readouterr().out
    assert all(n in out for n in WORKLOADS) and "standardised digits" in out
    raw = wdata.digits()
    assert raw.x_train.min() == 0 and raw.x_train.max() == 1
    w = get_workload("digits-mlp", 1, 32, seed=0).make_model()[0].weight.detach()
    assert w.abs().max() <= 1 / math.sqrt(64)                     # still U(+-1/sqrt(fan_in))


def test_fixed_batch_is_the_same_for_every_seed():
    a = get_workload("digits-mlp1", 2, 16, seed=0).fixed_batch(100)
    b = get_workload("digits-mlp3", 4, 8, seed=9).fixed_batch(100)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[0].shape == (100, 64)
