"""Protocol robustness against one shard (real ROUTER socket): every bad request gets an error reply naming the
problem and changes nothing; a push is all-or-nothing; a valid request still works afterwards."""

from __future__ import annotations

import time

import numpy as np
import pytest

from .rawsock import Raw

W = np.arange(6, dtype=np.float32)
B = np.ones(3, dtype=np.float32)


@pytest.fixture
def shard(thread_servers):
    servers = thread_servers(1, num_workers=2, policy="asp", optimizer="sgd:lr=1")
    owner = Raw(servers.addresses[0])
    assert owner.request("register", seq=1, meta={"worker": 0}).op == "ok"
    assert owner.request("init", {"w": W, "b": B}, seq=2, meta={"worker": 0}).meta["initialized"] is True
    yield servers, owner
    owner.close()


def params_of(raw: Raw, seq: int, clock: int = 0):
    r = raw.request("pull", seq=seq, meta={"clock": clock})
    assert r.op == "ok", r.meta
    return {k: np.array(v) for k, v in r.tensors.items()}, r.meta["version"]


@pytest.mark.parametrize("case, tensors, meta, kind", [
    ("unknown key", {"w": W, "b": B, "zz": B}, {"clock": 0, "version": 0}, "UnknownKeyError"),
    ("missing key", {"w": W}, {"clock": 0, "version": 0}, "ProtocolError"),
    ("wrong shape", {"w": W[:5], "b": B}, {"clock": 0, "version": 0}, "ShapeError"),
    ("wrong dtype", {"w": W.astype(np.float64), "b": B}, {"clock": 0, "version": 0}, "ShapeError"),
    ("future version", {"w": W, "b": B}, {"clock": 0, "version": 7}, "ProtocolError"),
    ("wrong clock", {"w": W, "b": B}, {"clock": 3, "version": 0}, "ClockError"),
    ("no clock", {"w": W, "b": B}, {"version": 0}, "ProtocolError"),
    ("bool clock", {"w": W, "b": B}, {"clock": True, "version": 0}, "ProtocolError"),
])
def test_bad_push_is_rejected_and_changes_nothing(shard, case, tensors, meta, kind):
    """Each bad push -> error reply of the right kind; params and version unchanged; a good push then applies."""
    servers, owner = shard
    before, v0 = params_of(owner, 3)
    r = owner.request("push", tensors, seq=4, meta=meta)
    assert r.op == "error" and r.meta["kind"] == kind, (case, r.meta)
    after, v1 = params_of(owner, 5)
    assert v1 == v0 == 0
    for k in before:
        np.testing.assert_array_equal(before[k], after[k])
    ok = owner.request("push", {"w": W, "b": B}, seq=6, meta={"clock": 0, "version": 0})
    assert ok.op == "ok" and ok.meta["version"] == 1


def test_unregistered_and_duplicate_requests(shard):
    """Push from an unregistered connection, a duplicate seq and an out-of-order seq are refused; state unchanged."""
    servers, owner = shard
    stranger = Raw(servers.addresses[0])
    r = stranger.request("push", {"w": W, "b": B}, seq=1, meta={"clock": 0, "version": 0})
    assert r.op == "error" and "unregistered" in r.meta["error"]
    r = stranger.request("register", seq=2, meta={"worker": 9})
    assert r.op == "error" and "worker" in r.meta["error"]
    ok = owner.request("push", {"w": W, "b": B}, seq=10, meta={"clock": 0, "version": 0})
    assert ok.op == "ok"
    dup = owner.request("push", {"w": W, "b": B}, seq=10, meta={"clock": 1, "version": 1})
    assert dup.op == "error" and dup.meta["kind"] == "DuplicateRequestError"
    old = owner.request("push", {"w": W, "b": B}, seq=9, meta={"clock": 1, "version": 1})
    assert old.op == "error" and old.meta["kind"] == "DuplicateRequestError"
    params, version = params_of(owner, 11, clock=1)
    assert version == 1
    np.testing.assert_array_equal(params["w"], W - W)
    stranger.close()


def test_push_before_init_and_malformed_frames(thread_servers):
    """A push before init is refused with NotInitializedError; garbage frames get an error reply (seq 0)."""
    servers = thread_servers(1, num_workers=1)
    raw = Raw(servers.addresses[0])
    raw.request("register", seq=1, meta={"worker": 0})
    r = raw.request("push", {"w": W}, seq=2, meta={"clock": 0, "version": 0})
    assert r.meta["kind"] == "NotInitializedError"
    raw.send_frames([b"\x00garbage"])
    r = raw.recv()
    assert r.op == "error" and r.seq == 0 and "malformed" in r.meta["error"]
    assert servers.servers[0].counters["malformed"] == 1
    raw.close()


def test_gate_timeout_replies_with_a_clear_error(thread_servers):
    """BSP: a pull for clock 1 while worker 1 never pushes gets GateTimeoutError naming worker 1."""
    servers = thread_servers(1, num_workers=2, policy="bsp", request_timeout=0.3)
    raw = Raw(servers.addresses[0])
    raw.request("register", seq=1, meta={"worker": 0})
    raw.request("init", {"w": W}, seq=2, meta={"worker": 0})
    raw.request("pull", seq=3, meta={"clock": 0})
    assert raw.request("push", {"w": W}, seq=4, meta={"clock": 0, "version": 0}).meta["status"] == "buffered"
    r = raw.request("pull", seq=5, meta={"clock": 1}, timeout_ms=5000)
    assert r.op == "error" and r.meta["kind"] == "GateTimeoutError" and "[1]" in r.meta["error"]
    raw.close()


