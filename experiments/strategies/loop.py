"""The one training loop. Every real run — `local`, `allreduce`, every `ps-*`, with any engine — is this function
on every rank; only the objects it is handed differ (see `build.py`):

    mesh      = DeviceMesh(world, dp=D, pp=P, tp=T)
    replica   = engine.build(model_factory, mesh)        this rank's piece of the model
    strategy.attach(replica)                              ring all-reduce, PS push/pull, or local averaging
    per step t:  forward/backward on batch(w, t) -> straggler padding -> strategy.step -> one record per worker

Worker w = this rank's dp coordinate (`local`: one process plays w = 0..K-1). The ranks of one worker's
model-parallel group (tp × pp) run in lockstep; the rank with pp = tp = 0 writes the worker's records. Times are
seconds since the start barrier. Evaluation (test loss/accuracy every `train.eval_every` updates, and at the end)
runs on the full model: the worker-0 group reassembles it (`parallelism.export.gather_full_state`) when it is split.

Returns, per rank, what the runner needs for the summary: bytes sent per kind over the training steps and, from
rank 0 of a PS run, the shards' own staleness series and statistics.
"""

from __future__ import annotations

import math
import time
from typing import Any, Sequence

import torch

from experiments.config import RunConfig, config_from_dict
from experiments.errors import DIVERGED, DivergedError
from experiments.results.records import UpdateRecord
from experiments.results.rundir import JsonlWriter, RunDir
from experiments.stragglers import StragglerModel
from experiments.workloads import Workload, batch_digest, get_workload


def train_worker(group: Any, cfg_dict: dict[str, Any], run_path: str,
                 addresses: Sequence[Sequence[str]] | None = None, curve_keys_dir: str | None = None,
                 secret: str | None = None) -> dict[str, Any]:
    """One rank of a run (for `collectives.launch`, or a torchrun/SLURM process); see the module docstring."""
    from parallelism.mesh import DeviceMesh
    from experiments.strategies.build import make_engine, make_strategy
    torch.set_num_threads(1)
    cfg: RunConfig = config_from_dict(cfg_dict)
    t, K = cfg.train, cfg.train.workers
    wl = get_workload(cfg.workload.name, K, cfg.workload.batch_size, cfg.workload.seed)
    # -- 1. the layout: D data-parallel workers, each a tp x pp model-parallel group of ranks ------------------
    D = 1 if cfg.strategy.kind == "local" else K
    mesh = DeviceMesh(group, dp=D, pp=cfg.parallel.pp, tp=cfg.parallel.tp)
    # -- 2. the engine builds this rank's replica; 3. the sync strategy attaches to it --------------------------
    replica = make_engine(cfg, wl).build(wl.make_model, mesh)
    strategy = make_strategy(cfg, mesh, addresses, curve_keys_dir, secret)
    strategy.attach(replica)
    workers = list(range(K)) if getattr(strategy, "plays_all_workers", False) else [mesh.coord("dp")]
    writer = mesh.coord("pp") == 0 and mesh.coord("tp") == 0
    rd = RunDir(run_path)
    records = _fresh_writer(rd.part_path("metrics", group.rank)) if writer else None
    ev = _Evaluator(cfg, wl, replica, mesh, _fresh_writer(rd.part_path("eval", 0)) if group.rank == 0 else None)
    straggle = StragglerModel(cfg.stragglers, cfg.workload.seed)
    agree = cfg.stragglers.active and cfg.parallel.model_parallel > 1
    try:
        ev.evaluate(0, 0.0)
        group.barrier()
        t0 = time.time()
        measured: dict[str, int] = {}
        stale = None if cfg.strategy.uses_ps else 0      # PS: the shard's own series fills it in (records.py)
        step = 0
        while step < t.steps:
            before = _traffic(mesh)
            # -- phase 1: forward + backward on batch(w, step) for the worker(s) this process plays -------------
            tc = time.perf_counter()
            done = []
            for w in workers:
                x, y, idx = wl.batch(w, step)
                done.append((w, replica.forward_backward(x, y), batch_digest(idx)))
            compute = (time.perf_counter() - tc) / len(workers)     # local's K passes would run in parallel
            for w, loss, _ in done:
                if not math.isfinite(loss):
                    raise DivergedError(f"worker {w}'s loss is {loss} at step {step}: {DIVERGED} (try a "
                                        f"smaller train.lr than {t.lr})")
            # -- phase 2: straggler padding: the step lasts StragglerModel.step_time(w, t, max(compute, base)) ---
            if agree:   # the worker's tp x pp ranks pad to one deadline: its compute spans the first rank's start to
                pre = _traffic(mesh)   # the last one's end (per-rank spans would include the peers' padding)
                start, compute = _span_over(mesh.group("mp"), tc, time.perf_counter())
                before = _shift(before, pre, _traffic(mesh))      # those 16 bytes are not the step's traffic
                tc = start
            target = max(straggle.step_time(w, step, max(compute, t.base_step_s)) for w in workers)
            left = target - (time.perf_counter() - tc)
            if left > 0:                 # a PS backup worker with abort polls its clock while it pads
                getattr(strategy, "pad", time.sleep)(left)
            # -- phase 3: synchronise and update (all-reduce + optimizer, or push_pull to the shards) ------------
            tw = time.perf_counter()
            strategy.step(replica)
            wait = time.perf_counter() - tw
            after = _traffic(mesh)
            ps_sent, ps_recv = getattr(strategy, "last_bytes", (0, 0))
            for axis, (sent, _) in after.items():
                measured[axis] = measured.get(axis, 0) + sent - before[axis][0]
            if ps_sent or ps_recv:
                measured["ps"] = measured.get("ps", 0) + ps_sent + ps_recv
            sent = sum(v[0] for v in after.values()) - sum(v[0] for v in before.values()) + ps_sent
            recv = sum(v[1] for v in after.values()) - sum(v[1] for v in before.values()) + ps_recv
            # -- phase 4: one record per worker --------------------------------------------------------------------
            now = time.time() - t0
            if records is not None:
                for w, loss, digest in done:
                    rec = UpdateRecord(w, step, step + 1, now, loss, stale, sent, recv, wait, digest,
                                       dropped=bool(getattr(strategy, "dropped", False)))
                    records.write(rec.to_json())
            # -- phase 5: evaluation every eval_every updates (K updates per step) --------------------------------
            nxt = max(step + 1, getattr(strategy, "clock", 0))    # backup-BSP may move a worker past a clock
            ev.maybe(step * K, min(nxt, t.steps) * K, now)
            step = nxt
        group.barrier()                                  # everyone has pushed everything
        return _finish(cfg, group, mesh, replica, strategy, ev, t0, measured, min(step, t.steps))
    finally:
        if records is not None:
            records.close()
        ev.close()
        close = getattr(strategy, "close", None)
        if close is not None:
            close(replica)
        getattr(replica, "close", lambda: None)()


