"""The Python API (experiments/api.py): pslab.run / compare / load return DataFrames equal to the run directory's
files, work from a kernel-like process (a __main__ without a file, as a Jupyter kernel's cells) and leave no
process-wide state behind (an interrupt from a kernel: tests/experiments/test_interrupts.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import pslab
from pslab.experiments.errors import ConfigError, ExperimentError
from pslab.experiments.results.rundir import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["train.steps=12", "train.eval_every=6"]


def _records(frame) -> list[dict]:
    """A frame's rows as the file's records: a key a record lacks is NaN in the frame, dropped here."""
    return [{k: v for k, v in row.items() if v is not None and v == v} for row in frame.to_dict("records")]


def _file(path: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if v is not None} for row in read_jsonl(path)]


def test_run_returns_the_files_as_frames_and_restores_the_thread_count(tmp_path):
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        r = pslab.run("compare_default", set=["train.strategy=local", *SHORT], out=tmp_path, progress=False)
        assert torch.get_num_threads() == 2                     # the run set 1 for itself, then put it back
    finally:
        torch.set_num_threads(before)
    assert r.strategy == "local" and not r.interrupted and r.summary["final_test_acc"] is not None
    assert _records(r.metrics) == _file(r.path / "metrics.jsonl") and len(r.metrics) == 4 * 12
    assert _records(r.evals) == _file(r.path / "eval.jsonl") and list(r.evals.columns)[:2] == ["updates", "time_s"]
    assert r.summary == json.loads((r.path / "summary.json").read_text()) and r.events.empty
    again = pslab.load(r.path)
    assert again.summary == r.summary and again.metrics.equals(r.metrics) and repr(again) == repr(r)


def test_a_toml_file_a_dict_and_a_runconfig_give_the_same_run(tmp_path):
    """Three spellings of one config; the local strategy is deterministic, so the losses are equal; the caller's
    RunConfig is not changed by the run's overrides."""
    from pslab.experiments.config import load_config
    toml = tmp_path / "c.toml"
    toml.write_text('[workload]\nname = "digits-logreg"\n[train]\nstrategy = "local"\nsteps = 12\neval_every = 6\n')
    cfg = load_config(toml)
    runs = [pslab.run(toml, out=tmp_path / "a", progress=False),
            pslab.run({"workload": {"name": "digits-logreg"}, "train": {"strategy": "local", "steps": 12,
                                                                        "eval_every": 6}}, out=tmp_path / "b",
                      progress=False),
            pslab.run(cfg, set=["train.eval_every=4"], out=tmp_path / "c", progress=False)]
    assert {r.config["workload"]["name"] for r in runs} == {"digits-logreg"}
    assert list(runs[0].metrics["loss"]) == list(runs[1].metrics["loss"]) == list(runs[2].metrics["loss"])
    assert runs[2].config["train"]["eval_every"] == 4 and cfg.train.eval_every == 6


@pytest.mark.parametrize("call, fragment", [
    (lambda t: pslab.run("no-such.toml", out=t), "config file not found"),
    (lambda t: pslab.run(set="train.steps=3", out=t), "set= takes a list"),
    (lambda t: pslab.run({"nope": {}}, out=t), "unknown section [nope]"),
    (lambda t: pslab.compare(strategies=["ps-nope"], out=t), "unknown strategy"),
    (lambda t: pslab.compare(strategies="ps-asp", out=t), "strategies= takes a non-empty list"),
    (lambda t: pslab.load(t), "neither a pslab run directory"),
])
def test_bad_input_raises_pslabs_one_line_errors(tmp_path, call, fragment):
    with pytest.raises((ConfigError, ExperimentError)) as e:
        call(tmp_path)
    assert fragment in str(e.value) and "\n" not in str(e.value)


KERNEL = """
import sys
import pslab
from pslab.experiments.results.rundir import read_jsonl
rows = lambda f: [{k: v for k, v in r.items() if v is not None and v == v} for r in f.to_dict("records")]
file = lambda p: [{k: v for k, v in r.items() if v is not None} for r in read_jsonl(p)]
c = pslab.compare(strategies=["allreduce", "ps-asp"], straggler=False, noise_seeds=0, progress=False,
                  set=["train.steps=12", "train.eval_every=6"], out=sys.argv[1])
assert [r.strategy for r in c.runs] == ["allreduce", "ps-asp"], c
for r in c.runs:
    assert rows(r.metrics) == file(r.path / "metrics.jsonl") and rows(r.evals) == file(r.path / "eval.jsonl")
loaded = pslab.load(sys.argv[1])
assert loaded.summary.equals(c.summary) and loaded.metrics.equals(c.metrics) and c.report.is_file()
s = c.summary
assert list(s["strategy"]) == ["allreduce", "ps-asp"] and not s["straggler"].any()
assert set(c.metrics["run"]) == {r.label for r in c.runs} and len(c.metrics) == 2 * 4 * 12
print("ok", len(c.metrics))
"""


