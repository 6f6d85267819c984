"""Elastic membership inside the one training loop: a member dies or hangs, the survivors go on; a replacement joins.

The supervisor (experiments/faults/supervisor.py, in the launcher's parent) publishes each new membership as a
generation of the job's `collectives.elastic.ElasticGroup`; a member learns of it when a wait of the old group raises
`MembershipChanged` (a survivor blocked on a dead peer) or at its next step's `check()`. Then, per strategy:

    allreduce (shrink / replace), Horovod's commit / rollback:
        commit    after every faults.commit_every steps: `parallelism.snapshot.capture` (parameters + optimizer
                  state, what an engine checkpoint writes), in memory
                  (the last two commits are kept: a failure can cut one member's step after its all-reduce ended)
        rebuild   join generation g+1 (a new ring: new sockets, or a new gloo group), build a new replica and
                  optimizer on it (the engine seam, as at the start)
        agree     c = min over the new group of each member's latest commit (an all-reduce of one integer; a
                  joiner has none and counts as +inf)
        restore   the lowest rank holding c broadcasts it (a JSON header: the snapshot's meta and each tensor's name,
                  shape, dtype; then the tensors): survivors and a joiner start step c from the same bytes (each
                  keeps its own RNG streams)
        continue  at world size n = len(members): each worker keeps its own data shard and batch size (the global
                  batch becomes n x B), and the step lr follows train.lr_rule at G = n (linear: lr x n)
    ps-* (continue / replace): the state lives on the shards, which the supervisor tells the new membership
        (`set_members`): the group (barriers only) is rebuilt, nothing is rolled back.

Worker ids never change: worker w keeps batch(w, step) and its part files; only its rank in the ring does.
Elastic all-reduce needs the data-parallel engine (tp = pp = 1, zero = 0): other layouts resume from an engine
checkpoint (`pslab run --resume`) after the run aborts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections import deque
from typing import Any

import torch

from pslab.collectives import trace
from pslab.collectives.launcher import notify
from pslab.experiments.config import RunConfig
from pslab.experiments.strategies.spec import step_lr
from pslab.parallelism.snapshot import Snapshot, capture, load_pieces


def lr_at(cfg: RunConfig, members: int) -> float:
    """The step lr of the run's strategy at world size `members` (train.lr_rule at G = members)."""
    return step_lr(dataclasses.replace(cfg.train, workers=members))


def _module(replica: Any) -> torch.nn.Module:
    return replica.module


class Commits:
    """The last two committed states of this member (allreduce): (step, `parallelism.snapshot.capture`), the same
    capture an engine checkpoint writes, kept in memory."""

    def __init__(self) -> None:
        self.kept: deque[tuple[int, Snapshot]] = deque(maxlen=2)

    def commit(self, step: int, replica: Any, strategy: Any) -> None:
        self.kept.append((step, capture(replica, strategy)))

    @property
    def latest(self) -> int:
        return self.kept[-1][0] if self.kept else -1

    def at(self, step: int) -> Snapshot | None:
        for s, snap in self.kept:
            if s == step:
                return snap
        return None


def agree_step(group: Any, mine: int) -> int:
    """The newest step every member of `group` has committed: min over members (a joiner counts as +inf)."""
    t = torch.tensor([mine if mine >= 0 else 1 << 60], dtype=torch.int64)
    group.all_reduce(t, op="min")
    return int(t[0])


def source_rank(group: Any, has: bool) -> int:
    """The lowest rank of `group` that holds the agreed commit (a joiner, even as rank 0, does not)."""
    t = torch.tensor([group.rank if has else 1 << 30], dtype=torch.int64)
    group.all_reduce(t, op="min")
    if int(t[0]) >= 1 << 30:
        raise RuntimeError("no member holds the agreed commit: the job's state is lost (every holder died)")
    return int(t[0])


def broadcast_state(group: Any, snap: Snapshot | None, src: int = 0) -> Snapshot:
    """Rank `src` of `group` sends its snapshot (tensors, meta); every rank returns the same, bitwise: a JSON
    header (the meta, and each tensor's name, shape and dtype), then the tensors."""
    if group.rank == src:
        assert snap is not None
        tensors, meta = snap
        head = {"meta": meta, "tensors": [[k, list(v.shape), str(v.dtype).removeprefix("torch.")]
                                          for k, v in tensors.items()]}
        raw = json.dumps(head).encode()
        n = torch.tensor([len(raw)], dtype=torch.int64)
    else:
        n = torch.zeros(1, dtype=torch.int64)
    group.broadcast(n, src=src)
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if group.rank == src else \
        torch.zeros(int(n[0]), dtype=torch.uint8)
    group.broadcast(buf, src=src)
    if group.rank != src:
        head = json.loads(bytes(buf.numpy()).decode())
        tensors = {k: torch.zeros(shape, dtype=getattr(torch, dt)) for k, shape, dt in head["tensors"]}
    out = {}
    for k, t in tensors.items():
        t = t.detach().clone().contiguous()
        if t.numel():
            group.broadcast(t, src=src)
        out[k] = t
    return out, head["meta"]


