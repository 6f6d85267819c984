"""A mixture-of-experts model through the other axes (parallelism/compose.py): tensor parallelism splits every
expert's MLP column/row over the tp group like a dense MLP (router replicated, so every tp rank routes the same
tokens), expert parallelism places the experts over ep inside that, pipelines cut around them, and activation
checkpointing returns the blocks' load-balancing losses from the checkpoint so their gradient still reaches the
routers. Every step's loss, the gathered model and the routed counts equal one process on the concatenated batch."""

from __future__ import annotations

import math

import pytest
import torch

from pslab import collectives
from pslab.parallelism.engine import AllReduceStrategy, EngineError
from pslab.parallelism.export import gather_full_state
from pslab.parallelism.models import lm_loss
from pslab.parallelism.moe import moe_layers

from tests.parallelism import test_expert_parallel as TEP
from tests.parallelism.par_helpers import adam_attention, assert_close, plain, run_training, sgd, tf_batches

pytestmark = pytest.mark.timeout(240)

STEPS = TEP.STEPS
FACTORY = TEP._pp_factory()       # test_expert_parallel's MoE with capacity per sequence: any split routes the same
OPTS = {"sgd": sgd, "adam": adam_attention}


def _reference(opt: str):
    """One process on the concatenated batches (test_expert_parallel's reference, same model and steps)."""
    return TEP._reference(None, opt=OPTS[opt])


def _engine(mesh_shape: dict[str, int], ckpt: bool):
    if mesh_shape.get("pp", 1) > 1:
        from pslab.parallelism.pipeline import PipelineEngine
        return PipelineEngine("1f1b", 2, loss_fn=lm_loss, checkpoint_activations=ckpt)
    if mesh_shape.get("ep", 1) > 1:
        from pslab.parallelism.expert import ExpertParallelEngine
        return ExpertParallelEngine(loss_fn=lm_loss, checkpoint_activations=ckpt)
    if mesh_shape.get("tp", 1) > 1:
        from pslab.parallelism.tensor import TensorParallelEngine
        return TensorParallelEngine(loss_fn=lm_loss, checkpoint_activations=ckpt)
    from pslab.parallelism.data import DataParallelEngine
    return DataParallelEngine(loss_fn=lm_loss, checkpoint_activations=ckpt)


def _worker(group, mesh_shape, ckpt, opt):
    torch.set_num_threads(1)
    mesh, replica, losses = run_training(group, _engine(mesh_shape, ckpt), FACTORY, tf_batches(STEPS), mesh_shape,
                                         strategy=AllReduceStrategy(OPTS[opt]))
    stats = {n: m.pop_stats() for n, m in moe_layers(replica.module if hasattr(replica, "module") else replica.stage)}
    wrapped = sum(type(m).__name__ == "CheckpointWrapper" for m in
                  (replica.module if hasattr(replica, "module") else replica.stage).modules())
    return plain({"losses": losses, "state": gather_full_state(replica, mesh), "coords": mesh.coords,
                  "stats": stats, "sites": sorted(replica.log.by_site()), "wrapped": wrapped})


CASES = [  # backend, mesh, activation checkpointing, optimizer
    ("zmq", {"dp": 2}, True, "sgd"),
    ("zmq", {"tp": 2}, False, "adam"),
    ("torch", {"tp": 2}, True, "sgd"),
    ("zmq", {"ep": 2, "tp": 2}, False, "sgd"),
    ("zmq", {"dp": 2, "ep": 2}, True, "adam"),
    ("torch", {"ep": 2, "tp": 2}, True, "sgd"),
    ("zmq", {"pp": 2, "tp": 2}, True, "sgd"),
    ("zmq", {"dp": 2, "ep": 2, "tp": 2}, True, "sgd"),
    ("zmq", {"pp": 2, "ep": 2, "tp": 2}, False, "adam"),
]


@pytest.mark.parametrize("backend,mesh_shape,ckpt,opt", CASES,
                         ids=["-".join(f"{k}{v}" for k, v in m.items()) + ("-ac" if c else "") + f"-{o}-{b}"
                              for b, m, c, o in CASES])
