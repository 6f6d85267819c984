"""A user's own workload (experiments/workloads/user.py), written in a temp folder and named in the config: a small
CNN on an .npz it generates, and a dict-batch model whose output is an object. Under local, allreduce, ps-asp,
ps-ssp:2 and the simulator; allreduce equals local (as the built-ins do: float32 summation order aside); ZeRO-2
runs; an MLP with a declared tp_plan under tp = 2 (and dp x tp, and ps-bsp) equals local, its tp bytes equal the
formula; with a declared pp_cuts too, dp x tp x pp (3D), ps-bsp tp x pp and ZeRO-3 x tp equal local, and a dict
batch is cut into micro-batches; tensor parallelism on a model without blocks or plan, a bad plan, a bad cut and
a bad name are one line, exit 1."""

from __future__ import annotations

import textwrap
from collections import Counter

import numpy as np
import pytest

from pslab.experiments.errors import ConfigError

CNN = """
import torch
from torch import nn
from pslab.experiments.workloads.user import UserWorkload, npz

def make_workload():
    train, test = npz("images.npz")
    def model(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 4))
    return UserWorkload(model=model, train=train, test=test, description="a CNN on images.npz")
"""

DICT = """
from dataclasses import dataclass
import numpy as np, torch
from torch import nn
from torch.nn import functional as F
from pslab.experiments.workloads.user import UserWorkload

@dataclass
class Out:
    logits: torch.Tensor

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 3))
    def forward(self, batch):                  # the whole dict batch; returns an object, not a tensor
        return Out(self.body(batch["features"] * batch["scale"][:, None]))

def make_workload():
    rng = np.random.default_rng(7)             # generated, seeded: the same data in every process
    x = rng.standard_normal((300, 16)).astype(np.float32)
    y = (x[:, :3].argmax(1)).astype(np.int64)
    scale = np.ones(300, np.float32)
    data = lambda s: {"features": x[s], "scale": scale[s], "label": y[s]}
    def model(seed):
        torch.manual_seed(seed)
        return Model()
    loss = lambda out, b: F.cross_entropy(out.logits, b["label"])
    def evaluate(model, b):
        out = model(b)
        acc = (out.logits.argmax(-1) == b["label"]).float().mean()
        return {"test_loss": float(loss(out, b)), "test_acc": float(acc)}
    return UserWorkload(model=model, train=data(slice(0, 240)), test=data(slice(240, 300)), loss=loss,
                        evaluate=evaluate)
"""


PLANNED = """
import numpy as np, torch
from torch import nn
from pslab.experiments.workloads.user import UserWorkload

def make_workload(plan=None):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((256, 12)).astype(np.float32)
    y = (x @ rng.standard_normal((12, 5))).argmax(1).astype(np.int64)
    def model(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 5))
    return UserWorkload(model=model, train=(x[:200], y[:200]), test=(x[200:], y[200:]),
                        tp_plan=plan or {"0": "colwise", "2": "rowwise"})      # the head (4) stays replicated

def bad_plan():
    return make_workload({"0": "colwise", "1": "rowwise"})      # "1" is the GELU
"""

