"""A fair comparison: the learning-rate rule per strategy, what the summary states about it, Ho et al.'s SSP versus
the aggregate variant, the seed-noise band and the bracketing lr search."""

from __future__ import annotations

import math
import tempfile

import numpy as np
import pytest

from pslab.experiments.config import TrainConfig
from pslab.experiments.errors import ConfigError
from pslab.experiments.results.records import time_to_accuracy
from pslab.experiments.results.rundir import read_jsonl
from pslab.experiments.runner import execute
from pslab.experiments.strategies.spec import lr_fields, parse_strategy, step_lr
from pslab.experiments.studies.compare import default_config
from pslab.experiments.studies.fairness import GRID, bracket_lr, in_band

from .conftest import small_config


@pytest.mark.parametrize("strategy, g", [("local", 4), ("allreduce", 4), ("ps-bsp", 4), ("ps-ssp-agg:2", 4),
                                         ("ps-bsp-backup:1", 3), ("ps-asp", 1), ("ps-ssp:2", 1)])
def test_lr_rule_scales_the_step_by_the_gradients_it_averages(strategy, g):
    """linear: lr_step = G lr; sqrt: sqrt(G) lr; none: lr -- with G the gradients one step averages."""
    assert parse_strategy(strategy).gradients_per_step(4) == g
    for rule, factor in (("linear", g), ("sqrt", math.sqrt(g)), ("none", 1.0)):
        t = TrainConfig(strategy=strategy, workers=4, lr=0.05, lr_rule=rule)
        assert step_lr(t) == pytest.approx(0.05 * factor)
        f = lr_fields(t, applied=40, batch_size=8)
        assert f["lr_per_gradient"] == pytest.approx(0.05 * factor / g)
        assert f["optimizer_steps"] == 40 // g and f["samples"] == 320


def test_bad_lr_rule_is_one_line():
    with pytest.raises(ConfigError, match="train.lr_rule must be one of linear, sqrt, none"):
        small_config("train.lr_rule=cubic").validate()


def test_summary_states_lr_steps_and_samples(tmp_path):
    """A local run with K = 3 virtual workers: 36 gradients, 12 optimizer steps at 3 x lr, 36 x batch samples."""
    rd = execute(small_config("train.strategy=local"), tmp_path, quiet=True)
    s = rd.load()["summary"]
    assert (s["lr_rule"], s["gradients_per_step"], s["optimizer_steps"]) == ("linear", 3, 12)
    assert s["lr_step"] == pytest.approx(0.3) and s["lr_per_gradient"] == pytest.approx(0.1)
    assert s["samples"] == 36 * 32 and s["train_examples"] > 1000


def test_real_ssp0_equals_bsp_under_the_linear_rule(tmp_path):
    """Real processes: ps-ssp:0 (Ho et al., one step per gradient at lr) and ps-bsp (one averaged step per clock at
    K lr) take the same SGD trajectory, so every (worker, step) loss agrees to float rounding; ps-asp does not."""
    losses = {}
    for s in ("ps-bsp", "ps-ssp:0", "ps-asp"):
        rd = execute(small_config(f"train.strategy={s}", "train.base_step_s=0.002"), tmp_path, label=s, quiet=True)
        losses[s] = {(u["worker"], u["step"]): u["loss"] for u in read_jsonl(rd.metrics_path)}
    assert losses["ps-ssp:0"].keys() == losses["ps-bsp"].keys()
    assert max(abs(losses["ps-ssp:0"][k] - losses["ps-bsp"][k]) for k in losses["ps-bsp"]) < 1e-5
    assert max(abs(losses["ps-asp"][k] - losses["ps-bsp"][k]) for k in losses["ps-bsp"]) > 1e-4


def _time_to(strategy: str, target: float, seeds: int, *extra: str) -> float:
    """Time at which the seed-mean test-accuracy curve (simulated) first reaches `target` (inf if never)."""
    grid = np.linspace(0, 4, 401)
    curves = []
    for seed in range(seeds):
        cfg = default_config(None, [f"train.strategy={strategy}", "train.eval_every=4", "train.steps=120",
                                    f"workload.seed={seed}", *extra])
        with tempfile.TemporaryDirectory() as d:
            ev = read_jsonl(execute(cfg, d, simulate=True, quiet=True).eval_path)
        curves.append(np.interp(grid, [e["time_s"] for e in ev], [e["test_acc"] for e in ev]))
    hit = time_to_accuracy([{"time_s": t, "test_acc": a, "updates": 0} for t, a in zip(grid, np.mean(curves, 0))],
                           target)
    return hit[0] if hit else math.inf


