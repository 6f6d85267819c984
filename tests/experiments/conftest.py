"""Shared helpers for the experiments tests: small configs that run in seconds on a 2-core machine."""

from __future__ import annotations

import pytest
import torch

from pslab.experiments.config import load_config

torch.set_num_threads(1)


def small_config(*overrides: str):
    base = ["workload.name=digits-logreg", "train.workers=3", "train.steps=12", "train.lr=0.1",
            "train.eval_every=12", "train.timeout_s=60"]
    return load_config(None, base + list(overrides))


@pytest.fixture
def cfg_factory():
    return small_config
