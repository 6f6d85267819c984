"""Tensor parallel engine (Megatron f/g, column/row linear, TP MLP and attention): parity and per-layer traffic."""

from __future__ import annotations

import pytest
import torch

from pslab import collectives
from pslab.parallelism.comm import Comm
from pslab.parallelism.models import lm_loss
from pslab.parallelism.tensor import SHARD_ATTR, TensorParallelEngine, f, g, tensor_parallelize

from tests.parallelism.par_helpers import (STEPS, TF_FACTORY, assert_close, plain, reference, tf_batches,
                                          train_engine)


class _FakeGroup:
    """Just enough of a group to build the shards of rank `rank` of `size` (construction does not communicate)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.world_size = rank, size


def expected_slots(ref_w: dict[str, torch.Tensor], tp: int) -> list[dict[str, torch.Tensor]]:
    """Per tp rank: the reference model's final weights cut exactly as the engine cuts them."""
    out = []
    for t in range(tp):
        model = TF_FACTORY()
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(ref_w[n])
        model = tensor_parallelize(model, Comm(_FakeGroup(t, tp)))
        out.append({n + (f"#tp{t}/{tp}" if getattr(p, SHARD_ATTR, False) else ""): p.detach()
                    for n, p in model.named_parameters()})
    return out


def _tp_worker(group, mesh_shape):
    return train_engine(group, TensorParallelEngine(loss_fn=lm_loss), TF_FACTORY, tf_batches(), mesh_shape)


@pytest.mark.parametrize("backend,mesh_shape", [("zmq", {"dp": 2, "tp": 2}), ("torch", {"dp": 2, "tp": 2})])
def test_tp_matches_single_process(backend, mesh_shape):
    """dp=2 x tp=2 on 4 ranks gives the single-process per-step losses and final weights: every rank's shards
    equal the matching slices of the reference weights (rtol 1e-5). Then `check_tp_traffic`."""
    ref_losses, ref_w = reference(TF_FACTORY, tf_batches(), loss_fn=lm_loss)
    world = mesh_shape.get("dp", 1) * mesh_shape["tp"]
    out = collectives.launch(_tp_worker, world, backend=backend, args=(mesh_shape,), timeout=120)
    want = expected_slots(ref_w, mesh_shape["tp"])
    for r in out:
        assert_close(r["losses"], ref_losses, "losses")
        exp = want[r["coords"]["tp"]]
        assert set(r["slots"]) == set(exp)
        for n, w in exp.items():
            assert_close(r["slots"][n], w, n)
        check_tp_traffic(r, batch=8 // mesh_shape.get("dp", 1))


def check_tp_traffic(r, batch: int, seq: int = 6, d: int = 16) -> None:
    """Tensor parallelism communicates in every layer: each Attention and each MLP of each block all-reduces once
    forward (g) and once backward (f), B·S·d·4 bytes each way per step; besides those only the dp gradient
    all-reduce ("grads"); no p2p, all-gather or reduce-scatter."""
    sites = r["by_site"]
    layers = [f"{b}.{m}" for b in (1, 2) for m in ("attn", "mlp")]
    for layer in layers:
        assert sites[layer] == STEPS * 2 * batch * seq * d * 4, layer
    assert set(sites) - set(layers) <= {"grads"}
    kinds = r["by_kind"]
    assert kinds["p2p"] == kinds["all_gather"] == kinds["reduce_scatter"] == 0


def _fg_worker(group):
    comm = Comm(group)
    x = torch.full((3,), float(group.rank + 1), requires_grad=True)
    y = f(x, comm)
    (y * (group.rank + 1)).sum().backward()        # backward of f all-reduces: grad = 1 + 2 = 3 on both ranks
    fx = x.grad.clone()
    x2 = torch.full((3,), float(group.rank + 1), requires_grad=True)
    z = g(x2, comm)                                   # forward of g all-reduces: 1 + 2 = 3
    (z * (group.rank + 1)).sum().backward()          # backward of g is identity: grad = rank + 1
    return plain((y.detach(), fx, z.detach(), x2.grad))


def test_f_and_g_are_conjugate():
    """f is identity forward / all-reduce backward; g is all-reduce forward / identity backward."""
    out = collectives.launch(_fg_worker, 2, backend="zmq", timeout=60)
    for rank, (y, fx, z, gx) in enumerate(out):
        assert (y == rank + 1).all() and (fx == 3).all()
        assert (z == 3).all() and (gx == rank + 1).all()


def test_uneven_split_is_refused():
    """A head count the tp size does not divide is refused with an actionable message."""
    with pytest.raises(ValueError, match="attention heads"):
        tensor_parallelize(TF_FACTORY(), Comm(_FakeGroup(0, 3)))
