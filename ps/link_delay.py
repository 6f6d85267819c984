"""An emulated network link between a PS client and its shards, when both run on one machine.

`pslab run` with `[topology]` puts every rank on an emulated host (collectives/topology.py) and the parameter
server's shards on one of them (`topology.shard_host`); a worker's requests to its shards and their replies then
cross that host pair's link class: "intra" (same host) or "inter". Each direction, per (client, shard), is a
`collectives.topology.Link` — the same serialising model the collectives' emulator uses:

    a message of B bytes handed over at t:   start = max(t, busy);  busy = start + B / bandwidth;
                                             delivered at busy + latency

The client applies it on its own side, which is exact for the request-reply pattern of a PS worker: a request is
sent only once its delivery time has come (the shard sees it when a real link would deliver it), and a reply is
handed to the caller only `latency + B / bandwidth` after it arrived (the shard is never held). B is the tensor
payload the message carries, by any path (frames, shared memory, a lane's slot), as `PSClient.wire` counts it.
"""

from __future__ import annotations

import time

from pslab.collectives.topology import Link


class EmulatedLink(Link):
    """A `Link` whose messages the caller waits for (`carry`), with counts of them and of the time they took."""

    def __init__(self, latency_s: float, bandwidth_Bps: float) -> None:
        super().__init__(latency_s, bandwidth_Bps)
        self.messages = 0
        self.delayed_s = 0.0           # total time this link held its messages

    def carry(self, nbytes: int) -> None:
        """Wait until a message of `nbytes` handed over now is delivered."""
        now = time.monotonic()
        due = self.due(nbytes, now)
        self.messages += 1
        self.delayed_s += due - now
        while (left := due - time.monotonic()) > 0:
            time.sleep(left)
