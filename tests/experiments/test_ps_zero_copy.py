"""The PS worker step copies nothing (same host): `PSSyncStrategy` lets backward accumulate every gradient straight
into the client's push segment, pushes it without a copy into the segment, and points every weight at the shard's
reply segment instead of copying the pulled values into the model."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from pslab import collectives
from pslab import ps
from pslab.collectives import shm
from pslab.experiments.strategies.ps import PSSyncStrategy
from pslab.parallelism.data import DataParallelEngine
from pslab.parallelism.mesh import DeviceMesh
from pslab.parallelism.models import mlp

FACTORY = functools.partial(mlp, [16, 32, 32, 4])
STEPS = 4


def _inside(ptr: int, base: int, size: int) -> bool:
    return base <= ptr < base + size


def _worker(group, addresses):
    torch.set_num_threads(1)
    writes: list = []
    real_write = shm.Outbox.write
    shm.Outbox.write = lambda self, off, t: writes.append(self) or real_write(self, off, t)
    replica = DataParallelEngine().build(FACTORY, DeviceMesh(group, dp=1))
    strategy = PSSyncStrategy(addresses[0], timeout=30)
    strategy.attach(replica)
    link = strategy.client._links[0]
    out = {"shm": list(strategy.client.shm), "push_copies": [], "grads_in_push_segment": [],
           "weights_in_reply_segment": [], "versions": []}
    g = torch.Generator().manual_seed(0)
    try:
        for _ in range(STEPS):
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            writes.clear()
            replica.forward_backward(x, y)
            push_base, push_size = link.outbox.bytes.data_ptr(), link.outbox.size
            out["grads_in_push_segment"].append(all(
                _inside(s.grad.data_ptr(), push_base, push_size) for s in replica.slots()))
            strategy.step(replica)
            out["push_copies"].append(sum(1 for w in writes if w is link.outbox))
            reply = link.inbox.maps[link.peer][1]
            reply_base, reply_size = np.frombuffer(reply, np.uint8).ctypes.data, len(reply)
            out["weights_in_reply_segment"].append(all(
                _inside(s.param.data_ptr(), reply_base, reply_size) for s in replica.slots()))
            out["versions"].append(strategy.history[-1].versions[0])
        out["final"] = {s.name: s.param.detach().clone().numpy() for s in replica.slots()}
    finally:
        strategy.close(replica)
        shm.Outbox.write = real_write
    return out


@pytest.mark.timeout(90)
def test_ps_worker_step_copies_no_gradient_and_no_weights():
    """Every step: gradients lie in the push segment when pushed and no write into that segment happens (no
    gradient copy); afterwards every weight's storage lies inside the shard's reply segment (no weight copy);
    the shard applied every push (versions 1..STEPS) and the weights equal SGD on the same batches."""
    with ps.start_servers(1, 1, "asp", "sgd:lr=0.1", start_method="fork", idle_timeout=60) as servers:
        out = collectives.launch(_worker, 1, backend="zmq", timeout=60, secret=servers.secret,
                                 args=(servers.group_addresses,))[0]
    assert out["shm"] == [True]
    assert out["grads_in_push_segment"] == [True] * STEPS
    assert out["push_copies"] == [0] * STEPS
    assert out["weights_in_reply_segment"] == [True] * STEPS
    assert out["versions"] == list(range(1, STEPS + 1))
    model = FACTORY()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    for n, p in model.named_parameters():
        np.testing.assert_allclose(out["final"][n], p.detach().numpy(), rtol=1e-6, atol=1e-7)
