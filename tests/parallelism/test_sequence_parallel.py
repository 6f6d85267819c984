"""Sequence parallelism on the tp group (Korthikanti et al. 2022): same loss, gradients and training as TP and as one
process; the LayerNorm regions' saved activations are 1/T of TP's; the activation wire bytes equal TP's."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from pslab import collectives
from pslab.parallelism.checkpointing import ActivationMeter
from pslab.parallelism.comm import CommLog
from pslab.parallelism.engine import AllReduceStrategy, EngineError
from pslab.parallelism.export import gather_full_state
from pslab.parallelism.mesh import DeviceMesh
from pslab.parallelism.models import lm_loss, tiny_transformer
from pslab.parallelism.sequence import (GRAD_SITE, LOSS_SITE, meter_modules, paper_layer_bytes, sp_activation_bytes,
                                  sp_comm_bytes, tp_activation_bytes)
from pslab.parallelism.snapshot import capture, restore_into
from pslab.parallelism.tensor import TensorParallelEngine

from tests.parallelism.par_helpers import (TF_FACTORY, adam_attention, assert_close, plain, reference, run_training,
                                          sgd, tf_batches)
from tests.parallelism.test_tensor_parallel import expected_slots

TIMEOUT = 60
VOCAB, D, HEADS, LAYERS, SEQ, BATCH = 16, 16, 4, 2, 6, 8      # TF_FACTORY's model and tf_batches' shapes
adam = adam_attention


VARIANTS = {"tp": {}, "sp": {"sequence_parallel": True}, "sp-regather": {"sequence_parallel": True, "regather": True}}


def _engine(variant: str, log: CommLog | None = None) -> TensorParallelEngine:
    return TensorParallelEngine(loss_fn=lm_loss, log=log, **VARIANTS[variant])


def _wire_by_site(log: CommLog) -> dict[str, dict[str, float]]:
    """{site: {kind: bytes the backend counted}}, and under "calls" {site: ops}."""
    out: dict[str, dict[str, float]] = {}
    calls: dict[str, int] = {}
    for kind, site, _, wire in log.records:
        out.setdefault(site, {}).setdefault(kind, 0.0)
        out[site][kind] += wire
        calls[site] = calls.get(site, 0) + 1
    return {**out, "calls": calls}


def _counted(got: float, formula: float, calls: int, backend: str) -> bool:
    """zmq: the counted bytes are the formula's; gloo: + its framing, 48 B a message, at most 12 per op (an
    all-reduce of 2 ranks; tests/collectives/test_traffic.py)."""
    return got == formula if backend == "zmq" else formula < got <= formula + calls * 12 * 48


def _parity_worker(group, with_snapshot):
    """Per variant: one step's loss, gradients and wire bytes by site; then SGD and Adam training, the gathered
    full state after it; with_snapshot: capture -> one more step -> restore_into -> that step again."""
    torch.set_num_threads(1)
    x, y = tf_batches(1)[0]
    out = {}
    for variant in VARIANTS:
        log = CommLog()
        mesh = DeviceMesh(group, tp=2)
        replica = _engine(variant, log).build(TF_FACTORY, mesh)
        loss = replica.forward_backward(x, y)
        r = {"loss": loss, "grads": {s.name: s.grad.clone() for s in replica.slots()}, "wire": _wire_by_site(log)}
        for name, opt in (("sgd", sgd), ("adam", adam)):
            mesh, replica, losses = run_training(group, _engine(variant), TF_FACTORY, tf_batches(), {"tp": 2}, opt)
            r[name] = {"losses": losses, "state": gather_full_state(replica, mesh)}
        if with_snapshot:
            strategy = AllReduceStrategy(adam)
            mesh, replica, _ = run_training(group, _engine(variant), TF_FACTORY, tf_batches(2), {"tp": 2},
                                            strategy=strategy)
            tensors, meta = capture(replica, strategy)
            nx, ny = tf_batches(3)[2]
            first = [replica.forward_backward(nx, ny)]
            strategy.step(replica)
            after = {s.name: s.param.detach().clone() for s in replica.slots()}
            restore_into(replica, strategy, tensors, meta)
            restored = all(torch.equal(s.param, tensors[f"{k}/param"]) for k, s in enumerate(replica.slots()))
            first.append(replica.forward_backward(nx, ny))
            strategy.step(replica)
            again = all(torch.equal(after[s.name], s.param) for s in replica.slots())
            r["snapshot"] = {"restored": restored, "again": again, "losses": first}
        out[variant] = r
    return plain(out)


def _replicated_numel() -> int:
    """Elements of the parameters TP replicates in TF_FACTORY's model, counted from its definition."""
    embed = VOCAB * D + SEQ * D                      # tok, pos
    per_layer = 2 * 2 * D + D + D                    # ln1, ln2 (weight, bias); proj bias; fc2 bias
    head = 2 * D + VOCAB * D + VOCAB                 # ln; out weight and bias
    return embed + LAYERS * per_layer + head


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["zmq", "torch"])
def test_sp_matches_tp_and_single_process(backend):
    """tp=2: SP (with and without regather) gives TP's loss and every slot's gradient after one backward (same slot
    names); 5 SGD and 5 Adam steps give the single-process losses and weights (gather_full_state); the wire bytes of
    every activation site equal TP's (all_gather + reduce_scatter = all_reduce), the replicated-gradient and loss
    all-reduces match `sp_comm_bytes`; on zmq, capture / restore_into of an SP replica is bitwise."""
    out = collectives.launch(_parity_worker, 2, backend=backend, args=(backend == "zmq",), timeout=TIMEOUT)
    refs = {name: reference(TF_FACTORY, tf_batches(), opt=opt, loss_fn=lm_loss) for name, opt in
            (("sgd", sgd), ("adam", adam))}
    x, y = tf_batches(1)[0]
    ref_loss = float(lm_loss(TF_FACTORY()(x), y).detach())
    formula = sp_comm_bytes(BATCH, SEQ, D, LAYERS, 2, _replicated_numel())
    layer_sites = [f"{b}.{m}" for b in range(1, LAYERS + 1) for m in ("attn", "mlp")]
    for rank, r in enumerate(out):
        tp = r["tp"]
        assert_close(tp["loss"], ref_loss, "tp loss")
        for variant in ("sp", "sp-regather"):
            sp = r[variant]
            assert_close(sp["loss"], tp["loss"], f"{variant} loss")
            assert set(sp["grads"]) == set(tp["grads"])
            for n, gr in tp["grads"].items():
                assert_close(sp["grads"][n], gr, f"rank {rank} {variant} grad {n}")
            for name, (ref_losses, ref_w) in refs.items():
                assert_close(sp[name]["losses"], ref_losses, f"{variant} {name} losses")
                if rank == 0:
                    assert list(sp[name]["state"]) == list(ref_w)
                    for n, w in ref_w.items():
                        assert_close(sp[name]["state"][n], w, f"{variant} {name} {n}")
                else:
                    assert sp[name]["state"] is None
            wire, tp_wire = dict(sp["wire"]), dict(tp["wire"])
            calls, tp_calls = wire.pop("calls"), tp_wire.pop("calls")
            for site in layer_sites:
                assert set(tp_wire[site]) == {"all_reduce"}
                assert set(wire[site]) == {"all_gather", "reduce_scatter"}
                # all-gather + reduce-scatter move an all-reduce's bytes (gloo: each op's framing apart, 48 B a
                sp_bytes = wire[site]["all_gather"] + wire[site]["reduce_scatter"]    # message, at most 12 an op;
                # the torch backend's reduce-scatter and all-gather are rings over gloo's p2p, collectives/torch_group)
                if backend == "zmq":
                    assert sp_bytes == tp_wire[site]["all_reduce"]
                else:
                    ar = tp_wire[site]["all_reduce"]        # (gloo's all-reduce frames more messages than the rings)
                    assert ar - calls[site] * 12 * 48 <= sp_bytes <= ar, (site, sp_bytes, ar)
            assert _counted(sum(tp_wire[s]["all_reduce"] for s in layer_sites), formula["activations"],
                            sum(tp_calls[s] for s in layer_sites), backend)
            assert set(wire[GRAD_SITE]) == set(wire[LOSS_SITE]) == {"all_reduce"}
            assert _counted(wire[GRAD_SITE]["all_reduce"], formula["replicated_grads"], calls[GRAD_SITE], backend)
            assert _counted(wire[LOSS_SITE]["all_reduce"], formula["loss"], calls[LOSS_SITE], backend)
            regather = {s: w for s, w in wire.items() if s.endswith(" regather")}
            if variant == "sp":
                assert set(wire) == set(layer_sites) | {GRAD_SITE, LOSS_SITE}
            else:
                f2 = sp_comm_bytes(BATCH, SEQ, D, LAYERS, 2, _replicated_numel(), regather=True)
                assert set(regather) == {f"{s} regather" for s in layer_sites}
                assert f2["regather"] > 0 and _counted(sum(w["all_gather"] for w in regather.values()), f2["regather"],
                                                       sum(calls[s] for s in regather), backend)
            if "snapshot" in sp:
                snap = sp["snapshot"]
                assert snap["restored"] and snap["again"] and snap["losses"][0] == snap["losses"][1]


