"""The real parameter server as a `SyncStrategy` for the parallelism engines: push each slot's gradient by its
full-model name, pull the shards' new values, copy them into the slots.

    servers = start_slot_group_servers(groups=pp * tp, num_workers=dp, policy="bsp", optimizer="sgd:lr=0.1")
    strategy = PSSyncStrategy(servers.addresses[slot_group(mesh)])      # on every rank
    strategy.attach(replica)          # dp rank 0 initialises its group's shards; every rank pulls and adopts them
    loss = train_step(replica, strategy, x, y)                           # forward+backward, push, pull, copy

One shard set per *slot group*: the ranks that hold the same slots, i.e. one data-parallel group (same pipeline
stage, same tensor-parallel coordinate). On those shards the worker id is the rank's dp coordinate
(`replica.dp.rank`) and num_workers = `replica.dp.size` = D. So stage s's clock counts only stage s's pushes, and BSP
applies, per stage,

    θ_s ← opt(θ_s, (1/D) Σ_d g_{s,d}),    g_{s,d} = ∂L_d/∂θ_s, L_d the mean loss on dp shard d (b examples)

which is ∂/∂θ_s of the mean loss over the concatenated D·b batch: the update `AllReduceStrategy` makes.
Why not one shard set for all stages: a client partitions exactly the names it is given and a push must carry a
gradient for every key of a shard, so a stage cannot be a worker of shards holding another stage's parameters;
and as D·P workers of one set, BSP would wait for pushes that never come (or, padded with zero gradients, divide by
D·P instead of D). Consequence: versions, clocks and staleness are per stage (under ASP two stages may run on
weights of different ages; under BSP every stage's weights after step t are exactly t updates old).

A step is push(clock c) then pull(clock c+1): under BSP the pull waits at the gate until the clock is complete;
under ASP it returns at once, and each push's ack carries its staleness τ = version applied − version read.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from experiments.errors import ExperimentError
from parallelism.engine import Replica, zero_grads
from parallelism.mesh import DeviceMesh


class PSStrategyError(ExperimentError):
    """The PS strategy cannot drive this replica with these servers; the message says what to change."""


def slot_group(mesh: DeviceMesh) -> int:
    """Index of this rank's slot group (its shard set): pp · T + tp; there are P · T groups, each of D ranks."""
    return mesh.coord("pp") * mesh.size("tp") + mesh.coord("tp")


@dataclass
class PSStep:
    """What one `step` saw: the clock it pushed, and per shard the ack's status, version and (worker, τ) pairs."""

    clock: int
    status: list[str]
    versions: list[int]
    staleness: list[list[tuple[int, int]]]


@dataclass
class PSSyncStrategy:
    """Synchronise `replica.slots()` through the shards at `addresses` (this rank's slot group, in shard order)."""

    addresses: Sequence[str]
    timeout: float = 60.0
    client: Any = field(default=None, init=False, repr=False)     # ps.PSClient once attached
    history: list[PSStep] = field(default_factory=list, init=False)

    def attach(self, replica: Replica) -> None:
        import ps
        from ps.errors import ProtocolError
        slots = replica.slots()
        names = [s.name for s in slots]
        if not slots or len(set(names)) != len(names):
            raise PSStrategyError(f"a replica must expose distinct, non-empty slot names to push by; got {names[:8]}")
        self.close()
        worker, workers = replica.dp.rank, replica.dp.size
        params = {s.name: s.param.detach() for s in slots}
        fix = ("start one shard set per slot group (pipeline stage x tp coordinate) with num_workers = dp size "
               "(start_slot_group_servers)")
        try:
            self.client = ps.connect(self.addresses, worker=worker, params=params, timeout=self.timeout)
        except ProtocolError as e:            # e.g. this dp rank is not a worker id the shards know
            raise PSStrategyError(f"dp rank {worker} of {workers} cannot register with {list(self.addresses)}: {e}; "
                                  f"{fix}") from e
        served = {int(meta["num_workers"]) for meta, _ in self.client.registration}
        if served != {workers}:
            self.close()
            raise PSStrategyError(f"the shards at {list(self.addresses)} serve {sorted(served)} workers, but this "
                                  f"replica's data-parallel group has {workers} ranks: {fix}")
        if worker == 0:                       # the group's owner; the others' first pull waits for its init
            self.client.init(params).result(self.timeout)
        self._adopt(replica)

    def step(self, replica: Replica) -> None:
        if self.client is None:
            raise PSStrategyError("PSSyncStrategy.step before attach(replica)")
        slots = replica.slots()
        grads = {s.name: (s.grad if s.grad is not None else torch.zeros_like(s.param)).detach().contiguous()
                 for s in slots}
        clock = self.client.clocks[0]
        acks = self.client.push(grads).result(self.timeout)     # zero-copy send: keep grads alive until acked
        self.history.append(PSStep(clock, [a["status"] for a in acks], [int(a["version"]) for a in acks],
                                   [[(int(w), int(t)) for w, t in a["staleness"]] for a in acks]))
        zero_grads(slots)
        self._adopt(replica)

    def _adopt(self, replica: Replica) -> None:
        """Pull at this worker's clock (waits at the consistency gate) and copy the values into the slots."""
        pulled = self.client.pull().result(self.timeout).params
        with torch.no_grad():
            for s in replica.slots():
                s.param.copy_(torch.from_numpy(np.asarray(pulled[s.name])).view_as(s.param))

    def shard_stats(self) -> list[dict[str, Any]]:
        """Per shard: version, clocks, staleness summary (histogram, per worker), waits, counters."""
        if self.client is None:
            raise PSStrategyError("shard_stats before attach(replica)")
        return self.client.stats().result(self.timeout)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None


