"""Partition: a pure, balanced map from parameter keys to shards, splitting tensors bigger than a fair share."""

from __future__ import annotations

import numpy as np
import pytest

from pslab.ps.errors import ConfigError
from pslab.ps.partition import make_partition

SHAPES = {"fc1.weight": (512, 256), "fc1.bias": (512,), "fc2.weight": (10, 512), "fc2.bias": (10,),
          "emb": (1000, 64)}


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4])
def test_every_element_has_exactly_one_owner(num_shards):
    """Each flat element of every tensor is covered by exactly one slice, and keys are unique."""
    p = make_partition(SHAPES, num_shards)
    for name, shape in SHAPES.items():
        cover = np.zeros(int(np.prod(shape)), dtype=int)
        for s in p.slices_of(name):
            cover[s.start:s.stop] += 1
            assert 0 <= s.shard < num_shards
        assert (cover == 1).all(), name
    keys = [s.key for s in p.slices]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize("num_shards", [2, 3, 4])
def test_balanced_by_bytes(num_shards):
    """Heaviest shard holds at most 4/3 of the fair share (LPT bound) because big tensors are split."""
    p = make_partition(SHAPES, num_shards)
    b = p.bytes_per_shard()
    fair = sum(b) / num_shards
    assert max(b) <= fair * 4 / 3 + 1, b
    assert len(p.slices_of("fc1.weight")) > 1   # the largest tensor exceeds a fair share and is split


def test_pure_function_of_names_and_shapes():
    """Insertion order and tensor-vs-shape input do not change the map; every worker computes the same one."""
    a = make_partition(SHAPES, 3)
    b = make_partition(dict(reversed(list(SHAPES.items()))), 3)
    c = make_partition({k: np.zeros(v, np.float32) for k, v in SHAPES.items()}, 3)
    assert a == b == c


def test_bad_input_is_a_clear_error():
    with pytest.raises(ConfigError, match="shards"):
        make_partition(SHAPES, 0)
    with pytest.raises(ConfigError, match="empty"):
        make_partition({}, 2)
