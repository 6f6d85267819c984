"""The real parameter server as a `SyncStrategy` for the parallelism engines: every `ps-*` run goes through it.

    servers = ps.start_servers(shards, num_workers=D, policy=..., optimizer=spec, groups=P * E * T)
    strategy = PSSyncStrategy(servers.group_addresses[slot_group(mesh)])     # on every rank
    strategy.attach(replica)   # dp rank 0 initialises its group's shards; gradients now live in the push segment
    loss = replica.forward_backward(x, y); strategy.step(replica)           # one push_pull round trip

One shard set per *slot group*: the ranks that hold the same slots, i.e. one data-parallel group (same pipeline
stage, same tensor-parallel coordinate). On those shards the worker id is the rank's dp coordinate
(`replica.dp.rank`) and num_workers = `replica.dp.size` = D. So stage s's clock counts only stage s's pushes, and BSP
applies, per stage,

    θ_s ← opt(θ_s, (1/D) Σ_d g_{s,d}),    g_{s,d} = ∂L_d/∂θ_s, L_d the mean loss on dp shard d (b examples)

which is ∂/∂θ_s of the mean loss over the concatenated D·b batch: the update `AllReduceStrategy` makes.
(One set for all stages cannot work: a push must carry a gradient for every key of a shard, and as D·P workers of
one set BSP would wait for pushes that never come.) Versions, clocks and staleness are per stage.

Nothing is copied on the worker (same host, shared-memory path): at attach every slot's `.grad` becomes a view of
the client's push segment (`client.grad_buffers()`), so backward accumulates straight into what is pushed; a step
is one `push_pull(copy=False)` — push clock c, read at c+1 (waits at the consistency gate under BSP/SSP) — whose
weights arrive as read-only views of the shard's reply segment, and each slot's `.data` is pointed at them (valid
until the next read, which only this strategy makes). Then what backward wrote is zeroed for the next one: whole
buffers for dense gradients, only the touched rows for sparse ones (a gradient hook notes which).
(A tensor split across two shards is reassembled into one reused buffer, and a shard without the shared-memory
path sends frames: then the client copies, the worker still does not.)

With cp > 1 the cp ranks of a worker hold the same slots, and after backward the same gradients (the context-parallel
replica averages them over cp): cp rank 0 alone talks to the shards (slot groups are P·E·T, not P·C·E·T) and after
each read broadcasts every slot's new value over cp, with the clock, a rewind and the dropped flag, so the other cp
ranks step, rewind and record as it does (`mirror_group`; they hold no client and push nothing).

With [topology] (`link`), the rank's requests and their replies cross the emulated link between its host and the
shards' (`topology.shard_host`): `ps.link_delay` holds each until a real link would deliver it.

With tp > 1 the tensors every tp rank holds whole (LayerNorm, embeddings, row-parallel biases) live only on the
tp-rank-0 shard set: tp rank 0 pushes their gradient (equal on every tp rank) and broadcasts their new values to its
tp peers after each read — one copy, on the tensor-parallel link, so the peers never train on a different version.
Pulled weights lie in read-only shared memory: nothing may write a parameter in place while attached (the shards
run the optimizer); a write would fault. `close(replica)` gives them memory of their own again.

Backup workers (ps-bsp-backup:b). By default a straggler finishes and pushes its gradient even when its clock was
committed without it (TensorFlow's SyncReplicasOptimizer behaviour): the shard drops it and counts it. With
`abort` (train.backup_abort, Chen et al. 2016's idealised model) the worker gives the gradient up as soon as it
learns that the clock is committed: `pad` (the loop's straggler padding) asks the shards every ABORT_POLL_S, and
`step` asks once more before pushing; an aborted step pushes nothing and only pulls, which moves the worker up to
the committed clock. Compute already spent in backward is not interrupted (the check runs between phases).

Shard restarts (issue 9). When a shard dies the client fails the step's request at once (ShardLostError: the
socket monitor saw the connection drop; or NotRegisteredError: a request reached the new incarnation first). `step`
then recovers instead of failing: the weights get memory of their own (the old reply segment is gone), the client
resyncs (re-registers with every shard, re-negotiates shared memory: `.grad` is re-pointed at the new push
segment), and the worker reads at the restored clock. The step's gradient is given up (status "lost": `dropped`
is True for it). The loop then continues from the restored clock: `take_rewind()` returns it once (None otherwise)
and the loop sets `step` to it, so the lost clocks are redone on the same batches and, under BSP, every worker is
back in step with the shard (a worker that went on counting forward would end one clock apart and wait forever).
With several shards per slot group under an aggregating policy, ServerGroup.check restarts the whole group from
its newest common checkpoint version, so every shard comes back at the same clock (bitwise equal to a run without
the failure, tested); under asp/ssp only the dead shard restarts and the survivors keep their clocks (the redone
clocks are applied there again). `last_restart` = {"shard", "restored_version", "lost_updates", "restored_from", "clock", "step_clock"}
(lost_updates as this client saw it: a lower bound; ServerGroup.check's event has the shard's exact figure).
A shard restarted without a checkpoint has no parameters: that is a PSStrategyError (set a checkpoint interval).
`checkpoint_error`: the last failed periodic checkpoint a shard reported in a push ack (warned once), else None.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from pslab.collectives import trace
from pslab.experiments.errors import ExperimentError
from pslab.parallelism.engine import Replica
from pslab.parallelism.mesh import DeviceMesh

# the pulled weights are read-only views (the worker never writes its weights: the shards run the optimizer)
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", module=__name__)


ABORT_POLL_S = 0.005      # backup abort: how often a padding straggler asks whether its clock is committed
RECOVER_TRIES = 3         # resyncs per shard loss (a shard may drop again while it is being restarted)


class PSStrategyError(ExperimentError):
    """The PS strategy cannot drive this replica with these servers; the message says what to change."""


def slot_group(mesh: DeviceMesh) -> int:
    """Index of this rank's slot group (its shard set): (pp · E + ep) · T + tp; there are P · E · T groups, each of
    D workers. The cp ranks of a worker hold the same slots: they share their cp rank 0's group (only it connects)."""
    c = mesh.coords
    return (c["pp"] * mesh.size("ep") + c["ep"]) * mesh.size("tp") + c["tp"]


