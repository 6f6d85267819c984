"""The discrete-event simulator: the real `ps.ShardState` (consistency policy, optimizer, staleness tracking) driven
in virtual time, with real gradients, a compute-time model per worker and a network model (`experiments.sim.network`).

Worker w's life, in virtual time:

    read request --net--> shard gate (ps policy: may_read? else wait, counted as wait_s) --net--> params arrive
    -> compute: real forward/backward on batch(w, clock), taking StragglerModel.step_time(w, clock, compute_s)
    -> push gradient --net--> shard applies it (ps optimizer; staleness recorded by the shard); next read request
       follows the push on the same FIFO link.

Backup workers (ps-bsp-backup:b): by default a straggler's gradient for a clock committed without it still travels
to the shards and is dropped there; with train.backup_abort (Chen et al. 2016's idealised model) every worker
computing a clock that all shards have committed gives it up at that instant (a dropped record, nothing pushed) and
reads again.

Events sit in a heap ordered by (time, sequence number); sequence numbers are assigned in a deterministic order
and all randomness is seeded, so the same config gives a byte-identical metrics file. Nothing here depends on the
wall clock or on the machine: 64+ workers on 2 cores only cost 64x the gradient computations.

Every train.eval_every applied updates the shards' live parameters are evaluated; with `train.target_acc` the run
stops at the first evaluation whose test accuracy reaches it (gradients still in flight are abandoned, not recorded),
so time to accuracy is resolved to eval_every updates. `[simulate] timing_only` runs `experiments.sim.timing`
instead: this loop without tensors, giving the same records but for loss.

`train.compress` (topk:ρ, sign): each worker's push goes through its own `ps.compression.PushCompressor` (its
residual, error feedback) and the shard's decoder, as in a real run; the network carries the compressed bytes.

`[faults] events` (kill / stop of workers, kill of a shard) are injected, detected and recovered from in virtual
time by `experiments.sim.ps_faults` (the model: `experiments.sim.faults`), which writes RUN_DIR/events.jsonl and
changes the shards' membership (ShardState.set_members) as real runs do. Without events nothing changes.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from pslab.experiments.config import RunConfig
from pslab.experiments.errors import ExperimentError
from pslab.experiments.results.records import UpdateRecord
from pslab.experiments.results.rundir import JsonlWriter, RunDir
from pslab.experiments.sim.network import Network
from pslab.experiments.strategies.spec import optimizer_spec
from pslab.experiments.stragglers import StragglerModel
from pslab.ps import compression
from pslab.ps.errors import NotAMemberError
from pslab.ps.shard import PushResult
from pslab.experiments.workloads import compute_grads, get_params, get_workload, set_params

READ_ARRIVE, REPLY, COMPUTE_DONE, PUSH_ARRIVE = range(4)


@dataclass
class WorkerState:
    clock: int = 0
    read_sent: float = 0.0
    replies: dict[int, Any] = field(default_factory=dict)
    gate_wait: float = 0.0
    bytes_recv: int = 0
    done: bool = False
    computing: Any = None          # (token, loss, digest) of the gradient in flight; None when not computing
    token: int = 0                 # bumps per compute: an aborted compute's COMPUTE_DONE is ignored
    dead: bool = False             # [faults]: killed, or expelled
    frozen_until: float | None = None   # [faults]: SIGSTOP'd until then
    stop_idx: int = -1             # [faults]: the stop event that froze it
    epoch: int = 0                 # [faults]: bumped at each resync; replies of an older epoch are dropped


class Simulator:
    def __init__(self, cfg: RunConfig, progress: Callable[[int], None] | None = None):
        self.cfg, self.progress = cfg, progress
        t = cfg.train
        self.K, self.steps = t.workers, t.steps
        self.wl = get_workload(cfg.workload.name, self.K, cfg.workload.batch_size, cfg.workload.seed,
                          **cfg.workload.overrides())
        torch.manual_seed(cfg.workload.seed)
        self.model = self.wl.make_model()
        init = get_params(self.model)
        from pslab.ps import ShardState, make_partition
        self.partition = make_partition(init, t.shards)
        spec, policy = optimizer_spec(t), cfg.strategy.policy
        self.shards = [ShardState({k: v.copy() for k, v in piece.items()}, optimizer=spec, policy=policy,
                                  num_workers=self.K) for piece in self.partition_split(init)]
        self.net = Network(cfg.simulate, t.shards)
        self.compressors: list[Any] = []              # train.compress: each worker's push encoder (ps.compression)
        if t.compress != "none":
            form = compression.parse(t.compress)
            self.compressors = [compression.PushCompressor(form, t.error_feedback) for _ in range(self.K)]
            self.layouts = [{k: (v.numel(), v.numpy().dtype) for k, v in st.params.items()} for st in self.shards]
        self.straggle = StragglerModel(cfg.stragglers, cfg.workload.seed)
        self.heap: list[tuple[float, int, int, int, int, Any]] = []
        self.seq = itertools.count()
        self.workers = [WorkerState() for _ in range(self.K)]
        self.blocked: list[dict[int, float]] = [dict() for _ in range(t.shards)]  # shard -> {worker: since}
        self.pending: list[deque] = [deque() for _ in range(self.K)]  # records awaiting their update on shard 0
        self.applied = 0
        self.now = 0.0
        self.reached = False           # an evaluation reached train.target_acc: stop
        self.fx = None
        if cfg.faults.events:
            from pslab.experiments.sim.ps_faults import PSFaults
            self.fx = PSFaults(self)

    # -- event plumbing ------------------------------------------------------------------------------------------
    def _at(self, when: float, kind: int, worker: int, shard: int = 0, payload: Any = None) -> None:
        heapq.heappush(self.heap, (when, next(self.seq), kind, worker, shard, payload))

    def _send_read(self, w: int) -> None:
        ws = self.workers[w]
        ws.read_sent, ws.replies, ws.gate_wait, ws.bytes_recv = self.now, {}, 0.0, 0
        for s in range(len(self.shards)):
            epoch = self.fx.shard_epoch[s] if self.fx else 0
            self._at(self.net.to_shard(self.now, w, s, 0), READ_ARRIVE, w, s, (epoch, ws.epoch))

    def _begin_step(self, w: int) -> None:
        if self.fx is None or self.fx.begin_step(w):
            self._send_read(w)

    def _try_read(self, w: int, s: int, since: float) -> bool:
        st, ws = self.shards[s], self.workers[w]
        if not st.may_read(w, ws.clock, now=self.now):
            return False
        rr = st.read(w, ws.clock, now=self.now)
        nbytes = sum(int(v.numel()) * v.element_size() for v in rr.params.values())
        ws.gate_wait = max(ws.gate_wait, self.now - since)
        self._at(self.net.from_shard(self.now, w, s, nbytes), REPLY, w, s, (rr, nbytes, ws.epoch))
        return True

    def _recheck(self, s: int) -> None:
        for w in sorted(self.blocked[s]):
            if self._try_read(w, s, self.blocked[s][w]):
                del self.blocked[s][w]

    # -- handlers ------------------------------------------------------------------------------------------------
    def _on_reply(self, w: int, s: int, payload: Any) -> None:
        ws = self.workers[w]
        ws.replies[s] = payload[0]
        ws.bytes_recv += payload[1]
        if len(ws.replies) < len(self.shards):
            return
        ws.clock = max(ws.clock, *(int(r.clock) for r in ws.replies.values()))  # backup-BSP may move a worker up
        if ws.clock >= self.steps:
            ws.done = True
            return
        params = self.partition_join({k: v for r in ws.replies.values() for k, v in r.params.items()})
        set_params(self.model, params)
        loss, grads, digest = compute_grads(self.wl, self.model, w, ws.clock)
        dt = self.straggle.step_time(w, ws.clock, self.cfg.simulate.compute_s)
        ws.token += 1
        ws.computing = (ws.token, loss, digest)
        self._at(self.now + dt, COMPUTE_DONE, w, 0, (ws.token, loss, grads, digest))

    def _on_compute_done(self, w: int, payload: Any) -> None:
        ws = self.workers[w]
        token, loss, grads, digest = payload
        if ws.computing is None or token != ws.computing[0]:
            return                                   # aborted (backup_abort): its clock was committed without it
        ws.computing = None
        pieces = self.partition_split(grads)
        sent = 0
        for s, piece in enumerate(pieces):
            if self.compressors:                      # encoded, decoded as the shard would: the bytes are the code's
                piece, nbytes = self._compress(w, s, piece)
            else:
                nbytes = sum(a.nbytes for a in piece.values())
            sent += nbytes
            version = int(ws.replies[s].version)
            epoch = self.fx.shard_epoch[s] if self.fx else 0
            self._at(self.net.to_shard(self.now, w, s, nbytes), PUSH_ARRIVE, w, s, (ws.clock, version, piece, epoch))
        self.pending[w].append(UpdateRecord(w, ws.clock, ws.clock + 1, 0.0, loss, None, sent, ws.bytes_recv,
                                            ws.gate_wait, digest))
        ws.clock += 1
        if self.progress:
            self.progress(1)
        if ws.clock < self.steps:
            self._begin_step(w)
        else:
            ws.done = True

    def _compress(self, w: int, s: int, piece: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int]:
        """Worker w's push to shard s through its encoder (residual kept: no push is refused here) and the
        shard's decoder: (the gradient the shard applies, the bytes on the wire)."""
        comp = self.compressors[w]
        meta, tensors, residual = comp.encode(s, piece)
        comp.commit(s, residual)
        return compression.decode(meta, tensors, self.layouts[s]), sum(a.nbytes for a in tensors.values())

    def _on_push(self, w: int, s: int, payload: Any) -> None:
        clock, version, piece, epoch = payload
        if self.fx and self.fx.lost(s, epoch):
            return                                   # sent to a dead shard: its record is flushed at the resync
        try:
            pr = self.shards[s].push(w, clock, version, {k: torch.from_numpy(v) for k, v in piece.items()},
                                     now=self.now)
        except NotAMemberError:                      # an expelled worker's push, still on the wire
            pr = PushResult("refused", self.shards[s].version, clock)
        if s == 0 and pr.status in ("dropped", "refused"):   # refused: an expelled worker's push
            rec = self.pending[w].pop()  # the newest: this very push
            self._emit(rec, None, dropped=True)
        self._applied_now(s, pr.staleness)
        if self.fx:
            self.fx.after_push(s)
        if self.cfg.train.backup_abort and pr.staleness:
            self._abort_committed()
        self._recheck(s)

    def _applied_now(self, s: int, staleness: list[tuple[int, int]]) -> None:
        """Emit the records of the updates shard `s` just applied (shard 0 speaks for all)."""
        if s != 0:
            return
        for worker, tau in staleness:
            if self.pending[worker]:
                self._emit(self.pending[worker].popleft(), int(tau))

    def _flush_pending(self, w: int) -> None:
        """Records of pushes that will never become an update (lost with a shard, or dropped at a resync)."""
        while self.pending[w]:
            self._emit(self.pending[w].popleft(), None)

    def _abort_committed(self) -> None:
        """backup_abort (Chen et al. 2016's idealised model): a worker computing a clock that every shard has now
        committed gives it up at once -- a dropped record, no push -- and reads again (moved up to the clock)."""
        committed = min(st.committed_clock for st in self.shards)
        for w, ws in enumerate(self.workers):
            if ws.computing is not None and ws.clock < committed:
                _, loss, digest = ws.computing
                ws.computing = None
                self._emit(UpdateRecord(w, ws.clock, ws.clock + 1, 0.0, loss, None, 0, ws.bytes_recv, ws.gate_wait,
                                        digest), None, dropped=True)
                if self.progress:
                    self.progress(1)
                self._begin_step(w)

    def _emit(self, rec: UpdateRecord, tau: int | None, dropped: bool = False) -> None:
        rec.time_s, rec.staleness, rec.dropped = self.now, tau, dropped
        self.mw.write(rec.to_json())
        if tau is not None:
            before, self.applied = self.applied, self.applied + 1
            if self.applied // self.cfg.train.eval_every > before // self.cfg.train.eval_every:
                self._evaluate()

    def _evaluate(self) -> None:
        set_params(self.model, self.partition_join(self.current_params()))
        ev = self.wl.evaluate(self.model)
        self.ew.write({"updates": self.applied, "time_s": self.now, **ev})
        target = self.cfg.train.target_acc
        self.reached = target is not None and ev["test_acc"] >= target

    # -- the partition: {name: flat array} <-> per shard {key: flat piece} ---------------------------------------
    def partition_split(self, flat: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        out: list[dict[str, np.ndarray]] = [dict() for _ in range(self.partition.num_shards)]
        for sl in self.partition.slices:
            out[sl.shard][sl.key] = np.asarray(flat[sl.name]).reshape(-1)[sl.start: sl.stop]
        return out

    def partition_join(self, keyed: dict[str, Any]) -> dict[str, np.ndarray]:
        sizes: dict[str, int] = {}
        for sl in self.partition.slices:
            sizes[sl.name] = max(sizes.get(sl.name, 0), sl.stop)
        out = {n: np.empty(k, np.float32) for n, k in sizes.items()}
        for sl in self.partition.slices:
            v = keyed[sl.key]
            out[sl.name][sl.start: sl.stop] = v.numpy() if hasattr(v, "numpy") else np.asarray(v)
        return out

    def current_params(self) -> dict[str, Any]:
        """The shards' live parameters, bypassing the consistency gate (for evaluation only)."""
        return {k: v for st in self.shards for k, v in st.params.items()}

    # -- main loop -----------------------------------------------------------------------------------------------
    def run(self, rundir: RunDir) -> dict[str, Any]:
        try:
            if self.fx:
                self.fx.open(rundir.events_path)
            with JsonlWriter(rundir.metrics_path) as self.mw, JsonlWriter(rundir.eval_path) as self.ew:
                return self._loop()
        finally:
            if self.fx:
                self.fx.close()

    def _loop(self) -> dict[str, Any]:   # noqa: C901 -- one dispatch
        fx = self.fx
        from pslab.experiments.sim.ps_faults import PLAN_KINDS
        self._evaluate()
        if fx:
            fx.start()
        for w in range(self.K):
            self._begin_step(w)
        while self.heap and not self.reached:
            when, _, kind, w, s, payload = heapq.heappop(self.heap)
            if fx and kind in PLAN_KINDS and not fx.live_work():
                continue                         # the run is over: a later fault has nothing to hit
            self.now = when
            if fx and kind in (REPLY, COMPUTE_DONE) and fx.defer(kind, w, when, s, payload):
                continue
            if kind == READ_ARRIVE:
                if fx and (fx.lost(s, payload[0]) or payload[1] != self.workers[w].epoch
                           or self.workers[w].dead or w not in fx.members):
                    continue
                if not self._try_read(w, s, self.now):
                    self.blocked[s][w] = self.now
            elif kind == REPLY:
                self._on_reply(w, s, payload)
            elif kind == COMPUTE_DONE:
                self._on_compute_done(w, payload)
            elif kind == PUSH_ARRIVE:
                self._on_push(w, s, payload)
            else:
                fx.handle(kind, w, s, payload)
        if self.reached:
            return self._result()
        stuck = [w for w, ws in enumerate(self.workers) if not ws.done and not ws.dead
                 and (fx is None or w in fx.members)]    # an expelled one still stopped is ended with the run
        if stuck:
            raise ExperimentError(f"simulation stopped with workers {stuck} blocked at the consistency gate "
                                  f"({self.cfg.strategy.policy}); this is a deadlock in the policy")
        for q in self.pending:  # pushes that never became an update (e.g. a clock left incomplete)
            while q:
                rec = q.popleft()
                rec.time_s = self.now
                self.mw.write(rec.to_json())
        if self.applied % self.cfg.train.eval_every:
            self._evaluate()
        return self._result()

    def _result(self) -> dict[str, Any]:
        out = {"virtual_time_s": self.now, "applied_updates": self.applied, "stopped_at_target": self.reached,
               "shard_stats": [shard_summary(st) for st in self.shards]}
        if self.fx:
            out.update(fault_events=self.fx.log.summary(), world_size_final=len(self.fx.members))
        return out


def shard_summary(st: Any) -> dict[str, Any]:
    try:
        return dict(st.stats.summary())
    except Exception:  # stats are a courtesy in the summary; never fail a finished run over them
        return {}


def simulate(cfg: RunConfig, rundir: RunDir, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    if cfg.strategy.kind == "allreduce":
        from pslab.experiments.sim.allreduce import simulate_allreduce
        return simulate_allreduce(cfg, rundir, progress)
    if cfg.strategy.periodic:
        from pslab.experiments.sim.local_sgd import simulate_local_sgd
        return simulate_local_sgd(cfg, rundir, progress)
    if cfg.strategy.ps_periodic:
        from pslab.experiments.sim.ps_local import simulate_ps_local
        return simulate_ps_local(cfg, rundir, progress)
    if not cfg.strategy.uses_ps:
        raise ExperimentError(f"--simulate supports allreduce, local-sgd, diloco and the parameter-server "
                              f"strategies (ps-*), not {cfg.strategy}: `local` is already a single process, run it "
                              "without --simulate")
    if cfg.faults.events:
        from pslab.experiments.sim.faults import check_supported
        check_supported(cfg)
    if cfg.simulate.timing_only:
        from pslab.experiments.sim.timing import simulate_timing
        return simulate_timing(cfg, rundir, progress)
    return Simulator(cfg, progress).run(rundir)
