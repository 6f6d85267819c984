"""`pslab memory`: the article's example, JSON, the plot, one-line errors, and --measure (the real engines on 2
local processes) within 10 % of the model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from experiments.cli import main


def test_article_example_and_fit_table(capsys):
    assert main(["memory", "--params", "70e9"]) == 0
    out = capsys.readouterr().out
    assert "16 B/param" in out and "1.12 TB" in out
    assert "80 GB" in out and "141 GB" in out
    assert "zero3 dp=64 tp=1 pp=1" in out and "Rajbhandari" in out


def test_json_parses_and_fits(capsys):
    assert main(["memory", "--params", "7.5e9", "--dp", "64", "--zero", "3", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["total_bytes"] == pytest.approx(1.875e9)
    assert d["state_bytes_per_param"] == 16
    assert {t["term"] for t in d["terms"]} == {"params", "grads", "optimizer"}
    fits = {r["layout"]: r for r in d["fits"]}
    one = fits["zero0 dp=1 tp=1 pp=1"]                  # 120 GB: only the 141 GB GPU holds it
    assert one["bytes"] == pytest.approx(120e9) and one["fits_141GB"] and not one["fits_80GB"]
    assert fits["zero3 dp=64 tp=1 pp=1"]["fits_80GB"]
    mine = d["fits"][0]                                 # the asked-for layout comes first, with the same total
    assert mine["layout"] == "yours: dp=64 zero3" and mine["bytes"] == pytest.approx(d["total_bytes"])


def test_shape_with_activations_and_plot(tmp_path, capsys):
    png = tmp_path / "mem.png"
    assert main(["memory", "--layers", "96", "--hidden", "12288", "--heads", "96", "--seq", "2048", "--vocab",
                 "51200", "--tp", "8", "--pp", "8", "--sp", "--recompute", "selective", "--json",
                 "--plot", str(png)]) == 0
    d = json.loads(capsys.readouterr().out)
    act = [t for t in d["terms"] if t["term"] == "activations"][0]
    assert act["bytes"] == pytest.approx(96 * 2048 * 12288 * 34 / 8) and "Korthikanti" in act["source"]
    assert png.stat().st_size > 1000


def test_interleaving_holds_p_plus_p_minus_1_over_v_micro_batches_on_the_first_stage(capsys):
    """--virtual-stages 2, pp = 4, m = 8: stage 0 holds 4 + 3/2 = 5.5 stage-micro-batches of activations (1F1B: 4)."""
    shape = ["--layers", "32", "--hidden", "1024", "--heads", "16", "--seq", "512", "--vocab", "1000", "--pp", "4",
             "--micro-batches", "8", "--json"]
    acts = []
    for v in ("1", "2"):
        assert main(["memory", *shape, "--virtual-stages", v]) == 0
        d = json.loads(capsys.readouterr().out)
        acts.append([t for t in d["terms"] if t["term"] == "activations"][0])
    assert "× 4 micro-batches in flight" in acts[0]["formula"] and "× 5.5 micro-batches in flight" in acts[1]["formula"]
    assert acts[1]["bytes"] == pytest.approx(acts[0]["bytes"] * 5.5 / 4, rel=1e-12)


@pytest.mark.parametrize("argv, fragment", [
    (["--params", "-3"], "--params must be > 0"),
    (["--zero", "4"], "--zero must be 0, 1, 2 or 3"),
    (["--layers", "4"], "needs all of"),
    (["--precision", "fp8"], "unknown precision"),
    (["--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "8", "--vocab", "16", "--tp", "3"], "divide"),
    (["--measure", "--configs", "dp=9"], "unknown --configs"),
    (["--virtual-stages", "2"], "--virtual-stages > 1 interleaves 1F1B"),
    (["--pp", "4", "--micro-batches", "6", "--virtual-stages", "2"], "must be a multiple of 4"),
])
def test_bad_input_is_one_line_exit_1(argv, fragment, capsys):
    assert main(["memory", *argv]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0]


def test_bad_input_from_the_shell_has_no_traceback():
    r = subprocess.run([sys.executable, "-m", "experiments.cli", "memory", "--dp", "0"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == ["pslab: error: --dp must be >= 1, got 0"]


def test_help_has_examples(capsys):
    with pytest.raises(SystemExit) as e:
        main(["memory", "--help"])
    assert e.value.code == 0
    assert "pslab memory --params 70e9" in capsys.readouterr().out


def test_measure_subset_within_10_percent_of_model(capsys):
    assert main(["memory", "--measure", "--configs", "dp=2 zero3,pp=2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    rows = d["rows"]
    assert [(r["config"], r["rank"]) for r in rows] == [("dp=2 zero3", 0), ("dp=2 zero3", 1), ("pp=2", 0),
                                                        ("pp=2", 1)]
    for r in rows:
        for kind in ("params", "grads", "optimizer", "activations"):
            assert r["measured"][kind] > 0
            assert r["ratio"][kind] == pytest.approx(1.0, abs=0.10), (r["config"], r["rank"], kind)
    z = rows[0]["measured"]
    assert z["params"] * 2 == rows[2]["measured"]["params"] + rows[3]["measured"]["params"]  # ZeRO-3: Ψ/2 each
    assert "ActivationMeter" in d["meters"]


def test_measure_covers_3d_layouts_to_the_byte(capsys):
    """tp x pp, dp x tp x pp with the distributed optimizer (ZeRO-1 per (pp, tp) coordinate) and tp x cp: parameters,
    gradients and saved activations equal the model to the byte on every rank; the optimizer state too, but for
    Adam's step counters (a few bytes per tensor), and ZeRO-1 halves it over dp = 2."""
    assert main(["memory", "--measure", "--configs", "tp=2 pp=2,dp=2 tp=2 pp=2 zero1,tp=2 cp=2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert len(rows) == 4 + 8 + 4
    for r in rows:
        m, f = r["measured"], r["model"]
        for kind in ("params", "grads", "activations"):
            assert m[kind] == f[kind], (r["config"], r["rank"], kind, m[kind], f[kind])
        assert 0 <= m["optimizer"] - f["optimizer"] <= 8 * 16, (r["config"], r["rank"], m, f)
    plain = {r["coords"]["pp"]: r["model"]["optimizer"] for r in rows if r["config"] == "tp=2 pp=2"}
    for r in rows:
        if r["config"] == "dp=2 tp=2 pp=2 zero1":
            assert r["model"]["optimizer"] * 2 == plain[r["coords"]["pp"]]
