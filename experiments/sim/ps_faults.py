"""The PS simulator's failures (`experiments.sim.ps.Simulator` with `[faults] events`): the injection, detection,
membership and restart events of `experiments.sim.faults`, driven in the simulator's heap.

Hooks the event loop calls:
    begin_step(w)          before worker w reads for its next step: an at_step fault of (w, clock) fires here
    defer(kind, w, ...)    a worker-side event (reply, compute done) of a stopped worker waits for its SIGCONT;
                           one of a dead worker (or of an abandoned epoch) is dropped
    lost(kind, s, epoch)   a message to a dead shard, or sent to its previous incarnation, is lost
    after_push(s)          a shard checkpoint every faults.shard_checkpoint_every applied updates
    handle(kind, ...)      FAULT, DETECT, MEMBER, THAW, JOIN, SHARD_UP

Worker state it adds to WorkerState: dead (killed, or expelled), frozen_until (SIGSTOP'd until then), epoch (bumped at
every resync: replies and deferred reads of an older epoch are dropped).
"""

from __future__ import annotations

from typing import Any

from pslab.experiments.errors import ExperimentError
from pslab.experiments.faults.spec import FaultEvent
from pslab.experiments.faults.events import EventLog
from pslab.experiments.sim import faults as fm

READ_ARRIVE, REPLY, COMPUTE_DONE, PUSH_ARRIVE = range(4)  # as in experiments.sim.ps
FAULT, DETECT, MEMBER, THAW, JOIN, SHARD_UP, RESEND, LEAVE = range(4, 12)
PLAN_KINDS = (FAULT, DETECT, MEMBER, THAW, RESEND)  # dropped once no member has work left (the run is over)