DEEP = """
import numpy as np, torch
from torch import nn
from torch.nn import functional as F
from pslab.experiments.workloads.user import UserWorkload

def make_workload(cuts=(4,)):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((256, 12)).astype(np.float32)
    y = (x @ rng.standard_normal((12, 5))).argmax(1).astype(np.int64)
    def model(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 16), nn.Tanh(),
                             nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 5))
    return UserWorkload(model=model, train=(x[:200], y[:200]), test=(x[200:], y[200:]),
                        tp_plan={"0": "colwise", "2": "rowwise", "4": "colwise", "6": "rowwise"},
                        pp_cuts=cuts)

def split_pair():
    return make_workload(cuts=[2])                 # stage 0 would end on the colwise "0"

def three_stages():
    return make_workload(cuts=[2, 4])

class Features(nn.Module):                         # stage 0 reads the dict batch; one tensor crosses the cut
    def forward(self, b):
        return b["features"] * b["scale"][:, None]

class Pair(nn.Module):                             # returns a tuple: no cut may follow it
    def forward(self, h):
        return h, h

class First(nn.Module):
    def forward(self, pair):
        return pair[0]

def dict_pipeline(pair=False):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((300, 16)).astype(np.float32)
    data = lambda s: {"features": x[s], "scale": np.full(len(x[s]), 0.5, np.float32),
                      "label": x[s, :3].argmax(1).astype(np.int64)}
    def model(seed):
        torch.manual_seed(seed)
        if pair:
            return nn.Sequential(Features(), nn.Linear(16, 32), Pair(), First(), nn.Linear(32, 3))
        return nn.Sequential(Features(), nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 3))
    return UserWorkload(model=model, train=data(slice(0, 240)), test=data(slice(240, 300)),
                        loss=lambda out, b: F.cross_entropy(out, b["label"]), pp_cuts=[3])

def tuple_cut():
    return dict_pipeline(pair=True)
"""


@pytest.fixture()
def folder(tmp_path, monkeypatch):
    """The user's folder: her two workload files and the .npz, as the working directory."""
    rng = np.random.default_rng(0)
    teacher = rng.standard_normal((100, 4))
    def images(n):
        x = rng.standard_normal((n, 1, 10, 10)).astype(np.float32)
        return x, (x.reshape(n, -1) @ teacher).argmax(1).astype(np.int64)
    (xtr, ytr), (xte, yte) = images(240), images(60)
    np.savez(tmp_path / "images.npz", x_train=xtr, y_train=ytr, x_test=xte, y_test=yte)
    (tmp_path / "my_cnn.py").write_text(textwrap.dedent(CNN))
    (tmp_path / "my_dict.py").write_text(textwrap.dedent(DICT))
    (tmp_path / "my_mlp.py").write_text(textwrap.dedent(PLANNED))
    (tmp_path / "my_deep.py").write_text(textwrap.dedent(DEEP))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _run(folder, name: str, strategy: str, *extra: str, simulate: bool = False):
    import pslab
    return pslab.run({"workload": {"name": name, "batch_size": 16},
                      "train": {"strategy": strategy, "workers": 2, "steps": 8, "eval_every": 4, "lr": 0.05,
                                "timeout_s": 60}},
                     set=list(extra), out=folder / "runs", progress=False, simulate=simulate)


@pytest.mark.parametrize("name", ["my_cnn.py:make_workload", "my_dict.py:make_workload"])
def test_in_process_local_and_the_simulator(folder, name):
    local = _run(folder, name, "local")
    assert len(local.metrics) == 16 and np.isfinite(local.metrics["loss"]).all()
    assert local.summary["final_test_acc"] is not None and 0 <= local.summary["final_test_acc"] <= 1
    sim = _run(folder, name, "ps-asp", simulate=True)
    assert len(sim.metrics) == 16 and sim.summary["simulated"] and sim.metrics["staleness"].max() >= 1
    assert Counter(sim.metrics["batch"]) == Counter(local.metrics["batch"])        # the same examples


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["my_cnn.py:make_workload", "my_dict.py:make_workload"])
def test_every_strategy_runs_it_and_allreduce_equals_local(folder, name):
    runs = {s: _run(folder, name, s) for s in ("local", "allreduce", "ps-asp", "ps-ssp:2")}
    runs["zero2"] = _run(folder, name, "allreduce", "parallel.zero=2")
    ref = {(u.worker, u.step): u.loss for u in runs["local"].metrics.itertuples()}
    for s, r in runs.items():
        assert not r.interrupted and len(r.metrics) == 16, s
        assert Counter(r.metrics["batch"]) == Counter(runs["local"].metrics["batch"]), s
    for s in ("allreduce", "zero2"):
        got = {(u.worker, u.step): u.loss for u in runs[s].metrics.itertuples()}
        assert got.keys() == ref.keys() and max(abs(got[k] - ref[k]) for k in ref) < 1e-4, s
        assert runs[s].summary["final_test_acc"] == pytest.approx(runs["local"].summary["final_test_acc"], abs=1e-6)
    assert runs["ps-asp"].metrics["staleness"].max() >= 1 and runs["ps-ssp:2"].metrics["staleness"].max() >= 0


