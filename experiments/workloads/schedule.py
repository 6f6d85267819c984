"""The per-worker batch schedule: which training examples worker w uses at its step t, for every strategy.

The training set is split once into K disjoint worker shards by a permutation seeded with `seed`
(shard_w = perm[w::K]). Worker w walks through its shard in epochs; epoch e is ordered by a permutation seeded with
(seed, w, e). Step t takes positions [t*b, (t+1)*b) of that endless sequence. So batch(seed, w, t) is a pure
function, and the same (w, t) gives the same examples whether the strategy is local, all-reduce or any PS mode.

The local reference with K "virtual" workers averages the K gradients of batch(w, t), w = 0..K-1, at step t —
exactly the averaged large-batch gradient that BSP computes.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

import numpy as np


class BatchSchedule:
    def __init__(self, n_train: int, workers: int, batch_size: int, seed: int):
        if workers < 1 or batch_size < 1:
            raise ValueError("workers and batch_size must be >= 1")
        self.n_train, self.workers, self.batch_size, self.seed = n_train, workers, batch_size, seed
        perm = np.random.default_rng([seed, 0xDA7A]).permutation(n_train)
        self.shards = [perm[w::workers] for w in range(workers)]
        if min(len(s) for s in self.shards) == 0:
            raise ValueError(f"{workers} workers but only {n_train} training examples")

    @lru_cache(maxsize=4096)
    def _epoch(self, worker: int, epoch: int) -> np.ndarray:
        shard = self.shards[worker]
        return shard[np.random.default_rng([self.seed, worker, epoch]).permutation(len(shard))]

    def indices(self, worker: int, step: int) -> np.ndarray:
        """Training-example indices of worker `worker` at its step `step` (0-based)."""
        if not 0 <= worker < self.workers:
            raise IndexError(f"worker {worker} out of range 0..{self.workers - 1}")
        n = len(self.shards[worker])
        out = []
        pos, end = step * self.batch_size, (step + 1) * self.batch_size
        while pos < end:
            epoch, off = divmod(pos, n)
            take = min(end - pos, n - off)
            out.append(self._epoch(worker, epoch)[off: off + take])
            pos += take
        return np.concatenate(out)


def batch_digest(indices: np.ndarray) -> str:
    """A short fingerprint of a batch, recorded with each update so tests can prove all strategies saw the same data."""
    return hashlib.blake2b(np.ascontiguousarray(indices, dtype=np.int64).tobytes(), digest_size=8).hexdigest()
