"""Configs: TOML + --set overrides, and bad values rejected with a message naming the key."""

from __future__ import annotations

import tomllib

import pytest

from pslab.experiments.config import load_config, to_toml
from pslab.experiments.errors import ConfigError
from pslab.experiments.strategies.spec import parse_strategy


def test_toml_file_and_overrides(tmp_path):
    """A TOML file sets values, --set overrides them, and the resolved config round-trips through TOML."""
    p = tmp_path / "c.toml"
    p.write_text('[train]\nstrategy = "ps-bsp"\nworkers = 5\n[stragglers]\nfactors = {"2" = 3.0}\n')
    cfg = load_config(p, ["train.strategy=ps-ssp:4", "train.lr=0.05"])
    assert cfg.strategy.kind == "ps-ssp" and cfg.strategy.staleness == 4
    assert cfg.train.workers == 5 and cfg.train.lr == 0.05 and cfg.stragglers.factors == {2: 3.0}
    again = load_config(None, [], base=None)
    assert again.train.workers != 5  # defaults are not shared between loads
    back = tomllib.loads(to_toml(cfg.to_dict()))
    assert back["train"]["strategy"] == "ps-ssp:4" and back["stragglers"]["factors"] == {"2": 3.0}


@pytest.mark.parametrize("override, fragment", [
    ("train.strategy=ps-foo", "unknown strategy"),
    ("train.strategy=ps-ssp:-1", "must be >= 0"),
    ("train.strategy=ps-ssp", "needs a staleness bound"),
    ("train.strategy=ps-bsp-backup:0", ">= 1"),
    ("train.workers=0", "train.workers"),
    ("train.lr=fast", "train.lr must be a number"),
    ("train.optimizer=lbfgs", "train.optimizer"),
    ("train.nope=1", "unknown key train.nope"),
    ("nosection.x=1", "unknown section"),
    ("workload.name=imagenet", "unknown workload"),
    ("stragglers.factors={\"9\"=2.0}", "out of range"),
    ("stragglers.delay=gamma", "stragglers.delay"),
    ("justtext", "section.key=value"),
    ("train.engine=data", "replaced by the [parallel] section"),
])
def test_bad_values_raise_config_error_naming_the_key(override, fragment):
    """Each invalid value gives a ConfigError whose message says what is wrong."""
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace("[", r"\[")):
        load_config(None, [override])


def test_strategy_labels_round_trip():
    """Every strategy form parses and prints back to itself."""
    for s in ("local", "allreduce", "ps-bsp", "ps-asp", "ps-ssp:0", "ps-ssp:16", "ps-bsp-backup:2"):
        assert parse_strategy(s).label == s


def test_missing_config_file_is_a_config_error(tmp_path):
    """A path that does not exist is reported as such."""
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")
