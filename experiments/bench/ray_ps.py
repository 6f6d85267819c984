"""Ray's parameter server, the peer of `pslab bench ps --peers ray`: the pattern of Ray's own documentation.

Ray's docs ("Parameter Server", ray.io examples) build a PS as one actor holding the weights, with an
`apply_gradients` method that runs the optimizer and returns the new weights, and workers as actors that compute a
gradient from the weights they got; the asynchronous variant lets each worker call the PS whenever its gradient is
ready. The benchmark keeps exactly that and drops the model (as `pslab bench ps` does for pslab and torch rpc):

    PS actor       update_and_fetch(grads): params[k] -= lr · grads[k] for every tensor; return params
    worker actor   window(ps, n): n × { weights = ray.get(ps.update_and_fetch.remote(grads)); copy them into the
                   worker's model buffers }  → (t_start, t_end)

Tensors are numpy float32 arrays (Ray's zero-copy path for numpy: arrays above 100 KB go through the plasma object
store, read-only views on the receiving side). The PS actor is single-threaded (max_concurrency = 1), like a lock
around the update, which is what the torch-rpc peer does too. updates/s of a window = K · n / (max end − min start).

Ray runs on this host only (`ray.init(address="local")`, 127.0.0.1, no dashboard, a small object store); its log
lines are kept off the terminal. Optional extra: `pip install -e '.[bench]'`.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np

class RayPS:
    """One Ray session: a PS actor and K worker actors for a model of `shapes`, kept for several windows."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], workers: int, lr: float = 0.01) -> None:
        import ray          # the optional extra: `pslab bench ps` checks it is there before it builds one
        self.ray = ray
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        # Ray's session directory (sockets, logs) in a short private path we remove at close
        self.tmp = tempfile.mkdtemp(prefix="pslab-ray-", dir="/tmp" if os.path.isdir("/tmp") else None)
        ray.init(address="local", num_cpus=max(2, workers + 1), include_dashboard=False, log_to_driver=False,
                 logging_level=logging.ERROR, object_store_memory=256 << 20, _node_ip_address="127.0.0.1",
                 configure_logging=True, _temp_dir=self.tmp)

        @ray.remote(max_concurrency=1)
        class ParameterServer:
            def __init__(self, shapes: dict, lr: float) -> None:
                rng = np.random.default_rng(0)
                self.params = {k: rng.standard_normal(s).astype(np.float32) * 0.01 for k, s in shapes.items()}
                self.lr = lr

            def update_and_fetch(self, grads: dict) -> dict:
                for k, g in grads.items():
                    self.params[k] -= self.lr * g
                return self.params

        @ray.remote
        class Worker:
            def __init__(self, shapes: dict, seed: int) -> None:
                rng = np.random.default_rng(seed)
                self.grads = {k: rng.standard_normal(s).astype(np.float32) * 0.01 for k, s in shapes.items()}
                self.model = {k: np.zeros(s, np.float32) for k, s in shapes.items()}

            def window(self, ps: Any, updates: int) -> tuple[float, float]:
                t0 = time.perf_counter()
                for _ in range(updates):
                    weights = ray.get(ps.update_and_fetch.remote(self.grads))
                    for k, w in weights.items():      # into the model, as a training loop would
                        np.copyto(self.model[k], w)
                return t0, time.perf_counter()

        self.ps = ParameterServer.remote(shapes, lr)
        self.workers = [Worker.remote(shapes, 1 + w) for w in range(workers)]
        ray.get([w.window.remote(self.ps, 10) for w in self.workers])         # warm-up, outside the windows

    def window(self, updates: int) -> float:
        """updates/s over one window in which every worker does `updates` updates at once."""
        spans = self.ray.get([w.window.remote(self.ps, updates) for w in self.workers])
        # perf_counter is CLOCK_MONOTONIC, machine-wide on Linux: the workers' stamps are comparable
        return len(self.workers) * updates / (max(b for _, b in spans) - min(a for a, _ in spans))

    def close(self) -> None:
        try:
            self.ray.shutdown()
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)
