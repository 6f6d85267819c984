"""gather_full_state: the full single-process model reassembled from one replica's ranks, for every engine."""

from __future__ import annotations

import pytest
import torch

from pslab import collectives
from pslab.parallelism.comm import Comm
from pslab.parallelism.data import DataParallelEngine
from pslab.parallelism.engine import EngineError, LocalReplica, ParamSlot
from pslab.parallelism.export import assemble, gather_full_state, local_pieces
from pslab.parallelism.mesh import DeviceMesh
from pslab.parallelism.models import lm_loss
from pslab.parallelism.pipeline import PipelineEngine
from pslab.parallelism.tensor import SHARD_ATTR, TP_INDEX_ATTR, TensorParallelEngine, tensor_parallelize
from pslab.parallelism.zero import ZeroEngine, ZeroStrategy

from tests.parallelism.par_helpers import (MLP_FACTORY, TF_FACTORY, adam, assert_close, mlp_batches, plain,
                                          reference, run_training, sgd, tf_batches)

STEPS = 2   # gather after each step: the state mid-training and at the end

CASES = {  # name: (engine factory, model factory, batches, loss_fn, mesh, optimizer, ZeRO?)
    "dp2": (lambda: DataParallelEngine(), MLP_FACTORY, mlp_batches, None, {"dp": 2}, sgd, False),
    "ckpt-dp2": (lambda: DataParallelEngine(checkpoint_activations=True), MLP_FACTORY, mlp_batches, None, {"dp": 2},
                 sgd, False),
    "tp2": (lambda: TensorParallelEngine(loss_fn=lm_loss), TF_FACTORY, tf_batches, lm_loss, {"tp": 2}, sgd, False),
    "dp2tp2": (lambda: TensorParallelEngine(loss_fn=lm_loss), TF_FACTORY, tf_batches, lm_loss, {"dp": 2, "tp": 2},
               sgd, False),
    "pp2-mlp": (lambda: PipelineEngine("1f1b", 2), MLP_FACTORY, mlp_batches, None, {"pp": 2}, sgd, False),
    "pp2-tf": (lambda: PipelineEngine("gpipe", 4, loss_fn=lm_loss), TF_FACTORY, tf_batches, lm_loss, {"pp": 2},
               sgd, False),
    "dp2pp2": (lambda: PipelineEngine("1f1b", 2, loss_fn=lm_loss), TF_FACTORY, tf_batches, lm_loss,
               {"dp": 2, "pp": 2}, sgd, False),
    "zero1": (lambda: ZeroEngine(1, adam), MLP_FACTORY, mlp_batches, None, {"dp": 2}, adam, True),
    "zero3": (lambda: ZeroEngine(3, adam), MLP_FACTORY, mlp_batches, None, {"dp": 2}, adam, True),
}


def _export_worker(group, case, dp0_only):
    """Train; after every step gather the full state (on every rank, or with dp0_only only on dp coordinate 0)."""
    torch.set_num_threads(1)
    engine, factory, batches, _, mesh_shape, opt, zero = CASES[case]
    states = []

    def export(mesh, replica):
        if dp0_only and mesh.coord("dp") != 0:
            states.append("skipped")
        else:
            states.append(gather_full_state(replica, mesh))

    mesh, replica, _ = run_training(group, engine(), factory, batches(STEPS), mesh_shape, opt,
                                    strategy=ZeroStrategy() if zero else None, on_step=export)
    if zero:
        replica.close()
    return plain({"states": states, "coords": mesh.coords})


RUNS = [("zmq", "dp2", False), ("zmq", "ckpt-dp2", False), ("zmq", "tp2", False), ("torch", "dp2tp2", False),
        ("zmq", "dp2tp2", True), ("zmq", "pp2-mlp", False), ("zmq", "pp2-tf", False), ("zmq", "dp2pp2", False),
        ("zmq", "zero1", False), ("zmq", "zero3", False)]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend,case,dp0_only", RUNS, ids=[f"{b}-{c}{'-dp0only' if o else ''}" for b, c, o in RUNS])
