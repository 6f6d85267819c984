"""The one training loop. Every real run — `local`, `allreduce`, every `ps-*`, with any engine — is this function
on every rank; only the objects it is handed differ (see `build.py`):

    mesh      = DeviceMesh(world, dp=D, pp=P, tp=T, cp=C, ep=E)
    replica   = engine.build(model_factory, mesh)        this rank's piece of the model
    strategy.attach(replica)                              ring all-reduce, PS push/pull, or local averaging
    per step t:  forward/backward on batch(w, t) -> straggler padding -> strategy.step -> one record per worker

Worker w = this rank's dp coordinate (`local`: one process plays w = 0..K-1). The ranks of one worker's
model-parallel group (tp × pp) run in lockstep; the rank with pp = tp = 0 writes the worker's records. Times are
seconds since the start barrier. Evaluation (test loss/accuracy every `train.eval_every` updates, and at the end)
runs on the full model: the worker-0 group reassembles it (`parallelism.export.gather_full_state`) when it is split.

Under the run's supervisor (a local launch) the group is elastic: a member that dies or hangs raises
MembershipChanged out of the survivors' waits, and `ElasticMember` (strategies/elastic.py) rebuilds the mesh,
replica and strategy on the next generation and, for allreduce, rolls back to the newest step every member
committed (faults.commit_every); worker ids, batches and part files stay. Injected faults ([faults] events at_step)
are announced to the supervisor at the start of the step; a planned `leave` changes membership at that boundary.

Returns, per rank, what the runner needs for the summary: bytes sent per kind over the training steps (and, under
a [topology], per link class over the same steps: `collectives.topology.link_bytes`) and, from rank 0 of a PS run,
the shards' own staleness series and statistics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from typing import Any, Sequence

import torch

from pslab.collectives import trace
from pslab.collectives.launcher import notify
from pslab.collectives.topology import link_bytes
from pslab.experiments.config import RunConfig, config_from_dict
from pslab.experiments.errors import DIVERGED, DivergedError
from pslab.experiments.results.records import UpdateRecord
from pslab.experiments.results.rundir import JsonlWriter, RunDir
from pslab.experiments.strategies import resume
from pslab.experiments.strategies.elastic import Commits, ElasticMember
from pslab.experiments.stragglers import StragglerModel
from pslab.experiments.workloads import Workload, batch_digest, get_workload


def train_worker(group: Any, cfg_dict: dict[str, Any], run_path: str,
                 addresses: Sequence[Sequence[str]] | None = None, curve_keys_dir: str | None = None,
                 secret: str | None = None, joining: dict[str, Any] | None = None) -> dict[str, Any]:
    """One rank of a run (for `collectives.launch`, or a torchrun/SLURM process); see the module docstring.
    `group` may be a `collectives.elastic.ElasticGroup` (a supervised launch): then membership changes are
    survived as `strategies/elastic.py` says; `joining` = {"t0": ...} for a replacement member."""
    torch.set_num_threads(1)
    return _Worker(group, config_from_dict(cfg_dict), run_path, addresses, curve_keys_dir, secret, joining).run()


class _Worker(ElasticMember):
    """The state of one rank's run; `_build` makes (mesh, replica, strategy, evaluator) for the current group;
    membership changes are `ElasticMember`'s (strategies/elastic.py)."""

    def __init__(self, group: Any, cfg: RunConfig, run_path: str, addresses: Sequence[Sequence[str]] | None,
                 curve_keys_dir: str | None, secret: str | None, joining: dict[str, Any] | None) -> None:
        self.eg = group if hasattr(group, "membership") and hasattr(group, "join") else None   # an ElasticGroup
        self.group = group.group if self.eg is not None else group
        self.member = self.eg.member if self.eg is not None else self.group.rank
        self.cfg, self.run_path, self.addresses = cfg, run_path, addresses
        self.curve_keys_dir, self.secret, self.joining = curve_keys_dir, secret, joining
        self.K = cfg.train.workers
        self.wl = get_workload(cfg.workload.name, self.K, cfg.workload.batch_size, cfg.workload.seed,
                          **cfg.workload.overrides())
        self.rd = RunDir(run_path)
        self.commits: Any = None
        self.strategy: Any = None
        self.ev: Any = None
        self.fired: set[int] = set()                  # injected faults this process has triggered
        faults = cfg.faults.parsed()
        mp = cfg.parallel.model_parallel      # ranks per worker (a split model): worker w's first rank fires
        self.events = [] if joining else [e for e in faults if e.kind == "worker" and e.index * mp == self.member
                                          and e.at_step is not None and e.action != "leave"]
        self.leaves = {e.at_step: e.index for e in faults if e.action == "leave"}   # planned: every member knows

    # -- 1. the layout: D data-parallel workers, each a tp x pp model-parallel group of ranks -----------------
    # -- 2. the engine builds this rank's replica; 3. the sync strategy attaches to it --------------------------
    def _build(self, first: bool) -> None:
        from pslab.parallelism.mesh import DeviceMesh
        from pslab.experiments.strategies.build import make_engine, make_strategy
        cfg = self.cfg
        D = 1 if cfg.strategy.kind == "local" else self.group.world_size // cfg.parallel.model_parallel
        p = cfg.parallel
        self.mesh = DeviceMesh(self.group, dp=D, pp=p.pp, tp=p.tp, cp=p.cp, ep=p.ep)
        if first or not cfg.strategy.uses_ps:       # a PS replica and its client outlive membership changes
            if self.strategy is not None:
                getattr(self.strategy, "close", lambda r: None)(self.replica)
            self.replica = make_engine(cfg, self.wl).build(self.wl.make_model, self.mesh)
            at_size = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, workers=D)) \
                if self.eg is not None and cfg.strategy.kind == "allreduce" else cfg
            self.strategy = make_strategy(at_size, self.mesh, self.addresses, self.curve_keys_dir, self.secret)
            self.strategy.attach(self.replica)
        if self.eg is not None:
            self.workers = [self.member]
        else:
            self.workers = list(range(self.K)) if getattr(self.strategy, "plays_all_workers", False) \
                else [self.mesh.coord("dp")]
        if self.ev is not None:
            self.ev.close()
        self.writer = all(v == 0 for ax, v in self.mesh.coords.items() if ax != "dp")   # one per worker
        out = None
        if self.group.rank == 0:
            path = self.rd.part_path("eval", 0)
            out = JsonlWriter(path) if (self.joining or not first) else _fresh_writer(path)
        self.ev = _Evaluator(self.cfg, self.wl, self.replica, self.mesh, out,
                             getattr(self.strategy, "global_view", None))

    def run(self) -> dict[str, Any]:
        cfg, t = self.cfg, self.cfg.train
        self._build(first=True)
        if cfg.trace.enabled:           # this rank's timeline: RUN_DIR/trace/trace-rank<r>.json (collectives/trace.py)
            coords = " ".join(f"{ax}{v}" for ax, v in self.mesh.coords.items() if self.mesh.size(ax) > 1)
            trace.start(os.path.join(self.run_path, "trace"), f"rank{self.member}", cfg.trace.max_events,
                        role="rank", rank=self.member, coords=dict(self.mesh.coords), label=coords,
                        sizes={ax: self.mesh.size(ax) for ax in self.mesh.coords}, strategy=str(cfg.strategy),
                        schedule=cfg.parallel.schedule, micro_batches=cfg.parallel.micro_batches,
                        virtual_stages=cfg.parallel.virtual_stages)
        path = self.rd.part_path("metrics", self.member)
        self.records = (JsonlWriter(path) if self.joining else _fresh_writer(path)) if self.writer else None
        straggle = StragglerModel(cfg.stragglers, cfg.workload.seed)
        agree = cfg.stragglers.active and cfg.parallel.model_parallel > 1
        elastic_ar = self.eg is not None and cfg.strategy.kind == "allreduce"
        try:
            step = 0
            if self.joining:
                step = self._recover(self.eg.generation, None) or 0
                t0 = float(self.joining["t0"])
            else:
                step = resume.start(cfg, self.run_path, self.replica, self.strategy, self.mesh)   # 0: fresh run
                if elastic_ar:                     # (a joiner gets its first commit from the survivors)
                    self.commits = Commits()
                    self.commits.commit(step, self.replica, self.strategy)
                self.ev.evaluate(step * self.K, 0.0)
                back = self._barrier()
                step = step if back is None else back
                t0 = time.time()
                if self.group.rank == 0:
                    notify({"kind": "t0", "t0": t0})
            self.t0 = t0
            first_step = step                                  # a resumed run or a joiner starts later
            measured: dict[str, int] = {}
            self.link_sent = {"intra": 0, "inter": 0}     # [topology]: bytes per link class, same window as measured
            self.sends: dict[str, int] = {}                # per axis, the sends `measured` was counted in
            self.pipe_busy = self.pipe_span = 0.0            # a pipeline rank's compute and step spans (bubble)
            stale = None if cfg.strategy.uses_ps else 0      # PS: the shard's own series fills it in (records.py)
            while True:
                while step < t.steps:
                    self._inject(step)
                    if step in self.leaves and (self.eg is None or self.leaves[step] in self.eg.membership.members):
                        gen = self._quiesce()            # every member has finished step - 1: nothing in flight
                        if self.leaves[step] == self.member and not self.joining:
                            notify({"kind": "leave", "member": self.member, "step": step})
                            return {"rank": self.member, "left": True, "steps": step}
                        if self.eg is not None:
                            if self.commits is not None:  # a planned change: nothing to roll back
                                self.commits.commit(step, self.replica, self.strategy)
                            step = self._recover(gen, step)
                            continue
                    trace.set_step(step)
                    try:
                        if self.eg is not None:
                            self.eg.check()
                        before, links0 = _traffic(self.mesh), link_bytes(self.group)
                        # -- phase 1: forward + backward on batch(w, step) for the worker(s) this process plays -----
                        tc = time.perf_counter()
                        done = []
                        with self._meter(step - first_step):
                            for w in self.workers:
                                x, y, idx = self.wl.batch(w, step)
                                done.append((w, self.replica.forward_backward(x, y), batch_digest(idx)))
                        trace.complete("forward+backward", "phase" if hasattr(self.replica, "spans") else "compute",
                                       tc, time.perf_counter())   # (a pipeline marks its own F and B spans)
                        compute = (time.perf_counter() - tc) / len(self.workers)  # local's K passes: in parallel
                        if step > first_step:    # (the first step connects and sends the shape headers)
                            self._pipeline_spans()
                        for w, loss, _ in done:
                            if not math.isfinite(loss):
                                raise DivergedError(f"worker {w}'s loss is {loss} at step {step}: {DIVERGED} (try a "
                                                    f"smaller train.lr than {t.lr})")
                        # -- phase 2: straggler padding: the step lasts StragglerModel.step_time(w, t, max(c, base))
                        if agree:   # the worker's tp x pp ranks pad to one deadline: its compute spans the first
                            pre, lpre = _traffic(self.mesh), link_bytes(self.group)   # rank's start to the last
                            start, compute = _span_over(self.mesh.group("mp"), tc, time.perf_counter())   # one's end
                            before = _shift(before, pre, _traffic(self.mesh))   # those 16 bytes are not the step's
                            now = link_bytes(self.group)
                            links0 = {c: v + now[c] - lpre[c] for c, v in links0.items()}
                            tc = start
                        target = max(straggle.step_time(w, step, max(compute, t.base_step_s)) for w in self.workers)
                        left = target - (time.perf_counter() - tc)
                        if left > 0:                 # a PS backup worker with abort polls its clock while it pads
                            with trace.span("straggler pad", "pad", target_s=round(target, 6)):
                                getattr(self.strategy, "pad", time.sleep)(left)
                        # -- phase 3: synchronise and update (all-reduce + optimizer, or push_pull to the shards) ----
                        tw = time.perf_counter()
                        self.strategy.step(self.replica)
                        wait = time.perf_counter() - tw
                        trace.complete("sync + update", "sync", tw, tw + wait)
                    except self._changed() as e:
                        step = self._recover(e.generation, step)
                        continue
                    after = _traffic(self.mesh)
                    for c, v in link_bytes(self.group).items():
                        self.link_sent[c] += v - links0[c]
                    ps_sent, ps_recv = getattr(self.strategy, "last_bytes", (0, 0))
                    ps_link = getattr(self.strategy, "link_class", None)   # [topology]: PS traffic on its link
                    if ps_link is not None:
                        self.link_sent[ps_link] += ps_sent + ps_recv
                    for axis, (sent, _, sends) in after.items():
                        measured[axis] = measured.get(axis, 0) + sent - before[axis][0]
                        self.sends[axis] = self.sends.get(axis, 0) + sends - before[axis][2]
                    if ps_sent or ps_recv:
                        measured["ps"] = measured.get("ps", 0) + ps_sent + ps_recv
                    sent = sum(v[0] for v in after.values()) - sum(v[0] for v in before.values()) + ps_sent
                    recv = sum(v[1] for v in after.values()) - sum(v[1] for v in before.values()) + ps_recv
                    if not all(getattr(g, "observable", True) for _, g in _groups(self.mesh)):
                        sent = recv = None               # a group's bytes are unknown (NCCL, ...): not 0
                    # -- phase 4: one record per worker ----------------------------------------------------------------
                    now = time.time() - t0
                    if self.records is not None:
                        stale = getattr(self.strategy, "staleness", stale)   # local-sgd / diloco: steps alone
                        for w, loss, digest in done:
                            rec = UpdateRecord(w, step, step + 1, now, loss, stale, sent, recv, wait, digest,
                                               dropped=bool(getattr(self.strategy, "dropped", False)))
                            self.records.write(rec.to_json())
                    # -- phase 5: evaluation every eval_every updates (K updates per step) ----------------------------
                    nxt = max(step + 1, getattr(self.strategy, "clock", 0))  # backup-BSP may move a worker past a clock
                    rewind = getattr(self.strategy, "take_rewind", lambda: None)()
                    if rewind is not None:   # a PS shard restarted from its checkpoint: redo the clocks it lost
                        nxt = rewind
                    self.ev.maybe(step * self.K, min(nxt, t.steps) * self.K, now)
                    step = nxt
                    resume.maybe_save(cfg, self.run_path, step, self.replica, self.strategy, self.mesh)
                    if self.commits is not None and step % cfg.faults.commit_every == 0:
                        self.commits.commit(step, self.replica, self.strategy)
                trace.set_step(-1)                           # (the end's barrier is no step's)
                back = self._barrier()                       # everyone has pushed everything
                if back is None or back >= t.steps:
                    break
                step = back                                  # a failure at the end: redo what was rolled back
            return self._finish(measured, min(step, t.steps), min(step, t.steps) - first_step)
        except self._expelled() as e:
            notify({"kind": "expelled", "member": self.member, "why": str(e)})
            return {"rank": self.member, "expelled": True}
        finally:
            trace.stop()
            if self.records is not None:
                self.records.close()
            self.ev.close()
            close = getattr(self.strategy, "close", None)
            if close is not None:
                close(self.replica)
            getattr(self.replica, "close", lambda: None)()

    METERED_STEPS = 3        # the first steps of a process are metered for saved activations (shapes repeat;
                             # a mixture of experts' do not: its routing changes them, so all its steps are)

    def _meter(self, k: int) -> Any:
        """`parallelism.checkpointing.ActivationMeter` around the k-th step of this process (k < METERED_STEPS, or
        every step of an MoE model): the high-water mark of activations saved for backward, in
        self.peak_activations."""
        if k >= self.METERED_STEPS and not self.cfg.workload.name == "text-moe":
            return contextlib.nullcontext()
        from pslab.parallelism.checkpointing import ActivationMeter
        meter = ActivationMeter()

        @contextlib.contextmanager
        def run() -> Any:
            with meter:
                yield
            self.peak_activations = max(getattr(self, "peak_activations", 0), meter.peak)
        return run()

    def _pipeline_spans(self) -> None:
        """A pipeline rank's step: busy = its actions' compute spans, span = its step start to its last action's end
        (results/pipeline.py turns the sums into the measured bubble)."""
        spans = getattr(self.replica, "spans", None)
        if spans:
            self.pipe_busy += sum(e - b for _, b, e in spans)
            self.pipe_span += max(e for _, _, e in spans)

    def _finish(self, measured: dict[str, int], steps: int, ran: int) -> dict[str, Any]:
        """After the last step: PS replicas adopt the shards' final weights; the final evaluation; the shards'
        stats (from the current rank 0). `ran`: the steps this process took, over which `measured` was counted."""
        strategy, replica = self.strategy, self.replica
        pushed = getattr(strategy, "pushed_bytes", None)     # a PS strategy's (a cp rank > 0 pushes nothing: 0)
        out: dict[str, Any] = {"rank": self.member, "bytes_sent": measured, "sends": dict(self.sends),
                               "steps": max(1, ran),
                               "slot_bytes": pushed if pushed is not None
                               else sum(s.param.numel() * s.param.element_size() for s in replica.slots()),
                               "zero_packed_bytes": int(getattr(replica, "packed_bytes", 0)),
                               "peak_activation_bytes": int(getattr(self, "peak_activations", 0)),
                               "coords": dict(self.mesh.coords), "link_bytes": dict(self.link_sent),
                               "unobserved": {axis: g.traffic().get("unobserved_why", "")   # NCCL, ...: no
                                              for axis, g in _groups(self.mesh)            # byte counted
                                              if not g.traffic().get("observed", True)}}
        if self.pipe_span > 0:
            out["pipeline_busy_s"], out["pipeline_span_s"] = self.pipe_busy, self.pipe_span
        moe = _moe_stats(replica)
        if moe and self.mesh.coord("tp") == 0:      # tp ranks route the same tokens as tp rank 0: counted once
            out["moe"] = moe
        if hasattr(strategy, "refresh"):
            strategy.refresh(replica)
            if self.group.rank == 0:
                stats = strategy.shard_stats(series=True)
                out["series"] = stats[0].pop("series", [])
                out["shard_stats"] = stats
        self.ev.evaluate(steps * self.cfg.train.workers, time.time() - self.t0, final=True,
                         changed=self.cfg.strategy.uses_ps)
        self._barrier()
        return out

    def _inject(self, step: int) -> None:
        """Faults of this worker at this step (experiments/faults/spec.py): kill and stop are sent by the supervisor
        (the parent), so a kill is a real SIGKILL; each fires once per process (a rolled-back step does not)."""
        for i, e in enumerate(self.events):
            if e.at_step != step or i in self.fired:
                continue
            self.fired.add(i)
            notify({"kind": "inject", "action": e.action, "who": e.who, "step": step, "for_s": e.for_s,
                    "t": time.time()})
            if e.action == "kill":
                time.sleep(30)           # the supervisor's SIGKILL arrives meanwhile
                os._exit(137)
            if e.action == "stop":
                time.sleep(0.5)          # stopped (SIGSTOP) in here, for for_s