def _dp2tp2_worker(group):
    torch.set_num_threads(1)
    mesh, replica, losses = run_training(group, _engine("sp"), TF_FACTORY, tf_batches(), {"dp": 2, "tp": 2})
    return plain({"losses": losses, "slots": {s.name: s.param.detach().clone() for s in replica.slots()},
                  "coords": mesh.coords})


@pytest.mark.timeout(120)
def test_sp_dp2_tp2_matches_single_process():
    """dp=2 x tp=2 with SP on 4 ranks (zmq): per-step losses and every rank's shards and replicas equal the
    single-process reference cut as TP cuts it."""
    ref_losses, ref_w = reference(TF_FACTORY, tf_batches(), loss_fn=lm_loss)
    want = expected_slots(ref_w, 2)
    out = collectives.launch(_dp2tp2_worker, 4, backend="zmq", timeout=TIMEOUT)
    for r in out:
        assert_close(r["losses"], ref_losses, "losses")
        exp = want[r["coords"]["tp"]]
        assert set(r["slots"]) == set(exp)
        for n, w in exp.items():
            assert_close(r["slots"][n], w, n)


MEM_SEQS = (32, 256)
MEM_MODEL = dict(vocab=32, d=32, heads=4, layers=2)     # tiny_transformer's defaults
MEM_BATCH = 2


