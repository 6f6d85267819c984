"""The run's supervisor: in the launcher's parent, it watches the ranks (and the PS shards), executes injected
faults, applies `[faults] on_failure`, and writes RUN_DIR/events.jsonl.

    started   elastic runs: publish generation 0 = every worker (collectives.elastic)
    tick      every poll (50 ms): faults due at_s, SIGCONT of stopped ranks, shard liveness (ServerGroup.check)
    message   from a rank: t0 (the start barrier's time), inject (a worker reached its at_step fault: the signal is
              sent from here, so a kill is a real SIGKILL), recover / join / expelled (membership news to record)
    failed    a rank died (exit code) or hung (no heartbeat for detect_s): record `detect`, then
                abort     the run ends (the launcher stops every rank)
                continue  (ps-*) publish generation g+1 without it; the shards' gates stop waiting for it
                shrink    (allreduce) publish generation g+1 without it: survivors rebuild the ring and roll back
                replace   as shrink/continue, then start a replacement member and publish g+2 with it back

A hung member that wakes up later (SIGCONT) finds itself outside the newest generation (`Expelled`) and ends
cleanly; a rank the supervisor let go is never waited for again, and every process is reaped at the end.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from pslab.experiments.config import RunConfig
from pslab.experiments.faults.events import EventLog
from pslab.experiments.faults.spec import EVENT_FIELDS, NO_SHARD_CHECKPOINT
from pslab.experiments.results.rundir import RunDir


class RunSupervisor:
    """`collectives.launcher.Supervisor` for one real run (see the module docstring)."""

    def __init__(self, cfg: RunConfig, rd: RunDir, servers: Any = None) -> None:
        f = cfg.faults
        self.cfg, self.servers = cfg, servers
        self.heartbeat_s, self.detect_s = f.heartbeat_s, f.detect_s
        self.policy = f.policy(cfg.strategy.kind, cfg.parallel.model_parallel > 1 or cfg.parallel.zero > 0)
        self.mp = cfg.parallel.model_parallel     # ranks per worker: worker w is ranks w*mp .. w*mp + mp - 1
        self.elastic = self.policy != "abort"
        self.out = EventLog(rd.events_path)
        self.members = list(range(cfg.train.workers))
        self.generation = 0
        self.t0: float | None = None            # wall-clock time of the start barrier (the records' time base)
        self.started_wall = time.time()
        self.pending = [e for e in f.parsed() if e.at_s is not None]   # faults the parent times
        self.resume: list[tuple[float, Any]] = []                      # (monotonic time, action) to do later
        self.injected: dict[str, float] = {}                           # who -> wall time of its fault
        self.cause: dict[int, str] = {}                                # generation -> the member it is about
        self.detected: list[str] = []                                  # workers seen dead or hung, in order

    # ------------------------------------------------------------------ records
    def now(self, wall: float | None = None) -> float:
        """Seconds since the start barrier (of the wall-clock time `wall`, default now)."""
        return (time.time() if wall is None else wall) - (self.t0 if self.t0 is not None else self.started_wall)

    def record(self, event: str, who: str, wall: float | None = None, **fields: Any) -> dict[str, Any]:
        """One line of events.jsonl at wall-clock time `wall` (default now); fields outside the schema (a shard's
        extra details) are left out."""
        return self.out.write(event, round(self.now(wall), 6), who,
                              **{k: v for k, v in fields.items() if k in EVENT_FIELDS})

    def close(self) -> None:
        self.out.close()

    # ------------------------------------------------------------------ membership
    def _change(self, job: Any, members: list[int], reason: str) -> None:
        """The next generation: `members`, published (and told to the shards)."""
        self.members = sorted(members)
        self.generation += 1
        self._publish(job, reason)

    def _publish(self, job: Any, reason: str) -> None:
        from pslab.collectives.elastic import Membership, publish
        reason = " ".join(reason.split())[:160]             # one printable line
        self.cause.setdefault(self.generation, reason.split(" ", 1)[0] if reason.startswith("worker:") else "group")
        # each member's current process (incarnation): a replaced member's earlier one, woken up, is no member
        incarnations = tuple(job.incarnation(m) for m in self.members)
        publish(job.store, Membership(self.generation, tuple(self.members), reason, incarnations), job.secret)
        if self.servers is not None and self.generation > 0:
            self.servers.set_members(list(self.members), self.generation)

    # ------------------------------------------------------------------ launcher protocol
    def started(self, job: Any) -> None:
        if self.elastic:
            self._publish(job, "start")

    def failed(self, job: Any, rank: int, how: str, hung: bool) -> bool:
        who = f"worker:{rank // self.mp}"                       # (a split model: one of the worker's ranks)
        if self.mp > 1:
            how = f"{how} (rank {rank})"
        if how.startswith(("PeerFailedError", "PeerTimeoutError")) and self.detected:
            # a survivor's inference: name the peer the supervisor saw fail (the launcher records deaths first)
            how = f"{how} [the supervisor's verdict: {', '.join(self.detected)} failed first]"
        if how.startswith(("died", "hung")):                       # the supervisor's own verdicts only
            self.detected.append(who)
        inj, wall = self.injected.pop(who, None), time.time()    # one clock reading: detect_s = time_s - inject's
        self.record("detect", who, wall, how=how, generation=self.generation,
                    detect_s=None if inj is None else round(wall - inj, 6))
        if not self.elastic or rank not in self.members or len(self.members) == 1:
            self.record("abort", who, how=how)
            return False
        self._change(job, [m for m in self.members if m != rank], f"{who} {how}")
        if hung:
            self.record("expel", who, how="left the membership", generation=self.generation,
                        world_size=len(self.members))
        if self.policy == "replace":
            job.spawn(rank, (None, None, {"t0": self.t0 if self.t0 is not None else self.started_wall}))
            self._change(job, self.members + [rank], f"{who} replaced")
        return True

    def message(self, job: Any, rank: int, payload: Any) -> None:
        if not isinstance(payload, dict):
            return
        kind = payload.get("kind")
        if kind == "t0":
            self.t0 = float(payload["t0"])
        elif kind == "inject":
            self._execute(job, payload["action"], f"worker:{rank // self.mp}", float(payload.get("for_s") or 0.0),
                          step=payload.get("step"))
        elif kind in ("recover", "join"):
            gen = payload.get("generation")
            who = f"worker:{payload.get('member', rank)}" if kind == "join" else self.cause.get(gen, "group")
            self.record(kind, who,
                        generation=payload.get("generation"), world_size=payload.get("world_size"),
                        step=payload.get("step"), lost_steps=payload.get("lost_steps"), lr_step=payload.get("lr_step"),
                        how=payload.get("digest") and f"params {payload['digest']}")
        elif kind == "leave":
            if rank in self.members and len(self.members) > 1:
                self._change(job, [m for m in self.members if m != rank],
                             f"worker:{rank} left at step {payload.get('step')}")
                self.record("leave", f"worker:{rank}", step=payload.get("step"), generation=self.generation,
                            world_size=len(self.members))
        elif kind == "expelled":
            self.record("expel", f"worker:{payload.get('member', rank)}", how="woke up outside the membership")
        elif kind == "shard_restart":
            self.record("shard_restart", str(payload.get("who", "shard")), lost_updates=payload.get("lost_updates"))

    def tick(self, job: Any) -> None:
        now = time.monotonic()
        for due, action in [r for r in self.resume if r[0] <= now]:
            self.resume.remove((due, action))
            action()
        if self.t0 is not None:
            for e in [e for e in self.pending if self.now() >= e.at_s]:
                self.pending.remove(e)
                self._execute(job, e.action, e.who, e.for_s)
        if self.servers is not None:
            # detect, record, then restart: `detect` is written when the failure is seen and `shard_restart` when
            # the shard serves again, so time to recover is the restart's (one check(restart=True) would return
            # both after the restart); an injected failure's detect_s is inject -> detect, like a worker's (the
            # beat age check() reports is kept only when nothing was injected)
            found = self.servers.check(job.hang_bound_s(self.detect_s), restart=False)   # (widened by load)
            seen = {ev["who"] for ev in found if ev.get("event") == "detect"}
            self._shard_events(found, set())
            if seen and self.elastic:
                self._shard_events(self.servers.check(job.hang_bound_s(self.detect_s)), seen)

    def _shard_events(self, events: list[dict[str, Any]], recorded: set[str]) -> None:
        """Record ServerGroup.check's events (a detect of a shard in `recorded` was written already); a detect
        without elastic recovery, or a failed restart, ends the run."""
        for ev in events:
            ev = dict(ev)
            name, who = ev.pop("event", "shard_restart"), ev.pop("who", "shard")
            ev.pop("time_s", None)
            if name == "detect" and who in recorded:
                continue
            inj, wall = self.injected.pop(who, None), time.time()
            if name == "detect" and inj is not None:
                ev["detect_s"] = round(wall - inj, 6)
            self.record(name, who, wall, **ev)           # (record keeps the schema's fields only)
            if name == "abort" or (name == "detect" and not self.elastic):
                from pslab.collectives.errors import LaunchError
                self.record("abort", who, how=ev.get("how"))
                raise LaunchError(f"{who} failed: {ev.get('how')}")
            if name == "shard_restart" and not ev.get("checkpoint") and not self.cfg.faults.shard_checkpoint_every:
                # nothing to restore (no checkpoint directory): the workers would wait for an init nobody sends;
                # the run ends here, with the reason, instead of train.timeout_s later on another message
                from pslab.collectives.errors import LaunchError
                why = f"{who} died and {NO_SHARD_CHECKPOINT}"
                self.record("abort", who, how=why)
                raise LaunchError(why)

    # ------------------------------------------------------------------ faults
    def _execute(self, job: Any, action: str, who: str, for_s: float, step: int | None = None) -> None:
        kind, _, idx = who.partition(":")
        i = int(idx)
        sig = signal.SIGKILL if action == "kill" else signal.SIGSTOP
        # SIGCONT goes to the process that was stopped, by pid: a hung worker may have a replacement by then (the
        # rank's current process), and the original must still wake up (and find itself let go)
        pid = job.pid(i * self.mp) if kind == "worker" else self._shard_pid(i)   # (a worker's first rank)
        done = pid is not None and _kill(pid, sig)
        cont = (lambda: pid is not None and _kill(pid, signal.SIGCONT))
        self.injected[who] = wall = time.time()
        self.record("inject", who, wall, how=f"{signal.Signals(sig).name}" + (f" for {for_s:g} s" if action == "stop"
                                                                          else ""), step=step,
                    generation=self.generation)
        if done and action == "stop":
            self.resume.append((time.monotonic() + for_s, cont))

    def _shard_pid(self, i: int) -> int | None:
        procs = self.servers.processes
        p = procs[i] if i < len(procs) else None
        return p.pid if p is not None and p.is_alive() else None


def _kill(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
    except OSError:
        return False
    return True
