"""The staleness presets: exact steps to target, censored medians, the bracketing lr search, the remedies preset's
wiring, the new CLI options, and `--quick` end to end."""

from __future__ import annotations

import json
import math

import pytest

from pslab.experiments.cli import build_parser, main
from pslab.experiments.config import TrainConfig
from pslab.experiments.sim.dai import run_dai
from pslab.experiments.studies import staleness_search as search
from pslab.experiments.studies.staleness import REMEDIES, preset_spec, rows, run_row_cell, run_staleness_sweep
from pslab.experiments.studies.staleness_report import claims, greater
from pslab.experiments.studies.staleness_search import centre_out, lower_median, search_lr, steps_to_target
from pslab.experiments.workloads import get_workload


# --- exact steps to target -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, opt, lr, s, target", [
    ("digits-mlr", "sgd", 0.2, 4, 0.93), ("digits-mlp3", "momentum", 0.02, 8, 0.9),
    ("digits-mlp1", "adam", 0.004, 2, 0.95)])
def test_steps_to_target_equals_per_step_evaluation(name, opt, lr, s, target):
    """Checks every 10 steps with scan-back and per-step evaluation near the target give exactly the first step
    that per-step evaluation (run_dai with eval_every=1) finds; margin 1 (scan at every check) too."""
    wl = get_workload(name, 1, 32, 0)
    tc = TrainConfig(optimizer=opt, lr=lr)
    exact = run_dai(wl, tc, s, 400, target, 1, 0).steps_to_target
    assert exact is not None
    r = steps_to_target(wl, tc, s, 400, target, 0, every=10, margin=0.02)
    assert r.steps == exact and r.evals < exact                  # fewer evaluations than one per step
    assert steps_to_target(wl, tc, s, 400, target, 0, every=10, margin=1.0).steps == exact


def test_steps_to_target_finds_a_crossing_between_checks_and_censors_at_the_budget():
    wl = get_workload("digits-mlr", 1, 32, 0)
    tc = TrainConfig(optimizer="sgd", lr=0.2)
    exact = run_dai(wl, tc, 0, 300, 0.95, 1, 0).steps_to_target
    coarse = run_dai(wl, tc, 0, 300, 0.95, 25, 0).steps_to_target
    assert exact % 25 and coarse > exact            # a coarse grid alone overstates T ...
    assert steps_to_target(wl, tc, 0, 300, 0.95, 0, every=25).steps == exact   # ... the scan-back does not
    cut = steps_to_target(wl, tc, 0, exact - 1, 0.95, 0, every=25)
    assert cut.steps is None and cut.budget == exact - 1 and 0.9 < cut.best_acc < 0.95   # censored at the budget
    assert steps_to_target(wl, tc, 0, exact, 0.95, 0, every=25).steps == exact          # the last step is a check


# --- censoring and medians -------------------------------------------------------------------------------------

def test_lower_median_is_censored_exactly_when_more_than_half_are():
    assert lower_median([50, None, 70]) == 70 and lower_median([None, 40, 30]) == 40
    assert lower_median([None, None, 30]) is None and lower_median([None, None, None]) is None
    assert lower_median([None, 40]) == 40                        # one of two censored: not more than half
    assert lower_median([None, None, 40, 50]) == 50 and lower_median([None, None, None, 50]) is None
    assert lower_median([7]) == 7 and lower_median([]) is None


def test_comparisons_with_censored_lower_bounds():
    assert greater((3.0, False), (2.0, False)) is True and greater((2.0, False), (3.0, False)) is False
    assert greater((5.0, True), (2.0, False)) is True and greater((2.0, True), (3.0, False)) is None
    assert greater((2.0, False), (5.0, True)) is False and greater((5.0, True), (5.0, True)) is None


# --- the lr search ---------------------------------------------------------------------------------------------

def _fake(optimum: float, base: int = 20, slope: int = 15, never: set | None = None, calls: list | None = None):
    """steps_to_target replaced by T(lr, seed) = base + slope |log2(lr / optimum)| + seed, censored at the
    budget; (lr, seed) pairs in `never` never reach the target."""
    def fake(wl, tc, s, budget, target, seed, **kw):
        if calls is not None:
            calls.append((tc.lr, seed, budget))
        t = base + round(slope * abs(math.log2(tc.lr / optimum))) + seed
        if never and (round(tc.lr, 6), seed) in never:
            t = 10 ** 9
        return search.RunResult(t if t <= budget else None, budget, 0.95 if t <= budget else 0.5, 1)
    return fake


