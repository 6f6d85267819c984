"""A user's own workload (experiments/workloads/user.py), written in a temp folder and named in the config: a small
CNN on an .npz it generates, and a dict-batch model whose output is an object. Under local, allreduce, ps-asp,
ps-ssp:2 and the simulator; allreduce equals local (as the built-ins do: float32 summation order aside); ZeRO-2
runs; tensor parallelism on a model without pslab's blocks, and a bad name, are one line and exit 1."""

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
        return {"test_loss": float(loss(out, b)), "test_acc": float((out.logits.argmax(-1) == b["label"]).float().mean())}
    return UserWorkload(model=model, train=data(slice(0, 240)), test=data(slice(240, 300)), loss=loss,
                        evaluate=evaluate)
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


def test_npz_without_the_four_arrays_is_refused(folder):
    from pslab.experiments.workloads.user import npz
    np.savez(folder / "half.npz", x_train=np.zeros((3, 2)))
    with pytest.raises(ConfigError, match="missing y_train, x_test, y_test"):
        npz(folder / "half.npz")
