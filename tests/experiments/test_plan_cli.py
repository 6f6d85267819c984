"""`pslab plan`: the table and the explanation, JSON that parses and is ranked, the plot, the published comparison,
one-line errors with exit 1 (never a traceback), and --help with examples."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pslab.experiments.cli import main

SHAPE = ["--layers", "24", "--hidden", "2048", "--heads", "16", "--seq", "2048", "--vocab", "51200"]


def test_table_and_explanation(capsys):
    assert main(["plan", *SHAPE, "--nodes", "2", "--global-batch", "64", "--top", "4", "-q"]) == 0
    out = capsys.readouterr().out
    assert "layouts enumerated" in out and "mem/GPU" in out and "TFLOP/s" in out
    assert out.count("\n  1 dp=") == 1 and "\n  4 dp=" in out and "\n  5 dp=" not in out
    assert "Best of" in out and "inter link" in out and "What limits it" in out


def test_json_is_ranked_and_fits(capsys):
    assert main(["plan", *SHAPE, "--nodes", "2", "--global-batch", "64", "--top", "6", "--json",
                 "--zero", "0,1", "--recompute", "none,full"]) == 0
    d = json.loads(capsys.readouterr().out)
    top = d["top"]
    assert len(top) == 6 and d["feasible"] >= 6 and d["gpus"] == 16 and d["global_batch"] == 64
    steps = [r["step_s"] for r in top]
    assert steps == sorted(steps)
    for r in top:
        assert r["fits"] and r["memory_bytes"] <= d["cluster"]["gpu_memory_bytes"]
        assert r["dp"] * r["tp"] * r["pp"] == 16 and r["dp"] * r["micro_batches"] * r["micro_batch"] == 64
        assert r["zero"] in (0, 1) and r["recompute"] in ("none", "full")
        assert sum(r["breakdown_s"].values()) == pytest.approx(r["step_s"], rel=1e-9)
    assert "Best of" in d["explanation"]


def test_plot_writes_a_png(tmp_path, capsys):
    png = tmp_path / "plan.png"
    assert main(["plan", "--model", "gpt-7.5b", "--top", "5", "--plot", str(png), "-q"]) == 0
    assert png.stat().st_size > 5000 and f"plot: {png}" in capsys.readouterr().out


def test_published_row_json(capsys):
    assert main(["plan", "--published", "--model", "gpt-76b", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    (row,) = d["rows"]
    assert row["paper"] == {"tp": 8, "pp": 4, "dp": 32, "tflops_per_gpu": 140}
    assert abs(row["paper_layout"]["tflops_per_gpu"] / 140 - 1) <= 0.25
    assert (row["planner_megatron"]["tp"], row["planner_megatron"]["pp"]) == (8, 4)     # the paper's own choice
    assert row["planner_best"]["tp_inside_node"] and "Narayanan" in d["source"]


def test_published_table_text(capsys):
    assert main(["plan", "--published", "--model", "gpt-18b", "-q"]) == 0
    out = capsys.readouterr().out
    assert "Narayanan et al. 2021" in out and "gpt-18b" in out and "efficiency 0.5" in out


@pytest.mark.parametrize("argv, fragment", [
    (["--model", "gpt-2"], "unknown --model"),
    (["--layers", "4"], "give a model"),
    (["--layers", "4", "--hidden", "64", "--heads", "4", "--seq", "8", "--vocab", "16"], "--global-batch is required"),
    (["--layers", "4", "--hidden", "64", "--heads", "5", "--seq", "8", "--vocab", "16", "--global-batch", "8"],
     "must divide"),
    (["--model", "gpt-1.7b", "--layers", "4"], "not both"),
    (["--model", "gpt-1.7b", "--cluster", "nope"], "unknown cluster"),
    (["--model", "gpt-1.7b", "--cluster", "/nonexistent/c.json"], "no such file"),
    (["--model", "gpt-1.7b", "--zero", "5"], "--zero must list"),
    (["--model", "gpt-1.7b", "--recompute", "some"], "--recompute must be"),
    (["--model", "gpt-1.7b", "--nodes", "2", "--gpus", "1000"], "exceeds the cluster"),
    (["--layers", "2", "--hidden", "48", "--heads", "3", "--seq", "8", "--vocab", "16", "--nodes", "1",
      "--global-batch", "3"], "no layout of 8 GPUs"),
    (["--model", "gpt-1.7b", "--precision", "fp8"], "unknown precision"),
    (["--model", "gpt-1.7b", "--top", "0"], "--top must be"),
    (["--check"], "needs a calibration"),
    (["--model", "gpt-1.7b", "--virtual-stages", "0"], "--virtual-stages must be a non-empty list"),
])
def test_bad_input_is_one_line_exit_1(argv, fragment, capsys):
    assert main(["plan", *argv, "-q"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], lines


def test_virtual_stages_are_searched_when_asked(capsys):
    """--virtual-stages 1,2: interleaved layouts join the ranking (each row says its v; v = 2 only with pp > 1)."""
    assert main(["plan", *SHAPE, "--nodes", "2", "--global-batch", "64", "--top", "400", "--json",
                 "--virtual-stages", "1,2", "--zero", "0", "--recompute", "none"]) == 0
    rows = json.loads(capsys.readouterr().out)["top"]
    inter = [r for r in rows if r["virtual_stages"] == 2]
    assert inter and all(r["pp"] > 1 and r["micro_batches"] % r["pp"] == 0 and "v=2" in r["layout"] for r in inter)
    assert any(r["virtual_stages"] == 1 and r["pp"] > 1 for r in rows)


def test_nothing_fits_is_exit_1_with_the_reason(tmp_path, capsys):
    small = tmp_path / "small.json"
    from pslab.parallelism.cluster import preset
    small.write_text(preset("dgx-a100-80gb").with_(gpu_memory_bytes=1e9).to_json())
    assert main(["plan", "--model", "gpt-18b", "--cluster", str(small), "--nodes", "1", "--global-batch", "8",
                 "-q"]) == 1
    assert "No layout fits. The leanest" in capsys.readouterr().out


def test_bad_input_from_the_shell_has_no_traceback():
    r = subprocess.run([sys.executable, "-m", "pslab", "plan", "--model", "gpt-1t", "--nodes", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == ["pslab: error: --nodes must be >= 1, got 0"]


def test_help_has_examples(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "pslab plan --model gpt-145b" in out and "--calibrate" in out and "--check" in out