# ---------------------------------------------------------------------------------------------- servers
def _serve_child(config: Any, conn: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    torch.set_num_threads(1)
    from ps import serve
    try:
        serve(config, ready=lambda address: conn.send(("ok", address)))
    except Exception as e:  # e.g. address in use
        conn.send(("error", f"{type(e).__name__}: {e}"))


@dataclass
class SlotGroupServers:
    """Shard server processes, one set per slot group: `addresses[g]` lists group g's shards in shard order."""

    addresses: list[list[str]]
    processes: list[Any]

    def stop(self) -> None:
        for p in self.processes:
            if p.is_alive():
                p.terminate()
        for p in self.processes:
            p.join(3)
            if p.is_alive():
                p.kill()
                p.join(3)

    def __enter__(self) -> "SlotGroupServers":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_slot_group_servers(groups: int, num_workers: int, policy: str = "bsp", optimizer: str = "sgd:lr=0.1",
                             shards_per_group: int = 1, *, timeout: float = 60.0,
                             start_method: str = "fork") -> SlotGroupServers:
    """Start `groups` × `shards_per_group` shard servers on 127.0.0.1 (all at once; forked, so in milliseconds),
    each serving `num_workers` workers; they exit after `timeout` seconds idle."""
    from ps import ServerConfig
    if groups < 1 or shards_per_group < 1 or num_workers < 1:
        raise PSStrategyError(f"need groups, shards_per_group and num_workers >= 1; got {groups}, "
                              f"{shards_per_group}, {num_workers}")
    ctx = mp.get_context(start_method)
    procs: list[Any] = []
    pipes = []
    servers = SlotGroupServers([], procs)
    try:
        for g in range(groups):
            for i in range(shards_per_group):
                cfg = ServerConfig(bind="tcp://127.0.0.1:0", shard_id=i, num_workers=num_workers, policy=policy,
                                   optimizer=optimizer, request_timeout=timeout, idle_timeout=timeout)
                cfg.validate()
                parent, child = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_serve_child, args=(cfg, child), daemon=True, name=f"pslab-g{g}-shard{i}")
                p.start()
                child.close()
                procs.append(p)
                pipes.append(parent)
        for g in range(groups):
            servers.addresses.append([])
            for i in range(shards_per_group):
                conn = pipes[g * shards_per_group + i]
                if not conn.poll(timeout):
                    raise PSStrategyError(f"shard {i} of slot group {g} did not start within {timeout:g}s")
                status, info = conn.recv()
                if status != "ok":
                    raise PSStrategyError(f"shard {i} of slot group {g} failed to start: {info}")
                servers.addresses[g].append(info)
    except BaseException:
        servers.stop()
        raise
    return servers
