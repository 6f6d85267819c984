"""`pslab compare --preset communication` (experiments/studies/communication.py): the verdicts' arithmetic on made-up
rows (the band, the paired bootstrap, a target never reached), the loss-vs-bytes curve read off the records, one
small real study end to end (bytes ratios equal to H and to the compressor's, the report and its plots, the
simulated part), and bad input as one line."""

from __future__ import annotations

import json
import math

import pytest

from pslab.experiments.cli import main
from pslab.experiments.studies.communication import (Arm, REFERENCE, curve, run_communication, sim_lr,
                                                     study_config, verdicts)
from pslab.experiments.studies.compare import default_config


def _row(loss: float, t: float | None, bps: float = 100.0) -> dict:
    return {"final_test_loss": loss, "time_to_target_s": t, "bytes_per_sample": bps}


def test_verdicts_band_bootstrap_and_a_target_never_reached():
    """bsp losses 1.0, 1.1, 1.2 (sd 0.1: band ± 0.2). An arm at 1.15 median is inside it in every replicate whose
    medians stay within 0.2; one at 2.0 is outside in all; bytes ratios are medians' ratios; a target an arm never
    reaches is slower than any reached one."""
    res = {REFERENCE: [_row(1.0, 2.0), _row(1.1, 3.0), _row(1.2, 4.0)],
           "near": [_row(1.05, 1.0, 25.0), _row(1.15, 1.5, 25.0), _row(1.25, 2.0, 25.0)],
           "far": [_row(2.0, None, 10.0), _row(2.1, None, 10.0), _row(2.2, 9.0, 10.0)]}
    v = {x["arm"]: x for x in verdicts(res)}
    assert v["near"]["band"] == pytest.approx(0.2) and v["near"]["within_band"]
    assert v["near"]["d_loss"] == pytest.approx(0.05) and v["near"]["fewer_bytes"] == pytest.approx(4.0)
    assert v["near"]["faster"] and v["near"]["t_target"] == 1.5 and v["near"]["ref_t_target"] == 3.0
    assert 0.5 < v["near"]["within_share"] <= 1.0          # resampled medians may land 0.25 apart: not always
    assert not v["far"]["within_band"] and v["far"]["within_share"] == 1.0
    assert not v["far"]["faster"] and v["far"]["t_target"] is None and v["far"]["fewer_bytes"] == pytest.approx(10)
    assert REFERENCE not in v


def test_the_curve_counts_bytes_moved_per_worker_up_to_each_evaluation():
    run = {"summary": {"workers": 2},
           "updates": [{"time_s": 0.1, "bytes_sent": 100, "bytes_recv": 10}, {"time_s": 0.2, "bytes_sent": 300},
                       {"time_s": 0.5, "bytes_sent": 600, "bytes_recv": 400}],
           "evals": [{"updates": 0, "time_s": 0.0, "test_loss": 2.0}, {"updates": 2, "time_s": 0.2, "test_loss": 1.5},
                     {"updates": 3, "time_s": 0.6, "test_loss": 1.0}]}
    c = curve(run, batch_size=8)
    assert c == {"bytes": [0.0, 205.0, 705.0], "time_s": [0.0, 0.2, 0.6], "samples": [0.0, 16.0, 24.0],
                 "loss": [2.0, 1.5, 1.0]}


def test_the_study_puts_every_worker_on_its_own_host_behind_the_slow_link():
    c = study_config(default_config(None, ["train.workers=3"]))
    assert (c.topology.hosts, c.topology.gpus_per_host) == (3, 1)
    assert c.topology.inter_latency_us == pytest.approx(2000) and c.topology.inter_bandwidth_GBps == pytest.approx(2e-3)
    assert c.simulate.latency_inter_s == pytest.approx(0.002) and c.simulate.bandwidth_inter_Bps == pytest.approx(2e6)
    assert c.simulate.workers_per_host == 1 and c.faults.on_failure == "abort"
    assert sim_lr(c, 64) == pytest.approx(0.2 * 3 / 64)          # the real runs' step lr, 3 x 0.2, kept at K = 64


@pytest.mark.timeout(300)
def test_a_small_study_end_to_end(tmp_path):
    """bsp, local-sgd:4 and top-k 1 % on 2 seeds, 16 steps, then the simulator at 8 workers: the measured bytes per
    sample of local-sgd:4 are exactly 1/4 of bsp's (⌈16/4⌉ averages of the parameters for 16 all-reduces of the
    gradient; same tensor sizes), top-k's are the formula's (K − 1)·k·8 per step against bsp's (K − 1)·4n; the
    report holds both tables' rows, the verdicts and the three plots; the JSON has every run."""
    arms = (Arm("bsp", "allreduce"), Arm("local-sgd:4", "local-sgd:4"), Arm("topk 1%", "allreduce", "topk:0.01"))
    cfg = default_config(None, ["train.steps=16", "train.base_step_s=0", "train.eval_every=4", "train.workers=2"])
    report, data = run_communication(cfg, tmp_path, seeds=2, straggler=False, sim_workers=8, quiet=True,
                                     arms=arms)
    v = {x["arm"]: x for x in data["verdicts"]["none"]}
    assert v["local-sgd:4"]["fewer_bytes"] == pytest.approx(4.0, rel=1e-12)
    n, K = 4810, 2                                   # digits-mlp's parameters; direct exchange (S <= 32 KiB)
    k = math.ceil(0.01 * n)
    assert v["topk 1%"]["fewer_bytes"] == pytest.approx((K - 1) * 4 * n / ((K - 1) * k * 8), rel=1e-12)
    text = report.read_text()
    for s in ("| bsp |", "| local-sgd:4 |", "| topk 1% |", "**local-sgd:4**", "Simulated at 8 workers",
              "loss_vs_bytes.png", "loss_vs_time.png", "loss_vs_samples.png"):
        assert s in text, s
    for p in ("loss_vs_bytes.png", "loss_vs_time.png", "loss_vs_samples.png"):
        assert (tmp_path / p).stat().st_size > 10_000
    saved = json.loads((tmp_path / "communication.json").read_text())
    assert {a: len(r) for a, r in saved["results"]["none"].items()} == {"bsp": 2, "local-sgd:4": 2, "topk 1%": 2}
    assert [r["label"] for r in saved["sim"]] == ["bsp", "local-sgd:4", "topk 1%"]
    assert saved["sim"][0]["bytes_moved_per_worker"] > 0 and all(r["final_test_loss"] < 2.3 for r in saved["sim"])


@pytest.mark.parametrize("argv, fragment", [
    (["compare", "--seeds", "3"], "--seeds applies to --preset communication"),
    (["compare", "--preset", "failure", "--sim-workers", "0"], "--sim-workers applies to --preset communication"),
    (["compare", "--preset", "communication", "--strategies", "allreduce"], "--strategies does not apply"),
    (["compare", "--preset", "communication", "--simulate"], "--simulate does not apply"),
    (["compare", "--preset", "communication", "--seeds", "1"], "--seeds must be >= 2"),
    (["compare", "--preset", "communication", "--sim-workers", "1"], "--sim-workers must be 0"),
    (["compare", "--preset", "communication", "--set", 'faults.events=[{kill="worker:1", at_step=5}]'],
     "--preset communication, arm 'local-sgd:4'"),
])
def test_bad_input_is_one_line(argv, fragment, capsys):
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pslab: error:") and fragment in err[0], err
