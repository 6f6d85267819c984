"""pslab's engines against PyTorch's own implementations, in the same gloo processes, on the same initial weights
and batches: the per-step losses and the parameters after several SGD and Adam steps agree to float32 rounding.

    ZeRO-3 / ZeRO-2   FSDP2 (`torch.distributed.fsdp.fully_shard` on an `init_device_mesh("cpu", ...)`), each
                      Linear its own unit, reshard_after_forward True (ZeRO-3) / False (ZeRO-2's kept parameters)
    TP                DTensor tensor parallelism (`parallelize_module` with ColwiseParallel / RowwiseParallel) on
                      a model that declares the same plan (`tp_plan`, the user-model path of tensor.py)
    TP + SP           DTensor with SequenceParallel on the LayerNorms, the residual stream Shard(1) between the
                      blocks (PrepareModuleInput all-gathers it into each MLP, RowwiseParallel reduce-scatters back),
                      on pslab's blocks (Embed, LayerNorm + MLP, Head; no attention: DTensor would need its heads
                      split per tp rank, which pslab's Attention computes from its full width)

(DDP, ZeroRedundancyOptimizer and torch.distributed.pipelining: tests/parallelism/test_data_parallel.py,
test_zero.py and test_pipeline_parallel.py.)"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from pslab import collectives
from pslab.experiments.bench.engines import dtensor_sequence_parallel, ff_blocks
from pslab.parallelism.engine import AllReduceStrategy
from pslab.parallelism.export import gather_full_state
from pslab.parallelism.mesh import DeviceMesh
from pslab.parallelism.models import lm_loss, mlp
from pslab.parallelism.tensor import TensorParallelEngine
from pslab.parallelism.zero import ZeroEngine, ZeroStrategy

from tests.parallelism.par_helpers import adam, assert_close, dp_shard, plain, sgd

FACTORY = functools.partial(mlp, [24, 48, 48, 48, 6])
STEPS = 4


def batches(seed: int = 3, width: int = 24, classes: int = 6):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, width, generator=g), torch.randint(0, classes, (16,), generator=g))
            for _ in range(STEPS)]


OPTS = {"sgd": sgd, "adam": adam}


def _fsdp_worker(group, stage: int, opt: str):
    """pslab's ZeRO-`stage` and FSDP2 (reshard after forward for stage 3), one after the other in these ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.set_num_threads(1)
    world, rank = group.world_size, group.rank
    mesh = DeviceMesh(group, dp=world)
    rep = ZeroEngine(stage, OPTS[opt]).build(FACTORY, mesh)
    strategy = ZeroStrategy()
    strategy.attach(rep)
    ours = []
    for x, y in batches():
        loss = rep.forward_backward(dp_shard(x, rank, world), dp_shard(y, rank, world))
        strategy.step(rep)
        t = torch.tensor([loss], dtype=torch.float64)
        group.all_reduce(t, "avg")
        ours.append(float(t[0]))
    our_params = rep.full_parameters()
    rep.close()

    model = FACTORY()
    dmesh = init_device_mesh("cpu", (world,))
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=dmesh, reshard_after_forward=stage == 3)
    fully_shard(model, mesh=dmesh, reshard_after_forward=stage == 3)
    o = OPTS[opt](list(model.parameters()))
    theirs = []
    for x, y in batches():
        loss = nn.functional.cross_entropy(model(dp_shard(x, rank, world)), dp_shard(y, rank, world))
        o.zero_grad()
        loss.backward()
        o.step()
        t = loss.detach().double().reshape(1)
        torch.distributed.all_reduce(t)
        theirs.append(float(t[0]) / world)
    their_params = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    return plain({"ours": ours, "theirs": theirs, "our_params": our_params, "their_params": their_params})


@pytest.mark.parametrize("stage", [3, 2])
@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_zero_equals_fsdp2(stage, opt):
    """2 ranks, an MLP of 4 Linear units, 4 steps: the same mean loss every step and the same parameters after."""
    out = collectives.launch(_fsdp_worker, 2, backend="torch", args=(stage, opt), timeout=120)
    for r in out:
        assert_close(r["ours"], r["theirs"], f"ZeRO-{stage} vs FSDP2 losses ({opt})")
        assert r["our_params"].keys() == r["their_params"].keys()
        for n, w in r["their_params"].items():
            assert_close(r["our_params"][n], w, f"ZeRO-{stage} vs FSDP2 {n} ({opt})")


class PlannedMLP(nn.Sequential):
    """Two Megatron pairs (column-parallel, then row-parallel) declared the way a user's model declares them."""

    tp_plan = {"0": "colwise", "2": "rowwise", "4": "colwise", "6": "rowwise"}


