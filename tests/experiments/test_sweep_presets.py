"""`pslab sweep --preset momentum|coherence` and the emulator options of the presets (--workers, --delay,
--models, --lags, --runs): reports written, options reaching the studies, bad values one line."""

from __future__ import annotations

import json

import pytest

from pslab.experiments.cli import build_parser, main
from pslab.experiments.studies.staleness import SweepSpec, run_staleness_sweep


def test_sweep_help_documents_every_preset_option(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["sweep", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for fragment in ("{staleness,staleness-remedies,momentum,coherence,ssp-straggler}", "--workers K", "--tune-lr",
                     "{uniform,constant,geometric,exponential}", "--models [LABEL=]WORKLOAD", "--lags M", "--runs N",
                     "mu = 1 - 1/M"):
        assert fragment in text, fragment


def test_momentum_preset_writes_report_with_z_scores(tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["sweep", "--preset", "momentum", "--quick", "--runs", "12", "--workers", "2", "-q",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "M = 2: mean vs momentum mu = 0.500" in text and "fails, as it must" in text
    data = json.loads((out / "momentum_study.json").read_text())
    assert data["spec"]["runs"] == 12 and data["spec"]["workers"] == 2 and [r["M"] for r in data["results"]] == [2, 4]
    assert all(r["check"]["passed"] and not r["control_plain"]["passed"] for r in data["results"])
    assert (out / "momentum.png").stat().st_size > 10000 and "max|z|" in (out / "report.md").read_text()


def test_coherence_preset_takes_models_and_lags(tmp_path, capsys):
    out = tmp_path / "c"
    assert main(["sweep", "--preset", "coherence", "--quick", "--models", "flat=digits-mlr", "--lags", "1,3",
                 "--workers", "2", "-q", "--out", str(out)]) == 0
    data = json.loads((out / "coherence.json").read_text())
    assert data["spec"]["workers"] == 2 and data["spec"]["lags"] == [1, 3] and list(data["models"]) == ["flat"]
    assert set(data["models"]["flat"]["mean"]) == {"1", "3"}
    assert (out / "coherence.png").exists() and "flat [digits-mlr]: m=1:" in capsys.readouterr().out


def test_staleness_preset_passes_workers_delay_and_models(tmp_path, capsys):
    out = tmp_path / "s"
    assert main(["sweep", "--preset", "staleness", "--quick", "--workers", "2", "--delay", "geometric",
                 "--models", "mlr=digits-mlr", "-q", "--out", str(out)]) == 0
    data = json.loads((out / "staleness_sweep.json").read_text())
    assert data["spec"]["workers"] == 2 and data["spec"]["delay"] == "geometric"
    assert data["spec"]["models"] == {"mlr": "digits-mlr"} and {c["model"] for c in data["cells"]} == {"digits-mlr"}
    assert "2 emulated worker(s) per step, geometric delays" in (out / "report.md").read_text()


def test_staleness_spec_workers_and_delay_change_the_cells():
    """The same cell with K = 1 uniform (today's default) and with K = 3 constant delays differs; defaults are
    unchanged (K = 1, uniform)."""
    assert (SweepSpec().workers, SweepSpec().delay) == (1, "uniform")
    kw = dict(models={"m": "digits-mlr"}, optimizers={"sgd": (0.2,)}, staleness=(8,), target_acc=0.9,
              max_steps=200, eval_every=1)
    a = run_staleness_sweep(SweepSpec(**kw))[0]
    b = run_staleness_sweep(SweepSpec(workers=3, delay="constant", **kw))[0]
    assert a["steps"] is not None and b["steps"] is not None and a["steps"] != b["steps"]


@pytest.mark.parametrize("argv, fragment", [
    (["--preset", "staleness", "--workers", "0"], "--workers must be >= 1"),
    (["--preset", "momentum", "--runs", "1"], "--runs must be >= 2"),
    (["--preset", "staleness", "--runs", "5"], "--runs applies to --preset momentum only"),
    (["--preset", "staleness", "--lags", "1,2"], "--lags applies to --preset coherence only"),
    (["--preset", "coherence", "--lags", "0,2"], "--lags must be integers >= 1"),
    (["--preset", "coherence", "--lags", "a"], "--lags must be comma-separated integers"),
    (["--preset", "coherence", "--models", "digits-nope"], "unknown workload 'digits-nope'"),
    (["--preset", "coherence", "--models", "a=digits-mlr,a=digits-mlp1"], "repeated label"),
    (["--preset", "coherence", "--delay", "geometric"], "drop --delay"),
    (["--preset", "coherence", "--seeds", "0,1"], "runs one seed"),
    (["--preset", "momentum", "--delay", "uniform"], "needs geometric delays"),
    (["--preset", "momentum", "--models", "digits-mlr"], "runs on its own quadratic"),
    (["--preset", "momentum", "--seeds", "1"], "use --runs N"),
    (["--knob", "train.lr", "--values", "0.1", "--workers", "4"], "--workers applies to a preset"),
    (["--knob", "train.lr", "--values", "0.1", "--delay", "constant", "--lags", "2"], "--delay --lags apply to"),
])
def test_bad_preset_options_are_one_line(capsys, tmp_path, argv, fragment):
    assert main(["sweep", *argv, "-q", "--out", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pslab: error:") and fragment in err[0], err


def test_cli_delay_choices_are_the_emulators():
    from pslab.experiments.commands.sweep import _DELAYS
    from pslab.experiments.sim.delays import DELAYS
    assert _DELAYS == DELAYS


def test_malformed_delay_is_an_argparse_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["sweep", "--preset", "staleness", "--delay", "poisson"])
    assert e.value.code == 2 and "invalid choice: 'poisson'" in capsys.readouterr().err
