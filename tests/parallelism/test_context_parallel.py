"""Context parallel engine (ring attention over the cp axis, alone or after tp's head split: tp × cp, dp × tp × cp):
parity with single-process training, ring traffic, export and snapshots of a CP replica, and the layout errors."""

from __future__ import annotations

import functools

import pytest
import torch

from pslab import collectives
from pslab.parallelism.checkpointing import ActivationMeter
from pslab.parallelism.comm import Comm
from pslab.parallelism.context import ContextParallelEngine, ContextParallelReplica, context_parallelize
from pslab.parallelism.engine import AllReduceStrategy, EngineError
from pslab.parallelism.export import gather_full_state
from pslab.parallelism.mesh import DeviceMesh
from pslab.parallelism.models import lm_loss, tiny_transformer
from pslab.parallelism.ring_attention import ring_bytes
from pslab.parallelism.snapshot import capture, restore_into

from tests.parallelism.par_helpers import adam_attention, assert_close, plain, reference, run_training, sgd

STEPS, BATCH, VOCAB, D = 3, 4, 16, 16


adam = adam_attention


OPTS = {"sgd": sgd, "adam": adam}


def factory(seq: int) -> functools.partial:
    return functools.partial(tiny_transformer, vocab=VOCAB, d=D, heads=4, layers=2, seq=seq)


def batches(seq: int, batch: int = BATCH, steps: int = STEPS):
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, VOCAB, (batch, seq), generator=g), torch.randint(0, VOCAB, (batch, seq), generator=g))
            for _ in range(steps + 1)]          # the last batch: the step repeated after restore_into


def _cp_worker(group, mesh_shape, opt, seq, ac=False, sp=False):
    torch.set_num_threads(1)
    data = batches(seq, BATCH * mesh_shape.get("dp", 1))
    strategy = AllReduceStrategy(OPTS[opt])
    engine = ContextParallelEngine(loss_fn=lm_loss, checkpoint_activations=ac, sequence_parallel=sp)
    mesh, replica, losses = run_training(group, engine, factory(seq), data[:-1], mesh_shape, strategy=strategy)
    p2p = replica.log.by_site("p2p")
    full = gather_full_state(replica, mesh)
    slots = {s.name: s.param.detach().clone() for s in replica.slots()}
    # snapshot: capture, take a step, restore_into, take the same step again -> bitwise the same
    dp_rank, dp = mesh.coord("dp"), mesh.size("dp")
    x, y = (torch.tensor_split(t, dp)[dp_rank] for t in data[-1])
    tensors, meta = capture(replica, strategy)
    stored = len(capture(replica, strategy, mesh)[1]["pieces"])
    first = replica.forward_backward(x, y)
    strategy.step(replica)
    after = {s.name: s.param.detach().clone() for s in replica.slots()}
    restore_into(replica, strategy, tensors, meta)
    again = replica.forward_backward(x, y)
    strategy.step(replica)
    same = first == again and all(torch.equal(after[s.name], s.param) for s in replica.slots())
    return plain({"losses": losses, "slots": slots, "full": full, "p2p": p2p, "coords": mesh.coords,
                  "by_site": replica.log.by_site(), "by_kind": replica.log.by_kind(), "stored": stored,
                  "restore_repeats": same})


