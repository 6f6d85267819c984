"""Checkpoints: atomic, checksummed, exact resume; corrupt files are rejected with a clear error; a shard killed
with SIGKILL and restarted resumes from its checkpoint with the checkpointed versions and clocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pslab.ps.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from pslab.ps.admin import connect_admin
from pslab.ps.client import connect
from pslab.ps.errors import AlreadyInitializedError, CheckpointError
from pslab.ps.restore import load_state
from pslab.ps.server import ServerConfig, ShardServer, start_servers
from pslab.ps.shard import ShardState

RNG = np.random.default_rng(3)
INIT = {"w": RNG.standard_normal((6, 4)).astype(np.float32), "b": RNG.standard_normal(4).astype(np.float32)}
GRADS = [{k: RNG.standard_normal(v.shape).astype(np.float32) for k, v in INIT.items()} for _ in range(20)]


def drive(st: ShardState, steps: range, k: int = 1) -> None:
    for i in steps:
        w = i % k
        r = st.read(w, st.clocks[w]) if st.may_read(w, st.clocks[w]) else None
        st.push(w, st.clocks[w], r.version if r else st.version, GRADS[i])


@pytest.mark.parametrize("opt", ["momentum:lr=0.1", "adam:lr=0.01,dc_lambda=0.1,dc_adaptive=1"])
@pytest.mark.parametrize("policy", ["asp", "ssp:2", "bsp"])
def test_round_trip_resumes_exactly(tmp_path, opt, policy):
    """Save mid-run (pending clock buffers, optimizer state, DC backups, stats), load through the validating loader,
    continue: bitwise the uninterrupted run."""
    a = ShardState(INIT, opt, policy, num_workers=2)
    drive(a, range(7), k=2)
    tensors, meta = a.state_dict()
    path = save_checkpoint(tmp_path, tensors, meta)
    b = load_state(path)
    assert (b.version, b.clocks, b.committed_clock) == (a.version, a.clocks, a.committed_clock)
    assert b.stats.histogram() == a.stats.histogram()
    drive(a, range(7, 20), k=2)
    drive(b, range(7, 20), k=2)
    for k in INIT:
        assert torch.equal(a.params[k], b.params[k])


def test_corrupt_checkpoint_is_rejected(tmp_path):
    """A flipped payload byte, a truncation or a bad magic -> CheckpointError; the newest *valid* file is used."""
    st = ShardState(INIT, "sgd:lr=0.1", "asp")
    drive(st, range(3))
    old = save_checkpoint(tmp_path, *st.state_dict())
    drive(st, range(3, 6))
    new = save_checkpoint(tmp_path, *st.state_dict())
    assert list_checkpoints(tmp_path) == [new, old]
    data = bytearray(new.read_bytes())
    data[-5] ^= 0xFF
    new.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum"):
        load_checkpoint(new)
    path, _, meta = latest_checkpoint(tmp_path)
    assert path == old and meta["version"] == 3 and meta["_rejected"][0][0] == str(new)
    new.write_bytes(bytes(data[:100]))
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(new)
    old.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="magic"):
        load_checkpoint(old)
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        ShardServer(ServerConfig(checkpoint_dir=str(tmp_path)))
    assert not list(tmp_path.glob(".*tmp*"))          # no temp files left behind


@pytest.mark.timeout(120)
def test_sigkill_and_restart_resumes_from_checkpoint(tmp_path):
    """Shard with checkpoint_every=5 takes 12 pushes, is SIGKILLed, restarts: version 10, clock 10, the weights of
    the 10-update run; training then continues from there."""
    ref = ShardState(INIT, "momentum:lr=0.1", "asp")
    with start_servers(1, 1, "asp", "momentum:lr=0.1", checkpoint_dir=str(tmp_path), checkpoint_every=5,
                       idle_timeout=60, start_method="fork") as servers:     # (spawn: tests/ps/test_processes.py)
        with connect(servers.addresses, 0, INIT, timeout=20) as c:
            c.init(INIT).result(20)
            for i in range(12):
                c.pull().result(20)
                c.push(GRADS[i]).result(20)
                if i == 9:
                    snap = {k: np.array(v) for k, v in c.pull().result(20).params.items()}
        servers.kill(0)                                  # SIGKILL: no goodbye, no final checkpoint
        assert not servers.alive(0)
        servers.start(0)                                 # same config and checkpoint directory, new process
        with connect(servers.addresses, 0, INIT, timeout=20) as c:
            assert c.registration[0][0]["version"] == 10 and c.clocks == [10]
            with pytest.raises(AlreadyInitializedError, match="restored from"):   # restored state wins
                c.init(INIT).result(20)
            r = c.pull().result(20)
            assert r.versions == [10]
            for k in INIT:
                np.testing.assert_array_equal(r.params[k], snap[k])
            stats = c.stats().result(20)[0]
            assert stats["restored_from"].endswith("ckpt-000000000010.pslab")
            assert stats["stats"]["count"] == 10
            ack = c.push(GRADS[10]).result(20)
            assert ack[0]["version"] == 11
            drive(ref, range(11))
            final = c.pull().result(20).params
            for k in INIT:    # momentum state survived the crash: same as an uninterrupted 11-step run
                np.testing.assert_allclose(final[k], ref.params[k].numpy(), rtol=0, atol=0)


def test_on_demand_checkpoint_and_mismatched_restart(thread_servers, tmp_path):
    """An admin client's checkpoint() writes a verifiable file at the current version; restarting the directory under
    another policy or optimizer is refused with a CheckpointError that says so."""
    servers = thread_servers(1, num_workers=1, policy="asp", optimizer="adam:lr=0.01", checkpoint_dir=str(tmp_path))
    with connect(servers.addresses, 0, INIT, timeout=20) as c, connect_admin(servers.addresses, timeout=20) as admin:
        c.init(INIT).result(20)
        for i in range(3):
            c.pull().result(20)
            c.push(GRADS[i]).result(20)
        path = admin.checkpoint().result(20)[0]["path"]
    tensors, meta = load_checkpoint(path)
    assert meta["version"] == 3 and meta["clocks"] == [3]
    with pytest.raises(CheckpointError, match="policy"):
        ShardServer(ServerConfig(checkpoint_dir=str(tmp_path), policy="bsp", optimizer="adam:lr=0.01"))
    with pytest.raises(CheckpointError, match="optimizer"):
        ShardServer(ServerConfig(checkpoint_dir=str(tmp_path), policy="asp", optimizer="adam:lr=0.02"))
    restored = ShardServer(ServerConfig(checkpoint_dir=str(tmp_path), policy="asp", optimizer="adam:lr=0.01"))
    assert restored.state.version == 3
