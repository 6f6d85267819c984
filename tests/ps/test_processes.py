"""`start_servers`: slot groups (independent shard sets) under fork and spawn, OptimizerSpec or string, argument
checks, failed start-ups that leave nothing behind, SIGINT ignored / SIGTERM and stop() obeyed."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from pslab.ps.checkpoint import save_checkpoint
from pslab.ps.client import connect
from pslab.ps.errors import ConfigError, PSError
from pslab.ps.optim import OptimizerSpec
from pslab.ps.processes import start_servers
from pslab.ps.server import ServerConfig
from pslab.ps.shard import ShardState

PARAMS = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, dtype=np.float32)}
GRADS = {"w": np.full((2, 3), 0.5, np.float32), "b": np.full(4, -1.0, np.float32)}


def shard_children() -> list[mp.process.BaseProcess]:
    """Live multiprocessing children of this process that are shard servers."""
    return [p for p in mp.active_children() if p.name.startswith("pslab-")]


def step(addresses: list[str], init: dict[str, np.ndarray], pushes: int = 1) -> tuple[dict[str, np.ndarray], list]:
    """Worker 0: init the shards at `addresses`, push GRADS `pushes` times, pull; returns (params, versions)."""
    with connect(addresses, 0, init, timeout=20) as c:
        c.init(init).result(20)
        for _ in range(pushes):
            c.pull().result(20)
            c.push(GRADS).result(20)
        r = c.pull().result(20)
        return r.params, r.versions


@pytest.mark.timeout(30)
@pytest.mark.parametrize("method, shards", [("fork", 2), ("spawn", 1)])    # (a spawned shard imports torch afresh:
def test_slot_groups_are_independent_shard_sets(method, shards):           # ~3 s of CPU each, so one per group)
    with start_servers(shards, num_workers=1, policy="asp", optimizer="sgd:lr=0.5", groups=2, start_method=method,
                       idle_timeout=30) as servers:
        assert [len(g) for g in servers.group_addresses] == [shards, shards]
        assert len(set(servers.addresses)) == 2 * shards
        assert servers.addresses == servers.group_addresses[0] + servers.group_addresses[1]
        assert [p.name for p in servers.processes] == [f"pslab-g{g}-shard-{i}" for g in (0, 1) for i in range(shards)]
        init1 = {k: v + 10 for k, v in PARAMS.items()}
        with connect(servers.group_addresses[1], 0, init1, timeout=20) as c1:
            c1.init(init1).result(20)
            p0, v0 = step(servers.group_addresses[0], PARAMS, pushes=2)      # group 0 moves on ...
            assert v0 == [2] * shards
            np.testing.assert_allclose(p0["w"], PARAMS["w"] - 2 * 0.5 * GRADS["w"])
            r1 = c1.pull().result(20)                                        # ... group 1 does not
            assert r1.versions == [0] * shards
            np.testing.assert_array_equal(r1.params["b"], init1["b"])
            c1.push(GRADS).result(20)
            assert c1.pull().result(20).versions == [1] * shards
        if method == "fork":                      # restart one shard of group 1: a new process, same address
            old, old_pid = servers.group_addresses[1][1], servers.processes[3].pid
            with pytest.raises(PSError, match="shard 1 of slot group 1 is still running"):
                servers.start(1, group=1)
            servers.kill(1, group=1)
            assert not servers.alive(1, group=1) and servers.alive(0, group=1) and servers.alive(1)
            assert servers.start(1, group=1) == servers.group_addresses[1][1] == old
            assert servers.alive(1, group=1) and servers.processes[3].pid != old_pid
    assert not shard_children()


@pytest.mark.timeout(20)
def test_one_group_keeps_the_flat_api(tmp_path):
    with start_servers(2, 1, start_method="fork", checkpoint_dir=str(tmp_path), idle_timeout=30) as servers:
        assert servers.groups == 1 and servers.num_shards == 2
        assert servers.addresses == servers.group_addresses[0] and len(servers.addresses) == 2
        assert [c.checkpoint_dir for c in servers.configs[0]] == [str(tmp_path / f"shard-{i}") for i in (0, 1)]
        assert [p.name for p in servers.processes] == ["pslab-shard-0", "pslab-shard-1"]


@pytest.mark.timeout(20)
def test_ipc_groups_and_checkpoint_dirs(tmp_path):
    servers = start_servers(1, 1, groups=2, transport="ipc", start_method="fork", checkpoint_dir=str(tmp_path),
                            idle_timeout=30)
    try:
        assert all(a.startswith("ipc://") for a in servers.addresses) and len(set(servers.addresses)) == 2
        assert [g[0].checkpoint_dir for g in servers.configs] == [str(tmp_path / f"g{g}-shard-0") for g in (0, 1)]
        tmpdir = Path(servers.addresses[0][len("ipc://"):]).parent
        assert tmpdir.is_dir()
        step(servers.group_addresses[1], PARAMS)
    finally:
        servers.stop()
    assert not tmpdir.exists() and not shard_children()
    servers.stop()                                # idempotent


@pytest.mark.timeout(20)
def test_optimizer_spec_and_its_string_serve_the_same():
    spec = OptimizerSpec("adam", lr=0.1, betas=(0.8, 0.99), staleness_lr=True)
    text = spec.to_string()
    assert text == "adam:lr=0.1,betas=0.8/0.99,staleness_lr=1"
    assert ServerConfig(optimizer=text).optimizer == spec and ServerConfig(optimizer=spec).optimizer is spec
    results = []
    for opt in (spec, text):
        with start_servers(2, 1, "asp", opt, start_method="fork", idle_timeout=30) as servers:
            assert all(c.optimizer == spec for c in servers.configs[0])
            results.append(step(servers.addresses, PARAMS, pushes=3))
    (pa, va), (pb, vb) = results
    assert va == vb == [3, 3]
    for k in PARAMS:
        np.testing.assert_array_equal(pa[k], pb[k])
        assert not np.allclose(pa[k], PARAMS[k])


def test_bad_arguments_raise_config_error_before_starting_anything():
    with pytest.raises(ConfigError, match="start_method must be one of 'spawn', 'fork'; got 'forkserver'"):
        start_servers(start_method="forkserver")
    with pytest.raises(ConfigError, match="transport"):
        start_servers(transport="udp")
    with pytest.raises(ConfigError, match="groups"):
        start_servers(groups=0)
    with pytest.raises(ConfigError, match="bind_host"):
        start_servers(bind_host="tcp://127.0.0.1:5555")
    with pytest.raises(ConfigError, match="unknown optimizer"):
        start_servers(optimizer="rmsprop")
    with pytest.raises(ConfigError, match="curve_keys_dir"):          # beyond loopback without keys
        start_servers(bind_host="0.0.0.0", start_method="fork")
    assert not shard_children()


@pytest.mark.timeout(20)
def test_a_shard_that_fails_to_start_stops_all_the_others(tmp_path):
    """Group 1's shard 1 finds a checkpoint of another shard: a PSError names it; the three good shards are gone."""
    st = ShardState(PARAMS, "sgd:lr=0.1", "asp", num_workers=1, shard_id=0)
    save_checkpoint(tmp_path / "g1-shard-1", *st.state_dict())
    with pytest.raises(PSError, match="shard 1 of slot group 1 failed to start: CheckpointError"):
        start_servers(2, 1, groups=2, start_method="fork", checkpoint_dir=str(tmp_path), idle_timeout=30)
    assert not shard_children()