def test_ho_ssp_time_to_target_does_not_grow_with_s_under_transient_stragglers():
    """Ho et al.'s setting (each step 4x slower with probability 0.1, simulated, mean of 4 seeds): time to 90 % is
    non-increasing in s for s in {0, 1, 4}."""
    t = [_time_to(f"ps-ssp:{s}", 0.9, 4, "stragglers.transient_prob=0.1", "stragglers.transient_factor=4")
         for s in (0, 1, 4)]
    assert t[0] >= t[1] >= t[2] and t[2] < math.inf, t


def test_aggregate_ssp_is_the_slow_one_under_a_persistent_straggler():
    """With a persistent 4x straggler the aggregate variant only advances when the straggler completes a clock,
    on ever staler gradients: ps-ssp-agg:1 reaches 85 % later than Ho's ps-ssp:1 (about 2x here)."""
    strag = 'stragglers.factors={"3" = 4.0}'
    assert _time_to("ps-ssp-agg:1", 0.85, 2, strag) > 1.3 * _time_to("ps-ssp:1", 0.85, 2, strag)


def test_bracket_lr_widens_until_the_optimum_is_inside():
    """A score minimised at lr = 3.2 with lr0 = 0.1 (grid 0.025..0.4): the search widens upward to bracket it;
    diverged (None) values never win; a score already interior needs no widening."""
    best, tried = bracket_lr(0.1, lambda lr: (math.log(lr) - math.log(3.2)) ** 2)
    assert best == pytest.approx(0.4 * 2 ** 3) and len(tried) == len(GRID) + 3          # MAX_WIDEN widenings
    best, tried = bracket_lr(0.1, lambda lr: None if lr > 0.15 else (lr - 0.05) ** 2)
    assert best == pytest.approx(0.05) and all(v is None for lr, v in tried if lr > 0.15)
    best, tried = bracket_lr(0.1, lambda lr: (lr - 0.1) ** 2)
    assert best == pytest.approx(0.1) and len(tried) == len(GRID)


def test_in_band_is_mean_plus_minus_two_sd():
    assert in_band(1.0, (1.1, 0.05)) and not in_band(1.0, (1.2, 0.05)) and in_band(None, (1, 1)) is None


def test_compare_tune_lr_reports_each_strategys_choice(tmp_path, capsys):
    """`pslab compare --simulate --tune-lr`: each strategy's lr is chosen from the tried grid, the runs use it, and
    the report lists it with every lr tried."""
    from pslab.experiments.cli import main
    out = tmp_path / "cmp"
    assert main(["compare", "--simulate", "-q", "--tune-lr", "--no-straggler", "--noise-seeds", "0", "--out", str(out),
                 "--strategies", "ps-bsp,ps-asp", "--set", "workload.name=digits-logreg", "--set", "train.steps=8",
                 "--set", "train.workers=2"]) == 0
    text = (out / "report.md").read_text()
    assert "## Learning rates (tuned)" in text and "## Seed noise" not in text
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ps-")}
    for s in ("ps-bsp", "ps-asp"):
        chosen = float(rows[s].split(" | ")[1])
        tried = [float(c.split(" → ")[0]) for c in rows[s].split(" | ")[2].rstrip(" |").split(", ")]
        assert chosen in tried and len(tried) >= len(GRID)
        run = next(line for line in text.splitlines() if line.startswith(f"| {s} (simulated) |"))
        assert f"| {chosen:.4g} (" in run                  # the comparison run used the chosen lr per gradient


def test_timing_only_compare_has_no_band_and_refuses_tuning(tmp_path, capsys):
    """A timing-only compare computes no loss: no seed band, '—' for time to target, and --tune-lr is one line."""
    from pslab.experiments.cli import main
    base = ["compare", "--timing-only", "-q", "--no-straggler", "--strategies", "ps-asp", "--set", "train.steps=6",
            "--set", "train.workers=2"]
    assert main(base + ["--out", str(tmp_path / "a")]) == 0
    text = (tmp_path / "a" / "report.md").read_text()
    assert "## Seed noise" not in text and "not reached" not in text
    capsys.readouterr()
    assert main(base + ["--tune-lr", "--out", str(tmp_path / "b")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tune-lr compares training losses" in err[0]
