"""What every real worker process does the same way, whatever the strategy: build the workload and model from the
config, time its compute, apply the straggler model (sleep so that step t of worker w takes
StragglerModel.step_time(w, t, max(compute, base_step_s)) seconds), and write its metrics part file.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from experiments.config import RunConfig, config_from_dict
from experiments.metrics import JsonlWriter, RunDir
from experiments.stragglers import StragglerModel
from experiments.workloads import Workload, compute_grads, get_workload


class WorkerContext:
    def __init__(self, cfg_dict: dict[str, Any], run_path: str, rank: int):
        torch.set_num_threads(1)
        self.cfg: RunConfig = config_from_dict(cfg_dict)
        self.rank = rank
        self.rundir = RunDir(run_path)
        t = self.cfg.train
        self.wl: Workload = get_workload(self.cfg.workload.name, t.workers, self.cfg.workload.batch_size,
                                         self.cfg.workload.seed)
        self.model = self.wl.make_model()
        self.straggle = StragglerModel(self.cfg.stragglers, self.cfg.workload.seed)
        self.metrics = JsonlWriter(self.rundir.part_path("metrics", rank))
        self.evals = JsonlWriter(self.rundir.part_path("eval", rank)) if rank == 0 else None
        self.t0 = time.time()

    def start_clock(self) -> None:
        """Call right after the start barrier: times are seconds since then, comparable across processes."""
        self.t0 = time.time()

    def now(self) -> float:
        return time.time() - self.t0

    def compute(self, step: int) -> tuple[float, dict, str]:
        """Forward/backward on batch(rank, step), stretched to the straggler model's step time."""
        t = time.perf_counter()
        loss, grads, digest = compute_grads(self.wl, self.model, self.rank, step)
        c = time.perf_counter() - t
        target = self.straggle.step_time(self.rank, step, max(c, self.cfg.train.base_step_s))
        if target > c:
            time.sleep(target - c)
        return loss, grads, digest

    def record(self, **fields: Any) -> None:
        self.metrics.write(fields)

    def maybe_evaluate(self, updates_before: int, updates_after: int, final: bool = False) -> None:
        e = self.cfg.train.eval_every
        if self.evals is not None and (updates_after // e > updates_before // e or final):
            when = 0.0 if updates_after == 0 else self.now()
            self.evals.write({"updates": updates_after, "time_s": when, **self.wl.evaluate(self.model)})

    def close(self) -> None:
        self.metrics.close()
        if self.evals is not None:
            self.evals.close()