@pytest.mark.parametrize("backend,mesh_shape,opt,seq,ac", [
    ("zmq", {"cp": 2}, "sgd", 12, False),
    ("torch", {"cp": 2}, "adam", 12, False),
    ("zmq", {"cp": 4}, "adam", 24, False),
    ("zmq", {"dp": 2, "cp": 2}, "sgd", 12, False),
    ("torch", {"dp": 2, "cp": 2}, "adam", 12, False),
    ("zmq", {"tp": 2, "cp": 2}, "adam", 12, False),
    ("torch", {"tp": 2, "cp": 2}, "sgd", 12, True),
    ("zmq", {"dp": 2, "tp": 2, "cp": 2}, "sgd", 12, True),
    ("zmq", {"tp": 2, "cp": 2}, "adam", 12, "sp"),          # + sequence parallelism: S/(C·T) tokens a rank
    ("torch", {"dp": 2, "tp": 2, "cp": 2}, "sgd", 24, "sp"),
])
def test_cp_matches_single_process(backend, mesh_shape, opt, seq, ac):
    """Per-step losses and every rank's parameters (full-model names; under tp × cp its head shards) equal
    single-process training on the same batches (S = 12 or 24: not powers of two); gather_full_state gives the
    reference model on rank 0; each layer's ring sends exactly `ring_bytes` per step (tp × cp: over the rank's d/T
    of the heads; checkpointing replays the forward ring); capture/restore_into repeats a step bitwise; a
    checkpoint stores the parameters on cp rank 0 of dp rank 0 only. With sequence parallelism ("sp") each tp rank
    runs the LayerNorm regions on its S/(C·T) of the tokens, attention's ring on the gathered S/C."""
    sp, ac = ac == "sp", ac is True
    data = batches(seq, BATCH * mesh_shape.get("dp", 1))
    ref_losses, ref_w = reference(factory(seq), data[:-1], opt=OPTS[opt], loss_fn=lm_loss)
    world = mesh_shape.get("dp", 1) * mesh_shape.get("tp", 1) * mesh_shape["cp"]
    out = collectives.launch(_cp_worker, world, backend=backend, args=(mesh_shape, opt, seq, ac, sp), timeout=150)
    cp, tp = mesh_shape["cp"], mesh_shape.get("tp", 1)
    rb = ring_bytes(BATCH, seq, D // tp, cp)
    per_layer = STEPS * (rb["total"] + (rb["forward"] if ac else 0))
    for r in out:
        assert_close(r["losses"], ref_losses, "losses")
        if tp == 1:
            assert set(r["slots"]) == set(ref_w)
            for n, w in ref_w.items():
                assert_close(r["slots"][n], w, n)
        assert r["p2p"] == {"1.attn": per_layer, "2.attn": per_layer}
        assert set(r["by_site"]) <= {"1.attn", "2.attn", "1.mlp", "2.mlp", "cp grads", "cp loss", "grads", "export",
                                     "sp loss", "sp replicated grads"}
        assert ("sp replicated grads" in r["by_site"]) == sp
        assert (r["by_kind"]["all_gather"] == r["by_kind"]["reduce_scatter"] == 0) != sp   # sp: ḡ / ḡ* over tp
        assert r["restore_repeats"]
        if tp == 1:
            assert r["stored"] == (len(ref_w) if r["coords"]["cp"] == r["coords"]["dp"] == 0 else 0)
        else:
            assert (r["stored"] > 0) == (r["coords"]["cp"] == r["coords"]["dp"] == 0)
        if r["coords"]["cp"] == r["coords"]["dp"] == r["coords"]["tp"] == 0:
            assert list(r["full"]) == list(ref_w)
            for n, w in ref_w.items():
                assert_close(r["full"][n], w, f"export {n}")
        else:
            assert r["full"] is None


def _zero_cp_worker(group, stage, opt, seq):
    from pslab.parallelism.zero import ZeroEngine, ZeroStrategy
    torch.set_num_threads(1)
    data = batches(seq, BATCH * 2)
    engine = ZeroEngine(stage, OPTS[opt], loss_fn=lm_loss)
    mesh, replica, losses = run_training(group, engine, factory(seq), data[:-1], {"dp": 2, "cp": 2},
                                         strategy=ZeroStrategy())
    full = gather_full_state(replica, mesh)
    out = plain({"losses": losses, "full": full, "coords": mesh.coords, "deferred": len(replica.deferred),
                 "named": len(replica.named), "by_site": replica.log.by_site(), "p2p": replica.log.by_site("p2p"),
                 "held": sum(s.param.numel() for s in replica.slots()),
                 "numel": sum(p.numel() for _, p in factory(seq)().named_parameters()),
                 "peak": getattr(replica, "peak_gathered_bytes", 0), "unit_bytes": [u.nbytes for u in replica.units]})
    replica.close()
    return out


@pytest.mark.parametrize("backend,stage,opt", [("zmq", 2, "adam"), ("torch", 3, "sgd")])
def test_zero2_and_zero3_on_cp_replicas_match_single_process(backend, stage, opt):
    """ZeRO-2/3 on dp 2 x cp 2: each cp rank runs its zig-zag tokens on the ring; every gradient's hook waits for
    the average over cp ("cp grads"), then the gradients are reduce-scattered over dp; the losses and the exported
    model equal one process, the ring moves what it moves without ZeRO, and each rank holds 1/D of the model (the
    cp ranks the same chunks). Stage 3 frees a unit's gathered weights once its gradients are in, the waiting ones
    included: at most two units whole at once, as under plain dp (it held every unit until backward ended before)."""
    seq = 12
    data = batches(seq, BATCH * 2)
    ref_losses, ref_w = reference(factory(seq), data[:-1], opt=OPTS[opt], loss_fn=lm_loss)
    out = collectives.launch(_zero_cp_worker, 4, backend=backend, args=(stage, opt, seq), timeout=150)
    rb = ring_bytes(BATCH, seq, D, 2)
    for r in out:
        assert_close(r["losses"], ref_losses, "losses")
        assert r["deferred"] == r["named"] and "cp grads" in r["by_site"], r["by_site"]
        assert r["p2p"] == {"1.attn": STEPS * rb["total"], "2.attn": STEPS * rb["total"]}
        assert r["held"] == pytest.approx(r["numel"] / 2, abs=r["named"]), r["coords"]
        if stage == 3:
            u = r["unit_bytes"]
            assert 0 < r["peak"] <= max(a + b for a, b in zip(u, u[1:])), (r["peak"], u)
    assert list(out[0]["full"]) == list(ref_w)
    for n, w in ref_w.items():
        assert_close(out[0]["full"][n], w, f"export {n}")


def _cp_pp_worker(group, mesh_shape, opt, seq, v):
    from pslab.parallelism.pipeline import PipelineEngine
    torch.set_num_threads(1)
    data = batches(seq, BATCH * mesh_shape.get("dp", 1))
    engine = PipelineEngine("1f1b", 2, loss_fn=lm_loss, virtual_stages=v)
    mesh, replica, losses = run_training(group, engine, factory(seq), data[:-1], mesh_shape,
                                         strategy=AllReduceStrategy(OPTS[opt]))
    return plain({"losses": losses, "full": gather_full_state(replica, mesh), "coords": mesh.coords,
                  "p2p": replica.log.by_site("p2p")})


@pytest.mark.parametrize("backend,mesh_shape,opt,v", [
    ("zmq", {"pp": 2, "cp": 2}, "adam", 1),
    ("torch", {"dp": 2, "pp": 2, "cp": 2}, "sgd", 1),
    ("zmq", {"tp": 2, "pp": 2, "cp": 2}, "sgd", 2),
])
def test_cp_in_a_pipeline_matches_single_process(backend, mesh_shape, opt, v):
    """pp × cp (and dp × pp × cp, tp × pp × cp with interleaved 1F1B): each stage's attention runs on its cp ring,
    every micro-batch at the rank's zig-zag tokens, so each cut carries b·(S/C)·d per rank; the losses and the
    gathered model equal one process's."""
    seq = 12
    data = batches(seq, BATCH * mesh_shape.get("dp", 1))
    ref_losses, ref_w = reference(factory(seq), data[:-1], opt=OPTS[opt], loss_fn=lm_loss)
    world = 1
    for n in mesh_shape.values():
        world *= n
    out = collectives.launch(_cp_pp_worker, world, backend=backend, args=(mesh_shape, opt, seq, v), timeout=150)
    cp, tp = mesh_shape["cp"], mesh_shape.get("tp", 1)
    cut = STEPS * BATCH * (seq // cp) * D * 4                  # one cut's activation per step (2 micro-batches)
    for r in out:
        assert_close(r["losses"], ref_losses, "losses")
        s = r["coords"]["pp"]
        sends = sum((c < 2 * v - 1) + (c > 0) for c in range(s, 2 * v, 2))
        site = "stage 0 -> 1" if s == 0 else "stage 1 -> 0"
        assert r["p2p"][site] == sends * cut, (r["coords"], r["p2p"])
        # every rank holds one of the two blocks (stage 0: Embed + block 1, or interleaved chunks 0 and 2: Embed and
        # block 2), so it runs one layer's ring per micro-batch: ring_bytes of the whole batch per step
        rb = ring_bytes(BATCH, seq, D // tp, cp)["total"] * STEPS
        assert sum(n for k, n in r["p2p"].items() if k.endswith(".attn")) == rb, r["p2p"]
    root = out[0]["full"]
    assert list(root) == list(ref_w)
    for n, w in ref_w.items():
        assert_close(root[n], w, n)


class _FakeGroup:
    """Just enough of a group for a replica that fails before it communicates."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.world_size, self.ranks = rank, size, tuple(range(size))


def _replica(cp: int, seq: int) -> ContextParallelReplica:
    comm = Comm(_FakeGroup(0, cp))
    return ContextParallelReplica(context_parallelize(factory(seq)(), comm), comm, Comm(_FakeGroup(0, 1)), 0,
                                  lm_loss, "zigzag")


def test_sequence_not_divisible_is_refused():
    """S = 10 with cp = 2 does not cut into 4 chunks: one EngineError line saying what to choose."""
    x = torch.zeros(2, 10, dtype=torch.long)
    with pytest.raises(EngineError, match=r"cp = 2: sequence length 10 .* divisible by 4"):
        _replica(2, 10).forward_backward(x, x)


def test_cp1_equals_plain_model_and_meter():
    """cp = 1 (a one-rank ring) is the plain model: same loss and gradients as tiny_transformer, and roughly the
    same saved activations (ring attention's q, k, v, out, lse versus SDPA's flash kernel on CPU)."""
    seq = 16
    x, y = batches(seq)[0]
    plain_model = factory(seq)()
    with ActivationMeter() as m_plain:
        loss = lm_loss(plain_model(x), y)
        loss.backward()
    rep = _replica(1, seq)
    with ActivationMeter() as m_cp:
        got = rep.forward_backward(x, y)
    assert abs(got - float(loss.detach())) < 1e-5
    for (n, p), (n2, p2) in zip(plain_model.named_parameters(), rep.module.named_parameters()):
        assert n == n2
        assert_close(p2.grad, p.grad, n)
    assert abs(m_cp.peak - m_plain.peak) <= 0.1 * m_plain.peak


def test_engine_refuses_other_axes():
    """cp combines with dp and tp in this engine: a mesh with pp > 1 is refused before any group is used."""
    class _Mesh:
        def size(self, ax: str) -> int:
            return 2 if ax == "pp" else 1
    with pytest.raises(EngineError, match="pp=2: set them to 1"):
        ContextParallelEngine(loss_fn=lm_loss).build(factory(8), _Mesh())


def _meter_worker(group, seq):
    torch.set_num_threads(1)
    mesh = DeviceMesh(group, cp=group.world_size)
    replica = ContextParallelEngine(loss_fn=lm_loss).build(factory(seq), mesh)
    x, y = batches(seq)[0]
    for s in replica.slots():       # as a parameter-server strategy does: gradients live in its own buffers
        s.param.grad = torch.zeros_like(s.param)
    buffers = [s.param.grad for s in replica.slots()]
    with ActivationMeter() as meter:
        replica.forward_backward(x, y)
    kept = all(s.param.grad is b for s, b in zip(replica.slots(), buffers))
    return meter.peak, kept, plain({s.name: s.param.grad for s in replica.slots()})


def test_saved_activations_per_rank_are_one_over_cp():
    """ActivationMeter around one forward+backward: each of the C = 2 ranks keeps half the saved activations of
    the plain single-process model (every saved tensor is per token; ring attention saves q, k, v, out, lse for
    its S/C tokens, as SDPA's CPU flash kernel does for S) — within 1 %. The cp-averaged gradients equal the plain
model's and are written into the gradient tensors a strategy put there (a parameter server's push buffers)."""
    seq = 64
    model = factory(seq)()
    x, y = batches(seq)[0]
    with ActivationMeter() as m1:
        lm_loss(model(x), y).backward()
    out = collectives.launch(_meter_worker, 2, backend="zmq", args=(seq,), timeout=60)
    for p, kept, grads in out:
        assert abs(p - m1.peak / 2) <= 0.01 * m1.peak / 2, (p, m1.peak)
        assert kept, "the cp gradient average must write into the existing gradient tensors"
        for n, w in model.named_parameters():
            assert_close(grads[n], w.grad, f"grad {n}")


def test_moe_models_are_refused():
    """The context-parallel engine does not add an MoE model's load-balancing loss: such a model is refused."""
    from pslab.parallelism.context import ContextParallelEngine
    from pslab.parallelism.engine import EngineError
    from pslab.parallelism.models import tiny_moe_transformer

    class _Mesh:
        def size(self, axis):
            return 1

        def group(self, axis):
            class _G:
                rank, world_size, ranks = 0, 1, (0,)
            return _G()
    with pytest.raises(EngineError, match="mixture-of-experts"):
        ContextParallelEngine().build(tiny_moe_transformer, _Mesh())
