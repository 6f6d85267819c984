"""The planner's communication and step-time model (parallelism/comm_model.py, parallelism/step_model.py).

References are written out by hand from the papers' formulas (ring 2(N−1)/N, Megatron's 4 all-reduces per layer,
the bubble (p−1)/(m+p−1), Narayanan et al.'s eq. (3) for a Table 1 model), or measured: the bytes a real dp = 4
gradient sync puts on each emulated link class under a 2 x 2 `Topology` (collectives.topology.link_bytes). The
engines' own per-kind bytes are checked against `algorithm="pslab"` in tests/experiments/test_engine_runs.py."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from pslab import collectives
from pslab.collectives.topology import Topology, link_bytes, reset_link_bytes
from pslab.parallelism.cluster import Cluster, preset
from pslab.parallelism.comm_model import CommModelError, Placement, bytes_by_kind, bytes_by_link, ring, step_comm
from pslab.parallelism.memory_model import Layout, Shape
from pslab.parallelism.models import tiny_transformer
from pslab.parallelism.step_model import StepModelError, model_flops, predict

GPT = Shape(layers=4, hidden=256, heads=8, seq=128, vocab=1000, micro_batch=2)


def _cluster(gpus_per_node: int, nodes: int = 1, **kw) -> Cluster:
    return Cluster("test", gpus_per_node, nodes, 80e9, 100e12, 1.0, **kw)


def _by(terms, kind: str, link: str | None = None) -> float:
    return sum(t.bytes for t in terms if t.kind == kind and (link is None or t.link == link))


def test_ring_all_reduce_moves_2_n_minus_1_over_n_of_the_gradients():
    """dp = 4 inside a node: Σ over ranks of 2(N−1)/N·Ψ·g with Ψ = the Shape's parameter count, written out."""
    h, L, V, s = 256, 4, 1000, 128
    psi = V * h + s * h + L * (12 * h * h + 13 * h) + 2 * h + h * V + V
    assert GPT.params() == psi
    terms = step_comm(GPT, Layout(dp=4), _cluster(4), grad_bytes=2)
    assert _by(terms, "dp gradient sync") == pytest.approx(4 * 2 * 3 / 4 * psi * 2, rel=1e-12)
    assert {t.link for t in terms} == {"intra"} and all(t.overlappable for t in terms)
    # the ring's exact chunking (collectives/ring.py): 2(N−1)·numel elements in all, whatever N divides
    pl = Placement(Layout(dp=3), _cluster(3), "packed")
    c = ring(pl, [0, 1, 2], 1001, 4, "ar")
    assert c.bytes == {"intra": 2 * 2 * 1001 * 4, "inter": 0}
    # a flat ring over 2 nodes x 2 crosses twice; what the crossing ranks send is collectives' own exact count
    from pslab.collectives.hierarchical import exact_inter_bytes
    pl = Placement(Layout(dp=4), _cluster(2, 2), "packed")
    for numel in (7, 1001, 30011):
        c = ring(pl, [0, 1, 2, 3], numel, 4, "ar")
        assert c.bytes["inter"] == sum(exact_inter_bytes(numel, 4, 2, 2, "ring"))
        assert c.bytes["intra"] + c.bytes["inter"] == 4 * 2 * 3 * numel


