"""CommLog records what the backend counted for each op, not a formula: on the zmq backend a small all-reduce is the
direct exchange ((N−1)·S sent), a large one the ring (2(N−1)/N·S, to the rounding of uneven chunks); on gloo a ring
at every size plus its 48-byte message headers; a p2p send is recorded when its wait returns (on gloo a receive
waiting meanwhile may claim the send's bytes: the two records together hold them)."""

from __future__ import annotations

import pytest
import torch

from pslab import collectives
from pslab.parallelism.comm import Comm
from tests.parallelism.par_helpers import gloo_all_reduce_framing

SMALL, LARGE = 1_000, 100_003          # float32 elements: 4 kB (<= 32 KiB) and 400 kB


def _log_worker(group):
    torch.set_num_threads(1)
    comm = Comm(group)
    comm.all_reduce(torch.ones(SMALL), site="small")
    comm.all_reduce(torch.ones(LARGE), site="large")
    nxt, prv = (group.rank + 1) % group.world_size, (group.rank - 1) % group.world_size
    work = comm.isend(torch.ones(SMALL), nxt, tag=3, site="p2p")
    comm.recv(torch.empty(SMALL), prv, tag=3)
    work.wait()
    return [(k, site, payload, wire) for k, site, payload, wire in comm.log.records]


@pytest.mark.parametrize("backend", ["zmq", "torch"])
def test_comm_log_holds_the_backends_count(backend):
    n = 3
    res = collectives.launch(_log_worker, n, backend=backend, timeout=90)
    for records in res:
        by_site: dict[str, float] = {}
        for kind, site, payload, wire in records:
            by_site[site] = by_site.get(site, 0) + wire
        small, large = SMALL * 4, LARGE * 4
        ring = 2 * (n - 1) / n * large
        if backend == "zmq":
            assert by_site["small"] == (n - 1) * small                 # the direct exchange, not 2(N−1)/N·S
            assert abs(by_site["large"] - ring) <= 2 * (n - 1) * 4     # the ring: one element per uneven step
            assert by_site["p2p"] == small
        else:                                                            # gloo: a ring at every size, + framing
            framing = gloo_all_reduce_framing(1, n)
            assert 2 * (n - 1) / n * small < by_site["small"] <= 2 * (n - 1) / n * small + framing + 8
            assert ring < by_site["large"] <= ring + framing + 8
            assert small <= by_site["p2p"] + by_site.get("", 0) <= small + 3 * 48   # a send: S + gloo's headers