def _fresh_writer(path: Any) -> JsonlWriter:
    """A part file of this run only (a crashed run's leftovers in a reused directory are not appended to)."""
    path.unlink(missing_ok=True)
    return JsonlWriter(path)


class _Evaluator:
    """Test loss/accuracy of the full model; collective over worker 0's model-parallel group when it is split."""

    def __init__(self, cfg: RunConfig, wl: Workload, replica: Any, mesh: Any, out: JsonlWriter | None,
                 view: Any = None) -> None:
        self.every, self.wl, self.replica, self.mesh, self.out = cfg.train.eval_every, wl, replica, mesh, out
        self.split = cfg.parallel.model_parallel > 1 or cfg.parallel.zero == 3
        self.view = view          # the strategy's global_view (local-sgd / diloco: the averaged model, not a copy)
        self.last = -1

    def maybe(self, before: int, after: int, now: float) -> None:
        if after // self.every > before // self.every:
            self.evaluate(after, now)

    def evaluate(self, updates: int, now: float, final: bool = False, changed: bool = False) -> None:
        """Evaluate unless this update count was evaluated already (`changed`: the weights moved since, e.g. the
        PS's final read after every worker finished)."""
        if updates == self.last and not changed:
            return
        if not self.split and self.out is None:     # nothing for this rank to evaluate: not even the view (ps-local
            self.last = updates                     # would read the shards for nothing)
            return
        with self.view(self.replica) if self.view is not None else contextlib.nullcontext():
            model = self._full_model()
            if model is not None and self.out is not None:
                self.out.write({"updates": updates, "time_s": now, **self.wl.evaluate(model)})
        self.last = updates

    def _full_model(self) -> torch.nn.Module | None:
        if not self.split:
            if self.out is None:
                return None
            module = getattr(self.replica, "module", None)
            return module if module is not None else self.replica.stage
        from pslab.parallelism.export import gather_full_state
        state = gather_full_state(self.replica, self.mesh)
        if state is None:
            return None
        model = self.wl.make_model()
        missing, unexpected = model.load_state_dict(state, strict=False)   # parameters only, no buffers
        names = {n for n, _ in model.named_parameters()}
        if unexpected or names & set(missing):
            raise RuntimeError(f"reassembled model does not match the workload's: missing {sorted(names & set(missing))[:4]}"
                               f", unexpected {sorted(unexpected)[:4]}")
        return model

    def close(self) -> None:
        if self.out is not None:
            self.out.close()