def test_pslab_ring_passes_pay_their_latency_hop_by_hop_and_the_closing_acknowledgement():
    """collectives/ring.py: member i sends step j once step j−1 arrived from its left, and waits at the end for its
    right neighbour's empty acknowledgement. Worked by hand (α = 1 ms inside a node, 10 ms across):
    one link class, N members, s steps: (s + 1)·α; 2 members on 2 nodes, one step: 2·α_inter (the textbook ring
    charges 1); 2 nodes x 2 packed, a reduce-scatter (3 steps): 2 crossings and 1 intra hop of the data lie on the
    critical path (the other intra hop pipelines), and the members whose right neighbour sits across then wait one
    more: 3·α_inter + α_intra (the textbook rule says 3·α_inter)."""
    from pslab.parallelism.comm_cost import pass_latency
    cl = Cluster("t", 2, 2, 80e9, 1e12, 1.0, intra_latency_s=1e-3, intra_bandwidth_Bps=math.inf,
                 inter_latency_s=10e-3, inter_bandwidth_Bps=math.inf)
    one = Cluster("t", 4, 1, 80e9, 1e12, 1.0, intra_latency_s=1e-3, intra_bandwidth_Bps=math.inf)
    assert pass_latency(Placement(Layout(dp=4), one, "packed"), [0, 1, 2, 3], 3) == pytest.approx(4e-3)
    assert pass_latency(Placement(Layout(dp=4), one, "packed"), [0, 1, 2, 3], 6) == pytest.approx(7e-3)
    pl = Placement(Layout(dp=4), cl, "packed")                  # ranks 0, 1 on node 0; 2, 3 on node 1
    assert pass_latency(pl, [0, 2], 1) == pytest.approx(20e-3)
    assert pass_latency(pl, [0, 1, 2, 3], 3) == pytest.approx(31e-3)
    assert ring(pl, [0, 2], 1000, 4, "rs", ack=True).secs["inter"] == pytest.approx(20e-3)
    assert ring(pl, [0, 2], 1000, 4, "rs").secs["inter"] == pytest.approx(10e-3)     # textbook: N − 1 latencies


def test_tp_bytes_per_layer_are_four_all_reduces_of_the_activation():
    """Megatron: 2 all-reduces forward + 2 backward per layer and micro-batch, of b·s·h·act bytes; full recompute
    runs the forward ones again (6); sequence parallelism moves the same bytes as all-gathers + reduce-scatters."""
    T, m = 4, 3
    A = 2 * 128 * 256 * 2                                   # b·s·h·2 bytes
    per_rank_per_allreduce = 2 * (T - 1) / T * A
    lay = Layout(tp=T, pp=1, micro_batches=m)
    tp = _by(step_comm(GPT, lay, _cluster(4)), "tp activations")
    assert tp == pytest.approx(T * GPT.layers * m * 4 * per_rank_per_allreduce, rel=1e-12)
    full = _by(step_comm(GPT, Layout(tp=T, micro_batches=m, recompute="full"), _cluster(4)), "tp activations")
    assert full == pytest.approx(tp * 6 / 4, rel=1e-12)
    sp = _by(step_comm(GPT, Layout(tp=T, micro_batches=m, sp=True), _cluster(4)), "tp activations")
    assert sp == pytest.approx(tp, rel=1e-12)


def test_pp_boundaries_send_activation_and_gradient_per_micro_batch():
    """p = 4 stages, m = 8: 3 boundaries x 8 micro-batches x (activation forward + gradient back)."""
    A = 2 * 128 * 256 * 2
    terms = step_comm(GPT, Layout(pp=4, micro_batches=8), _cluster(4))
    assert _by(terms, "pp boundaries") == 3 * 8 * 2 * A


def test_placement_packed_vs_spread_flips_the_tp_link():
    """dp = 2 x tp = 8 on 2 nodes of 8: packed keeps tp inside a node (dp crosses), spread the other way round."""
    c = _cluster(8, 2, intra_bandwidth_Bps=400e9, inter_bandwidth_Bps=50e9)
    lay = Layout(dp=2, tp=8)
    packed = {(t.kind, t.link) for t in step_comm(GPT, lay, c, placement="packed") if t.bytes}
    spread = {(t.kind, t.link) for t in step_comm(GPT, lay, c, placement="spread") if t.bytes}
    assert packed == {("tp activations", "intra"), ("dp gradient sync", "inter")}
    assert spread == {("tp activations", "inter"), ("dp gradient sync", "intra")}
    # the same bytes either way, but tp across the slow link costs more time
    tp_s = {pl: sum(t.seconds for t in step_comm(GPT, lay, c, placement=pl) if t.kind == "tp activations")
            for pl in ("packed", "spread")}
    assert tp_s["spread"] == pytest.approx(tp_s["packed"] * 400 / 50, rel=1e-9)
    with pytest.raises(CommModelError, match="placement"):
        step_comm(GPT, lay, c, placement="diagonal")


