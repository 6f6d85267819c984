"""An emulated network link between a PS client and its shards, when both run on one machine.

`pslab run` with `[topology]` puts every rank on an emulated host (collectives/topology.py) and the parameter
server's shards on one of them (`topology.shard_host`); a worker's requests to its shards and their replies then
cross that host pair's link class: "intra" (same host) or "inter". Each direction is a serialising link with the
same model as collectives/topology.py's, one per (client, shard):

    a message of B bytes handed over at t:   start = max(t, busy);  busy = start + B / bandwidth;
                                             delivered at busy + latency

The client applies it on its own side, which is exact for the request-reply pattern of a PS worker: a request is
sent only once its delivery time has come (the shard sees it when a real link would deliver it), and a reply is
handed to the caller only `latency + B / bandwidth` after it arrived (the shard is never held). B is the tensor
payload the message carries, by any path (frames, shared memory, a lane's slot), as `PSClient.wire` counts it.
"""

from __future__ import annotations

import math
import time


class EmulatedLink:
    """One direction of one link: `latency_s` seconds, `bandwidth_Bps` bytes/s (inf: unlimited)."""

    def __init__(self, latency_s: float, bandwidth_Bps: float) -> None:
        if not (latency_s >= 0 and math.isfinite(latency_s)) or not bandwidth_Bps > 0:
            raise ValueError(f"an emulated link needs latency >= 0 s and bandwidth > 0 B/s, got {latency_s}, "
                             f"{bandwidth_Bps}")
        self.latency_s, self.bandwidth_Bps = float(latency_s), float(bandwidth_Bps)
        self.busy = 0.0
        self.messages = 0
        self.delayed_s = 0.0           # total time this link held its messages

    def due(self, nbytes: int, now: float | None = None) -> float:
        """When a message of `nbytes` handed over now is delivered (and the link's busy time moves on)."""
        now = time.monotonic() if now is None else now
        start = max(now, self.busy)
        self.busy = start + nbytes / self.bandwidth_Bps
        return self.busy + self.latency_s

    def carry(self, nbytes: int) -> None:
        """Wait until a message of `nbytes` handed over now is delivered."""
        now = time.monotonic()
        due = self.due(nbytes, now)
        self.messages += 1
        self.delayed_s += due - now
        while (left := due - time.monotonic()) > 0:
            time.sleep(left)
