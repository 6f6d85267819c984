"""Local SGD and DiLoCo through the parameter server: `ps-local:H` and `ps-diloco:H`, asynchronous.

local-sgd:H / diloco:H (parallelism/local_sgd.py) meet every H steps in an all-reduce: everyone waits for the
slowest. Through the shards nobody waits. Worker i reads θ (version v_i), takes H local steps with its own
optimizer on its own gradients (train.optimizer at the step lr of train.lr_rule with G = K, as local-sgd), then
pushes its pseudo-gradient and reads again:

    Δ_i = θ_read − θ_i                         (what its H steps moved: one push of S bytes per H steps)
    shard:  θ ← θ − (1/K) Δ_i                   ps-local: SGD at lr 1/K, on arrival (policy asp)
            θ ← outer(θ, Δ_i), lr outer.lr / K  ps-diloco: [outer] — SGD with Nesterov momentum by default

If the K pushes of a round all read the same θ, ps-local ends the round at θ − (1/K) Σ Δ_i = mean θ_i: Local SGD's
average, one push at a time. They do not, in general: a worker that read earlier pushes a Δ computed from an older
θ, and the shard counts how much older — τ = the pushes it applied between this worker's read and its push, i.e.
the staleness in outer steps, which the records carry (each of the period's H records gets its push's τ,
`records.assign_staleness(period=H)`). ps-diloco's momentum moves at every push (K times per round), where
diloco's moves once per average: with [outer] sgd, lr 1, momentum 0 it is ps-local. ps-local:1 with plain SGD is
ps-asp exactly: the worker's step moves K·lr·g, the shard applies 1/K of it.

Evaluation reads the shards' θ (`global_view`: one pull), never a worker's drifted copy. Plain data parallelism
only (config.py says so otherwise); no faults or engine checkpoints yet; [topology] delays every push and read on
the worker's link to the shards' host, as for ps-*. Bytes: S pushed and S read per H steps, and after the last
step (bytes.py: ⌈n/H⌉/n · Σ 2·S).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from pslab.parallelism.engine import OptimizerFactory, Replica, zero_grads
from pslab.experiments.strategies.ps import PSStrategyError


class PSPeriodicStrategy:
    """A SyncStrategy: local optimizer steps; every `period` steps (and after step `total_steps`) push θ_read − θ
    to the shards at `addresses` and read θ back (module docstring)."""

    def __init__(self, addresses: Sequence[str], optimizer_factory: OptimizerFactory, period: int, total_steps: int,
                 timeout: float = 60.0, curve_keys_dir: str | None = None, secret: str | None = None,
                 link: tuple[str, float, float] | None = None) -> None:
        if period < 1 or total_steps < 1:
            raise PSStrategyError(f"ps-local / ps-diloco need period >= 1 and total_steps >= 1, got {period}, "
                                  f"{total_steps}")
        self.addresses, self.optimizer_factory = list(addresses), optimizer_factory
        self.period, self.total_steps = int(period), int(total_steps)
        self.timeout, self.curve_keys_dir, self.secret, self.link = timeout, curve_keys_dir, secret, link
        self.client: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.read: dict[str, torch.Tensor] = {}     # θ as last read from the shards (the period's anchor)
        self.local_steps = 0
        self.done = 0
        self.pushes = 0
        self.last_bytes: tuple[int, int] = (0, 0)   # (pushed, read) payload of the last step (the loop's bytes)

    @property
    def link_class(self) -> str | None:
        return None if self.link is None else self.link[0]

    def attach(self, replica: Replica) -> None:
        from pslab import ps
        from pslab.ps.errors import AuthenticationError, ProtocolError
        slots = replica.slots()
        worker, workers = replica.dp.rank, replica.dp.size
        params = {s.name: s.param.detach().numpy() for s in slots}
        try:
            self.client = ps.connect(self.addresses, worker=worker, params=params, timeout=self.timeout,
                                     curve_keys_dir=self.curve_keys_dir, secret=self.secret,
                                     link=self.link[1:] if self.link is not None else None)
        except (ProtocolError, AuthenticationError) as e:
            raise PSStrategyError(f"dp rank {worker} of {workers} cannot register with {self.addresses}: {e}") from e
        if worker == 0:
            self.client.init(params).result(self.timeout)
        self._adopt(replica, self.client.pull().result(self.timeout))
        self.optimizer = self.optimizer_factory([s.param for s in slots])

    def _adopt(self, replica: Replica, read: Any) -> None:
        """θ read from the shards becomes this worker's parameters (its own memory) and the next anchor."""
        self.read = _load(replica, read)

    def _wire(self) -> tuple[int, int]:
        ops = self.client.wire.snapshot()["by_op"]
        return (ops.get("push", {}).get("sent", 0),
                ops.get("pull", {}).get("recv", 0) + ops.get("push", {}).get("recv", 0))

    def step(self, replica: Replica) -> None:
        if self.optimizer is None or self.client is None:
            raise PSStrategyError("PSPeriodicStrategy.step before attach(replica)")
        slots = replica.slots()
        self.optimizer.step()
        zero_grads(slots)
        self.local_steps += 1
        self.done += 1
        self.last_bytes = (0, 0)
        if self.local_steps == self.period or self.done == self.total_steps:
            before = self._wire()
            with torch.no_grad():
                delta = {s.name: (self.read[s.name] - s.param.detach()).numpy().astype(np.float32, copy=False)
                         for s in slots}
            _, read = self.client.push_pull(delta).result(self.timeout)     # applied, then read: one round trip
            self._adopt(replica, read)
            after = self._wire()
            self.last_bytes = (after[0] - before[0], after[1] - before[1])
            self.local_steps = 0
            self.pushes += 1

    @contextlib.contextmanager
    def global_view(self, replica: Replica) -> Iterator[None]:
        """The replica's parameters are the shards' θ inside the block (one read), its own again after."""
        own = [s.param.detach().clone() for s in replica.slots()]
        versions = list(self.client.versions)           # a side read: the next push still reports the version
        read = self.client.pull().result(self.timeout)  # its Δ started from, so the shard's τ stays right
        self.client.versions[:] = versions
        _load(replica, read)
        try:
            yield
        finally:
            with torch.no_grad():
                for s, o in zip(replica.slots(), own):
                    s.param.copy_(o)

    def refresh(self, replica: Replica) -> None:
        """Read the shards' current θ into the replica (after every worker has finished: the final model)."""
        self._adopt(replica, self.client.pull().result(self.timeout))

    def shard_stats(self, series: bool = False) -> list[dict[str, Any]]:
        if self.client is None:
            raise PSStrategyError("shard_stats before attach(replica)")
        return self.client.stats(series=series).result(self.timeout)

    def close(self, replica: Replica | None = None) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None


def _load(replica: Replica, read: Any) -> dict[str, torch.Tensor]:
    """Copy a read's values into the replica's parameters (their own memory); returns them by slot name."""
    values = {}
    with torch.no_grad():
        for s in replica.slots():
            v = torch.from_numpy(np.array(read.params[s.name], copy=True)).view_as(s.param)
            s.param.copy_(v)
            values[s.name] = v
    return values
