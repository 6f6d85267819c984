"""A refused push leaves the client and the shards where they were: the same client pulls and pushes on at its clock,
without resync(), under every policy, and the parameters equal those of a run without the refused push.

Kinds of refusal: a non-finite gradient (refused by the one shard; with two shards, refused whole by the client
before any shard sees it, since otherwise one shard would apply its slice of a push the other refused), a wrong
shape or a missing tensor (refused by the client's split before anything is sent), a push larger than a shard's
max_message_bytes (refused by the client: ZeroMQ would drop the connection; the limit is made small here, since a
push's size is fixed by the parameters and a shard too small for them could not even be initialised), and a push
that passes the client but that the shard refuses (a wrong dtype sent past the client's checks: ShapeError from the
shard)."""

from __future__ import annotations

import numpy as np
import pytest

from pslab.ps import connect
from pslab.ps.errors import ConfigError, NonFiniteGradientError, ProtocolError, ShapeError

SHAPES = {"w": (6, 4), "b": (4,)}
POLICIES = ["asp", "bsp", "ssp:2", "bsp-backup:1"]


def _init() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def _grad(step: int, worker: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 * step + worker + 1)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def _bad(kind: str, clients, step: int) -> None:
    """Worker 0's refused push of `kind`; asserts the refusal."""
    c = clients[0]
    if kind == "nan":
        g = _grad(step, 0)
        g["w"][2, 1] = np.nan
        with pytest.raises(NonFiniteGradientError, match="gradient 'w"):
            c.push(g).result(30)
    elif kind == "shape":
        g = _grad(step, 0)
        g["b"] = np.ones(5, np.float32)
        with pytest.raises(ConfigError, match="has shape"):
            c.push(g).result(30)
    elif kind == "missing":
        g = _grad(step, 0)
        del g["w"]
        with pytest.raises(ConfigError, match="is missing"):
            c.push(g).result(30)
    elif kind == "oversize":             # more bytes than a shard accepts in one message (a small limit)
        limits = list(c._max_bytes)
        c._max_bytes = [16] * len(limits)
        try:
            with pytest.raises(ProtocolError, match="exceeds its max_message_bytes"):
                c.push(_grad(step, 0)).result(30)
        finally:
            c._max_bytes = limits
    elif kind == "shard-dtype":          # past the client (its split is bypassed): the shard refuses it
        g = _grad(step, 0)
        per = [({"clock": c.clocks[i], "version": c.versions[i]},
                {k: v.astype(np.float64) for k, v in c._split(g, i).items()}) for i in range(len(c.addresses))]
        with pytest.raises(ShapeError):
            c._all("push", per_shard=per).result(30)
    else:
        raise AssertionError(kind)


def _train(servers, num_workers: int, refuse: str | None, steps: int = 4, at: int = 1) -> dict[str, np.ndarray]:
    """`steps` clocks of pushes by every worker (worker 0's refused push of kind `refuse` before its push of clock
    `at`), a pull after each; returns worker 0's final read."""
    clients = [connect(servers.addresses, w, SHAPES, timeout=30) for w in range(num_workers)]
    try:
        clients[0].init(_init()).result(30)
        for step in range(steps):
            for w, c in enumerate(clients):
                if w == 0 and refuse is not None and step == at:
                    clocks = list(c.clocks)
                    _bad(refuse, clients, step)
                    assert c.clocks == clocks, (refuse, c.clocks, clocks)     # nothing moved
                c.push(_grad(step, w)).result(30)
            for c in clients:
                c.pull().result(30)
        assert [c.clocks for c in clients] == [[steps] * len(servers.addresses)] * num_workers
        return clients[0].pull().result(30).params
    finally:
        for c in clients:
            c.close()


@pytest.mark.parametrize("kind", ["nan", "shape", "missing", "shard-dtype", "oversize"])
@pytest.mark.parametrize("shards", [1, 2])
@pytest.mark.parametrize("policy", POLICIES)
def test_after_a_refused_push_the_client_goes_on_and_nothing_changed(thread_servers, policy, shards, kind):
    cfg = dict(num_workers=2, policy=policy, optimizer="momentum:lr=0.05,momentum=0.9")
    reference = _train(thread_servers(shards, **cfg), 2, None)
    refused = _train(thread_servers(shards, **cfg), 2, kind)
    for k in SHAPES:
        np.testing.assert_array_equal(refused[k], reference[k], err_msg=k)


def test_a_refused_push_with_another_in_flight_leaves_both_sides_agreed(thread_servers):
    """A NaN push and a good one sent behind it before the refusal is known: the good one was stamped one clock too
    far and is refused too (ClockError); after both answers the client's clock is the shard's again."""
    servers = thread_servers(1, num_workers=1, policy="asp", optimizer="sgd:lr=0.1")
    with connect(servers.addresses, 0, SHAPES, timeout=30) as c:
        c.init(_init()).result(30)
        bad = _grad(0, 0)
        bad["b"][0] = np.inf
        f1, f2 = c.push(bad), c.push(_grad(1, 0))
        with pytest.raises(NonFiniteGradientError):
            f1.result(30)
        with pytest.raises(Exception):
            f2.result(30)
        assert c.clocks == [0] and servers.servers[0].state.clocks == [0]
        c.push(_grad(2, 0)).result(30)
        assert c.pull().result(30).clocks == [1] and servers.servers[0].state.version == 1