def planned_mlp() -> nn.Module:
    torch.manual_seed(0)
    return PlannedMLP(nn.Linear(24, 32), nn.GELU(), nn.Linear(32, 24), nn.Tanh(), nn.Linear(24, 32), nn.GELU(),
                      nn.Linear(32, 6))


def _dtensor_tp_worker(group, opt: str):
    """pslab's tensor parallelism (the model's tp_plan) and DTensor's parallelize_module with the same plan."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    torch.set_num_threads(1)
    world = group.world_size
    mesh = DeviceMesh(group, tp=world)
    rep = TensorParallelEngine(loss_fn=nn.functional.cross_entropy).build(planned_mlp, mesh)
    strategy = AllReduceStrategy(OPTS[opt])
    strategy.attach(rep)
    ours = []
    for x, y in batches():                     # every tp rank sees the whole batch
        ours.append(float(rep.forward_backward(x, y)))
        strategy.step(rep)
    our_params = gather_full_state(rep, mesh)

    model = planned_mlp()
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(model, init_device_mesh("cpu", (world,)),
                       {name: styles[s]() for name, s in PlannedMLP.tp_plan.items()})
    o = OPTS[opt](list(model.parameters()))
    theirs = []
    for x, y in batches():
        loss = nn.functional.cross_entropy(model(x), y)
        o.zero_grad()
        loss.backward()
        o.step()
        theirs.append(float(loss.detach()))
    their_params = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    return plain({"ours": ours, "theirs": theirs, "our_params": our_params, "their_params": their_params})


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_tensor_parallel_equals_dtensor(opt):
    """tp = 2, the same plan: the same loss every step and the same full parameters after 4 steps."""
    out = collectives.launch(_dtensor_tp_worker, 2, backend="torch", args=(opt,), timeout=120)
    for r in out:
        assert_close(r["ours"], r["theirs"], f"TP vs DTensor losses ({opt})")
    ours, theirs = out[0]["our_params"], out[0]["their_params"]
    assert ours is not None and ours.keys() == theirs.keys()
    for n, w in theirs.items():
        assert_close(ours[n], w, f"TP vs DTensor {n} ({opt})")


def ff_model() -> nn.Module:
    return ff_blocks(vocab=16, d=16, seq=8)


def token_batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 16, (4, 8), generator=g), torch.randint(0, 16, (4, 8), generator=g))
            for _ in range(STEPS)]


def _dtensor_sp_worker(group, opt: str):
    """pslab's TP + SP on ff_model, then DTensor's: SequenceParallel LayerNorms, Shard(1) between blocks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import implicit_replication
    torch.set_num_threads(1)
    world = group.world_size
    mesh = DeviceMesh(group, tp=world)
    rep = TensorParallelEngine(sequence_parallel=True).build(ff_model, mesh)
    strategy = AllReduceStrategy(OPTS[opt])
    strategy.attach(rep)
    ours = []
    for x, y in token_batches():
        ours.append(float(rep.forward_backward(x, y)))
        strategy.step(rep)
    our_params = gather_full_state(rep, mesh)

    model = dtensor_sequence_parallel(ff_model(), init_device_mesh("cpu", (world,)))
    o = OPTS[opt](list(model.parameters()))
    theirs = []
    for x, y in token_batches():
        o.zero_grad()
        with implicit_replication():            # (the positions, torch.arange, meet the replicated embedding)
            loss = lm_loss(model(x), y)
            loss.backward()
        o.step()
        theirs.append(float(loss.detach()))
    their_params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
                    for n, p in model.named_parameters()}
    return plain({"ours": ours, "theirs": theirs, "our_params": our_params, "their_params": their_params})


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_tensor_and_sequence_parallel_equal_dtensor_sequence_parallel(opt):
    """tp = 2 with sequence parallelism: the same loss every step and the same full parameters after 4 steps, and
    the parameters moved (the comparison is not between two untouched copies)."""
    out = collectives.launch(_dtensor_sp_worker, 2, backend="torch", args=(opt,), timeout=120)
    for r in out:
        assert_close(r["ours"], r["theirs"], f"TP+SP vs DTensor SP losses ({opt})")
    ours, theirs = out[0]["our_params"], out[0]["their_params"]
    assert ours is not None and ours.keys() == theirs.keys()
    init = {n: p.detach() for n, p in ff_model().named_parameters()}
    moved = [n for n in theirs if not torch.equal(torch.as_tensor(theirs[n]), init[n])]
    assert len(moved) == len(theirs), sorted(set(theirs) - set(moved))
    for n, w in theirs.items():
        assert_close(ours[n], w, f"TP+SP vs DTensor SP {n} ({opt})")