def _finish(cfg: RunConfig, group: Any, mesh: Any, replica: Any, strategy: Any, ev: "_Evaluator", t0: float,
            measured: dict[str, int], steps: int) -> dict[str, Any]:
    """After the last step: PS replicas adopt the shards' final weights; the final evaluation; the shards' stats."""
    out: dict[str, Any] = {"rank": group.rank, "bytes_sent": measured, "steps": steps,
                           "slot_bytes": getattr(strategy, "pushed_bytes", None)
                           or sum(s.param.numel() * s.param.element_size() for s in replica.slots())}
    if hasattr(strategy, "refresh"):
        strategy.refresh(replica)
        if group.rank == 0:
            stats = strategy.shard_stats(series=True)
            out["series"] = stats[0].pop("series", [])
            out["shard_stats"] = stats
    ev.evaluate(steps * cfg.train.workers, time.time() - t0, final=True, changed=cfg.strategy.uses_ps)
    group.barrier()
    return out


def _fresh_writer(path: Any) -> JsonlWriter:
    """A part file of this run only (a crashed run's leftovers in a reused directory are not appended to)."""
    path.unlink(missing_ok=True)
    return JsonlWriter(path)


class _Evaluator:
    """Test loss/accuracy of the full model; collective over worker 0's model-parallel group when it is split."""

    def __init__(self, cfg: RunConfig, wl: Workload, replica: Any, mesh: Any, out: JsonlWriter | None) -> None:
        self.every, self.wl, self.replica, self.mesh, self.out = cfg.train.eval_every, wl, replica, mesh, out
        self.split = cfg.parallel.model_parallel > 1 or cfg.parallel.zero == 3
        self.last = -1

    def maybe(self, before: int, after: int, now: float) -> None:
        if after // self.every > before // self.every:
            self.evaluate(after, now)

    def evaluate(self, updates: int, now: float, final: bool = False, changed: bool = False) -> None:
        """Evaluate unless this update count was evaluated already (`changed`: the weights moved since, e.g. the
        PS's final read after every worker finished)."""
        if updates == self.last and not changed:
            return
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
        from parallelism.export import gather_full_state
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


def _shift(before: dict[str, tuple[int, int]], a: dict[str, tuple[int, int]],
           b: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """`before` moved by what happened between snapshots a and b (so it is not counted)."""
    return {k: (v[0] + b[k][0] - a[k][0], v[1] + b[k][1] - a[k][1]) for k, v in before.items()}


def _groups(mesh: Any) -> list[Any]:
    """The distinct process groups of the data, pipeline and tensor axes, by axis."""
    seen: dict[int, Any] = {}
    for axis in ("dp", "pp", "tp"):
        g = mesh.group(axis)
        if g.world_size > 1 and id(g) not in seen:
            seen[id(g)] = (axis, g)
    return list(seen.values())


def _traffic(mesh: Any) -> dict[str, tuple[int, int]]:
    """Per axis, (sent, received) payload bytes of this rank's group so far, as the backend counted them."""
    out = {}
    for axis, g in _groups(mesh):
        snap = g.traffic()
        out[axis] = (int(snap["sent_total"]), int(snap["recv_total"]))
    return out