def test_moe_composes_with_tp_ep_pp_and_checkpointing(backend, mesh_shape, ckpt, opt):
    """Losses of every step, the gathered model and the routed / dropped counts (summed over the ranks that see
    distinct tokens: tp ranks see the same ones) equal one process; under tp every expert's weights are split
    (sites of the experts' f/g appear), under checkpointing every block is wrapped."""
    ref_losses, ref_w, ref_stats = _reference(opt)
    out = collectives.launch(_worker, math.prod(mesh_shape.values()), backend=backend,
                             args=(mesh_shape, ckpt, opt), timeout=200)
    for r in out:
        assert_close(r["losses"], ref_losses, f"losses {r['coords']}")
        assert (r["wrapped"] > 0) == ckpt
        if mesh_shape.get("tp", 1) > 1:
            assert any(".experts." in s for s in r["sites"]), r["sites"]
    root = out[0]["state"]
    assert root is not None and all(r["state"] is None for r in out[1:])
    assert list(root) == list(ref_w)
    for n, w in ref_w.items():
        assert_close(root[n], w, n)
    got: dict[str, dict[str, torch.Tensor]] = {}
    for r in out:
        if r["coords"].get("tp", 0):
            continue                                # tp ranks route the same tokens as tp rank 0
        for layer, st in r["stats"].items():
            for k, v in st.items():
                got.setdefault(layer, {}).setdefault(k, torch.zeros_like(ref_stats[layer][k]))
                got[layer][k] += torch.as_tensor(v)
    assert set(got) == set(ref_stats)
    for layer, st in ref_stats.items():
        for k in ("routed", "dropped"):
            assert got[layer][k].tolist() == st[k].tolist(), (layer, k)
    assert sum(int(st["dropped"].sum()) for st in ref_stats.values()) > 0


def test_moe_with_sequence_parallelism_is_refused():
    """sp would route each tp rank's sequence shard alone, while capacity and the aux loss are per whole sequence:
    compose refuses it in one line."""
    from types import SimpleNamespace
    from pslab.parallelism.comm import CommLog
    from pslab.parallelism.compose import compose

    class _G:
        def __init__(self, size: int) -> None:
            self.rank, self.world_size, self.ranks = 0, size, tuple(range(size))

    mesh = SimpleNamespace(group=lambda axis: _G(2 if axis == "tp" else 1), world=_G(1), rank=0)
    with pytest.raises(EngineError, match="sequence parallelism would route each tp rank's sequence shard"):
        compose(FACTORY, mesh, CommLog(), sequence_parallel=True)


def test_engines_refuse_meshes_and_models_they_would_train_wrongly():
    """TensorParallelEngine on a mesh with ep (every ep rank would run the whole batch: experts' gradients ep times
    too large) and ZeroEngine on an MoE model (its replica drops the load-balancing loss) are one-line errors."""
    from types import SimpleNamespace
    from pslab.parallelism.tensor import TensorParallelEngine
    from pslab.parallelism.zero import ZeroEngine

    class _G:
        def __init__(self, size: int) -> None:
            self.rank, self.world_size, self.ranks = 0, size, tuple(range(size))

    sizes = {"tp": 2, "ep": 2}
    mesh = SimpleNamespace(group=lambda axis: _G(sizes.get(axis, 1)), world=_G(4), rank=0,
                           size=lambda axis: sizes.get(axis, 1))
    with pytest.raises(EngineError, match="TensorParallelEngine runs on dp x tp meshes; this one also has ep=2"):
        TensorParallelEngine(loss_fn=lm_loss).build(FACTORY, mesh)
    one = SimpleNamespace(group=lambda axis: _G(1), world=_G(1), rank=0, size=lambda axis: 1)
    with pytest.raises(EngineError, match="would drop a mixture-of-experts model's load-balancing loss"):
        ZeroEngine(2, sgd, loss_fn=lm_loss).build(FACTORY, one)