def test_hierarchical_dp_has_an_intra_and_an_inter_term():
    """dp = 4 on 2 nodes x 2: reduce-scatter + all-gather inside (2(L−1)/L·S per rank, intra) and the all-reduce
    across of S/L (2(H−1)/H·S/L per rank, inter)."""
    S = GPT.params() * 2
    terms = step_comm(GPT, Layout(dp=4), _cluster(2, 2))
    assert _by(terms, "dp gradient sync", "intra") == pytest.approx(4 * 2 * 1 / 2 * S, rel=1e-12)
    assert _by(terms, "dp gradient sync", "inter") == pytest.approx(4 * 2 * 1 / 2 * S / 2, rel=1e-12)


def test_zero_moves_what_the_paper_says():
    """ZeRO-1/2: reduce-scatter + all-gather = 2(N−1)/N·Ψ; ZeRO-3: 3(N−1)/N·Ψ (Rajbhandari et al. §7)."""
    S = GPT.params() * 2
    for z, k in ((1, 2), (2, 2), (3, 3)):
        terms = step_comm(GPT, Layout(dp=4, zero=z), _cluster(4))
        assert bytes_by_kind(terms) == {"zero RS + AG": pytest.approx(4 * k * 3 / 4 * S, rel=1e-12)}


def test_zero_2_and_3_pay_per_micro_batch_under_gradient_accumulation():
    """m = 4 micro-batches: ZeRO-1 keeps whole gradients (2(N−1)/N·Ψ per step); ZeRO-2 reduce-scatters after each
    micro-batch ((m+1)(N−1)/N); ZeRO-3 also all-gathers the parameters for each forward and backward (3m(N−1)/N)."""
    S, m = GPT.params() * 2, 4
    for z, k in ((1, 2), (2, m + 1), (3, 3 * m)):
        terms = step_comm(GPT, Layout(dp=4, zero=z, micro_batches=m), _cluster(4))
        assert bytes_by_kind(terms) == {"zero RS + AG": pytest.approx(4 * k * 3 / 4 * S, rel=1e-12)}, z


def test_model_flops_of_a_narayanan_table_1_model():
    """GPT-3 175B of Narayanan et al. 2021 Table 1 (h = 12288, 96 layers, s = 2048, V = 51200, batch 1536), eq. (3)
    with full recompute, by hand: 96·1536·2048·96·12288²·(1 + 2048/73728 + 51200/18874368) = 4.5110e18 FLOPs."""
    shape = Shape(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200)
    by_hand = 96 * 1536 * 2048 * 96 * 12288 ** 2 * (1 + 2048 / 73728 + 51200 / 18874368)
    assert by_hand == pytest.approx(4.5110e18, rel=1e-4)
    assert model_flops(shape, 1536, "full") == pytest.approx(by_hand, rel=1e-12)
    assert model_flops(shape, 1536) == pytest.approx(
        72 * 1536 * 2048 * 96 * 12288 ** 2 * (1 + 2048 / 73728 + 51200 / 14155776), rel=1e-12)
    # selective recompute: only the attention scores' forward again (4·B·s²·h per layer)
    assert model_flops(shape, 1536, "selective") == pytest.approx(
        model_flops(shape, 1536) + 4 * 1536 * 2048 ** 2 * 12288 * 96, rel=1e-12)


def test_bubble_is_p_minus_1_over_m_plus_p_minus_1_of_the_pipeline_time():
    """Free links: step = compute + bubble, and bubble / step = (p−1)/(m+p−1) for 1F1B and GPipe alike."""
    c = _cluster(8)
    for sched in ("1f1b", "gpipe"):
        for p, m in ((2, 2), (4, 8), (4, 16)):
            pr = predict(GPT, Layout(pp=p, schedule=sched), c, global_batch=m * GPT.micro_batch)
            assert pr.layout.micro_batches == m and pr.exposed_comm_s == 0
            assert pr.bubble_s / pr.step_s == pytest.approx((p - 1) / (m + p - 1), rel=1e-12)