def test_pipelined_pulls_see_consistent_snapshots(thread_servers):
    """Pulls and pushes in flight together (no waiting in between): each pull's weights are exactly those of the
    version it reports, although the server replies zero-copy and updates in place (copy-on-write)."""
    from pslab.ps.client import connect
    servers = thread_servers(2, num_workers=1, policy="asp", optimizer="sgd:lr=1")
    init = {"w": np.zeros(300_000, np.float32), "b": np.zeros(7, np.float32)}
    ones = {"w": np.ones(300_000, np.float32), "b": np.ones(7, np.float32)}
    with connect(servers.addresses, 0, init, timeout=30) as c:
        c.init(init).result(30)
        c.pull().result(30)
        futs = []
        for _ in range(15):
            futs.append(c.push(ones))
            futs.append(c.pull())
        pulls = [f.result(30) for f in futs[1::2]]
        for f in futs[0::2]:
            f.result(30)
    assert [p.versions for p in pulls] == [[i + 1, i + 1] for i in range(15)]
    for p in pulls:
        v = p.versions[0]
        assert (p.params["w"] == -v).all() and (p.params["b"] == -v).all()


def test_client_refuses_a_shard_holding_another_model(thread_servers):
    """Connecting with a model whose partition does not match what an initialised shard holds is a clear error."""
    from pslab.ps.client import connect
    from pslab.ps.errors import ConfigError
    servers = thread_servers(1, num_workers=2)
    with connect(servers.addresses, 0, {"w": W, "b": B}, timeout=10) as c:
        c.init({"w": W, "b": B}).result(10)
    with pytest.raises(ConfigError, match="shard order"):
        connect(servers.addresses, 1, {"w": W, "other": B}, timeout=10)
    connect(servers.addresses, 1, {"w": W, "b": B}, timeout=10).close()


def test_curve_shard_admits_only_clients_with_the_keys(tmp_path):
    """A shard started with CURVE keys serves a client holding them and never answers one without them (the
    refused handshake is an AuthenticationError at connect); a shard cannot bind beyond loopback without keys."""
    import threading

    import numpy as np
    import pytest as _pytest

    from pslab.collectives.curve import generate_keys
    from pslab.ps.client import connect
    from pslab.ps.errors import AuthenticationError, ConfigError
    from pslab.ps.server import ServerConfig, ShardServer
    generate_keys(str(tmp_path))
    with _pytest.raises(ConfigError, match="curve_keys_dir"):
        ServerConfig(bind="tcp://10.1.2.3:0").validate()
    server = ShardServer(ServerConfig(num_workers=2, curve_keys_dir=str(tmp_path)))
    addr = server.bind()
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        shapes = {"w": (3,)}
        with connect([addr], 0, shapes, timeout=10, curve_keys_dir=str(tmp_path)) as c:
            c.init({"w": np.ones(3, np.float32)}).result(10)
            c.push({"w": np.ones(3, np.float32)}).result(10)
            assert c.pull().result(10).versions == [1]
        with _pytest.raises(AuthenticationError, match="refused this client's credential"):
            connect([addr], 1, shapes, timeout=1.5)
        deadline = time.monotonic() + 5          # the unregister is sent without waiting: let the shard count it
        while server.counters["messages"] < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.counters["messages"] == 5          # register, init, push, pull, unregister: the stranger's
        # register never reached the shard
    finally:
        server._stop = True
        t.join(5)


def test_two_curve_shards_in_one_process_and_a_failed_bind_leaves_nothing(tmp_path):
    """Each CURVE shard has its own context (one ZAP authenticator per context), so two run side by side in one
    process; a bind that fails (port in use) raises and leaves no socket or authenticator thread behind."""
    import threading
    import time

    import numpy as np
    import pytest as _pytest

    from pslab.collectives.curve import generate_keys
    from pslab.ps.client import connect
    from pslab.ps.server import ServerConfig, ShardServer
    generate_keys(str(tmp_path))
    servers = [ShardServer(ServerConfig(num_workers=1, curve_keys_dir=str(tmp_path))) for _ in range(2)]
    addrs = [s.bind() for s in servers]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for t in threads:
        t.start()
    try:
        for a in addrs:
            with connect([a], 0, {"w": (2,)}, timeout=10, curve_keys_dir=str(tmp_path)) as c:
                c.init({"w": np.zeros(2, np.float32)}).result(10)
                assert c.ping().result(10)[0]["shard"] == 0
        before = threading.active_count()
        taken = ShardServer(ServerConfig(bind=addrs[0], curve_keys_dir=str(tmp_path)))
        from pslab.ps.errors import ConfigError
        with _pytest.raises(ConfigError, match="Address already in use"):
            taken.bind()
        deadline = time.monotonic() + 5
        while threading.active_count() > before and time.monotonic() < deadline:
            time.sleep(0.02)
        assert threading.active_count() <= before
    finally:
        for s in servers:
            s._stop = True
        for t in threads:
            t.join(5)
