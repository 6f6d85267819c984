"""SSP and ASP over real sockets with a deliberately slowed worker (threads as workers, one shard per policy):
every pull's version satisfies the SSP read guarantee and the bound, the fast workers wait under SSP, nobody ever
waits under ASP, and the staleness time series is readable through the client."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from pslab.ps.client import connect

K, CLOCKS, SLOW = 3, 8, 0.03
INIT = {"w": np.zeros(16, np.float32)}


def run(servers) -> tuple[list, list]:
    logs: list = [[] for _ in range(K)]
    errors: list = []
    ready = threading.Event()

    def worker(w: int) -> None:
        try:
            with connect(servers.addresses, w, INIT, timeout=30) as c:
                if w == 0:
                    c.init(INIT).result(30)
                    ready.set()
                ready.wait(30)
                for _ in range(CLOCKS):
                    clock = c.clocks[0]
                    r = c.pull().result(30)
                    logs[w].append((clock, r.versions[0]))
                    if w == K - 1:
                        time.sleep(SLOW)
                    c.push({"w": np.full(16, 1.0, np.float32)}).result(30)
        except BaseException as e:
            errors.append(e)
    ts = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(K)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors
    with connect(servers.addresses, 0, INIT, timeout=30) as c:    # everyone is done: read the final stats
        return logs, c.stats(series=True).result(30)[0]


@pytest.mark.parametrize("s", [0, 2])
@pytest.mark.parametrize("variant", ["ssp", "ssp-agg"])
def test_ssp_bound_over_sockets(thread_servers, s, variant):
    """Both SSP variants hold the read guarantee (every update stamped <= c-s-1 is in a read at clock c) and hold
    the fast workers back. ssp-agg: one version per clock, tau <= s. ssp (Ho et al.): one version per push, the
    read also holds the reader's own c pushes, tau <= (K-1)(2s+1)."""
    servers = thread_servers(1, num_workers=K, policy=f"{variant}:{s}", optimizer="sgd:lr=0.1")
    logs, stats = run(servers)
    for w in range(K):
        for clock, version in logs[w]:
            if variant == "ssp-agg":
                assert version >= clock - s, (w, clock, version)
            else:
                assert version >= clock + (K - 1) * max(clock - s, 0), (w, clock, version)
    waits = stats["stats"]["wait_seconds"]
    assert waits["0"] > 0 and waits["1"] > 0                      # the fast workers were held back
    assert stats["stats"]["max"] <= (s if variant == "ssp-agg" else (K - 1) * (2 * s + 1))
    assert stats["version"] == (CLOCKS if variant == "ssp-agg" else K * CLOCKS)
    assert len(stats["series"]) == K * CLOCKS and all(len(x) == 4 for x in stats["series"])


def test_asp_never_waits_over_sockets(thread_servers):
    servers = thread_servers(1, num_workers=K, policy="asp", optimizer="sgd:lr=0.1")
    logs, stats = run(servers)
    assert stats["stats"]["waits"] == {"0": 0, "1": 0, "2": 0}
    assert all(v == 0 for v in stats["stats"]["wait_seconds"].values())
    assert stats["version"] == K * CLOCKS


def test_backup_workers_over_sockets(thread_servers):
    """bsp-backup:1 with 3 workers, worker 2 slow: every clock commits without waiting for it, its late gradients
    are dropped and counted, its reads move it to the current clock, and tau is always 0."""
    servers = thread_servers(1, num_workers=K, policy="bsp-backup:1", optimizer="sgd:lr=0.1")
    errors: list = []
    statuses: list = [[] for _ in range(K)]
    ready = threading.Event()

    def worker(w: int) -> None:
        try:
            with connect(servers.addresses, w, INIT, timeout=30) as c:
                if w == 0:
                    c.init(INIT).result(30)
                    ready.set()
                ready.wait(30)
                while c.clocks[0] < CLOCKS:
                    r = c.pull().result(30)
                    if r.clocks[0] >= CLOCKS:
                        break
                    if w == K - 1:
                        time.sleep(0.05)
                    statuses[w].append(c.push({"w": np.full(16, 1.0, np.float32)}).result(30)[0]["status"])
        except BaseException as e:
            errors.append(e)
    ts = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(K)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors
    with connect(servers.addresses, 0, INIT, timeout=30) as c:
        st = c.stats().result(30)[0]
    assert st["version"] == CLOCKS and st["committed"] == CLOCKS
    assert st["stats"]["dropped"]["2"] >= 1 and "dropped" in statuses[2]
    assert st["stats"]["histogram"] == {"0": 2 * CLOCKS}          # N = 2 gradients per clock, all fresh
    assert len(statuses[2]) < CLOCKS                               # the straggler skipped clocks
