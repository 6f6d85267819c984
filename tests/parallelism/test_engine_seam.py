"""The engine seam: replicas expose exactly their own parameters and gradients, by full-model name and owner, and
a sync strategy other than all-reduce (a fake parameter-server strategy) drives them without hidden all-reduces.

The real parameter server is wired to this seam in `experiments/`; here a fake strategy stands in for it."""

from __future__ import annotations

import torch

from pslab import collectives
from pslab.parallelism.data import DataParallelEngine
from pslab.parallelism.engine import Replica, SyncStrategy, zero_grads
from pslab.parallelism.mesh import DeviceMesh
from pslab.parallelism.pipeline import PipelineEngine

from tests.parallelism.par_helpers import MLP_FACTORY, dp_shard, mlp_batches, plain


class FakePushPullStrategy:
    """Stands in for the PS: 'pushes' (records) each slot's gradient by name and owner, 'pulls' by applying SGD to
    its own copy of the weights, and writes them back into the replica."""

    def __init__(self) -> None:
        self.pushed: list[dict[str, tuple[int, torch.Tensor]]] = []
        self.server: dict[str, torch.Tensor] = {}

    def attach(self, replica: Replica) -> None:
        self.server = {s.name: s.param.detach().clone() for s in replica.slots()}

    def step(self, replica: Replica) -> None:
        slots = replica.slots()
        self.pushed.append({s.name: (s.owner, s.grad.detach().clone()) for s in slots})
        for s in slots:
            self.server[s.name] -= 0.1 * s.grad
        with torch.no_grad():
            for s in slots:
                s.param.copy_(self.server[s.name])
        zero_grads(slots)


def _seam_worker(group):
    x, y = mlp_batches(1)[0]
    out = {}
    for kind in ("dp", "pp"):
        mesh = DeviceMesh(group, **{kind: 2})
        eng = DataParallelEngine() if kind == "dp" else PipelineEngine("gpipe", 2)
        replica = eng.build(MLP_FACTORY, mesh)
        strategy = FakePushPullStrategy()
        assert isinstance(replica, Replica) and isinstance(strategy, SyncStrategy)
        strategy.attach(replica)
        xb, yb = (dp_shard(x, group.rank, 2), dp_shard(y, group.rank, 2)) if kind == "dp" else (x, y)
        replica.forward_backward(xb, yb)
        strategy.step(replica)
        out[kind] = {"pushed": {n: (o, g) for n, (o, g) in strategy.pushed[0].items()},
                     "all_reduce": replica.log.by_kind()["all_reduce"],
                     "weights": {s.name: s.param.detach().clone() for s in replica.slots()}}
    return plain(out)


def test_fake_ps_strategy_drives_dp_and_pp_replicas():
    """DP: every rank pushes every parameter (owner = itself) with its *local* gradient — the engine did not
    all-reduce behind the strategy's back. PP: stage s pushes only stage s's parameters, under their full-model
    names; together the stages cover the model exactly once, with the full-batch gradients. Both apply the pulled
    weights."""
    out = collectives.launch(_seam_worker, 2, backend="zmq", timeout=60)
    x, y = mlp_batches(1)[0]
    names = [n for n, _ in MLP_FACTORY().named_parameters()]

    def grads(xb, yb):
        m = MLP_FACTORY()
        torch.nn.functional.cross_entropy(m(xb), yb).backward()
        return {n: p.grad for n, p in m.named_parameters()}, {n: p.detach() for n, p in m.named_parameters()}

    for rank, r in enumerate(out):
        local, w0 = grads(dp_shard(x, rank, 2), dp_shard(y, rank, 2))
        assert sorted(r["dp"]["pushed"]) == sorted(names)
        assert r["dp"]["all_reduce"] == 0
        for n, (owner, g) in r["dp"]["pushed"].items():
            assert owner == rank
            torch.testing.assert_close(torch.as_tensor(g), local[n], rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(torch.as_tensor(r["dp"]["weights"][n]), w0[n] - 0.1 * local[n])
    full, _ = grads(x, y)
    stage_names = [set(r["pp"]["pushed"]) for r in out]
    assert stage_names[0].isdisjoint(stage_names[1]) and stage_names[0] | stage_names[1] == set(names)
    assert all(n.split(".")[0] in ("0", "1", "2", "3") for n in stage_names[0])  # stage 0 = the first layers
    for rank, r in enumerate(out):
        for n, (owner, g) in r["pp"]["pushed"].items():
            assert owner == rank
            torch.testing.assert_close(torch.as_tensor(g), full[n], rtol=1e-5, atol=1e-7)