def _memory_worker(group):
    """Per S and variant: whole-step peak saved-activation bytes, and the LayerNorm regions' saved bytes."""
    torch.set_num_threads(1)
    out = {}
    for seq in MEM_SEQS:
        factory = functools.partial(tiny_transformer, seq=seq, **MEM_MODEL)
        g = torch.Generator().manual_seed(seq)
        x, y = (torch.randint(0, MEM_MODEL["vocab"], (MEM_BATCH, seq), generator=g) for _ in range(2))
        for variant in VARIANTS:
            replica = _engine(variant).build(factory, DeviceMesh(group, tp=2))
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                with ActivationMeter() as meter:
                    replica.forward_backward(x, y)
                lns = [m for m in replica.module.modules() if isinstance(m, torch.nn.LayerNorm)]
                with meter_modules(lns) as ln_meter:
                    replica.forward_backward(x, y)
            out[f"{variant}/{seq}"] = {"peak": meter.peak, "ln": ln_meter.peak, "ln_live_after": ln_meter.live}
    return out


def _single_process_peak(seq: int) -> int:
    model = tiny_transformer(seq=seq, **MEM_MODEL)
    g = torch.Generator().manual_seed(seq)
    x, y = (torch.randint(0, MEM_MODEL["vocab"], (MEM_BATCH, seq), generator=g) for _ in range(2))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), ActivationMeter() as meter:
        lm_loss(model(x), y).backward()
    return meter.peak


def test_activation_formulas_match_single_process():
    """At t = 1 the TP and SP formulas are the single process's measured peak (the terms are the model's)."""
    for seq in MEM_SEQS:
        args = (MEM_BATCH, seq, MEM_MODEL["d"], MEM_MODEL["heads"], MEM_MODEL["layers"], MEM_MODEL["vocab"], 1)
        assert _single_process_peak(seq) == tp_activation_bytes(*args) == sp_activation_bytes(*args)


