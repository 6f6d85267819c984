"""Dai et al. staleness emulation and the staleness-sweep preset."""

from __future__ import annotations

import json

import torch

from pslab.experiments.config import TrainConfig
from pslab.experiments.sim.dai import run_dai
from pslab.experiments.studies.staleness import SweepSpec, plot_curve, run_staleness_sweep, save, trend_note
from pslab.experiments.workloads import get_workload


def test_zero_staleness_is_plain_sequential_training():
    """s = 0 reproduces an ordinary torch training loop on the same batches exactly (same accuracy curve)."""
    wl = get_workload("digits-logreg", 1, 16, seed=0)
    res = run_dai(wl, TrainConfig(optimizer="momentum", lr=0.05), 0, 40, target_acc=2.0, eval_every=10)
    m = wl.make_model()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    curve = []
    for t in range(40):
        x, y, _ = wl.batch(0, t)
        opt.zero_grad()
        wl.loss(m, x, y).backward()
        opt.step()
        if (t + 1) % 10 == 0:
            curve.append((t + 1, wl.evaluate(m)["test_acc"]))
    assert res.curve == curve and res.steps_to_target is None


def test_stale_runs_are_deterministic_and_differ_from_fresh():
    """With s = 4 two runs give identical curves, different from s = 0 (gradients really are stale)."""
    wl = get_workload("digits-logreg", 1, 16, seed=0)
    tc = TrainConfig(optimizer="sgd", lr=0.2)
    a = run_dai(wl, tc, 4, 60, 2.0, 10)
    b = run_dai(wl, tc, 4, 60, 2.0, 10)
    c = run_dai(wl, tc, 0, 60, 2.0, 10)
    assert a.curve == b.curve and a.curve != c.curve


def test_sweep_writes_data_curve_and_note(tmp_path):
    """A tiny sweep writes the JSON/CSV data and the PNG; normalised steps at s = 0 are 1 and the note quotes
    the measured numbers."""
    spec = SweepSpec(models={"shallow": "digits-logreg"}, optimizers={"sgd": (0.2,)}, staleness=(0, 8),
                     target_acc=0.7, max_steps=300)
    cells = run_staleness_sweep(spec)
    save(cells, spec, tmp_path)
    png = plot_curve(cells, spec, tmp_path)
    assert png.stat().st_size > 10000
    data = json.loads((tmp_path / "staleness_sweep.json").read_text())
    c0 = next(c for c in data["cells"] if c["staleness"] == 0)
    assert c0["normalised"] == 1.0 and c0["steps"] is not None
    assert f"s=0: {c0['steps']:.0f}" in trend_note(cells, spec)
    assert (tmp_path / "staleness_sweep.csv").read_text().count("\n") == 3


def test_ps_optimizer_options_reach_the_emulation():
    """The emulation updates through ps.optim with tau = the drawn delay: staleness-aware lr changes a stale run
    but leaves s = 0 (tau always 0) bit-for-bit unchanged."""
    wl = get_workload("digits-logreg", 1, 16, seed=0)
    plain, aware = TrainConfig(optimizer="sgd", lr=0.2), TrainConfig(optimizer="sgd", lr=0.2, staleness_lr=True)
    assert run_dai(wl, plain, 0, 30, 2.0, 10).curve == run_dai(wl, aware, 0, 30, 2.0, 10).curve
    assert run_dai(wl, plain, 8, 30, 2.0, 10).curve != run_dai(wl, aware, 8, 30, 2.0, 10).curve
