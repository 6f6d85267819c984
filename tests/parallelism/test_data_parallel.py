"""Data parallel engine: parity with single-process training and with torch DDP; bucketing; no_sync."""

from __future__ import annotations

import pytest
import torch

from pslab import collectives
from pslab.parallelism.comm import Comm
from pslab.parallelism.data import DataParallel, DataParallelEngine, GradReducer

from tests.parallelism.par_helpers import (MLP_FACTORY, STEPS, assert_close, dp_shard, gloo_all_reduce_framing,
                                          mlp_batches, plain, reference, sgd, train_engine)

BACKENDS = ["zmq", "torch"]


def _dp_worker(group, bucket_bytes):
    return train_engine(group, DataParallelEngine(bucket_bytes=bucket_bytes), MLP_FACTORY, mlp_batches(),
                        {"dp": group.world_size})


@pytest.mark.parametrize("backend", BACKENDS)
def test_dp_matches_single_process(backend):
    """DP on 2 ranks with small buckets (several buckets, overlapped hooks) gives the single-process per-step losses
    and final weights on the same global batches (rtol 1e-5), and moves 2(N-1)/N x gradient bytes per step by
    all-reduce only."""
    ref_losses, ref_w = reference(MLP_FACTORY, mlp_batches())
    out = collectives.launch(_dp_worker, 2, backend=backend, args=(512,), timeout=90)
    for r in out:
        assert_close(r["losses"], ref_losses, "losses")
        for n, w in ref_w.items():
            assert_close(r["slots"][n], w, n)
    psi_bytes = sum(w.numel() for w in ref_w.values()) * 4
    kinds = out[0]["by_kind"]            # what the backend counted
    ring = STEPS * 2 * (2 - 1) / 2 * psi_bytes
    assert out[0]["payload"]["all_reduce"] == STEPS * psi_bytes
    if backend == "zmq":                 # each tensor slice sent, counted
        assert kinds["all_reduce"] == pytest.approx(ring)
    else:                                # the kernel's count on gloo's connections: + its 48 B message headers
        assert ring < kinds["all_reduce"] <= ring + gloo_all_reduce_framing(out[0]["calls"]["all_reduce"], 2)
    assert kinds["all_gather"] == kinds["reduce_scatter"] == kinds["p2p"] == 0
    assert len([s for s in out[0]["by_site"] if s.startswith("bucket")]) > 1  # really bucketed


def _ddp_worker(group, opt_name="sgd"):
    """Our DP and torch DDP side by side in the same gloo processes."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from tests.parallelism.par_helpers import adam
    assert dist.is_initialized(), "torch backend should initialise torch.distributed"
    make_opt = {"sgd": sgd, "adam": adam}[opt_name]
    ours = train_engine(group, DataParallelEngine(bucket_bytes=1024), MLP_FACTORY, mlp_batches(), {"dp": 2},
                        opt=make_opt)
    model = DDP(MLP_FACTORY(), bucket_cap_mb=0.001)
    opt = make_opt(list(model.parameters()))
    losses = []
    for x, y in mlp_batches():
        loss = torch.nn.functional.cross_entropy(model(dp_shard(x, group.rank, 2)), dp_shard(y, group.rank, 2))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return plain((ours, losses, {n.removeprefix("module."): p.detach().clone() for n, p in model.named_parameters()}))


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_dp_matches_torch_ddp(opt_name):
    """Our DP equals torch DistributedDataParallel on gloo: same local losses per rank and same final weights."""
    out = collectives.launch(_ddp_worker, 2, backend="torch", args=(opt_name,), timeout=90)
    for rank, (ours, ddp_losses, ddp_w) in enumerate(out):
        for n, w in ddp_w.items():
            assert_close(ours["slots"][n], w, n)
    ours0 = out[0][0]["losses"]
    mean_ddp = [(a + b) / 2 for a, b in zip(out[0][1], out[1][1])]
    assert_close(ours0, mean_ddp, "losses")


def _bucket_order_worker(group):
    torch.manual_seed(group.rank)  # different models: only the order/launch logic matters here
    model = MLP_FACTORY()
    comm = Comm(group)
    ddp = DataParallel(model, comm, bucket_bytes=600)
    names = {id(p): n for n, p in model.named_parameters()}
    buckets = [[names[id(p)] for p in b.params] for b in ddp.reducer.buckets]
    x, y = mlp_batches(1)[0]
    torch.nn.functional.cross_entropy(ddp(dp_shard(x, group.rank, 2)), dp_shard(y, group.rank, 2)).backward()
    sites = [s for k, s, *_ in comm.log.records if k == "all_reduce"]
    return buckets, sites, [n for n, _ in model.named_parameters()]


def test_buckets_reverse_order_and_fixed_launch_order():
    """Buckets hold parameters in reverse registration order, respect the size cap, and are all-reduced in the
    order bucket 0, 1, 2 ... on every rank."""
    out = collectives.launch(_bucket_order_worker, 2, backend="zmq", timeout=60)
    buckets, sites, names = out[0]
    flat = [n for b in buckets for n in b]
    assert flat == list(reversed(names))
    assert len(buckets) > 2
    for r in out:
        assert r[1] == [f"bucket {i}" for i in range(len(buckets))]


def _no_sync_worker(group):
    """Accumulate two micro-batches (first under no_sync) vs. one synchronised step on both halves."""
    model = MLP_FACTORY()
    comm = Comm(group)
    ddp = DataParallel(model, comm, bucket_bytes=1024)
    x, y = mlp_batches(1, batch=16)[0]
    xl, yl = dp_shard(x, group.rank, 2), dp_shard(y, group.rank, 2)
    with ddp.no_sync():
        (torch.nn.functional.cross_entropy(ddp(xl[:4]), yl[:4]) / 2).backward()
    calls_inside = comm.log.calls("all_reduce")
    (torch.nn.functional.cross_entropy(ddp(xl[4:]), yl[4:]) / 2).backward()
    return plain((calls_inside, {n: p.grad.clone() for n, p in model.named_parameters()}))


def test_no_sync_accumulates_and_defers():
    """Inside no_sync nothing is communicated; the next synchronised backward reduces the accumulated gradients,
    which equal the single-process gradient of the mean loss over the four quarter-batches."""
    out = collectives.launch(_no_sync_worker, 2, backend="zmq", timeout=60)
    x, y = mlp_batches(1, batch=16)[0]
    model = MLP_FACTORY()
    loss = 0
    for r in range(2):
        xl, yl = dp_shard(x, r, 2), dp_shard(y, r, 2)
        loss = loss + torch.nn.functional.cross_entropy(model(xl[:4]), yl[:4]) / 4 \
            + torch.nn.functional.cross_entropy(model(xl[4:]), yl[4:]) / 4
    loss.backward()
    for calls_inside, grads in out:
        assert calls_inside == 0
        for n, p in model.named_parameters():
            assert_close(grads[n], p.grad, n)


def test_bucket_bytes_validated():
    """A non-positive bucket size is refused with a message naming the parameter."""
    class _G:  # a one-rank group is enough for the constructor
        world_size, rank = 1, 0
    with pytest.raises(ValueError, match="bucket_bytes"):
        GradReducer(MLP_FACTORY(), Comm(_G()), bucket_bytes=0)