@pytest.mark.timeout(300)
def test_a_declared_tp_plan_splits_the_users_model_and_equals_local(folder):
    """tp = 2 by the model's plan (colwise Linear, GELU, rowwise Linear), alone and under dp = 2 and ps-bsp: the
    losses of local, and the tp activations' bytes the formula's (f backward on the colwise input, g forward on
    the rowwise output, read off the model's own shapes)."""
    name = "my_mlp.py:make_workload"
    ref = {1: _run(folder, name, "local", "train.workers=1"), 2: _run(folder, name, "local")}
    runs = {"tp=2": (_run(folder, name, "allreduce", "train.workers=1", "parallel.tp=2"), 1),
            "dp=2 x tp=2": (_run(folder, name, "allreduce", "parallel.tp=2"), 2),
            "ps-bsp tp=2": (_run(folder, name, "ps-bsp", "train.workers=1", "parallel.tp=2"), 1)}
    for label, (r, k) in runs.items():
        want = {(u.worker, u.step): u.loss for u in ref[k].metrics.itertuples()}
        got = {(u.worker, u.step): u.loss for u in r.metrics.itertuples()}
        assert got.keys() == want.keys() and max(abs(got[q] - want[q]) for q in want) < 1e-4, label
        assert r.summary["final_test_acc"] == pytest.approx(ref[k].summary["final_test_acc"], abs=1e-6), label
        tp = r.summary["bytes_by_kind"]["tp activations"]
        assert tp["measured_per_step"] > 0 and tp["model_per_step"] == pytest.approx(tp["measured_per_step"],
                                                                                      rel=1e-9), (label, tp)


def _same_losses(r, ref, label):
    want = {(u.worker, u.step): u.loss for u in ref.metrics.itertuples()}
    got = {(u.worker, u.step): u.loss for u in r.metrics.itertuples()}
    assert got.keys() == want.keys() and max(abs(got[q] - want[q]) for q in want) < 1e-4, label
    assert r.summary["final_test_acc"] == pytest.approx(ref.summary["final_test_acc"], abs=1e-6), label


@pytest.mark.timeout(400)
def test_a_declared_cut_and_plan_run_the_users_model_in_3d(folder):
    """The model's own pp_cuts and tp_plan: dp 2 x tp 2 x pp 2 (8 ranks), ps-bsp with tp 2 x pp 2, and ZeRO-3 over
    the tp shards each equal local; the tp and pp bytes equal their formulas; a dict batch is cut into micro-batches
    (stage 0 reads the dict, the last stage's loss the dict's labels) and equals local."""
    name = "my_deep.py:make_workload"
    ref = {1: _run(folder, name, "local", "train.workers=1"), 2: _run(folder, name, "local")}
    runs = {"dp2 x tp2 x pp2": (_run(folder, name, "allreduce", "parallel.tp=2", "parallel.pp=2"), 2),
            "ps-bsp tp2 x pp2": (_run(folder, name, "ps-bsp", "train.workers=1", "parallel.tp=2", "parallel.pp=2"), 1),
            "zero3 x tp2": (_run(folder, name, "allreduce", "parallel.tp=2", "parallel.zero=3"), 2)}
    for label, (r, k) in runs.items():
        _same_losses(r, ref[k], label)
        for kind in ("tp activations", "pp boundaries"):
            b = r.summary["bytes_by_kind"].get(kind)
            if b is not None:
                assert b["measured_per_step"] > 0 and b["model_per_step"] == pytest.approx(
                    b["measured_per_step"], rel=1e-9), (label, kind, b)
    assert "pp boundaries" in runs["dp2 x tp2 x pp2"][0].summary["bytes_by_kind"]
    dict_name = "my_deep.py:dict_pipeline"
    _same_losses(_run(folder, dict_name, "allreduce", "train.workers=1", "parallel.pp=2"),
                 _run(folder, dict_name, "local", "train.workers=1"), "dict batch, pp2")


