"""`pslab plan --calibrate` and `--check` as functions: experiments/bench/calibrate.py, experiments/studies/plan_check.py.

Calibration recovers an emulated link (the emulation only ever adds time: a 2 ms latency must measure >= 2 ms, a
bandwidth must not measure faster than emulated, beyond noise) and returns a Cluster that survives its JSON file.
The check's rows carry both figures and the planner's bytes equal the run's measured bytes, per kind and per link
(never an assertion on how well the times agree: that is the study's result, not a property of the code)."""

from __future__ import annotations

import math

import pytest

from pslab.collectives.topology import Topology
from pslab.experiments.bench.calibrate import CalibrationError, fit_line, model_flops, workload_shape
from pslab.parallelism.cluster import Cluster

LAT, BW = 2e-3, 20e6


def test_fit_line_recovers_a_line_and_refuses_one_point():
    a, b = fit_line([1.0, 2.0, 4.0], [3.0 + 2 * 1, 3.0 + 2 * 2, 3.0 + 2 * 4])
    assert a == pytest.approx(3.0) and b == pytest.approx(2.0)
    with pytest.raises(CalibrationError):
        fit_line([2.0, 2.0], [1.0, 3.0])


def test_workload_shape_is_the_text_transformer_and_flops_follow_narayanan():
    """Shape off the workload (2 blocks, width 32, 4 heads, 32 tokens, the corpus' characters); FLOPs of a step:
    72·B·s·L·h²·(1 + s/(6h) + V/(12·L·h)), linear in the batch."""
    from pslab.experiments.workloads import get_workload
    wl = get_workload("text-transformer", 1, 8, 0)
    sh = workload_shape(8)
    assert (sh.layers, sh.hidden, sh.heads, sh.micro_batch) == (2, 32, 4, 8)
    assert sh.seq == wl.data.x_train.shape[1] and sh.vocab == wl.data.num_classes
    B, s, L, h, V = 8, sh.seq, 2, 32, sh.vocab
    assert model_flops(sh, 8) == pytest.approx(72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h)))
    assert model_flops(sh, 16) == pytest.approx(2 * model_flops(sh, 8))


@pytest.fixture(scope="module")
def calibrated():
    """Batches 2 and 32 (16x the FLOPs: ~17 ms apart here, against ~20 ms of per-step overhead), and up to 3
    attempts: on a loaded machine one pair of short runs can still come out inverted, which calibrate refuses."""
    from pslab.experiments.bench.calibrate import calibrate
    topo = Topology(2, 1, inter_latency_s=LAT, inter_bandwidth_Bps=BW)
    for attempt in range(3):
        details: dict = {}
        try:
            return topo, calibrate(topo, progress=False, reps=2, sizes=(2, 32), details=details,
                                   micro_batches=(1, 4)), details
        except CalibrationError:
            if attempt == 2:
                raise


def test_calibrate_recovers_the_emulated_link_and_round_trips(calibrated):
    topo, c, details = calibrated
    assert c.name == "here" and (c.nodes, c.gpus_per_node) == (2, 1) and c.efficiency == 1.0
    assert c.peak_flops > 1e6 and c.step_overhead_s >= 0 and c.gpu_memory_bytes > 0
    assert Cluster.from_json(c.to_json()) == c
    assert LAT <= c.inter_latency_s < 10 * LAT                       # emulation is a lower bound
    assert BW / 4 < c.inter_bandwidth_Bps < 1.5 * BW
    (s1, t1), (s2, t2) = details["links"]["inter"]["points"]        # the raw points: one way >= latency + S/bw
    assert t1 >= LAT + s1 / BW and t2 >= LAT + s2 / BW
    assert set(details["compute"]["all"]) == {2, 32}
    assert set(details["micro_batches"]) == {1, 4} and c.micro_batch_overhead_s >= 0     # the pipeline runs
    per_core = details["cores"] / 2 if 2 > details["cores"] else 1.0       # 2 ranks on 1 core: stored per core
    assert c.step_overhead_s + c.micro_batch_overhead_s == pytest.approx(details["compute"]["overhead_s"] * per_core)
    assert c.shared_cores == (details["cores"] if 2 > details["cores"] else 0)


def test_check_one_config_has_both_figures_and_equal_bytes(calibrated, tmp_path):
    from pslab.experiments.studies.plan_check import check, format_table
    topo, c, _ = calibrated
    rows = check(c, topo, [{"label": "dp=2", "dp": 2}], repeats=1, steps=6, progress=False, root=tmp_path)
    (r,) = rows
    assert r["label"] == "dp=2" and r["predicted_s"] > 0 and r["measured_s"] > 0
    assert math.isclose(r["ratio"], r["predicted_s"] / r["measured_s"])
    assert r["measured_bytes_by_kind"]["dp gradient sync"] > 0
    assert r["planner_bytes_by_kind"] == r["measured_bytes_by_kind"]
    assert r["measured_bytes_by_link"]["inter"] > 0 and r["measured_bytes_by_link"]["intra"] == 0
    assert r["planner_bytes_by_link"]["inter"] == r["measured_bytes_by_link"]["inter"]
    assert r["bytes_equal"]
    text = format_table(rows)
    assert "dp=2" in text and "= measured" in text


def test_check_refuses_a_config_that_does_not_fill_the_topology(calibrated):
    from pslab.experiments.studies.plan_check import CheckError, check
    topo, c, _ = calibrated
    with pytest.raises(CheckError, match="ranks"):
        check(c, topo, [{"dp": 4}], progress=False)
    with pytest.raises(CheckError, match="unknown"):
        check(c, topo, [{"dp": 2, "tpp": 2}], progress=False)


def test_ranking_is_spearman_with_tied_ranks_and_the_top_picks_excess():
    """Spearman's ρ: 1 for the same order, −1 for the reverse, 0.8 for one swap of neighbours among 4; tied values
    share their mean rank and ρ is the Pearson correlation of the ranks (the textbook 1 − 6Σd²/(n(n²−1)) holds
    only without ties); the top pick's excess is its measured time over the measured best's, minus 1."""
    from pslab.experiments.studies.plan_check import CheckError, ranking

    def rows(pred, meas):
        return [{"label": str(i), "predicted_s": p, "measured_s": m, "error_pct": abs(p - m) / m * 100}
                for i, (p, m) in enumerate(zip(pred, meas))]
    assert ranking(rows([1, 2, 3, 4], [10, 20, 30, 40]))["spearman"] == pytest.approx(1.0)
    assert ranking(rows([1, 2, 3, 4], [40, 30, 20, 10]))["spearman"] == pytest.approx(-1.0)
    assert ranking(rows([1, 2, 3, 4], [1.1, 2.5, 2.4, 5]))["spearman"] == pytest.approx(0.8)
    # ties: predicted (1, 2, 2, 3) -> ranks (1, 2.5, 2.5, 4); measured in order -> ranks (1, 2, 3, 4)
    assert ranking(rows([1, 2, 2, 3], [1, 2, 3, 4]))["spearman"] == pytest.approx(4.5 / math.sqrt(4.5 * 5))
    r = ranking(rows([1, 2, 3], [0.12, 0.10, 0.3]))
    assert (r["top_pick"], r["best"]) == ("0", "1") and r["top_pick_excess"] == pytest.approx(0.2)
    assert ranking(rows([1, 1], [1, 2]))["spearman"] is None          # one side all tied: no order to compare
    with pytest.raises(CheckError, match="at least 2 configs"):
        ranking(rows([1], [1]))