def own_slot(slot: Any) -> bool:
    """A slot only this rank of its model replica holds: a tensor-parallel shard ("#tp" in its name) or an expert's
    parameter under expert parallelism; the others are replicated over the tp (ep) group."""
    return "#tp" in slot.name or bool(getattr(slot.param, "_ep_expert", False))


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
    curve_keys_dir: str | None = None
    secret: str | None = None     # the job secret the shards admit (None: PSLAB_JOB_SECRET / _FILE, as launched)
    shared_group: Any = None      # tp > 1 (or ep > 1): the tensor- (expert-) parallel group, whose ranks share the
                                  # replicated tensors (`own_slot` says which are a rank's own)
    mirror_group: Any = None      # cp > 1: the context-parallel group, whose ranks hold the same slots (and, after
                                  # backward, the same cp-averaged gradients): its rank 0 talks to the shards, the
                                  # others take every slot's new value from it (module docstring)
    abort: bool = False           # backup-BSP: give up a gradient whose clock is committed (module docstring)
    link: tuple[str, float, float] | None = None   # [topology]: (link class, latency s, bandwidth B/s) between this
                                                   # rank's emulated host and the shards' (ps.link_delay)
    compress: str | None = None   # train.compress: each push compressed (topk / sign, ps.compression), reads whole
    error_feedback: bool = True   # with compress: keep what was not sent and add it to the next gradient
    client: Any = field(default=None, init=False, repr=False)     # ps.PSClient once attached
    history: list[PSStep] = field(default_factory=list, init=False)
    last_bytes: tuple[int, int] = field(default=(0, 0), init=False)  # (pushed, pulled) payload of the last step,
    #                                                                   counted by the client's transport
    _grads: dict[str, np.ndarray] = field(default_factory=dict, init=False, repr=False)
    _touched: dict[str, Any] = field(default_factory=dict, init=False, repr=False)
    _hooks: list[Any] = field(default_factory=list, init=False, repr=False)
    _shared: list[str] = field(default_factory=list, init=False, repr=False)
    _aborted: bool = field(default=False, init=False, repr=False)
    restarts: list[dict[str, Any]] = field(default_factory=list, init=False)   # shard restarts recovered from
    _rewind: int | None = field(default=None, init=False, repr=False)
    _mirror_clock: int = field(default=0, init=False, repr=False)

    @property
    def link_class(self) -> str | None:
        """The emulated link class ("intra" / "inter") this rank's PS traffic crosses, or None (no topology, or a
        cp rank > 0, which sends none)."""
        return None if self.link is None or self.mirror else self.link[0]

    @property
    def mirror(self) -> bool:
        """Whether this rank is a cp rank > 0: no client, every slot's value from cp rank 0 after each read."""
        return self.mirror_group is not None and self.mirror_group.rank > 0

    def attach(self, replica: Replica) -> None:
        from pslab import ps
        from pslab.ps.errors import AuthenticationError, ProtocolError
        slots = replica.slots()
        names = [s.name for s in slots]
        if not slots or len(set(names)) != len(names):
            raise PSStrategyError(f"a replica must expose distinct, non-empty slot names to push by; got {names[:8]}")
        self.close()
        if self.mirror:
            self._receive(replica)
            return
        worker, workers = replica.dp.rank, replica.dp.size
        self._shared = [s.name for s in slots if self.shared_group is not None and not own_slot(s)]
        if self.shared_group is not None and self.shared_group.rank > 0:
            slots = [s for s in slots if s.name not in self._shared]     # rank 0's shard set holds them
        params = {s.name: s.param.detach() for s in slots}
        fix = "start one shard set per slot group (pp x ep x tp coordinate) with num_workers = dp size " \
              "(ps.start_servers(..., groups=pp x ep x tp: the slot groups of a worker))"
        try:
            self.client = ps.connect(self.addresses, worker=worker, params=params, timeout=self.timeout,
                                     curve_keys_dir=self.curve_keys_dir, secret=self.secret,
                                     link=self.link[1:] if self.link is not None else None,
                                     compress=self.compress, error_feedback=self.error_feedback)
        except (ProtocolError, AuthenticationError) as e:   # e.g. this dp rank is no worker id the shards serve
            raise PSStrategyError(f"dp rank {worker} of {workers} cannot register with {list(self.addresses)}: {e}; "
                                  f"{fix}") from e
        served = {int(meta["num_workers"]) for meta, _ in self.client.registration}
        if served != {workers}:
            self.close()
            raise PSStrategyError(f"the shards at {list(self.addresses)} serve {sorted(served)} workers, but this "
                                  f"replica's data-parallel group has {workers} ranks: {fix}")
        if worker == 0:                       # the group's owner; the others' first pull waits for its init
            self.client.init(params).result(self.timeout)
        self._grads = self.client.grad_buffers()
        for g in self._grads.values():        # the segment may still hold the init's payload
            g.fill(0.0)
        for s in slots:                       # backward accumulates into the push segment itself
            s.param.grad = torch.from_numpy(self._grads[s.name])
            self._hooks.append(s.param.register_hook(self._touch(s.name)))
        self._adopt(replica, self.client.pull(copy=False).result(self.timeout))

    def _pushed(self, replica: Replica) -> list[Any]:
        """The slots this rank pushes and pulls: all of them, except on tp ranks > 0 the replicated ones."""
        return [s for s in replica.slots() if s.name in self._grads]

    def _wire(self) -> tuple[int, int]:
        """(push payload sent, read payload received) so far, as the client's transport counted them (frames,
        shared segments, lanes: ps.client's `wire`)."""
        ops = self.client.wire.snapshot()["by_op"]
        return ops.get("push", {}).get("sent", 0), ops.get("pull", {}).get("recv", 0)

    def step(self, replica: Replica) -> None:
        if self.mirror:
            self._receive(replica)
            return
        if self.client is None:
            raise PSStrategyError("PSSyncStrategy.step before attach(replica)")
        before = self._wire()
        try:
            self._step(replica)
        finally:
            after = self._wire()
            self.last_bytes = (after[0] - before[0], after[1] - before[1])

    def _step(self, replica: Replica) -> None:
        clock = self.client.clocks[0]
        if self.abort and (self._aborted or self._committed_without_me()):
            self._aborted = False             # nothing pushed: the pull moves this worker up to the committed clock
            read = self.client.pull(copy=False).result(self.timeout)
            self.history.append(PSStep(clock, ["aborted"], list(read.versions), []))
            self._zero()
            self._adopt(replica, read)
            return
        try:
            with trace.span("push_pull", "comm", worker=self.client.worker, clock=clock):   # flows to the shards
                acks, read = self.client.push_pull(self._grads, copy=False).result(self.timeout)
        except self._lost_errors() as e:
            self._recover(replica, clock, e)
            return
        self.history.append(PSStep(clock, [a["status"] for a in acks], [int(a["version"]) for a in acks],
                                   [[(int(w), int(t)) for w, t in a["staleness"]] for a in acks]))
        self._zero()                          # acked: the shard has read them; start the next sum from zero
        self._adopt(replica, read)

    @staticmethod
    def _lost_errors() -> tuple[type[BaseException], ...]:
        from pslab.ps.errors import NotRegisteredError, ShardLostError
        return (ShardLostError, NotRegisteredError)

    def _recover(self, replica: Replica, clock: int, why: BaseException) -> None:
        """A shard was lost mid-step: resync with every shard and read at the restored clocks (module docstring)."""
        pushed = self._pushed(replica)
        for s in pushed:                      # off the old segments: the weights and gradients get their own memory
            s.param.data = s.param.data.clone()
            s.param.grad = None
        seen = len(self.client.restarts)
        for attempt in range(RECOVER_TRIES):
            try:
                self.client.resync()
                empty = [i for i, (m, _) in enumerate(self.client.registration) if not m.get("initialized", True)]
                if empty:       # at once: a pull would wait for an init that nobody sends (train.timeout_s)
                    from pslab.experiments.faults.spec import NO_SHARD_CHECKPOINT
                    raise PSStrategyError(f"shard(s) {empty} {NO_SHARD_CHECKPOINT}")
                read = self.client.pull(copy=False).result(self.timeout)
                break
            except self._lost_errors() as e:  # dropped again while coming back: try again
                why = e
        else:
            raise PSStrategyError(f"lost a shard and could not resync after {RECOVER_TRIES} tries: {why}") from why
        self._grads = self.client.grad_buffers()      # the new push segment
        for g in self._grads.values():
            g.fill(0.0)
        for s in pushed:
            s.param.grad = torch.from_numpy(self._grads[s.name])
        self._touched.clear()
        for r in self.client.restarts[seen:]:
            self.restarts.append(dict(r, step_clock=clock, why=f"{type(why).__name__}: {why}"[:300]))
        if len(self.client.restarts) > seen:
            self._rewind = self.client.clocks[0]
        self.history.append(PSStep(clock, ["lost"], list(read.versions), []))
        self._adopt(replica, read)

    def take_rewind(self) -> int | None:
        """The step the loop continues from after a shard restart (the restored clock on shard 0), once; else None."""
        r, self._rewind = self._rewind, None
        return r

    @property
    def last_restart(self) -> dict[str, Any] | None:
        """The last shard restart this worker recovered from (module docstring), or None."""
        return self.restarts[-1] if self.restarts else None

    @property
    def checkpoint_error(self) -> str | None:
        """The failed periodic checkpoint a shard last reported in a push ack (None while they succeed)."""
        errs = [e for e in (self.client.checkpoint_errors if self.client is not None else []) if e]
        return errs[0] if errs else None

    def pad(self, seconds: float) -> None:
        """The loop's straggler padding: sleep `seconds`; with `abort`, stop early once this worker's clock has
        been committed without it (then `step` pushes nothing)."""
        end = time.perf_counter() + seconds
        while self.abort and self.client is not None:
            if self._committed_without_me():
                self._aborted = True
                return
            left = end - time.perf_counter()
            if left <= 0:
                return
            time.sleep(min(left, ABORT_POLL_S))
        time.sleep(max(0.0, end - time.perf_counter()))

    def _committed_without_me(self) -> bool:
        """Every shard has committed this worker's current clock (backup-BSP took the first N gradients)."""
        clock = self.client.clocks[0]
        return all(int(m.get("committed", 0)) > clock for m in self.client.stats().result(self.timeout))

    def _touch(self, name: str) -> Any:
        """A gradient hook that notes what backward writes: a sparse gradient's rows, or 'all' for a dense one."""
        def hook(g: torch.Tensor) -> None:
            if g.is_sparse and self._touched.get(name) != "all":
                self._touched.setdefault(name, []).append(g._indices()[0])
            else:
                self._touched[name] = "all"
        return hook

    def _zero(self) -> None:
        """Zero what the last backward wrote: whole buffers for dense gradients, only the touched rows for sparse
        ones (an embedding's step touches a few rows of a large table: no 4 MB memset per step)."""
        for name, rows in self._touched.items():
            buf = self._grads[name]
            if rows == "all":
                buf.fill(0.0)
            else:
                buf[torch.cat(rows).numpy()] = 0.0
        self._touched.clear()

    @property
    def clock(self) -> int:
        """This worker's clock on its shards (after a read; backup-BSP may move it past a clock)."""
        return self.client.clocks[0] if self.client is not None else self._mirror_clock

    @property
    def pushed_bytes(self) -> int:
        """Bytes of the gradients this rank pushes each step (its slots, less replicated ones on tp ranks > 0)."""
        return sum(g.nbytes for g in self._grads.values())

    @property
    def dropped(self) -> bool:
        """The last step's gradient was not applied: a late backup push (dropped), given up before it (aborted),
        skipped by a shard running nonfinite="skip" (it held NaN/Inf), or lost with a shard that died (lost)."""
        return bool(self.history) and bool({"dropped", "aborted", "skipped", "lost"} & set(self.history[-1].status))

    def refresh(self, replica: Replica) -> None:
        """Read the shards' current weights into the replica (e.g. after every worker has finished)."""
        if self.mirror:
            self._receive(replica)
            return
        self._adopt(replica, self.client.pull(copy=False).result(self.timeout))

    def _send_mirrors(self, replica: Replica) -> None:
        """cp rank 0, after each read: every slot's value to the other cp ranks, with the clock, the rewind (or −1)
        and whether the step's gradient was dropped, so they step, rewind and record exactly as it does."""
        head = torch.tensor([float(self.clock), float(-1 if self._rewind is None else self._rewind),
                             float(self.dropped)])
        flat = torch.cat([s.param.detach().reshape(-1) for s in replica.slots()] + [head])
        self.mirror_group.broadcast(flat, src=0)

    def _receive(self, replica: Replica) -> None:
        """A cp rank > 0: take cp rank 0's slot values (and clock, rewind, dropped); its gradients are not pushed.
        (It waits at most its group's timeout, train.timeout_s, while cp rank 0 may spend up to RECOVER_TRIES of
        them resyncing with a restarted shard: a restart slower than that fails the cp ranks > 0 with a timeout.)"""
        slots = replica.slots()
        flat = torch.empty(sum(s.param.numel() for s in slots) + 3)
        self.mirror_group.broadcast(flat, src=0)
        off = 0
        for s in slots:
            with torch.no_grad():
                s.param.copy_(flat[off:off + s.param.numel()].view_as(s.param))
            s.param.grad = None                      # cp-averaged like cp rank 0's, which pushed it
            off += s.param.numel()
        clock, rewind, dropped = (int(v) for v in flat[off:].tolist())
        self._mirror_clock = clock
        if rewind >= 0:
            self._rewind = rewind
        self.history.append(PSStep(clock, ["dropped" if dropped else "mirrored"], [], []))

    def _adopt(self, replica: Replica, read: Any) -> None:
        """Point every pushed slot's data at the pulled (read-only) values: no copy. With tp > 1, tp rank 0 then
        broadcasts the replicated tensors (LayerNorm, embeddings, row-parallel biases) to its tp peers, so every tp
        rank of a worker computes with the same copy even when ASP/SSP reads race with other workers' pushes."""
        for s in self._pushed(replica):
            s.param.data = torch.from_numpy(read.params[s.name])
        if self._shared:
            shared = [s for s in replica.slots() if s.name in self._shared]
            root = self.shared_group.rank == 0
            flat = torch.cat([s.param.detach().reshape(-1) for s in shared]) if root else \
                torch.empty(sum(s.param.numel() for s in shared))
            self.shared_group.broadcast(flat, src=0)
            if not root:
                off = 0
                for s in shared:
                    with torch.no_grad():
                        s.param.copy_(flat[off:off + s.param.numel()].view_as(s.param))
                    s.param.grad = None              # computed like tp rank 0's, which pushes it
                    off += s.param.numel()
        if self.mirror_group is not None:
            self._send_mirrors(replica)

    def shard_stats(self, series: bool = False) -> list[dict[str, Any]]:
        """Per shard: version, clocks, staleness summary (histogram, per worker), waits, counters; with `series`
        the shard's exact [[now, worker, tau, version], ...] of every update."""
        if self.client is None:
            raise PSStrategyError("shard_stats before attach(replica)")
        return self.client.stats(series=series).result(self.timeout)

    def close(self, replica: Replica | None = None) -> None:
        """Disconnect; with `replica`, first give its weights and gradients memory of their own (the views die)."""
        if replica is not None and self.client is not None:
            for s in replica.slots():
                s.param.data = s.param.data.clone()
                s.param.grad = None
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self.client is not None:
            self.client.close()
            self.client = None
