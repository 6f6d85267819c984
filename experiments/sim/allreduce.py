"""Ring all-reduce BSP in virtual time (the `allreduce` strategy under --simulate).

Each step every worker computes its real gradient on batch(w, t) from the same parameters, taking
StragglerModel.step_time(w, t, compute_s); the ring starts when the slowest is done, and costs the textbook

    T_ring = 2 (N - 1) * (latency + (M / N) / bandwidth)        M = gradient bytes, N = workers

(reduce-scatter then all-gather, N - 1 steps each, one chunk of M/N per step; the inter-host link when the workers
span several hosts). Then every replica applies the averaged gradient with the same torch.optim step as `local`.
Worker w waits max_v c_v - c_w for the slowest; it sends and receives 2 (N - 1)/N * M bytes per step.
`train.target_acc` stops the run at the first evaluation that reaches it; `simulate.timing_only` skips the gradients
and the optimizer (loss null, no evaluations): the times are the same.

`[faults] events` (kill / stop of worker:<w>, at_step or at_s; leave = a planned departure at a step boundary:
the ring is rebuilt there, nothing rolled back; `experiments.sim.faults` has the detection and cost
model): a failure during a step stops that step (its gradients are lost); at detection the survivors roll back to
the last commit (model + optimizer every faults.commit_every completed steps), rebuild the ring and go on with the
N' survivors: their own batches, T_ring at N', the step lr of train.lr_rule at G = N' (`spec.step_lr`). A stop no
longer than faults.detect_s only pauses its worker (the ring waits). Under `replace` a replacement joins at the first
step boundary after t_detect + T_join. Faults triggered at_s while a recovery is under way fire at the next step.
Events go to RUN_DIR/events.jsonl; timing_only simulates them too.

`train.compress` (parallelism/compress.py): every worker runs its own compressor (its own residual, error feedback)
on its own gradient, the K of them in lockstep, and the step applies
their compressed mean — the arithmetic of the real run (`compress.lockstep` drives the K compressors' collectives in
one thread). The step's communication is the compressed payload's: the ring all-reduce above for PowerSGD's factors (and the tensors it leaves whole), a ring
all-gather (K − 1)·(latency + s/bandwidth) for top-k's and sign's s bytes per worker; bytes per rank likewise.
Compression needs the gradients: not with timing_only, nor with faults (config.py says so).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

import torch

from pslab.experiments.config import RunConfig
from pslab.experiments.results.records import UpdateRecord
from pslab.experiments.results.rundir import JsonlWriter, RunDir
from pslab.experiments.faults.events import EventLog
from pslab.experiments.sim import faults as fm
from pslab.experiments.strategies.spec import optimizer_spec, step_lr, torch_optimizer
from pslab.experiments.stragglers import StragglerModel
from pslab.experiments.workloads import compute_grads, get_workload


def ring_time(nbytes: int, n: int, latency: float, bandwidth: float) -> float:
    return 0.0 if n == 1 else 2 * (n - 1) * (latency + nbytes / n / bandwidth)


def simulate_allreduce(cfg: RunConfig, rundir: RunDir, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    return _Ring(cfg, rundir, progress).run()


class _Ring:
    """The all-reduce step loop; `members` are the workers in the ring now (all K without faults)."""

    def __init__(self, cfg: RunConfig, rundir: RunDir, progress: Callable[[int], None] | None) -> None:
        fm.check_supported(cfg)
        t, m = cfg.train, cfg.simulate
        self.cfg, self.rundir, self.progress = cfg, rundir, progress
        self.K, self.timing = t.workers, m.timing_only
        self.wl = get_workload(cfg.workload.name, self.K, cfg.workload.batch_size, cfg.workload.seed,
                          **cfg.workload.overrides())
        self.model = self.wl.make_model()
        self.params = list(self.model.named_parameters())
        self.opt = torch_optimizer(optimizer_spec(t), [p for _, p in self.params])
        self.straggle = StragglerModel(cfg.stragglers, cfg.workload.seed)
        self.nbytes = sum(p.numel() * p.element_size() for _, p in self.params)
        self.multi_host = self.K > m.workers_per_host
        self.lat, self.bw = fm.link(m, self.multi_host)
        self.members = list(range(self.K))
        self.events = cfg.faults.parsed()
        self.policy = cfg.faults.policy(cfg.strategy.kind)
        self.at_step: dict[tuple[int, int], list[int]] = {}
        for i, e in enumerate(self.events):
            if e.at_step is not None:
                self.at_step.setdefault((e.index, e.at_step), []).append(i)
        self.at_s = sorted((e.at_s, i) for i, e in enumerate(self.events) if e.at_s is not None)
        self.joins: list[tuple[float, int, str]] = []        # (time, worker, how): replacements under way
        self.returns: list[tuple[float, int, int]] = []      # (time, worker, event): stopped workers coming back
        self.refilled: set[int] = set()
        self.generation = 0
        self.log: EventLog | None = None
        self.committed: tuple[int, int, Any, Any] | None = None
        self.compressors: list[Any] = []                     # train.compress: one per worker, with its residual
        if t.compress != "none":
            from pslab.parallelism.compress import make_compressor
            self.compressors = [make_compressor(t.compress, t.error_feedback, cfg.workload.seed)
                                for _ in range(self.K)]

    # -- membership ----------------------------------------------------------------------------------------------
    def _resize(self) -> None:
        n = len(self.members)
        self.t_ring = ring_time(self.nbytes, n, self.lat, self.bw)
        self.per_rank = int(round(2 * (n - 1) / n * self.nbytes)) if n else 0
        lr = step_lr(dataclasses.replace(self.cfg.train, workers=max(1, n)))
        for g in self.opt.param_groups:
            g["lr"] = lr

    def _write(self, event: str, time_s: float, who: str, **kw: Any) -> None:
        kw.setdefault("generation", self.generation)
        kw.setdefault("world_size", len(self.members))
        self.log.write(event, time_s, who, **kw)

    def _commit(self, step: int, updates: int) -> None:
        state = None if self.timing else (copy.deepcopy(self.model.state_dict()), copy.deepcopy(self.opt.state_dict()))
        self.committed = (step, updates, state)

    def _rollback(self) -> tuple[int, int]:
        step, updates, state = self.committed
        if state is not None:
            self.model.load_state_dict(state[0])
            self.opt.load_state_dict(state[1])
        return step, updates

    def _boundary(self, now: float) -> None:
        """At a step boundary: stopped workers that came back, replacements that are ready."""
        for back, w, i in sorted(self.returns):
            if back > now:
                continue
            self.returns.remove((back, w, i))
            if self.policy == "replace" and w not in self.refilled:
                self.refilled.add(w)
                self._admit(now, w, "readmitted (back before its replacement joined)")
            else:
                self._write("expel", back, f"worker:{w}", how="back after detection: refused, told to exit")
        for when, w, how in sorted(self.joins):
            if when <= now:
                self.joins.remove((when, w, how))
                if w not in self.refilled:
                    self.refilled.add(w)
                    self._admit(now, w, how)

    def _admit(self, now: float, w: int, how: str) -> None:
        self.members = sorted(self.members + [w])
        self.generation += 1
        self._resize()
        self._write("join", now, f"worker:{w}", how=how + "; parameters from a healthy peer", step=self.step)

    def _leaves(self, now: float) -> float:
        """Planned departures (`leave` at this step): the ring is rebuilt at the boundary (T_ring), nothing is lost;
        returns when the step starts."""
        for w in list(self.members):
            due = self.at_step.get((w, self.step), [])
            for i in [i for i in due if self.events[i].action == "leave"]:
                due.remove(i)
                if w in self.members:
                    self.members = [v for v in self.members if v != w]
                    self.generation += 1
                    self._resize()
                    now += fm.ring_rebuild_s(self.cfg.simulate, self.multi_host)
                    self._write("leave", now, f"worker:{w}", how="planned: ring rebuilt at the step boundary",
                                step=self.step)
        return now

    def _faults_in_step(self, start: float, times: dict[int, float]) -> tuple[float, int, int] | None:
        """Inject this step's faults; returns (time, worker, event) of the first failure, or None (pauses only
        lengthen `times` or the ring, through self.ring_pause)."""
        fired: list[tuple[float, int]] = []
        for w in self.members:
            fired += [(start, i) for i in self.at_step.pop((w, self.step), [])]
        end = start + max(times.values()) + self.t_ring
        while self.at_s and self.at_s[0][0] < end:
            at, i = self.at_s.pop(0)
            fired.append((max(at, start), i))
        detect_s = self.cfg.faults.detect_s
        fired.sort()
        for k, (when, i) in enumerate(fired):
            e = self.events[i]
            if e.index not in self.members:
                continue                                   # already out of the ring
            self._write("inject", when, e.who, how="SIGKILL" if e.action == "kill" else "SIGSTOP", step=self.step)
            if fm.detect_delay(e, detect_s) is not None:
                for _, j in fired[k + 1:]:                 # not reached: they fire when their trigger comes again
                    later = self.events[j]
                    if later.at_s is not None:
                        self.at_s.append((later.at_s, j))
                    else:
                        self.at_step.setdefault((later.index, later.at_step), []).append(j)
                self.at_s.sort()
                return when, e.index, i
            if when < start + times[e.index]:
                times[e.index] += e.for_s                  # a pause: its compute takes for_s longer
            else:
                self.ring_pause += e.for_s                 # paused inside the ring: the ring waits
        return None

    def _fail(self, when: float, w: int, i: int) -> float:
        """The step in progress fails at `when` (worker w): detect, roll back, rebuild; returns the time training
        resumes."""
        e = self.events[i]
        d = fm.detect_delay(e, self.cfg.faults.detect_s)
        t_detect = when + d
        how = "exit code -9" if e.action == "kill" else f"no heartbeat for {self.cfg.faults.detect_s:g} s"
        self._write("detect", t_detect, e.who, how=how, detect_s=d)
        completed = self.step
        self.step, self.updates = self._rollback()
        self.members = [v for v in self.members if v != w]
        self.generation += 1
        self._resize()
        resume = t_detect + fm.ring_rebuild_s(self.cfg.simulate, self.multi_host)
        self._write("recover", resume, e.who, how=f"{self.policy}: ring rebuilt with the survivors, rolled back to "
                    f"the commit", step=self.step, lost_steps=completed - self.step)
        if e.action == "stop":
            self.returns.append((when + e.for_s, w, i))
        if self.policy == "replace":
            self.joins.append((t_detect + fm.join_s(self.cfg.simulate, self.multi_host, self.nbytes), w,
                               "replacement"))
        return resume

    def _compressed(self, results: dict[int, Any]) -> list[torch.Tensor]:
        """Every worker's compressor on its own gradient, the K driven together (compress.lockstep: the collectives
        of parallelism/compress.py, summed in rank order); this step's ring time and bytes per rank are the
        textbook ring all-reduce / all-gather of the compressed payload."""
        from pslab.parallelism.compress import lockstep
        grads = {w: [torch.from_numpy(results[w][1][n]).view_as(p) for n, p in self.params] for w in self.members}
        means, self.per_rank, self.t_ring = lockstep([self.compressors[w].steps(grads[w], len(self.members))
                                                      for w in self.members], self.lat, self.bw)
        return means[0]

    # -- the loop ------------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        self._resize()
        if self.events:
            self.log = EventLog(self.rundir.events_path)
        try:
            with JsonlWriter(self.rundir.metrics_path) as mw, JsonlWriter(self.rundir.eval_path) as ew:
                return self._loop(mw, ew)
        finally:
            if self.log:
                self.log.close()

    def _result(self, now: float, reached: bool) -> dict[str, Any]:
        out = {"virtual_time_s": now, "ring_time_s": self.t_ring, "stopped_at_target": reached,
               **({"timing_only": True} if self.timing else {})}
        if self.log:
            out.update(fault_events=self.log.summary(), world_size_final=len(self.members))
        return out

    def _loop(self, mw: JsonlWriter, ew: JsonlWriter) -> dict[str, Any]:   # noqa: C901
        t, m, wl = self.cfg.train, self.cfg.simulate, self.wl
        now, self.updates, self.step = 0.0, 0, 0
        if not self.timing:
            ev = wl.evaluate(self.model)
            ew.write({"updates": 0, "time_s": 0.0, **ev})
            if t.target_acc is not None and ev["test_acc"] >= t.target_acc:
                return self._result(now, True)
        if self.events:
            self._commit(0, 0)
        while self.step < t.steps:
            if self.events:
                self._boundary(now)
            if self.events:
                now = self._leaves(now)
            if not self.members:
                break                                       # nobody left
            step, K = self.step, len(self.members)
            results, times = {}, {}
            for w in self.members:
                results[w] = (None, None, None) if self.timing else compute_grads(wl, self.model, w, step)
                times[w] = self.straggle.step_time(w, step, m.compute_s)
            self.ring_pause = 0.0
            failure = self._faults_in_step(now, times) if self.events else None
            if failure is not None:
                now = self._fail(*failure)
                continue
            slowest = max(times.values())
            mean = self._compressed(results) if self.compressors else None    # (sets this step's t_ring, bytes)
            now += slowest + self.t_ring + self.ring_pause
            if not self.timing:
                for (_, p) in self.params:
                    p.grad = None
                for i, (n, p) in enumerate(self.params):
                    p.grad = mean[i] if mean is not None else \
                        sum(torch.from_numpy(results[w][1][n]) for w in self.members).view_as(p) / K
                self.opt.step()
            for w in self.members:
                loss, _, digest = results[w]
                mw.write(UpdateRecord(w, step, step + 1, now, loss, 0, self.per_rank, self.per_rank,
                                      slowest - times[w], digest).to_json())
            before, self.updates = self.updates, self.updates + K
            self.step += 1
            if self.progress:
                self.progress(K)
            if self.events and self.step % self.cfg.faults.commit_every == 0:
                self._commit(self.step, self.updates)
            if not self.timing and (self.updates // t.eval_every > before // t.eval_every or self.step == t.steps):
                ev = wl.evaluate(self.model)
                ew.write({"updates": self.updates, "time_s": now, **ev})
                if t.target_acc is not None and ev["test_acc"] >= t.target_acc:
                    return self._result(now, True)
        return self._result(now, False)
