"""Shared pieces of the parallelism tests: data, single-process reference training, a rank worker.

Worker functions live here (a module-level, importable name) because `collectives.launch` spawns processes.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from pslab.parallelism.comm import KINDS
from pslab.parallelism.engine import AllReduceStrategy
from pslab.parallelism.mesh import DeviceMesh
from pslab.parallelism.models import mlp, tiny_transformer

RTOL, ATOL = 1e-5, 1e-6
STEPS = 5

MLP_FACTORY = functools.partial(mlp, [8, 16, 16, 16, 4])
TF_FACTORY = functools.partial(tiny_transformer, vocab=16, d=16, heads=4, layers=2, seq=6)


def sgd(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adam(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def adam_attention(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """Adam with eps 1e-4, for models with attention: the key biases have a mathematically zero gradient (softmax
    ignores a constant logit shift), ~1e-10 of rounding noise that Adam with eps 1e-8 would turn into lr-sized steps
    of random sign; eps 1e-4 keeps that noise below the comparison tolerance while the real gradients (~1e-2) stay
    Adam-scaled."""
    return torch.optim.Adam(params, lr=0.01, eps=1e-4)


def mlp_batches(steps: int = STEPS, batch: int = 16, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 8, generator=g), torch.randint(0, 4, (batch,), generator=g)) for _ in range(steps)]


def tf_batches(steps: int = STEPS, batch: int = 8, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 16, (batch, 6), generator=g), torch.randint(0, 16, (batch, 6), generator=g))
            for _ in range(steps)]


def reference(factory: Callable[[], torch.nn.Module], batches, opt=sgd, loss_fn=None):
    """Single-process training on the global batches: per-step losses and final named parameters."""
    torch.set_num_threads(1)
    model = factory()
    loss_fn = loss_fn or torch.nn.functional.cross_entropy
    o = opt(list(model.parameters()))
    losses = []
    for x, y in batches:
        loss = loss_fn(model(x), y)
        o.zero_grad()
        loss.backward()
        o.step()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def dp_shard(t: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    return torch.tensor_split(t, dp_size)[dp_rank]


def run_training(group, engine, factory, batches, mesh_shape: dict[str, int], opt=sgd, strategy=None,
                 on_step=None):
    """Build mesh + replica + strategy (default AllReduceStrategy(opt)); train on the dp shard of each global batch,
    calling on_step(mesh, replica) after each step if given.

    Returns (mesh, replica, global loss per step — the mean over dp)."""
    mesh = DeviceMesh(group, **mesh_shape)
    replica = engine.build(factory, mesh)
    strategy = strategy if strategy is not None else AllReduceStrategy(opt)
    strategy.attach(replica)
    losses = []
    dp_rank, dp_size = mesh.coord("dp"), mesh.size("dp")
    for x, y in batches:
        loss = replica.forward_backward(dp_shard(x, dp_rank, dp_size), dp_shard(y, dp_rank, dp_size))
        strategy.step(replica)
        t = torch.tensor([loss], dtype=torch.float64)
        mesh.group("dp").all_reduce(t, "avg") if dp_size > 1 else None
        losses.append(float(t[0]))
        if on_step is not None:
            on_step(mesh, replica)
    return mesh, replica, losses


def train_engine(group, engine, factory, batches, mesh_shape: dict[str, int], opt=sgd) -> dict[str, Any]:
    """`run_training` with AllReduceStrategy(opt).

    Returns the global loss per step (mean over dp), this rank's slots by name, and the engine's bytes by kind."""
    mesh, replica, losses = run_training(group, engine, factory, batches, mesh_shape, opt)
    return plain({"losses": losses, "slots": {s.name: s.param.detach().clone() for s in replica.slots()},
                  "by_kind": replica.log.by_kind(), "by_site": replica.log.by_site(), "coords": mesh.coords,
                  "payload": replica.log.by_kind(wire=False), "calls": {k: replica.log.calls(k) for k in KINDS}})


GLOO_HEADER = 48     # bytes of gloo's header on every message (6 x 8: nbytes, opcode, slot, offset, length, roffset)


def gloo_all_reduce_framing(calls: int, n: int) -> int:
    """The most framing gloo adds to `calls` all-reduces over n ranks: 12(n−1) headers each (its ring's data and
    notification messages; tests/collectives/test_traffic.py measures the bytes)."""
    return calls * 12 * (n - 1) * GLOO_HEADER


def plain(obj: Any) -> Any:
    """Tensors -> numpy, recursively: `launch` results must not carry torch tensors (torch shares their storage
    through file descriptors that vanish when the child exits)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy().copy()
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(plain(v) for v in obj)
    return obj


def assert_close(a, b, what: str) -> None:
    """float32 parity: rtol 1e-5, atol 1e-6 (sums in a different order differ in the last bits)."""
    torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"{what}: {m}")