class PSFaults:
    def __init__(self, sim: Any) -> None:
        cfg = sim.cfg
        fm.check_supported(cfg)
        self.sim, self.cfg = sim, cfg
        self.events: list[FaultEvent] = cfg.faults.parsed()
        self.policy = cfg.faults.policy(cfg.strategy.kind)
        self.multi_host = cfg.train.workers > cfg.simulate.workers_per_host
        self.at_step: dict[tuple[int, int], list[int]] = {}
        for i, e in enumerate(self.events):
            if e.at_step is not None:
                self.at_step.setdefault((e.index, e.at_step), []).append(i)
        self.generation = 0
        self.members: set[int] = set(range(sim.K))
        self.inject_t: dict[int, float] = {}
        self.detected: set[int] = set()
        self.refilled: set[int] = set()              # slots whose JOIN already happened (or was pre-empted)
        self.shard_epoch = [0] * len(sim.shards)
        self.shard_down = [False] * len(sim.shards)
        self.ckpt: list[Any] = [fm.snapshot(st) for st in sim.shards]   # version 0: the initial state
        self.kill_version: dict[int, int] = {}

    # -- the log -----------------------------------------------------------------------------------------------
    def open(self, path: Any) -> None:
        self.log = EventLog(path)

    def close(self) -> None:
        self.log.close()

    def _write(self, event: str, who: str, **kw: Any) -> None:
        kw.setdefault("generation", self.generation)
        kw.setdefault("world_size", len(self.members))
        self.log.write(event, self.sim.now, who, **kw)

    # -- hooks -------------------------------------------------------------------------------------------------
    def start(self) -> None:
        for i, e in enumerate(self.events):
            if e.at_s is not None:
                self.sim._at(e.at_s, FAULT, e.index, 0, i)

    def live_work(self) -> bool:
        return any(not ws.done and not ws.dead and w in self.members for w, ws in enumerate(self.sim.workers))

    def begin_step(self, w: int) -> bool:
        """False if worker w does not read now (killed, or stopped: it reads when it resumes)."""
        ws = self.sim.workers[w]
        for i in self.at_step.pop((w, ws.clock), []):
            if self.events[i].action == "leave":
                self._leave(w, i)
            else:
                self._inject(i)
        if ws.dead:
            return False
        if ws.frozen_until is not None:
            if ws.frozen_until > self.sim.now:
                self.sim._at(ws.frozen_until, RESEND, w, 0, ws.epoch)
                return False
            epoch = ws.epoch                            # its SIGCONT is due now (the THAW event may be behind)
            self._thaw(w, ws.stop_idx)
            return not ws.dead and ws.epoch == epoch    # expelled, or re-admitted (which began its step itself)
        return True

    def defer(self, kind: int, w: int, when: float, s: int, payload: Any) -> bool:
        """True if this worker-side event is not handled now (dropped, or re-queued for after the stop)."""
        ws = self.sim.workers[w]
        if ws.dead or (kind == REPLY and payload[2] != ws.epoch):
            return True
        if ws.frozen_until is not None and when < ws.frozen_until:
            later = when + self.events[ws.stop_idx].for_s if kind == COMPUTE_DONE else ws.frozen_until
            self.sim._at(later, kind, w, s, payload)
            return True
        return False

    def lost(self, s: int, epoch: int) -> bool:
        return self.shard_down[s] or epoch != self.shard_epoch[s]

    def after_push(self, s: int) -> None:
        k = self.cfg.faults.shard_checkpoint_every
        st = self.sim.shards[s]
        if k and st.version // k > self.ckpt[s][1]["version"] // k:
            self.ckpt[s] = fm.snapshot(st)

    def handle(self, kind: int, w: int, s: int, payload: Any) -> None:
        sim = self.sim
        if kind == FAULT:
            self._inject(payload)
        elif kind == DETECT:
            self._detect(payload)
        elif kind == MEMBER:
            self._expel_members(payload)
        elif kind == THAW:
            self._thaw(w, payload)
        elif kind == JOIN:
            self._join(w, payload)
        elif kind == SHARD_UP:
            self._shard_up(s, payload)
        elif kind == LEAVE:
            self._left(w, payload)
        elif kind == RESEND:
            if payload == sim.workers[w].epoch and not sim.workers[w].dead and w in self.members:
                sim._begin_step(w)
        else:
            raise ExperimentError(f"unknown simulator event kind {kind}")

    # -- the fault's life --------------------------------------------------------------------------------------
    def _inject(self, i: int) -> None:
        sim, e = self.sim, self.events[i]
        if e.kind == "shard":
            s = e.index
            if self.shard_down[s]:
                return
            self.inject_t[i] = sim.now
            self.shard_down[s] = True
            self.shard_epoch[s] += 1
            self.kill_version[i] = sim.shards[s].version
            sim.blocked[s].clear()
            self._write("inject", e.who, how="SIGKILL")
            sim._at(sim.now + fm.EXIT_DETECT_S, DETECT, 0, s, i)
            return
        ws = sim.workers[e.index]
        if ws.dead or ws.done or ws.frozen_until is not None:
            return                                     # nothing left to fail (a later stop of a stopped one: ignored)
        self.inject_t[i] = sim.now
        self._write("inject", e.who, how="SIGKILL" if e.action == "kill" else "SIGSTOP", step=ws.clock)
        if e.action == "kill":
            self._kill(e.index)
        else:
            ws.frozen_until, ws.stop_idx = sim.now + e.for_s, i
            sim._at(ws.frozen_until, THAW, e.index, 0, i)
        d = fm.detect_delay(e, self.cfg.faults.detect_s)
        if d is not None:
            sim._at(sim.now + d, DETECT, e.index, 0, i)

    def _leave(self, w: int, i: int) -> None:
        """A planned departure: the worker stops before this step and tells the shards, after its last push (the
        same FIFO links), that it leaves; the membership changes when they hear it. No failure, no detection."""
        sim, ws = self.sim, self.sim.workers[w]
        if ws.dead or ws.done:
            return
        ws.dead = True
        arrive = max(sim.net.to_shard(sim.now, w, s, 0) for s in range(len(sim.shards)))
        sim._at(arrive, LEAVE, w, 0, i)

    def _left(self, w: int, i: int) -> None:
        sim = self.sim
        if w not in self.members:
            return
        self.members.discard(w)
        self.generation += 1
        for s, st in enumerate(sim.shards):
            sim._applied_now(s, st.set_members(sorted(self.members), self.generation, sim.now))
        self._write("leave", self.events[i].who, how="planned: membership changed at its step boundary",
                    step=sim.workers[w].clock)
        for s in range(len(sim.shards)):
            sim._recheck(s)

    def _kill(self, w: int) -> None:
        sim, ws = self.sim, self.sim.workers[w]
        ws.dead, ws.computing = True, None
        ws.token += 1
        for b in sim.blocked:
            b.pop(w, None)

    def _detect(self, i: int) -> None:
        e, sim = self.events[i], self.sim
        self.detected.add(i)
        how = "exit code -9" if e.action == "kill" else f"no heartbeat for {self.cfg.faults.detect_s:g} s"
        self._write("detect", e.who, how=how, detect_s=sim.now - self.inject_t[i])
        if e.kind == "shard":
            tensors, meta, nbytes = self.ckpt[e.index]
            sim._at(sim.now + fm.shard_restart_s(nbytes), SHARD_UP, 0, e.index, i)
            return
        sim._at(sim.now + fm.membership_s(self.cfg.simulate, self.multi_host), MEMBER, e.index, 0, i)
        if self.policy == "replace":
            model_bytes = sum(st.param_bytes() for st in sim.shards)
            sim._at(sim.now + fm.join_s(self.cfg.simulate, self.multi_host, model_bytes), JOIN, e.index, 0, i)

    def _expel_members(self, i: int) -> None:
        sim, w = self.sim, self.events[i].index
        if w not in self.members:
            return
        self.members.discard(w)
        self.generation += 1
        for b in sim.blocked:
            b.pop(w, None)
        for s, st in enumerate(sim.shards):
            ups = st.set_members(sorted(self.members), self.generation, sim.now)
            sim._applied_now(s, ups)
        sim._flush_pending(w)                          # its buffered gradients are dropped with it
        self._write("recover", self.events[i].who, how=f"{self.policy}: gates and clocks without it")
        for s in range(len(sim.shards)):
            sim._recheck(s)

    def _thaw(self, w: int, i: int) -> None:
        ws = self.sim.workers[w]
        if ws.dead or ws.frozen_until is None:
            return
        ws.frozen_until = None
        if i not in self.detected:
            return                                      # a pause, not a failure: its deferred events run on
        if self.policy == "replace" and w not in self.refilled:
            self.refilled.add(w)
            self._readmit(w, "readmitted (back before its replacement joined)")
            return
        self._kill(w)
        self._write("expel", self.events[i].who, how="back after detection: its pushes are refused", step=ws.clock)

    def _join(self, w: int, i: int) -> None:
        if w in self.refilled:
            return
        self.refilled.add(w)
        ws = self.sim.workers[w]
        if not ws.dead:                                 # the stopped original is still away: it is expelled on return
            self._kill(w)
            ws.frozen_until = None
        self._readmit(w, "replacement (state from the shards)")

    def _readmit(self, w: int, how: str) -> None:
        sim, ws = self.sim, self.sim.workers[w]
        self.members.add(w)
        self.generation += 1
        for s, st in enumerate(sim.shards):
            sim._applied_now(s, st.set_members(sorted(self.members), self.generation, sim.now))
        clock = min(st.clocks[w] for st in sim.shards)   # the rejoin clock (shards agree but in flight)
        for st in sim.shards:
            st.clocks[w] = clock
        ws.dead, ws.frozen_until, ws.computing = False, None, None
        for b in sim.blocked:
            b.pop(w, None)
        ws.token += 1
        ws.epoch += 1
        ws.clock, ws.done = clock, clock >= sim.steps
        sim._flush_pending(w)
        self._write("join", f"worker:{w}", how=how, step=clock)
        if not ws.done:
            sim._begin_step(w)

    def _shard_up(self, s: int, i: int) -> None:
        sim = self.sim
        tensors, meta, _ = self.ckpt[s]
        st = fm.restore(tensors, meta, self.members, self.generation)
        lost = self.kill_version[i] - st.version
        if st.policy.aggregate:                         # buffered gradients of the checkpoint are dropped: every
            st.pending.clear()                          # worker redoes its steps from the committed clock
            st.clocks = [st._committed] * len(st.clocks)
        sim.shards[s] = st
        self.shard_down[s] = False
        self._write("shard_restart", self.events[i].who, how="from its checkpoint" if meta["version"] else
                    "from its initial state (no checkpoint)", lost_updates=lost, step=st.committed_clock)
        lost_steps = 0
        for w, ws in enumerate(sim.workers):
            if ws.dead:
                continue
            new = st.clocks[w]
            lost_steps += max(0, ws.clock - new)
            ws.token += 1
            ws.epoch += 1
            ws.computing, ws.replies = None, {}
            sim._flush_pending(w)
            ws.clock, ws.done = new, new >= sim.steps
        sim.blocked[s].clear()
        self._write("recover", self.events[i].who, how="workers resynced (adopted the shard's clocks)",
                    lost_updates=lost, lost_steps=lost_steps)
        for w, ws in enumerate(sim.workers):
            if not ws.dead and not ws.done:
                if ws.frozen_until is not None:
                    sim._at(ws.frozen_until, RESEND, w, 0, ws.epoch)
                else:
                    sim._begin_step(w)