def load(replica: Any, strategy: Any, snap: Snapshot, lr: float) -> None:
    """Put a snapshot into a freshly built replica and strategy (its own RNG streams kept), at step lr `lr`."""
    load_pieces(replica, strategy, [snap], rng_from=None)
    for g in strategy.optimizer.param_groups:
        g["lr"] = lr


def digest(replica: Any) -> str:
    """A short hash of the model's bytes (records that a joiner's parameters equal the survivors')."""
    h = hashlib.sha256()
    for k, v in sorted(_module(replica).state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class ElasticMember:
    """The membership side of the loop's `_Worker` (a mixin): it uses the worker's eg (the ElasticGroup, or None),
    group, commits, joining, cfg, strategy, replica, member and `_build`, and reports to the supervisor with
    `collectives.launcher.notify`."""

    eg: Any                                 # collectives.elastic.ElasticGroup, or None (no supervisor)
    group: Any
    commits: Commits | None
    joining: dict[str, Any] | None
    cfg: RunConfig
    strategy: Any
    replica: Any
    member: int

    def _build(self, first: bool) -> None:
        raise NotImplementedError

    def _changed(self) -> tuple[type, ...]:
        if self.eg is None:
            return ()
        from pslab.collectives.elastic import MembershipChanged
        return (MembershipChanged,)

    def _expelled(self) -> tuple[type, ...]:
        if self.eg is None:
            return ()
        from pslab.collectives.elastic import Expelled
        return (Expelled,)

    def _barrier(self) -> int | None:
        """A barrier of the current members; if the membership changed meanwhile, the step the recovery rolled
        back to (allreduce), else None."""
        back = None
        while True:
            try:
                self.group.barrier()
                return back
            except self._changed() as e:
                at = self.commits.latest if self.commits is not None else None
                back = self._recover(e.generation, at)

    def _quiesce(self) -> int:
        """Before a planned leave: a barrier of the current members, so nobody's last all-reduce is cut by the
        new membership (it is published when the leaver leaves, which is after every member entered the barrier;
        a member still inside it when the news arrives has finished its step too). Returns the generation to join."""
        try:
            self.group.barrier()
        except self._changed() as e:
            return e.generation
        return self.eg.generation + 1 if self.eg is not None else 0

    def _recover(self, gen: int, step: int | None) -> int:
        """Generation `gen` (or newer): join it, rebuild, and (allreduce) agree on the step to roll back to, which
        is returned (the current step for ps-*: nothing rolls back). A newer generation published meanwhile (a
        second failure, a replacement) starts the recovery over on it. A joiner has no commit: it receives one."""
        while True:
            try:
                with trace.span("elastic recovery", "elastic", generation=gen):
                    return self._recover_once(gen, step)
            except self._changed() as e:
                gen = e.generation

    def _recover_once(self, gen: int, step: int | None) -> int:
        if gen > self.eg.generation or self.group is None:
            self.group = self.eg.join(gen)
            self._build(first=False)
        n = self.group.world_size
        joiner = self.joining is not None and self.commits is None
        if self.cfg.strategy.kind != "allreduce":
            step = int(getattr(self.strategy, "clock", 0)) if joiner else step
            if self.group.rank == 0 or joiner:
                notify({"kind": "join" if joiner else "recover", "member": self.member,
                        "generation": self.eg.generation, "world_size": n, "step": step})
            return step
        latest = self.commits.latest if self.commits is not None else -1
        c = agree_step(self.group, latest)
        mine = self.commits.at(c) if self.commits is not None else None
        src = source_rank(self.group, mine is not None)
        snap = broadcast_state(self.group, mine, src)
        lr = lr_at(self.cfg, n)
        load(self.replica, self.strategy, snap, lr)
        self.commits = Commits()
        self.commits.commit(c, self.replica, self.strategy)
        info = {"generation": self.eg.generation, "world_size": n, "step": c, "lr_step": lr,
                "digest": digest(self.replica)}
        if joiner:
            notify({"kind": "join", "member": self.member, **info})
        elif self.group.rank == 0:
            notify({"kind": "recover", "lost_steps": (step - c) if step is not None else None, **info})
        return c