def test_gather_full_state_matches_single_process(backend, case, dp0_only):
    """After each training step, the mesh's rank 0 gets exactly the reference model's parameter names (in order)
    and shapes, equal to single-process training's weights (rtol 1e-5); every other rank gets None. With dp0_only
    the ranks of dp coordinate ≠ 0 never call it: they are not needed."""
    _, factory, batches, loss_fn, mesh_shape, opt, _ = CASES[case]
    world = mesh_shape.get("dp", 1) * mesh_shape.get("pp", 1) * mesh_shape.get("tp", 1)
    out = collectives.launch(_export_worker, world, backend=backend, args=(case, dp0_only), timeout=60)
    refs = [reference(factory, batches(STEPS)[:k + 1], opt=opt, loss_fn=loss_fn)[1] for k in range(STEPS)]
    for rank, r in enumerate(out):
        assert len(r["states"]) == STEPS
        if rank != 0:
            want = "skipped" if dp0_only and r["coords"]["dp"] != 0 else None
            assert all(s == want for s in r["states"]), f"rank {rank} got a state"
            continue
        assert r["coords"] == {"dp": 0, "pp": 0, "cp": 0, "ep": 0, "tp": 0}
        for k, (state, ref) in enumerate(zip(r["states"], refs)):
            assert list(state) == list(ref), f"step {k}: names"
            for n, w in ref.items():
                assert tuple(state[n].shape) == tuple(w.shape), f"step {k}: shape of {n}"
                assert_close(state[n], w, f"step {k}: {n}")


class _FakeGroup:
    """Just enough of a group to build the shards of rank `rank` of `size` (construction does not communicate)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.world_size = rank, size


def tp_slots(tp: int) -> list[list[ParamSlot]]:
    """Per tp rank: TF_FACTORY's model cut as TensorParallelEngine cuts it, as slots named like the engine's."""
    out = []
    for t in range(tp):
        model = tensor_parallelize(TF_FACTORY(), Comm(_FakeGroup(t, tp)))
        out.append([ParamSlot(n + (f"#tp{t}/{tp}" if getattr(p, SHARD_ATTR, False) else ""), p, t)
                    for n, p in model.named_parameters()])
    return out


def test_shards_record_their_indices_and_reassemble():
    """Every tp shard carries (dim, indices) — qkv's rows are non-contiguous (its heads' rows of q, k and v) — which
    survives `param.data = …`; the pieces of all tp ranks reassemble the full model exactly."""
    per_rank = tp_slots(2)
    qkv = next(s for s in per_rank[1] if s.name == "1.attn.qkv.weight#tp1/2").param
    dim, rows = getattr(qkv, TP_INDEX_ATTR)
    assert dim == 0 and rows.tolist() == [*range(8, 16), *range(24, 32), *range(40, 48)]
    proj = next(s for s in per_rank[0] if s.name == "1.attn.proj.weight#tp0/2").param
    assert getattr(proj, TP_INDEX_ATTR)[0] == 1
    assert not hasattr(next(s for s in per_rank[0] if s.name == "1.attn.proj.bias").param, TP_INDEX_ATTR)
    qkv.data = torch.empty(0)
    assert getattr(qkv, TP_INDEX_ATTR)[1] is rows
    per_rank = tp_slots(2)
    got = assemble([p for t, slots in enumerate(per_rank) for p in local_pieces(slots, send_replicated=t == 0)])
    want = dict(TF_FACTORY().named_parameters())
    assert list(got) == list(want)
    for n, w in want.items():
        assert torch.equal(got[n], w.detach()), n


def test_incomplete_or_unplaceable_pieces_are_refused():
    """Shards that do not cover the full tensor, and a '#' shard without _tp_index, raise EngineError."""
    per_rank = tp_slots(2)
    with pytest.raises(EngineError, match=r"split over 2 tensor-parallel ranks but shards \[0\] arrived"):
        assemble(local_pieces(per_rank[0]))
    twice = local_pieces(per_rank[0]) + local_pieces(per_rank[1], send_replicated=False)
    fc1 = next(e for e, _ in twice if e["name"] == "1.mlp.fc1.weight" and e["part"] == 1)
    fc1["index"] = list(range(32))                       # rank 1 claims rank 0's rows
    with pytest.raises(EngineError, match="cover 32 of 64 indices along dim 0, 32 more than once"):
        assemble(twice)
    with pytest.raises(EngineError, match="without a _tp_index"):
        local_pieces([ParamSlot("w#shard0:4", torch.zeros(4), 0)])


class _World1:
    """A one-rank world: every mesh group is the world itself, so nothing is ever sent."""

    world_size, rank, ranks = 1, 0, (0,)


def test_single_rank_and_wrong_mesh():
    """On one rank the full state is the model's own parameters (copies); a replica built on another mesh is
    refused with EngineError."""
    mesh = DeviceMesh(_World1())
    model = MLP_FACTORY()
    state = gather_full_state(LocalReplica(model, Comm(mesh.group("dp")), 0), mesh)
    assert list(state) == [n for n, _ in model.named_parameters()]
    for n, p in model.named_parameters():
        assert torch.equal(state[n], p) and state[n].data_ptr() != p.data_ptr()

    class _Other(_World1):
        ranks = (3,)
    with pytest.raises(EngineError, match="pass the DeviceMesh the replica was built on"):
        gather_full_state(LocalReplica(model, Comm(_Other()), 0), mesh)
