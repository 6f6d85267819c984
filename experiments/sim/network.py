"""Virtual-time models of the simulator: where workers live and how long a message takes.

Placement: shards live on host 0; worker w lives on host w // workers_per_host. A message between a worker and a
shard on the same host uses the intra-host link, otherwise the inter-host link.

Transfer time of n bytes:   t = latency + n / bandwidth

Each shard has one link per direction (in: pushes and read requests, out: read replies) that carries one message
at a time, FIFO: a message starts when both it is sent and the link is free. So K workers pulling a model of P bytes
from one shard take ~K*P/bandwidth — the parameter server's well-known bottleneck at the root — while more shards
divide it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pslab.experiments.config import SimulateConfig

HEADER_BYTES = 256  # msgpack header + descriptors, roughly, per message


@dataclass
class Link:
    free_at: float = 0.0
    bytes: int = 0

    def send(self, now: float, nbytes: int, latency: float, bandwidth: float) -> float:
        """Occupy the link for nbytes/bandwidth starting when it is free; return the arrival time."""
        return self.occupy(now, nbytes, nbytes / bandwidth) + latency

    def occupy(self, now: float, nbytes: int, duration: float) -> float:
        """Hold the link for `duration` seconds from when it is free; return when it is free again. (The
        timing-only simulator inlines these three lines in its event loop: keep them in step.)"""
        start = max(now, self.free_at)
        self.free_at = start + duration
        self.bytes += nbytes
        return self.free_at


class Network:
    def __init__(self, cfg: SimulateConfig, num_shards: int):
        self.cfg = cfg
        self.links_in = [Link() for _ in range(num_shards)]
        self.links_out = [Link() for _ in range(num_shards)]

    def host(self, worker: int) -> int:
        return worker // self.cfg.workers_per_host

    def _lb(self, worker: int) -> tuple[float, float]:
        if self.host(worker) == 0:
            return self.cfg.latency_intra_s, self.cfg.bandwidth_intra_Bps
        return self.cfg.latency_inter_s, self.cfg.bandwidth_inter_Bps

    def route(self, worker: int, nbytes: int) -> tuple[int, float, float]:
        """(bytes on the wire, seconds on the link, latency) of an nbytes-payload message between `worker` and a
        shard: what `to_shard` / `from_shard` charge, for callers that precompute it."""
        lat, bw = self._lb(worker)
        n = nbytes + HEADER_BYTES
        return n, n / bw, lat

    def to_shard(self, now: float, worker: int, shard: int, nbytes: int) -> float:
        lat, bw = self._lb(worker)
        return self.links_in[shard].send(now, nbytes + HEADER_BYTES, lat, bw)

    def from_shard(self, now: float, worker: int, shard: int, nbytes: int) -> float:
        lat, bw = self._lb(worker)
        return self.links_out[shard].send(now, nbytes + HEADER_BYTES, lat, bw)