@pytest.mark.timeout(240)
def test_compare_from_a_kernel_like_process_returns_frames_equal_to_the_files(tmp_path):
    """`python -c`: __main__ has no file, as in a Jupyter kernel, so the ranks and shards the run starts cannot
    re-run the caller's code; the frames equal the files and `load` reads the same Comparison back."""
    r = subprocess.run([sys.executable, "-c", KERNEL, str(tmp_path / "cmp")], cwd=tmp_path, capture_output=True,
                       text=True, timeout=220)
    assert r.returncode == 0 and r.stdout.split() == ["ok", str(2 * 4 * 12)], (r.stdout[-1000:], r.stderr[-3000:])


def test_the_notebook_example_runs_as_a_kernel_runs_it(tmp_path):
    """docs/notebook.py (percent format: open it in Jupyter with jupytext, or run it) executed cell by cell the way
    a kernel does — in a process whose __main__ is not the file — from a folder that is not the checkout."""
    code = textwrap.dedent(f"""
        import runpy, sys
        sys.argv = ["notebook", {str(tmp_path / 'nb')!r}]
        runpy.run_path({str(ROOT / 'docs' / 'notebook.py')!r}, run_name="notebook")
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=220)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "notebook: done" in r.stdout, r.stdout[-2000:]
    assert (tmp_path / "nb" / "report.md").is_file() and (tmp_path / "nb" / "loss_by_strategy.png").stat().st_size


def test_export_writes_the_records_as_csv_tables(tmp_path, capsys):
    """`pslab export` over two runs: one table per kind, every row tagged with its run; the values read back equal
    the files'; --parquet without pyarrow is one line."""
    import pandas as pd
    from pslab.experiments.cli import main
    runs = [pslab.run("compare_default", set=[f"train.strategy={s}", *SHORT], out=tmp_path / "runs", label=s,
                      progress=False, simulate=s != "local") for s in ("local", "ps-asp")]
    assert main(["export", str(tmp_path / "runs"), "--out", str(tmp_path / "x")]) == 0
    assert "metrics.csv  (" in capsys.readouterr().out
    m = pd.read_csv(tmp_path / "x" / "metrics.csv")
    assert len(m) == sum(len(r.metrics) for r in runs) and set(m["run"]) == {"local", "ps-asp"}
    for r in runs:
        mine = m[m["run"] == r.label].drop(columns=["run", "run_dir"]).reset_index(drop=True)
        assert list(mine["loss"]) == pytest.approx(list(r.metrics["loss"]), rel=1e-12)
        assert list(mine["staleness"]) == list(r.metrics["staleness"])
    s = pd.read_csv(tmp_path / "x" / "summary.csv")
    assert list(s["run"]) == ["local", "ps-asp"] and list(s["final_test_acc"]) == pytest.approx(
        [r.summary["final_test_acc"] for r in runs])
    assert len(pd.read_csv(tmp_path / "x" / "evals.csv")) == sum(len(r.evals) for r in runs)
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        assert main(["export", str(tmp_path / "runs"), "--parquet", "--out", str(tmp_path / "y")]) == 1
        err = capsys.readouterr().err.strip()
        assert err == "pslab: error: --parquet needs pyarrow: pip install pyarrow (or export --csv)"


def test_tensorboard_scalars_read_back(tmp_path, capsys):
    """[logging] tensorboard = true writes RUN_DIR/tensorboard; tensorboard's own reader finds every update's loss
    per worker, the evaluations and the summary, with the run's values; pslab export --tensorboard writes the same
    for a run made without it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    r = pslab.run("compare_default", set=["train.strategy=local", *SHORT, "logging.tensorboard=true"],
                  out=tmp_path / "runs", progress=False)
    acc = EventAccumulator(str(r.path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {f"loss/worker{k}" for k in range(4)} | {"eval/test_acc", "summary/updates_per_s"} <= tags
    by_worker = r.metrics[r.metrics["worker"] == 2]
    assert [e.value for e in acc.Scalars("loss/worker2")] == pytest.approx(list(by_worker["loss"]), rel=1e-6)
    assert [e.step for e in acc.Scalars("eval/test_acc")] == list(r.evals["updates"])
    assert acc.Scalars("summary/final_test_acc")[0].value == pytest.approx(r.summary["final_test_acc"], rel=1e-6)
    plain = pslab.run("compare_default", set=["train.strategy=local", *SHORT], out=tmp_path / "plain",
                      progress=False)
    assert not (plain.path / "tensorboard").exists()
    from pslab.experiments.cli import main
    assert main(["export", str(plain.path), "--tensorboard"]) == 0
    again = EventAccumulator(str(plain.path / "tensorboard"))
    again.Reload()
    assert len(again.Scalars("loss/worker0")) == 12


def test_tensorboard_without_the_package_is_one_line_before_anything_runs(tmp_path, capsys, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    from pslab.experiments.cli import main
    assert main(["run", "compare_default", "--set", "logging.tensorboard=true", "--out", str(tmp_path), "-q"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("pslab: error: [logging] tensorboard needs the tensorboard package: pip install tensorboard "
                   "(in a checkout: pip install -e '.[tensorboard]')")
    assert not list(tmp_path.iterdir())                         # refused before a run directory was made