def _span_over(group: Any, start: float, end: float) -> tuple[float, float]:
    """(earliest start, latest end − earliest start) over the group, on the host's monotonic clock (perf_counter
    is CLOCK_MONOTONIC, shared by the processes of one host; a model-parallel group lives on one host)."""
    t = torch.tensor([-start, end], dtype=torch.float64)
    group.all_reduce(t, op="max")
    return -float(t[0]), float(t[1] + t[0])


def _shift(before: dict[str, tuple[int, ...]], a: dict[str, tuple[int, ...]],
           b: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """`before` moved by what happened between snapshots a and b (so it is not counted)."""
    return {k: tuple(x + y - z for x, y, z in zip(v, b[k], a[k])) for k, v in before.items()}


def _moe_stats(replica: Any) -> dict[str, dict[str, list[int]]]:
    """Per MoE layer, assignments routed to / dropped by each expert over this process's training forwards (its
    own tokens: summed over ranks they are the run's)."""
    if hasattr(replica, "moe_stats"):
        stats = replica.moe_stats()
    else:
        from pslab.parallelism.moe import moe_layers
        module = getattr(replica, "module", None)
        stats = {n: m.pop_stats() for n, m in moe_layers(module)} if module is not None else {}
    return {n: {k: [int(v) for v in t.tolist()] for k, t in st.items()} for n, st in stats.items()}


def _groups(mesh: Any) -> list[Any]:
    """The distinct process groups of the data, pipeline, context, expert and tensor axes, by axis."""
    seen: dict[int, Any] = {}
    for axis in ("dp", "pp", "cp", "ep", "tp"):
        g = mesh.group(axis)
        if g.world_size > 1 and id(g) not in seen:
            seen[id(g)] = (axis, g)
    return list(seen.values())


def _traffic(mesh: Any) -> dict[str, tuple[int, int, int]]:
    """Per axis, (sent, received) bytes of this rank's group so far, as the backend counted them, and the sends it
    counted them in (zmq: each slice; torch: each op's claim on gloo's connections)."""
    out = {}
    for axis, g in _groups(mesh):
        snap = g.traffic()
        out[axis] = (int(snap["sent_total"]), int(snap["recv_total"]), int(snap["messages"]))
    return out