def test_an_edge_winner_widens_the_grid_until_it_is_bracketed(monkeypatch):
    monkeypatch.setattr(search, "steps_to_target", _fake(optimum=0.4))
    kw = dict(target=0.9, max_steps=1000)
    r = search_lr(lambda seed: None, TrainConfig(), 0, (0.05, 0.1, 0.2), (0, 1, 2), **kw)
    assert r["lr"] == 0.4 and r["lr_edge"] is None and r["widened"] == 2 and r["lr_grid"] == [0.05, 0.1, 0.2, 0.4, 0.8]
    assert r["steps"] == 21 and r["seed_steps"] == [20, 21, 22] and r["censored"] == 0
    low = search_lr(lambda seed: None, TrainConfig(), 0, (0.8, 1.6, 3.2), (0,), **kw)        # the other side
    assert low["lr"] == 0.4 and low["lr_grid"][0] == 0.2 and low["lr_edge"] is None
    capped = search_lr(lambda seed: None, TrainConfig(), 0, (0.05, 0.1), (0, 1, 2), widen=2, **kw)
    assert capped["lr"] == 0.4 and capped["lr_edge"] == "high" and capped["widened"] == 2   # reported, not hidden
    one = search_lr(lambda seed: None, TrainConfig(), 0, (0.4,), (0,), widen=0, **kw)
    assert one["lr_edge"] == "both"


def test_ties_go_to_the_centre_and_the_grid_is_tried_centre_out(monkeypatch):
    assert centre_out((0.1, 0.2, 0.4, 0.8, 1.6)) == [0.4, 0.2, 0.8, 0.1, 1.6]
    monkeypatch.setattr(search, "steps_to_target", lambda wl, tc, s, budget, *a, **k:
                        search.RunResult(30 if 30 <= budget else None, budget, 0.95, 1))   # flat in lr
    r = search_lr(lambda seed: None, TrainConfig(), 0, (0.1, 0.2, 0.4), (0, 1, 2), target=0.9, max_steps=100)
    assert r["lr"] == 0.2 and r["lr_edge"] is None and r["widened"] == 0


def test_pruned_losers_and_the_winners_censored_seed_rerun_to_max_steps(monkeypatch):
    """Later lrs run with the best median as their budget and stop once more than half their seeds are censored;
    the winner's seed that was censored below max_steps is rerun to max_steps, so its numbers are exact."""
    calls: list = []
    monkeypatch.setattr(search, "steps_to_target", _fake(optimum=0.2, never={(0.2, 2)}, calls=calls))
    r = search_lr(lambda seed: None, TrainConfig(), 0, (0.1, 0.2, 0.4), (0, 1, 2), target=0.9, max_steps=500)
    assert r["lr"] == 0.2 and r["seed_steps"] == [20, 21, None] and r["censored"] == 1 and r["steps"] == 21
    budgets = {(lr, seed): b for lr, seed, b in calls}
    assert budgets[(0.1, 0)] == 21 and (0.1, 2) not in budgets           # 0.1 censored on 2 of 3 seeds at 21: stop
    assert [c for c in calls if c[:2] == (0.2, 2)][-1][2] == 500          # the winner's censored seed, rerun
    tried = {t["lr"]: t for t in r["tried"]}
    assert tried[0.1]["budget"] == 21 and tried[0.1]["censored"] == 2


def test_all_censored_cell_reports_more_than_max_steps(monkeypatch):
    monkeypatch.setattr(search, "steps_to_target", lambda wl, tc, s, budget, *a, **k:
                        search.RunResult(None, budget, 0.8 - abs(math.log2(tc.lr / 0.1)) / 100, 1))
    r = search_lr(lambda seed: None, TrainConfig(), 16, (0.05, 0.1, 0.2), (0, 1, 2), target=0.9, max_steps=50)
    assert r["steps"] is None and r["median_censored"] and r["censored"] == 3 and r["lr"] == 0.1


# --- presets ---------------------------------------------------------------------------------------------------

def test_default_preset_is_the_literature_study():
    spec = preset_spec("staleness")
    assert spec.models == {"mlr": "digits-mlr", "mlp1": "digits-mlp1", "mlp3": "digits-mlp3"}
    assert spec.seeds == tuple(range(25)) and spec.target_acc == 0.95 and spec.max_steps == 1000
    assert preset_spec("staleness-remedies").seeds == tuple(range(9))
    assert preset_spec("staleness", quick=True).seeds == (0, 1, 2)
    assert set(spec.optimizers) == {"sgd", "momentum", "adam"} and spec.staleness == (0, 1, 2, 4, 8, 16)
    ks = [(r.label, r.optimizer, r.workers) for r in rows(spec) if r.workers != 1]
    assert ks == [("mlp3", "sgd", 4), ("mlp3", "sgd", 8)] and len(rows(spec)) == 9 + 2


def test_remedies_preset_wires_each_variant_into_the_optimizer(monkeypatch):
    spec = preset_spec("staleness-remedies")
    assert list(spec.variants) == ["plain", "staleness-lr", "dc-asgd", "dc-asgd-a"] and spec.variants == REMEDIES
    assert list(spec.models) == ["mlp3"] and {r.variant for r in rows(spec)} == set(REMEDIES)
    seen = {}
    monkeypatch.setattr("pslab.experiments.studies.staleness.search_lr",
                        lambda mk, train, s, grid, seeds, **kw: seen.setdefault("train", train) and {})
    for variant, want in [("staleness-lr", (True, False, False)), ("dc-asgd-a", (False, True, True)),
                          ("plain", (False, False, False))]:
        seen.clear()
        row = next(r for r in rows(spec) if r.variant == variant and r.optimizer == "momentum")
        run_row_cell(spec, row, 8)
        t = seen["train"]
        assert (t.optimizer, (t.staleness_lr, t.dc_asgd, t.dc_adaptive)) == ("momentum", want)
    assert REMEDIES["dc-asgd"] == {"dc_asgd": True, "dc_lambda": 0.04}