def test_interleaving_divides_the_bubble_by_v_and_multiplies_the_boundary_bytes():
    """Interleaved 1F1B (v chunks per stage): bubble / step = (p−1)/(v·m+p−1) on free links; the pp boundaries
    carry (p·v−1)/(p−1) times 1F1B's bytes (every cut of the p·v-way cut crosses ranks)."""
    from dataclasses import replace
    c, deep = _cluster(8), replace(GPT, layers=12)
    for p, m, v in ((2, 2, 2), (4, 8, 2), (4, 8, 3)):
        lay = Layout(pp=p, micro_batches=m, virtual_stages=v)
        pr = predict(deep, lay, c, global_batch=m * GPT.micro_batch)
        assert pr.layout.virtual_stages == v and pr.exposed_comm_s == 0
        assert pr.bubble_s / pr.step_s == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-12)
        plain_ = step_comm(deep, Layout(pp=p, micro_batches=m), c)
        inter = step_comm(deep, lay, c)
        assert bytes_by_kind(inter)["pp boundaries"] == pytest.approx(
            bytes_by_kind(plain_)["pp boundaries"] * (p * v - 1) / (p - 1), rel=1e-12)


def test_predict_states_compute_throughput_and_memory():
    """compute_s = the busiest stage's FLOPs / (dp·tp) / achieved FLOP/s; tflops and tokens from step_s; memory is
    memory_model's max over stages; a layout that needs more memory than the GPU has does not fit."""
    c = _cluster(8)
    pr = predict(GPT, Layout(dp=2, tp=2), c, global_batch=8, overlap=False)
    assert pr.compute_s == pytest.approx(model_flops(GPT, 8) / 4 / c.flops, rel=1e-12)
    assert pr.tflops_per_gpu == pytest.approx(model_flops(GPT, 8) / pr.step_s / 4 / 1e12, rel=1e-12)
    assert pr.tokens_per_s == pytest.approx(8 * 128 / pr.step_s, rel=1e-12)
    assert pr.step_s == pytest.approx(pr.compute_s + pr.bubble_s + pr.exposed_comm_s + pr.overhead_s, rel=1e-12)
    assert pr.fits and not predict(GPT, Layout(dp=2, tp=2), c.with_(gpu_memory_bytes=1e6), 8).fits
    assert set(pr.as_dict()) >= {"step_s", "memory_bytes", "fits", "comm", "tflops_per_gpu"}
    with pytest.raises(StepModelError, match="multiple"):
        predict(GPT, Layout(dp=3), c, global_batch=8)


def test_overlap_hides_dp_sync_behind_backward():
    """Slow links: with overlap the exposed dp time is what exceeds 2/3 of compute; without, all of it."""
    c = preset("dgx-a100-80gb", nodes=2)
    lay = Layout(dp=16)
    on, off = (predict(GPT, lay, c, global_batch=32, overlap=o) for o in (True, False))
    dp_s = sum(t.seconds for t in on.comm if t.overlappable)
    assert off.exposed_comm_s == pytest.approx(dp_s, rel=1e-12)
    assert on.exposed_comm_s == pytest.approx(max(0.0, dp_s - 2 / 3 * on.compute_s), rel=1e-12)


# ---- measured: a dp = 4 gradient sync under an emulated 2 x 2 topology --------------------------------------------

TOPO = Topology(hosts=2, per_host=2)
TF_SHAPE = Shape(layers=2, hidden=32, heads=4, seq=6, vocab=16, micro_batch=2)   # > 32 KiB of gradients
FACTORY = functools.partial(tiny_transformer, vocab=16, d=32, heads=4, layers=2, seq=6)