@pytest.mark.timeout(20)
def test_a_process_that_cannot_be_created_stops_the_started_ones(monkeypatch):
    """os.fork failing for the third shard: that error propagates (not a clean-up error) and shards 0-1 are gone."""
    fork_process = type(mp.get_context("fork").Process())
    real_start, calls = fork_process.start, []

    def start(self):
        calls.append(self.name)
        if len(calls) == 3:
            raise OSError("Resource temporarily unavailable (fork)")
        real_start(self)
    monkeypatch.setattr(fork_process, "start", start)
    with pytest.raises(OSError, match="fork"):
        start_servers(2, 1, groups=2, start_method="fork", idle_timeout=30)
    assert len(calls) == 3 and not shard_children()


@pytest.mark.timeout(20)
def test_an_interrupt_delivered_as_a_start_returns_still_stops_that_shard(monkeypatch):
    """A Ctrl-C held across the start (collectives/forking.py) is raised as start() returns, the shard already
    forked: stop() must know it (a forked shard would otherwise serve on until its idle timeout)."""
    from pslab.collectives import forking
    real_start, started = forking.start, []

    def start(process, method):
        real_start(process, method)
        started.append(process)
        raise KeyboardInterrupt
    monkeypatch.setattr(forking, "start", start)
    with pytest.raises(KeyboardInterrupt):
        start_servers(1, 1, start_method="fork", idle_timeout=30)
    assert len(started) == 1 and started[0].exitcode is not None and not shard_children()


@pytest.mark.timeout(20)
def test_missing_curve_keys_fail_in_the_child_with_a_clear_error(tmp_path):
    with pytest.raises(PSError, match=r"shard 0 of slot group 0 failed to start: RendezvousError: CURVE key file"):
        start_servers(1, 1, start_method="fork", curve_keys_dir=str(tmp_path), idle_timeout=30)
    assert not shard_children()


@pytest.mark.timeout(20)
def test_start_timeout_stops_everything():
    t0 = time.monotonic()
    with pytest.raises(PSError, match=r"did not start within 0.001s"):
        start_servers(2, 1, start_method="spawn", start_timeout=0.001)
    assert not shard_children() and time.monotonic() - t0 < 10


@pytest.mark.timeout(30)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_sigint_is_ignored_sigterm_and_stop_are_not(method):
    servers = start_servers(2, 1, start_method=method, idle_timeout=30)
    try:
        p0, p1 = servers.processes
        os.kill(p0.pid, signal.SIGINT)            # what a Ctrl-C in the terminal sends the whole process group
        os.kill(p1.pid, signal.SIGINT)
        time.sleep(0.3)
        assert servers.alive(0) and servers.alive(1)
        step(servers.addresses, PARAMS)           # and both still serve
        servers.kill(1, signal.SIGTERM)           # SIGTERM: exits at once, cleanly
        assert not servers.alive(1) and p1.exitcode == 0
        t0 = time.monotonic()
        servers.stop()
        # stop() ended it, not the shard's idle timeout (30 s): a bound far from both, not a speed (under CI's CPU
        # hog a spawned shard's exit alone took 3.6 s)
        assert time.monotonic() - t0 < 15 and not servers.alive(0) and p0.exitcode is not None
    finally:
        servers.stop()
    assert not shard_children()
