"""Fixtures for the parameter-server tests: in-process shard servers (real ROUTER sockets on 127.0.0.1, served by
threads) for the protocol-level tests that do not need separate processes; helpers to stop them. Every test runs
with a job secret in the environment (PSLAB_JOB_SECRET), as a worker started by the job's controller would."""

from __future__ import annotations

import threading

import pytest
import torch

from pslab.ps.server import ServerConfig, ShardServer

torch.set_num_threads(1)

SECRET = "5ec7e7" * 8     # the tests' job secret (48 hex digits)


@pytest.fixture(autouse=True)
def job_secret_env():
    with pytest.MonkeyPatch.context() as mp:     # its own: a test's monkeypatch.undo() keeps the secret
        mp.setenv("PSLAB_JOB_SECRET", SECRET)
        mp.delenv("PSLAB_JOB_SECRET_FILE", raising=False)
        yield SECRET


class ThreadServers:
    """`num_shards` ShardServers on 127.0.0.1, each served by a daemon thread."""

    def __init__(self, num_shards: int, **cfg) -> None:
        self.servers = [ShardServer(ServerConfig(shard_id=i, **cfg)) for i in range(num_shards)]
        self.addresses = [s.bind() for s in self.servers]
        self.threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in self.servers]
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        for s in self.servers:
            s._stop = True
        for t in self.threads:
            t.join(5)
            assert not t.is_alive(), "server thread did not stop"


@pytest.fixture
def thread_servers():
    made: list[ThreadServers] = []

    def make(num_shards: int = 1, **cfg) -> ThreadServers:
        cfg.setdefault("request_timeout", 30.0)
        ts = ThreadServers(num_shards, **cfg)
        made.append(ts)
        return ts
    yield make
    for ts in made:
        ts.stop()