def test_remedies_compare_to_plain_in_the_same_run_and_equal_it_at_s0():
    """At s = 0 (tau = 0) every remedy is the plain optimizer bit for bit: same cell; at s > 0 vs_plain is set."""
    spec = preset_spec("staleness-remedies", quick=True, seeds=(0,), max_steps=150, staleness=(0, 8))
    cells = run_staleness_sweep(spec)
    at0 = [c for c in cells if c["staleness"] == 0]
    assert len({(c["lr"], tuple(c["seed_steps"])) for c in at0}) == 1 and len(at0) == 4
    stale = [c for c in cells if c["staleness"] == 8 and c["variant"] != "plain"]
    assert all(c["vs_plain"] is not None or c["steps"] is None for c in stale)
    found = [c["claim"] for c in claims(cells, spec)]
    assert "remedy staleness-lr on mlp3 sgd: fewer steps than plain sgd" in found


def test_the_pool_gives_the_numbers_of_one_process():
    spec = preset_spec("staleness", quick=True, models={"mlr": "digits-mlr"}, optimizers={"sgd": (0.2, 0.4)},
                       staleness=(0, 4), seeds=(0, 1), worker_counts=())
    one, two = run_staleness_sweep(spec, jobs=1), run_staleness_sweep(spec, jobs=2)
    strip = lambda cs: [{k: v for k, v in c.items() if k != "wall_s"} for c in cs]  # noqa: E731
    assert strip(one) == strip(two)


# --- the command -----------------------------------------------------------------------------------------------

def test_quick_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["sweep", "--preset", "staleness", "--quick", "-q", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "chosen learning rate" in text and "normalised cost" in text and "4. more workers amplify" in text
    data = json.loads((out / "staleness_sweep.json").read_text())
    # wall_s is recorded, not bounded: tests never assert speed
    assert data["spec"]["seeds"] == [0, 1, 2] and len(data["claims"]) == 4 and data["wall_s"] > 0
    assert all(c["lr"] is not None and len(c["seed_steps"]) == 3 for c in data["cells"])
    assert {c["workers"] for c in data["cells"]} == {1, 4}
    csv = (out / "staleness_sweep.csv").read_text().splitlines()
    assert csv[0].startswith("depth,model,optimizer,variant,workers,staleness,lr,steps_to_target")
    assert len(csv) == 1 + len(data["cells"])
    assert (out / "staleness_curve.png").stat().st_size > 10000
    assert "| mlp3 sgd K=4 |" in (out / "report.md").read_text()


def test_help_documents_the_new_options(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["sweep", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for fragment in ("staleness-remedies", "--target ACC", "--max-steps N", "--worker-counts K,...", "--jobs N",
                     "Zhang et al. 2016", "censored"):
        assert fragment in text, fragment


@pytest.mark.parametrize("argv, fragment", [
    (["--preset", "staleness", "--target", "1.5"], "--target must be a test accuracy in (0, 1]"),
    (["--preset", "staleness", "--target", "0"], "--target must be a test accuracy in (0, 1]"),
    (["--preset", "staleness", "--max-steps", "0"], "--max-steps must be >= 1"),
    (["--preset", "staleness", "--jobs", "0"], "--jobs must be >= 1"),
    (["--preset", "staleness", "--worker-counts", "0,4"], "--worker-counts must be integers >= 1"),
    (["--preset", "staleness", "--worker-counts", "four"], "--worker-counts must be comma-separated integers"),
    (["--preset", "staleness-remedies", "--worker-counts", "4"], "--worker-counts applies to --preset staleness"),
    (["--preset", "momentum", "--target", "0.9"], "--target applies to --preset staleness|staleness-remedies"),
    (["--preset", "coherence", "--jobs", "2"], "--jobs applies to --preset staleness|staleness-remedies"),
    (["--preset", "staleness", "--seeds", ","], "--seeds needs at least one integer"),
    (["--knob", "train.lr", "--values", "0.1", "--max-steps", "5"], "--max-steps applies to a preset"),
])
def test_bad_staleness_options_are_one_line(capsys, tmp_path, argv, fragment):
    assert main(["sweep", *argv, "-q", "--out", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pslab: error:") and fragment in err[0], err


def test_tutorial_section_4_explains_every_new_option():
    from pathlib import Path
    text = (Path(__file__).resolve().parents[2] / "docs" / "tutorial.md").read_text()
    sec = text[text.index("## 4. "):text.index("## 5. ")]
    for fragment in ("--target ACC", "--max-steps N", "--worker-counts", "--jobs N", "--seeds", "--quick",
                     "--preset staleness-remedies", "censored", "bootstrap"):
        assert fragment in sec, fragment