@pytest.mark.parametrize("name, extra, fragment", [
    ("my_deep.py:split_pair", ["parallel.tp=2"],
     "pipeline stage 0 holds the tp_plan's Linears ['0'] (colwise): a cut must not separate"),
    ("my_deep.py:three_stages", [], "pp_cuts [2, 4] cuts it into 3 stages, but the layout asks for 2"),
    ("my_deep.py:tuple_cut", [], "pipeline stage 0's output is a tuple; one tensor crosses a stage cut"),
    ("my_dict.py:make_workload", [], "parallel.pp cuts an nn.Sequential into stages; 'my_dict.py:make_workload' "
                                     "is not one"),
])
def test_a_cut_that_cannot_run_is_one_line(folder, capsys, name, extra, fragment):
    from pslab.experiments.cli import main
    cfg = folder / "c.toml"
    cfg.write_text(f'[workload]\nname = "{name}"\nbatch_size = 8\n[train]\nstrategy = "allreduce"\nworkers = 1\n'
                   'steps = 2\ntimeout_s = 60\n[parallel]\npp = 2\n')
    assert main(["run", str(cfg), "--out", str(folder / "runs"), "-q", *sum((["--set", e] for e in extra), [])]) == 1
    err = capsys.readouterr().err.strip()
    assert fragment in err and "\n" not in err, err


