"""The planner: the enumeration keeps to its constraints and misses nothing, the best layout equals an independent
brute force's, layouts that do not fit are never returned, the explanation says why TP stays in the node, and for
Narayanan et al. 2021's Table 1 the planner keeps TP inside the node and predicts the paper's own layouts' TFLOP/s
within a stated band."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from pslab.parallelism.cluster import Cluster, preset
from pslab.parallelism.memory_model import Layout, Shape, estimate
from pslab.parallelism.planner import (PlanError, breakdown, candidates, describe, explain, link_seconds, micro_batch, plan,
                                 tp_on_intra)
from pslab.parallelism.published import PUBLISHED, compare_published

SMALL = Shape(layers=6, hidden=384, heads=12, seq=256, vocab=1000)
GB = 1e9


def tiny_cluster(memory: float = 1e9, nodes: int = 2, per_node: int = 4) -> Cluster:
    return Cluster("tiny", per_node, nodes, memory, 100e12, 0.5, 300e9, 3e-6, 25e9, 5e-6)


def test_enumeration_respects_the_constraints_and_misses_nothing():
    gpus, batch = 24, 48
    cands = list(candidates(SMALL, gpus, batch))
    assert cands
    seen = set()
    for c in cands:
        lay, b = c.layout, c.shape.micro_batch
        assert lay.dp * lay.tp * lay.pp * lay.cp * lay.ep == gpus
        assert SMALL.heads % lay.tp == 0 and lay.pp <= SMALL.layers
        assert lay.dp * lay.micro_batches * b == batch
        assert lay.sp == (lay.tp > 1 and SMALL.seq % lay.tp == 0)      # SP splits the sequence over tp
        assert lay.zero == 0 or lay.dp > 1
        assert lay.schedule == "1f1b"
        seen.add((lay.dp, lay.tp, lay.pp, b, lay.zero, lay.recompute))
    assert len(seen) == len(cands)                      # no layout twice
    expect = set()                                      # independently: every integer split, filtered
    for dp, tp, pp in itertools.product(range(1, gpus + 1), repeat=3):
        if dp * tp * pp != gpus or SMALL.heads % tp or pp > SMALL.layers:
            continue
        for b in (1, 2, 4, 8):
            if batch % (dp * b):
                continue
            for z in ((0, 1, 2, 3) if dp > 1 else (0,)):
                for r in ("none", "selective", "full"):
                    expect.add((dp, tp, pp, b, z, r))
    assert seen == expect


def test_max_tp_and_gpipe_options():
    cands = list(candidates(SMALL, 12, 24, max_tp=2, schedules=("1f1b", "gpipe"), zero=(0,), recompute=("none",)))
    assert max(c.layout.tp for c in cands) == 2
    assert {c.layout.schedule for c in cands if c.layout.pp > 1} == {"1f1b", "gpipe"}
    assert {c.layout.schedule for c in cands if c.layout.pp == 1} == {"1f1b"}


# ---- an independent brute force: step time and memory of every layout from the docstrings' formulas -----------
# Written from the docs (parallelism/step_model.py, comm_model.py, comm_cost.py, memory_model.py, zero_memory.py)
# in plain Python, without calling the planner's models: mixed precision (p, g, K = 2, 2, 12; 2-byte activations),
# algorithm "ring", placement "packed" (mesh order dp, pp, tp with tp innermost; rank r on node r // gpus_per_node),
# DP overlapped with backward, 1F1B, SP with every tp > 1.

def _textbook_layers(L: int, pp: int, k: int) -> int:
    """Layers on stage k: ⌊L/p⌋, the first L mod p stages one more."""
    return L // pp + (k < L % pp)


def _textbook_psi(sh: Shape, tp: int, pp: int, k: int) -> float:
    """Ψ of one rank of stage k: per layer (12h² + 7h)/t split + 6h replicated, embeddings (Vh + sh) on the first
    stage, final LayerNorm + head (2h + hV + V) on the last."""
    h = sh.hidden
    n = _textbook_layers(sh.layers, pp, k) * ((12 * h * h + 7 * h) / tp + 6 * h)
    if k == 0:
        n += sh.vocab * h + sh.seq * h
    if k == pp - 1:
        n += 2 * h + h * sh.vocab + sh.vocab
    return n


def _textbook_memory(sh: Shape, dp: int, tp: int, pp: int, b: int, z: int, r: str, m: int) -> float:
    """Worst stage of ZeRO's (p + g + K)Ψ (stage 1: K/N_d, 2: (g + K)/N_d, 3: all /N_d) + Korthikanti et al.'s
    16-bit activations per layer (SP: sbh/t·(34 + 5as/h); selective sbh·34/t; full 2sbh/t; no SP at tp = 1:
    sbh(34 + 5as/h), sbh·34, 2sbh) × layers × min(p − k, m) in flight, + 4sbh/t + 4sbv/t on the last stage."""
    p_, g_, k_ = 2, 2, 12
    s, h, a, v = sh.seq, sh.hidden, sh.heads, sh.vocab
    sbh = s * b * h
    sp = tp > 1
    per = {"full": 2 * sbh / tp, "selective": sbh * 34 / tp}.get(r, sbh / tp * (34 + 5 * a * s / h)) if sp else \
        {"full": 2 * sbh, "selective": sbh * 34}.get(r, sbh * (34 + 5 * a * s / h))
    worst = 0.0
    for k in range(pp):
        psi = _textbook_psi(sh, tp, pp, k)
        state = {0: (p_ + g_ + k_) * psi, 1: (p_ + g_) * psi + k_ * psi / dp, 2: p_ * psi + (g_ + k_) * psi / dp,
                 3: (p_ + g_ + k_) * psi / dp}[z]
        act = _textbook_layers(sh.layers, pp, k) * min(pp - k, m) * per
        if k == pp - 1:
            act += 4 * sbh / tp + 4 * s * b * v / tp
        worst = max(worst, state + act)
    return worst


class _Textbook:
    """α-β costs on a packed cluster: a message of B bytes on a link takes α + B/β; a collective is charged to the
    slowest link its group spans, a point-to-point message to the link it crosses."""

    def __init__(self, cl: Cluster) -> None:
        self.cl = cl

    def node(self, r: int) -> int:
        return r // self.cl.gpus_per_node

    def link(self, group: list[int]) -> tuple[float, float]:
        inter = len({self.node(r) for r in group}) > 1
        return ((self.cl.inter_latency_s, self.cl.inter_bandwidth_Bps) if inter else
                (self.cl.intra_latency_s, self.cl.intra_bandwidth_Bps))

    def ab(self, group: list[int], messages: float, nbytes: float) -> float:
        lat, bw = self.link(group)
        return messages * lat + nbytes / bw

    def ring_ar(self, group: list[int], nbytes: float) -> float:
        """Ring all-reduce: 2(N−1) latencies, 2(N−1)/N·S per rank."""
        n = len(group)
        return 0.0 if n == 1 else self.ab(group, 2 * (n - 1), 2 * (n - 1) / n * nbytes)

    def ring_half(self, group: list[int], nbytes: float) -> float:
        """Ring reduce-scatter or all-gather: N−1 latencies, (N−1)/N·S per rank."""
        n = len(group)
        return 0.0 if n == 1 else self.ab(group, n - 1, (n - 1) / n * nbytes)

    def all_reduce(self, group: list[int], nbytes: float) -> float:
        """Hierarchical where the group spans H nodes with the same L > 1 of its ranks on each (group of >= 4):
        reduce-scatter + all-gather inside each node, a ring all-reduce of S/L across the nodes; else the ring."""
        by: dict[int, list[int]] = {}
        for r in group:
            by.setdefault(self.node(r), []).append(r)
        per = {len(v) for v in by.values()}
        if len(group) >= 4 and len(by) >= 2 and len(per) == 1 and min(per) >= 2:
            lo = len(group) // len(by)
            inside = max(2 * self.ring_half(v, nbytes) for v in by.values())
            return inside + max(self.ring_ar([v[i] for v in by.values()], nbytes / lo) for i in range(lo))
        return self.ring_ar(group, nbytes)

    def step_s(self, sh: Shape, batch: int, dp: int, tp: int, pp: int, b: int, z: int, r: str, m: int) -> float:
        s, h, v, act = sh.seq, sh.hidden, sh.vocab, 2
        rank = lambda d, k, j: (d * pp + k) * tp + j                       # noqa: E731  (tp innermost)
        layers = [_textbook_layers(sh.layers, pp, k) for k in range(pp)]
        # compute: FLOPs (Narayanan et al. eq. (3)): per layer 24Bsh² + 4Bs²h forward, backward twice; full
        # recompute one more forward, selective the 4Bs²h again; logits 6BshV; busiest stage / (D·T) at eff·peak
        mm, att = 24 * batch * s * h * h, 4 * batch * s * s * h
        layer = {"none": 3 * (mm + att), "selective": 3 * (mm + att) + att, "full": 4 * (mm + att)}[r]
        logits = 6 * batch * s * h * v
        compute = max(layers[k] * layer + (logits if k == pp - 1 else 0) for k in range(pp)) / (dp * tp)
        compute /= self.cl.efficiency * self.cl.peak_flops
        a_bytes = b * s * h * act                                          # A: one micro-batch's activation
        # TP: per layer and micro-batch 2 all-reduces of A forward, 2 backward (+2 with full recompute); SP's
        # all-gather + reduce-scatter cost the same; the slowest group (the stage with most layers)
        tp_s = max((layers[k] * m * (6 if r == "full" else 4) * self.ring_ar([rank(0, k, j) for j in range(tp)],
                                                                            a_bytes) for k in range(pp))) \
            if tp > 1 else 0.0
        # PP: per boundary and micro-batch the activation forward and its gradient back, each tp rank its S/T
        # slice under SP; a rank's time: the m messages it sends over each of its boundaries, each on the link it
        # crosses (a middle stage 2m(α + A/β)); the slowest rank
        pp_s = 0.0
        cut = a_bytes / tp
        for d, j, k in itertools.product(range(dp), range(tp), range(pp)):
            me, t = rank(d, k, j), 0.0
            for nb in (k - 1, k + 1):
                if 0 <= nb < pp:
                    t += self.ab([me, rank(d, nb, j)], m, m * cut)
            pp_s = max(pp_s, t)
        # DP: all-reduce of Ψ_k·g (ZeRO 1: RS + AG of it once per step; 2: RS per micro-batch + AG; 3: RS per
        # micro-batch + AG for each micro-batch's forward and backward), hidden behind 2/3 of the compute
        dp_s = 0.0
        for k, j in itertools.product(range(pp), range(tp)):
            grp = [rank(d, k, j) for d in range(dp)]
            nbytes = _textbook_psi(sh, tp, pp, k) * 2
            n_rs, n_ag = {0: (0, 0), 1: (1, 1), 2: (m, 1), 3: (m, 2 * m)}[z]
            t = self.all_reduce(grp, nbytes) if z == 0 else (n_rs + n_ag) * self.ring_half(grp, nbytes)
            dp_s = max(dp_s, t)
        dp_exposed = max(0.0, dp_s - self.cl.overlap_fraction * compute)
        stage = compute + tp_s + pp_s
        bubble = (pp - 1) / m * stage                      # (p − 1)/(m + p − 1) of the pipeline's time
        return compute + bubble + tp_s + pp_s + dp_exposed + self.cl.step_overhead_s


@pytest.mark.parametrize("per_node, nodes, overlap", [(4, 2, 2 / 3), (4, 2, 0.2), (2, 4, 0.2)])
def test_best_layout_equals_an_independent_brute_force(per_node, nodes, overlap):
    """Every (dp, tp, pp, b, zero, recompute) of 8 GPUs, its step time and memory computed here from the docs'
    formulas (above, not the planner's code): all 264 layouts' step times and memory equal the planner's (planned
    with memory to spare), the layouts that fit in 60 MB are the planner's, and its best is the brute force's best.
    Clusters: 2 nodes of 4 (tp inside a node, dp hierarchical, pipelines crossing between stages) and 4 nodes of 2
    (tp = 4 crosses nodes); overlap 2/3 (the presets') hides most DP, 0.2 leaves it exposed."""
    roomy = replace(tiny_cluster(memory=1e12, nodes=nodes, per_node=per_node), step_overhead_s=1e-5,
                    overlap_fraction=overlap)
    cl = replace(roomy, gpu_memory_bytes=60e6)
    tb, batch = _Textbook(cl), 16
    mine = {}
    for dp, tp, pp in itertools.product((1, 2, 4, 8), repeat=3):
        if dp * tp * pp != 8 or SMALL.heads % tp or pp > SMALL.layers:
            continue
        for b, z, r in itertools.product((1, 2, 4, 8), (0, 1, 2, 3), ("none", "selective", "full")):
            if batch % (dp * b) or (dp == 1 and z):
                continue
            m = batch // (dp * b)
            mine[(dp, tp, pp, b, z, r)] = (tb.step_s(SMALL, batch, dp, tp, pp, b, z, r, m),
                                           _textbook_memory(SMALL, dp, tp, pp, b, z, r, m))
    assert len(mine) == 264                       # 8 (dp, tp, pp) × b × ZeRO × recompute
    key = lambda p: (p.layout.dp, p.layout.tp, p.layout.pp, micro_batch(p), p.layout.zero,   # noqa: E731
                     p.layout.recompute)
    every = {key(p): p for p in plan(SMALL, roomy, batch)}
    assert set(every) == set(mine)
    off = {k: (t, every[k].step_s) for k, (t, _) in mine.items() if every[k].step_s != pytest.approx(t, rel=1e-9)}
    assert not off, f"step time differs from the textbook's for {len(off)} layouts: {sorted(off.items())[:5]}"
    off = {k: (m, every[k].memory_bytes) for k, (_, m) in mine.items()
           if every[k].memory_bytes != pytest.approx(m, rel=1e-12)}
    assert not off, f"memory differs from the textbook's for {len(off)} layouts: {sorted(off.items())[:5]}"
    fit = {k: v for k, v in mine.items() if v[1] <= cl.gpu_memory_bytes}
    assert 50 < len(fit) < 150                    # of 264: the memory filter matters here
    ranked = plan(SMALL, cl, batch)
    assert len(ranked) == len(fit) and {key(p) for p in ranked} == set(fit)
    best = min(fit, key=lambda k: (fit[k][0], fit[k][1], k[1] * k[2], k[2], k[4]))    # the planner's tie rule
    assert key(ranked[0]) == best
    assert [p.step_s for p in ranked] == sorted(p.step_s for p in ranked)
    assert {k[2] for k in fit} == {1, 2, 4} and {k[1] for k in fit} == {1, 2, 4} and {k[4] for k in fit} == {0, 1, 2, 3}


def test_a_layout_that_does_not_fit_is_not_returned():
    cluster = tiny_cluster(memory=60e6)
    ranked = plan(SMALL, cluster, 16)
    assert all(p.fits and p.memory_bytes <= cluster.gpu_memory_bytes for p in ranked)
    key = lambda lay, b: (lay.dp, lay.tp, lay.pp, b, lay.zero, lay.recompute)      # noqa: E731
    got = {key(p.layout, micro_batch(p)) for p in ranked}
    mem = {key(c.layout, c.shape.micro_batch): max(estimate(c.layout, "mixed", shape=c.shape, stage=k).total
                                                   for k in range(c.layout.pp)) for c in candidates(SMALL, 8, 16)}
    too_big = [k for k, v in mem.items() if v > cluster.gpu_memory_bytes]
    assert too_big and not set(too_big) & got                 # e.g. one GPU's worth of state per rank, b = 8
    assert (8, 1, 1, 2, 0, "none") in too_big               # dp=8 without ZeRO: all 16 B/param on every rank
    none = plan(SMALL, tiny_cluster(memory=1e6), 16)       # 1 MB per GPU: nothing fits
    assert list(none) == [] and none.smallest is not None and none.smallest[0] > 1e6
    assert "No layout fits" in explain(none, tiny_cluster(memory=1e6))


def test_bad_requests_raise_plan_error():
    odd = Shape(layers=2, hidden=384, heads=3, seq=256, vocab=1000)     # tp | 3, pp <= 2: tp·pp = 8 impossible,
    with pytest.raises(PlanError, match="no layout of 8 GPUs"):           # so dp is 4 or 8, and dp·b never divides 3
        plan(odd, tiny_cluster(), 3)
    with pytest.raises(PlanError, match="exceeds the cluster"):
        plan(SMALL, tiny_cluster(), 16, gpus=64)
    with pytest.raises(PlanError, match="global-batch"):
        plan(SMALL, tiny_cluster(), 0)


def test_explanation_says_why_tp_stays_in_the_node():
    shape = Shape(layers=8, hidden=2048, heads=16, seq=1024, vocab=32000)
    cluster = tiny_cluster(memory=12e9)
    ranked = plan(shape, cluster, 32, zero=(0,))
    best = ranked[0]
    assert best.layout.tp <= cluster.gpus_per_node
    text = explain(ranked, cluster)
    assert "TP stays inside the node" in text or "No tensor parallelism" in text
    crossing = [p for p in ranked if p.layout.tp > cluster.gpus_per_node]
    assert crossing and crossing[0].step_s > best.step_s
    x = crossing[0]
    slow = link_seconds(x)["inter"]
    fast = sum(link_seconds(tp_on_intra(x, cluster, shape)).values())
    assert slow > 5 * fast > 0                         # the same TP bytes: 12x less bandwidth across nodes
    assert "inter link" in text and f"#{ranked.index(x) + 1}" in text
    parts = breakdown(best)
    assert sum(parts.values()) == pytest.approx(best.step_s, rel=1e-9)


# Narayanan et al. 2021 Table 1 on the dgx-a100-80gb preset (efficiency 0.5, the preset's assumption, not fitted):
# the paper's own layout's predicted TFLOP/s per GPU against the reported ones, row by row as docs/tutorial.md §6
# states them (one decimal, in %), and the band it states: within 10 % for the five rows 3.6B-76B; the other five
# miss by more, +13.9 % (1.7B, over) and -12.3 % to -25.1 % (145B-1T, under: one efficiency for every matrix size,
# and v = 1 where the largest runs interleaved). The planner's best keeps tp <= 8 on every row; with Megatron-LM's
# 2021 knobs it picks exactly the paper's layout for 1.7B, 76B, 145B and 1T, and another one for the other six.
PUBLISHED_ERROR_PCT = {"gpt-1.7b": 13.9, "gpt-3.6b": 8.9, "gpt-7.5b": 0.9, "gpt-18b": 1.0, "gpt-39b": -3.0,
                       "gpt-76b": -6.3, "gpt-145b": -12.3, "gpt-310b": -17.9, "gpt-530b": -24.5, "gpt-1t": -25.1}
WITHIN_10_PCT = ("gpt-3.6b", "gpt-7.5b", "gpt-18b", "gpt-39b", "gpt-76b")
PAPERS_LAYOUT_WITH_2021_KNOBS = ("gpt-1.7b", "gpt-76b", "gpt-145b", "gpt-1t")


def test_the_published_table_is_every_row():
    assert set(PUBLISHED_ERROR_PCT) == set(PUBLISHED) and len(PUBLISHED) == 10


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_rows_tp_inside_the_node_and_tflops_within_band(name):
    row = PUBLISHED[name]
    d = compare_published(row)
    assert d["planner_best"]["tp"] <= 8 and d["planner_best"]["tp_inside_node"]
    own = d["paper_layout"]
    assert own is not None and own["layout"].startswith(f"dp={row.dp} tp={row.tp} pp={row.pp} ")
    err = own["tflops_per_gpu"] / row.tflops - 1
    assert abs(100 * err - PUBLISHED_ERROR_PCT[name]) <= 0.05, (name, own["tflops_per_gpu"], row.tflops, err)
    if name in WITHIN_10_PCT:
        assert abs(err) <= 0.10, (name, err)
    else:                                          # the stated misses: more than 10 %, at most 25.1 %
        assert 0.10 < abs(err) <= 0.2515, (name, err)
    meg = d["planner_megatron"]
    assert ((meg["tp"], meg["pp"], meg["dp"]) == (row.tp, row.pp, row.dp)) == (name in PAPERS_LAYOUT_WITH_2021_KNOBS)


@pytest.mark.parametrize("name", ("gpt-76b", "gpt-145b", "gpt-1t"))
def test_with_the_papers_constraints_the_planner_picks_the_papers_layout(name):
    """ZeRO 0, full recompute, no SP (Megatron-LM in 2021): for GPT-76B on 1024 A100s the fastest layout is the
    paper's own tp=8 pp=4 dp=32 — TP fills the node, PP crosses nodes, DP is the outer loop — and likewise for
    145.6B (8/8/24) and 1T (8/64/6)."""
    row = PUBLISHED[name]
    cluster = preset("dgx-a100-80gb", nodes=row.gpus // 8)
    ranked = plan(row.shape(), cluster, row.batch, gpus=row.gpus, zero=(0,), recompute=("full",), sp=False)
    best = ranked[0].layout
    assert (best.tp, best.pp, best.dp) == (row.tp, row.pp, row.dp)
    assert "TP stays inside the node" in explain(ranked, cluster)


def test_published_table_is_consistent():
    """The transcribed rows: aggregate = per-GPU x GPUs (Table 1's last column), tp·pp divides the GPUs, and the
    shapes give the parameter counts of the table (their eq. (2): 12lh²(1 + 13/12h + (V+s)/12lh), to the table's rounding)."""
    aggregate = {"gpt-1.7b": 4.4, "gpt-3.6b": 8.8, "gpt-7.5b": 18.2, "gpt-18b": 34.6, "gpt-39b": 70.8,
                 "gpt-76b": 143.8, "gpt-145b": 227.1, "gpt-310b": 297.4, "gpt-530b": 410.2, "gpt-1t": 502.0}
    for name, r in PUBLISHED.items():
        assert r.gpus % (r.tp * r.pp) == 0
        assert r.tflops * r.gpus / 1e3 == pytest.approx(aggregate[name], rel=0.01)
        l, h = r.layers, r.hidden
        p = 12 * l * h * h * (1 + 13 / (12 * h) + (51200 + 2048) / (12 * l * h))
        assert abs(p / 1e9 - r.params_b) <= 0.05 + 0.005 * r.params_b        # 1.65 printed as 1.7


def test_uneven_stages_are_planned():
    """pp need not divide the layers (published runs put 70 layers on 12 stages): the first 10 stages hold 6 layers,
    the last 2 hold 5 (as pipeline.split_stages cuts); a stage's memory is that of a stage with as many layers in
    an evenly cut model (stage 0 of 72 layers on 12, the last of 60 on 12), and the planner ranks such layouts."""
    from pslab.parallelism.memory_model import stage_layers
    big = replace(SMALL, layers=70, micro_batch=1)
    assert [stage_layers(70, 12, k) for k in range(12)] == [6] * 10 + [5] * 2
    lay = Layout(dp=2, tp=1, pp=12, micro_batches=24)
    first = estimate(lay, "mixed", shape=big, stage=0).total
    last = estimate(lay, "mixed", shape=big, stage=11).total
    assert first == estimate(lay, "mixed", shape=replace(big, layers=72), stage=0).total
    assert last == estimate(lay, "mixed", shape=replace(big, layers=60), stage=11).total
    assert any(c.layout.pp == 12 for c in candidates(big, 24, 48))
    ranked = plan(big, tiny_cluster(memory=1e12, nodes=3, per_node=8), 48)
    assert any(p.layout.pp == 12 for p in ranked)


def test_interleaved_layouts_are_planned_when_asked():
    """--virtual-stages 1,2: the planner adds interleaved 1F1B layouts (pp > 1, 1f1b, m a multiple of pp, pp·v ≤
    layers) and ranks them; with a bubble-dominated pipeline (tiny m) an interleaved one wins; by default none."""
    sh = replace(SMALL, layers=8, micro_batch=1)
    got = list(candidates(sh, 8, 8, virtual_stages=(1, 2)))
    inter = [c.layout for c in got if c.layout.virtual_stages > 1]
    assert inter and all(lay.pp > 1 and lay.schedule == "1f1b" and lay.micro_batches % lay.pp == 0
                         and lay.pp * lay.virtual_stages <= sh.layers for lay in inter)
    assert not any(c.layout.virtual_stages > 1 for c in candidates(sh, 8, 8))
    big = tiny_cluster(memory=1e12, nodes=1, per_node=8)
    ranked = plan(sh, big, 8, virtual_stages=(1, 2), where=lambda lay: lay.pp == 4 and lay.tp == 1, zero=(0,),
                  recompute=("none",))
    by_v = {p.layout.virtual_stages: p for p in ranked if p.layout.micro_batches == 4}
    assert set(by_v) == {1, 2} and "v=2" in describe(by_v[2]) and "v=" not in describe(by_v[1])
    # m = 4, p = 4: bubble 3/7 of the step with 1F1B, 3/11 interleaved; the extra transfers cost far less here
    assert by_v[2].bubble_s < by_v[1].bubble_s and by_v[2].step_s < by_v[1].step_s
    assert ranked[0].layout.virtual_stages == 2
