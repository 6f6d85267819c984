"""The step replayed on shared cores (parallelism/step_replay.py) and the step model's use of it.

References by hand: processor sharing of n equal jobs on C cores takes n/C of one; a schedule without latency
replays as schedule.simulate does; a latency-bound 1F1B of p = 2 pays one link latency per micro-batch (the tour's
claim: a round trip every p micro-batches)."""

from __future__ import annotations

import pytest

from pslab.parallelism.cluster import Cluster, ClusterError
from pslab.parallelism.memory_model import Layout, Shape
from pslab.parallelism.schedule import make_schedule, simulate
from pslab.parallelism.step_model import predict
from pslab.parallelism.step_replay import ReplayError, cpu, pipeline_programs, recv, replay, send, wait

GPT = Shape(layers=4, hidden=256, heads=8, seq=128, vocab=1000, micro_batch=2)


@pytest.mark.parametrize("sched,p,m,v", [("1f1b", 2, 4, 1), ("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1),
                                         ("1f1b", 2, 4, 2), ("1f1b", 4, 8, 2)])
def test_a_pipeline_without_latency_replays_as_the_schedule_simulator(sched, p, m, v):
    """Free links, a core per rank: the makespan is schedule.simulate's (forward 1/3, backward 2/3 of a stage)."""
    progs = pipeline_programs(p, m, v, sched, [3.0] * p, [(0.0, 0.0)] * p, [0.0] * (p * v - 1), [[]] * p)
    assert max(replay(progs)) == pytest.approx(simulate(make_schedule(sched, p, m, v), 1 / m, 2 / m).makespan,
                                               rel=1e-12)


def test_a_latency_bound_1f1b_pays_a_latency_per_micro_batch():
    """p = 2, m = 8, compute ≈ 0, one message α: stage 0's backward of micro-batch i needs its forward's round
    trip, two micro-batches in flight, so the step is m·α (+ the compute)."""
    alpha, m = 5.0, 8
    progs = pipeline_programs(2, m, 1, "1f1b", [1e-6, 1e-6], [(0.0, 0.0)] * 2, [alpha], [[], []])
    assert max(replay(progs)) == pytest.approx(m * alpha, rel=1e-3)
    gpipe = pipeline_programs(2, m, 1, "gpipe", [1e-6, 1e-6], [(0.0, 0.0)] * 2, [alpha], [[], []])
    assert max(replay(gpipe)) == pytest.approx(2 * alpha, rel=1e-3)     # GPipe: all forwards, then all backwards


def test_processor_sharing_of_cores():
    """n equal cpu jobs on C < n cores end together at n/C; a rank that waits leaves its core to the others;
    weights count a program as that many ranks."""
    assert replay([[cpu(1.0), wait(0.5)]] * 4, cores=2) == pytest.approx([2.5] * 4)
    assert replay([[cpu(1.0)], [wait(1.0), cpu(1.0)]], cores=1) == pytest.approx([1.0, 2.0])
    assert replay([[cpu(1.0)], [cpu(1.0)]], cores=1) == pytest.approx([2.0, 2.0])
    assert replay([[cpu(1.0)]], cores=2, weights=[4]) == pytest.approx([2.0])
    assert replay([[cpu(1.0)]] * 3) == pytest.approx([1.0] * 3)                  # 0 cores: one each


def test_messages_arrive_after_their_delay_and_a_missing_one_is_a_deadlock():
    progs = [[cpu(1.0), send(("x",), 2.0), cpu(1.0)], [recv(("x",)), cpu(0.5)]]
    assert replay(progs) == pytest.approx([2.0, 3.5])
    with pytest.raises(ReplayError, match="never sent"):
        replay([[recv(("y",))], [cpu(1.0)]])


def test_predict_on_shared_cores_is_the_closed_form_with_contention_without_a_pipeline():
    """dp = 4 on 2 shared cores: every rank computes at once at half speed, so the step is 2·(compute + overhead) +
    the exposed communication; with a core per rank (shared_cores = 0) the closed form is unchanged."""
    base = Cluster("t", 2, 2, 80e9, 100e12, 1.0, 1e9, 1e-4, 1e8, 1e-3, step_overhead_s=0.01)
    own = predict(GPT, Layout(dp=4), base, global_batch=8, overlap=False, precision="fp32", algorithm="pslab")
    shared = predict(GPT, Layout(dp=4), base.with_(shared_cores=2), global_batch=8, overlap=False, precision="fp32",
                     algorithm="pslab")
    assert own.step_s == pytest.approx(own.compute_s + own.exposed_comm_s + own.overhead_s, rel=1e-12)
    assert shared.step_s == pytest.approx(2 * (own.compute_s + own.overhead_s) + own.exposed_comm_s, rel=1e-9)
    assert shared.step_s == pytest.approx(shared.compute_s + shared.bubble_s + shared.exposed_comm_s
                                          + shared.overhead_s, rel=1e-12)


def test_predict_on_shared_cores_lets_a_pipeline_use_the_cores_its_waiting_stage_frees():
    """tp = 2 x pp = 2 on 2 cores with a slow pipeline link: the replay is below the closed form (which charges
    every boundary message and the contention in full) and above the dedicated replay (no contention)."""
    c = Cluster("t", 2, 2, 80e9, 3e9, 1.0, 1e9, 1e-4, 1e8, 2e-3, step_overhead_s=0.005)
    lay = Layout(tp=2, pp=2, micro_batches=4)
    kw = dict(global_batch=8, overlap=False, precision="fp32", algorithm="pslab", placement="spread")
    closed = predict(GPT, lay, c, **kw)
    shared = predict(GPT, lay, c.with_(shared_cores=2), **kw)
    contended = 2 * (closed.compute_s + closed.overhead_s) + closed.exposed_comm_s + closed.bubble_s
    assert closed.step_s < shared.step_s < contended


def test_the_software_share_of_a_message_takes_turns_on_shared_cores():
    """message_cpu_s = the intra link's α (and no bytes' time: unlimited bandwidth): an all-intra dp = 4's gradient
    sync is all CPU, so on 2 shared cores it doubles with the compute; with message_cpu_s = 0 it is a wait and does
    not; with a finite bandwidth the bytes' B/β stay a wait."""
    inf = float("inf")
    one = Cluster("t", 4, 1, 80e9, 100e12, 1.0, inf, 1e-4, inf, 1e-4, step_overhead_s=0.01, shared_cores=2)
    kw = dict(global_batch=8, overlap=False, precision="fp32", algorithm="pslab")
    own = predict(GPT, Layout(dp=4), one.with_(shared_cores=0), **kw)
    wait_ = predict(GPT, Layout(dp=4), one, **kw)
    cpu_ = predict(GPT, Layout(dp=4), one.with_(message_cpu_s=1e-4), **kw)
    assert wait_.step_s == pytest.approx(2 * (own.compute_s + own.overhead_s) + own.exposed_comm_s, rel=1e-9)
    assert cpu_.step_s == pytest.approx(2 * own.step_s, rel=1e-9)
    slow = one.with_(intra_bandwidth_Bps=1e8, inter_bandwidth_Bps=1e8, message_cpu_s=1e-4)
    own_slow = predict(GPT, Layout(dp=4), slow.with_(shared_cores=0), **kw)
    wire = sum(t.wire_seconds for t in own_slow.comm)
    assert wire > 0.1 * own_slow.exposed_comm_s
    assert predict(GPT, Layout(dp=4), slow, **kw).step_s == pytest.approx(2 * own_slow.step_s - wire, rel=1e-9)


def test_the_fixed_cost_of_a_micro_batch_is_paid_per_micro_batch_and_stage_share():
    """micro_batch_overhead_s c: a dp step pays c once; a stage of a pp = 2 pipeline with m micro-batches pays
    m·c·(its units / (L + 2)) — the text model cut [Embed, Block] | [Block, Head] pays m·c/2 per stage."""
    from pslab.parallelism.step_model import stage_compute_all
    c0 = Cluster("t", 4, 1, 80e9, 100e12, 1.0)
    c = c0.with_(micro_batch_overhead_s=0.004)
    shape = Shape(layers=2, hidden=32, heads=4, seq=32, vocab=64, micro_batch=2)
    flat = stage_compute_all(shape, Layout(dp=2, micro_batches=1), c0, 4, "pslab")
    assert stage_compute_all(shape, Layout(dp=2, micro_batches=1), c, 4, "pslab") == pytest.approx(
        [flat[0] + 0.004])
    lay = Layout(pp=2, micro_batches=4)
    base = stage_compute_all(shape, lay, c0, 8, "pslab")
    assert stage_compute_all(shape, lay, c, 8, "pslab") == pytest.approx([b + 4 * 0.004 / 2 for b in base])


def test_calibration_recovers_a_micro_batch_cost_from_the_models_own_points():
    """fit_micro_batch_overhead on points the step model itself produced with a known split of the dp intercept
    (4 ranks on 2 shared cores, costs per core = measured · 2/4) returns that split's c."""
    from pslab.experiments.bench.calibrate import _per_core, fit_micro_batch_overhead
    from pslab.experiments.studies.plan_check import predict_row
    measured = Cluster("here", 2, 2, 8e9, 10e9, 1.0, 2e9, 3e-4, 2e7, 2e-3, step_overhead_s=0.012,
                       message_cpu_s=2e-4, shared_cores=2)
    true_c = 0.005
    truth = _per_core(measured.with_(gpus_per_node=4, nodes=1), 0.012 - true_c, true_c, 4, 2)
    assert truth.peak_flops == pytest.approx(20e9) and truth.step_overhead_s == pytest.approx(0.0035)
    points = {m: predict_row({"dp": 2, "pp": 2, "micro_batches": m, "schedule": "gpipe"}, truth)["step_s"]
              for m in (1, 2, 4, 8)}
    assert fit_micro_batch_overhead(points, measured, 4, 2, (3e-4, 2e9)) == pytest.approx(true_c, rel=1e-3)
    one_core_each = _per_core(measured, 0.01, 0.002, 2, 2)            # no more ranks than cores: as measured
    assert (one_core_each.peak_flops, one_core_each.step_overhead_s) == (10e9, 0.01)


def test_cluster_shared_cores_is_validated_and_round_trips():
    c = Cluster("t", 2, 2, 80e9, 1e12, shared_cores=2)
    assert Cluster.from_json(c.to_json()) == c
    for bad in (-1, 1.5, True):
        with pytest.raises(ClusterError, match="shared_cores"):
            Cluster("t", 2, 2, 80e9, 1e12, shared_cores=bad)
    for field in ("micro_batch_overhead_s", "message_cpu_s"):
        with pytest.raises(ClusterError, match=field):
            Cluster("t", 2, 2, 80e9, 1e12, **{field: -1e-3})