@pytest.mark.timeout(120)
def test_sp_saved_activations_match_formulas():
    """tp=2, S = 32 and 256: the LayerNorm regions save exactly 1/T of TP's bytes under SP; each variant's whole-step
    peak equals its formula (`tp_activation_bytes` / `sp_activation_bytes`), SP < TP, regather < SP."""
    out = collectives.launch(_memory_worker, 2, backend="zmq", timeout=TIMEOUT)
    for r in out:
        for seq in MEM_SEQS:
            tp, sp, rg = (r[f"{v}/{seq}"] for v in VARIANTS)
            assert tp["ln_live_after"] == sp["ln_live_after"] == 0
            ln_tp = MEM_MODEL["layers"] * 2 + 1       # LayerNorms: two per block, one in the head
            assert tp["ln"] == ln_tp * (4 * MEM_BATCH * seq * MEM_MODEL["d"] + 8 * MEM_BATCH * seq)
            assert sp["ln"] * 2 == tp["ln"] and rg["ln"] == sp["ln"]
            args = (MEM_BATCH, seq, MEM_MODEL["d"], MEM_MODEL["heads"], MEM_MODEL["layers"], MEM_MODEL["vocab"], 2)
            assert tp["peak"] == tp_activation_bytes(*args)
            assert sp["peak"] == sp_activation_bytes(*args)
            assert rg["peak"] == sp_activation_bytes(*args, regather=True)
            assert rg["peak"] < sp["peak"] < tp["peak"]


def test_paper_formula():
    """Korthikanti's per-layer fp16 formulas: SP = TP's with the 10 replicated s·b·h bytes divided by t."""
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    tp, sp = paper_layer_bytes(s, b, h, a, t, sp=False), paper_layer_bytes(s, b, h, a, t, sp=True)
    assert tp - sp == pytest.approx(s * b * h * 10 * (1 - 1 / t))
    assert paper_layer_bytes(s, b, h, a, 1, sp=True) == paper_layer_bytes(s, b, h, a, 1, sp=False)


def _uneven_worker(group):
    replica = _engine("sp").build(functools.partial(tiny_transformer, vocab=16, d=16, heads=4, layers=1, seq=5),
                                  DeviceMesh(group, tp=2))
    msgs = []
    for y in (torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, dtype=torch.long)):
        try:
            replica.forward_backward(torch.zeros(2, 5, dtype=torch.long), y)
            msgs.append(None)
        except EngineError as e:
            msgs.append(str(e))
    return msgs


def test_sequence_not_divisible_is_refused():
    """S = 5 over tp = 2: a one-line EngineError naming both numbers; so are one target per sequence instead of per
    token, and regather without SP."""
    msg, per_sequence = collectives.launch(_uneven_worker, 2, backend="zmq", timeout=TIMEOUT)[0]
    assert msg is not None and "(5)" in msg and "(2)" in msg and "\n" not in msg
    assert per_sequence is not None and "target per token" in per_sequence
    with pytest.raises(EngineError, match="sequence_parallel=True"):
        TensorParallelEngine(regather=True)


def _accumulate_worker(group, variant):
    """Two forward_backward calls on two batches without zeroing: every slot's gradient."""
    replica = _engine(variant).build(TF_FACTORY, DeviceMesh(group, tp=2))
    for x, y in tf_batches(steps=2):
        replica.forward_backward(x, y)
    return {s.name: s.grad.clone() for s in replica.slots()}


def test_sp_accumulates_gradients_like_tp():
    """Gradient accumulation (two calls, no zeroing between them): SP's replicated parameters hold G1 + G2, as TP's
    do — each call sums only its own partial gradients over tp (it once summed the earlier total again: T·G1 + G2)."""
    sp = collectives.launch(_accumulate_worker, 2, backend="zmq", args=("sp",), timeout=TIMEOUT)
    tp = collectives.launch(_accumulate_worker, 2, backend="zmq", args=("tp",), timeout=TIMEOUT)
    for got, want in zip(sp, tp):
        assert got.keys() == want.keys()
        for name in want:
            assert_close(got[name], want[name], name)
    with pytest.raises(EngineError, match="mixture-of-experts"):
        from pslab.parallelism.models import tiny_moe_transformer
        TensorParallelEngine(sequence_parallel=True).build(tiny_moe_transformer, _OneRankMesh())
    with pytest.raises(EngineError, match="splits the sequence at the embedding"):
        from pslab.parallelism.models import Block
        TensorParallelEngine(sequence_parallel=True).build(lambda: torch.nn.Sequential(Block(16, 4)),
                                                           _OneRankMesh())


class _OneRankMesh:
    """Enough of a mesh for an engine that refuses the model before it talks to anyone."""

    def group(self, axis):
        class _G:
            rank, world_size, ranks = 0, 1, (0,)
        return _G()