def _dp4_worker(group, tp: int = 1, pp: int = 1, zero: int = 0):
    """Two training steps of the tiny transformer on a dp x pp x tp mesh of 4 ranks (or ZeRO over dp = 4): the
    link bytes of each. Micro-batches of 2 sequences (pipelines: 2 of them)."""
    torch.set_num_threads(1)
    from pslab.parallelism.data import DataParallelEngine
    from pslab.parallelism.engine import AllReduceStrategy, train_step
    from pslab.parallelism.mesh import DeviceMesh
    from pslab.parallelism.models import lm_loss
    from pslab.parallelism.pipeline import PipelineEngine
    from pslab.parallelism.tensor import TensorParallelEngine
    from pslab.parallelism.zero import ZeroEngine, ZeroStrategy
    mesh = DeviceMesh(group, dp=4 // (tp * pp), tp=tp, pp=pp)
    opt = lambda ps: torch.optim.SGD(ps, lr=0.1)        # noqa: E731
    if zero:
        engine, strat = ZeroEngine(zero, opt, loss_fn=lm_loss), ZeroStrategy()
    else:
        engine = (TensorParallelEngine(loss_fn=lm_loss) if tp > 1 else
                  PipelineEngine("1f1b", 2, loss_fn=lm_loss) if pp > 1 else DataParallelEngine(loss_fn=lm_loss))
        strat = AllReduceStrategy(opt, overlap=False)
    rep = engine.build(FACTORY, mesh)
    strat.attach(rep)
    g = torch.Generator().manual_seed(mesh.coord("dp"))
    out = []
    for _ in range(2):        # the first step also pays one-offs (the hierarchical set-up barrier, shape headers)
        reset_link_bytes(group)
        x = torch.randint(0, 16, (2 * pp, 6), generator=g)
        train_step(rep, strat, x, torch.randint(0, 16, (2 * pp, 6), generator=g))
        out.append(link_bytes(group))
    return out


@pytest.mark.timeout(90)
def test_hierarchical_dp_bytes_per_link_equal_the_emulated_topology():
    """Σ over ranks of the bytes each link class carried in a real dp = 4 step == the pslab model's terms, exactly:
    the first step with the one-off barrier (steps=1), the second without."""
    out = collectives.launch(_dp4_worker, 4, backend="zmq", timeout=80, topology=TOPO)
    cl = _cluster(2, 2)
    steady = bytes_by_link(step_comm(TF_SHAPE, Layout(dp=4), cl, algorithm="pslab", act_bytes=4, grad_bytes=4))
    first = bytes_by_link(step_comm(TF_SHAPE, Layout(dp=4), cl, algorithm="pslab", act_bytes=4, grad_bytes=4,
                                    steps=1))
    for i, want in enumerate((first, steady)):
        got = {k: float(sum(r[i][k] for r in out)) for k in ("intra", "inter")}
        assert got == want, (i, got, want)
    S = TF_SHAPE.params() * 4
    assert S > 32 << 10 and steady == {"intra": 4 * S, "inter": 2 * S}      # 2(L−1)·S per node, 2(H−1)·S across
    assert math.isclose(first["inter"] - steady["inter"], 8) and first["intra"] - steady["intra"] == 4


@pytest.mark.timeout(90)
@pytest.mark.parametrize("placement", ["packed", "spread"])
@pytest.mark.parametrize("what", ["zero=1", "zero=3", "dp=2 x pp=2"])
def test_zero_and_pipeline_bytes_per_link_equal_the_emulated_topology(placement, what):
    """ZeRO over dp = 4 (per-parameter rings whose hops cross hosts: chunk by chunk) and dp = 2 x pp = 2 (the
    stage boundaries and the loss broadcast on one link class, dp on the other): the second step's bytes per link
    equal the pslab model's, exactly."""
    kw = {"zero=1": dict(zero=1), "zero=3": dict(zero=3), "dp=2 x pp=2": dict(pp=2)}[what]
    topo = Topology(hosts=2, per_host=2, placement=placement)
    out = collectives.launch(_dp4_worker, 4, backend="zmq", args=(1, kw.get("pp", 1), kw.get("zero", 0)),
                             timeout=80, topology=topo)
    lay = Layout(dp=4 // kw.get("pp", 1), pp=kw.get("pp", 1), zero=kw.get("zero", 0), micro_batches=2)
    terms = step_comm(TF_SHAPE, lay, _cluster(2, 2), placement=placement, algorithm="pslab", act_bytes=4,
                      grad_bytes=4)
    got = {k: float(sum(r[1][k] for r in out)) for k in ("intra", "inter")}
    assert got == bytes_by_link(terms)
    if placement == "packed" or "pp" in what:       # spread: dp = 4's ring 0 -> 1 -> 2 -> 3 crosses at every hop
        assert got["intra"] > 0 and got["inter"] > 0
    else:
        assert got["intra"] == 0 and got["inter"] > 0


@pytest.mark.timeout(90)
@pytest.mark.parametrize("placement", ["packed", "spread"])
def test_placement_moves_tp_and_dp_between_the_links_as_measured(placement):
    """dp = 2 x tp = 2 on 2 emulated hosts x 2: packed keeps tp inside a host and sends dp across, spread the other
    way round; the bytes per link class of a real step equal the pslab model's for that placement, exactly."""
    topo = Topology(hosts=2, per_host=2, placement=placement)
    out = collectives.launch(_dp4_worker, 4, backend="zmq", args=(2,), timeout=80, topology=topo)
    terms = step_comm(TF_SHAPE, Layout(dp=2, tp=2), _cluster(2, 2), placement=placement, algorithm="pslab",
                      act_bytes=4, grad_bytes=4)
    got = {k: float(sum(r[1][k] for r in out)) for k in ("intra", "inter")}
    assert got == bytes_by_link(terms)
    tp_link = {t.link for t in terms if t.kind == "tp activations"}
    dp_link = {t.link for t in terms if t.kind == "dp gradient sync"}
    assert (tp_link, dp_link) == (({"intra"}, {"inter"}) if placement == "packed" else ({"inter"}, {"intra"}))


def test_pslab_parameter_lists_and_buckets_are_the_engines_own():
    """The pslab rules' parameter lists equal the real model's (per pipeline stage as split_stages cuts it), and the
    DDP buckets equal GradReducer's (reverse order, closed before exceeding bucket_bytes)."""
    from pslab.parallelism.comm_model import buckets, stage_tensors
    from pslab.parallelism.data import GradReducer
    from pslab.parallelism.pipeline import split_stages, stage_module
    shape = Shape(layers=3, hidden=32, heads=4, seq=6, vocab=16)
    model = tiny_transformer(vocab=16, d=32, heads=4, layers=3, seq=6)
    assert stage_tensors(shape, Layout(), 0, "pslab") == [p.numel() for p in model.parameters()]
    for pp in (2, 3, 4):
        for k, bounds in enumerate(split_stages(model, pp)):
            want = [p.numel() for p in stage_module(model, bounds).parameters()]
            assert stage_tensors(shape, Layout(pp=pp), k, "pslab") == want, (pp, k)
    for cap in (4096, 20000, 1 << 20):
        reducer = GradReducer(model, comm=None, bucket_bytes=cap)
        assert buckets(stage_tensors(shape, Layout(), 0, "pslab"), 4, cap) == [b.numel for b in reducer.buckets]
        reducer.close()


def test_an_axis_order_placement_sends_only_its_outer_axis_across_nodes():
    """placement "tp,dp,pp" (mesh.hosts_by_order) on dp 2 x tp 2 x pp 2 over 2 nodes of 4: each pipeline stage on
    its own node, so the pp boundaries are the only inter bytes; packed sends the dp sync across instead; a bad
    order is one CommModelError line."""
    c = _cluster(4, nodes=2)
    lay = Layout(dp=2, tp=2, pp=2, micro_batches=4)
    placed = step_comm(GPT, lay, c, placement="tp,dp,pp")
    inter = {t.kind for t in placed if t.link == "inter" and t.bytes > 0}
    assert inter == {"pp boundaries"}
    packed = {t.kind for t in step_comm(GPT, lay, c) if t.link == "inter" and t.bytes > 0}
    assert packed == {"dp gradient sync"}
    assert bytes_by_kind(placed) == pytest.approx(bytes_by_kind(step_comm(GPT, lay, c)), rel=1e-12)
    with pytest.raises(CommModelError, match="axis order"):
        step_comm(GPT, lay, c, placement="tp,pp")