@pytest.mark.parametrize("name, fragment", [
    ("nofile.py:make_workload", "no such file"),
    ("my_cnn.py:nope", "has no function 'nope'"),
    ("no_such_module_x:make", "cannot import no_such_module_x"),
    ("my_cnn.py:np", "has no function 'np'"),
    ("bad.py:make", "must return a pslab.experiments.workloads.user.UserWorkload, got dict"),
])
def test_a_bad_user_workload_is_one_line(folder, name, fragment, capsys):
    (folder / "bad.py").write_text("def make():\n    return {}\n")
    from pslab.experiments.cli import main
    cfg = folder / "c.toml"
    cfg.write_text(f'[workload]\nname = "{name}"\n[train]\nstrategy = "local"\nsteps = 2\n')
    assert main(["run", str(cfg), "--out", str(folder / "runs"), "-q"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("pslab: error: ") and fragment in err and "\n" not in err, err


def test_tensor_parallelism_on_a_model_without_blocks_is_one_line(folder, capsys):
    from pslab.experiments.cli import main
    cfg = folder / "c.toml"
    cfg.write_text('[workload]\nname = "my_cnn.py:make_workload"\n[train]\nstrategy = "allreduce"\nworkers = 1\n'
                   'steps = 2\n[parallel]\ntp = 2\n')
    assert main(["run", str(cfg), "--out", str(folder / "runs"), "-q"]) == 1
    err = capsys.readouterr().err.strip()
    assert "parallel.tp = 2 splits attention heads and MLP width" in err and "\n" not in err, err
    assert not (folder / "runs").exists()                    # refused before anything started


@pytest.mark.parametrize("name, extra, fragment", [
    ("my_mlp.py:bad_plan", [], "tp_plan names '1', a GELU: only nn.Linear modules split"),
    ("my_mlp.py:make_workload", ["parallel.tp=3"], "splits 32 output features over tp = 3"),
    ("my_mlp.py:make_workload", ["parallel.sp=true"], "runs with tp, pp and dp only (not sp)"),
])
def test_a_plan_that_cannot_split_is_one_line(folder, capsys, name, extra, fragment):
    from pslab.experiments.cli import main
    cfg = folder / "c.toml"
    cfg.write_text(f'[workload]\nname = "{name}"\n[train]\nstrategy = "allreduce"\nworkers = 1\nsteps = 2\n'
                   '[parallel]\ntp = 2\n')
    assert main(["run", str(cfg), "--out", str(folder / "runs"), "-q", *sum((["--set", e] for e in extra), [])]) == 1
    err = capsys.readouterr().err.strip()
    assert fragment in err and "\n" not in err, err


def test_npz_without_the_four_arrays_is_refused(folder):
    from pslab.experiments.workloads.user import npz
    np.savez(folder / "half.npz", x_train=np.zeros((3, 2)))
    with pytest.raises(ConfigError, match="missing y_train, x_test, y_test"):
        npz(folder / "half.npz")


def test_image_folder_and_token_file_read_data_from_disk(tmp_path):
    """image_folder: classes are the sorted sub-folders, pixels in [0, 1], channels first, a fixed split; mixed
    sizes are one line. token_file: windows whose targets are the inputs shifted by one, from text or ids."""
    from PIL import Image
    from pslab.experiments.workloads.user import image_folder, token_file
    rng = np.random.default_rng(0)
    for c, n in (("b", 6), ("a", 4)):
        (tmp_path / "img" / c).mkdir(parents=True)
        for i in range(n):
            Image.fromarray((rng.random((5, 7, 3)) * 255).astype(np.uint8)).save(tmp_path / "img" / c / f"{i}.png")
    (xtr, ytr), (xte, yte) = image_folder(tmp_path / "img")
    assert xtr.shape == (8, 3, 5, 7) and xte.shape == (2, 3, 5, 7) and xtr.dtype == np.float32
    assert 0 <= xtr.min() and xtr.max() <= 1 and sorted(np.concatenate([ytr, yte]).tolist()) == [0] * 4 + [1] * 6
    again = image_folder(tmp_path / "img")
    assert (again[0][0] == xtr).all() and (again[1][1] == yte).all()               # the same split every time
    Image.fromarray(np.zeros((3, 3), np.uint8)).save(tmp_path / "img" / "a" / "odd.png")
    with pytest.raises(ConfigError, match="differ in size"):
        image_folder(tmp_path / "img")
    assert image_folder(tmp_path / "img", size=(4, 4), grayscale=True)[0][0].shape[1:] == (1, 4, 4)
    (tmp_path / "t.txt").write_text("abcabcabd" * 20)
    (x, y), (xt, yt), vocab = token_file(tmp_path / "t.txt", context=8)
    assert vocab == 4 and x.shape[1] == 8 and (x[:, 1:] == y[:, :-1]).all() and len(x) + len(xt) == 179 // 8
    np.save(tmp_path / "ids.npy", np.arange(100) % 11)
    assert token_file(tmp_path / "ids.npy", context=9)[2] == 11
    np.save(tmp_path / "bad.npy", np.zeros((3, 3)))
    with pytest.raises(ConfigError, match="1-D array of non-negative integer ids"):
        token_file(tmp_path / "bad.npy")


@pytest.mark.timeout(300)
def test_the_docs_example_compares_allreduce_and_asp_on_its_images(tmp_path):
    """docs/examples/image_cnn.py as its docstring runs it, from a folder that is not the checkout: it writes its
    image folder once (the ranks race to it), and pslab compare reports both strategies."""
    import subprocess
    import sys
    from pathlib import Path
    example = Path(__file__).resolve().parents[2] / "docs" / "examples" / "image_cnn.py"
    r = subprocess.run([sys.executable, "-m", "pslab", "compare", "--set", f"workload.name={example}:make_workload",
                        "--strategies", "allreduce,ps-asp", "--no-straggler", "--noise-seeds", "0", "--set",
                        "train.steps=20", "-q", "--out", "out"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=280)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(list((tmp_path / "shapes").glob("*/*.png"))) == 400 and not list(tmp_path.glob(".shapes-*"))
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| allreduce |" in report and "| ps-asp |" in report
