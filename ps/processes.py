"""Shard servers as processes: `start_servers` spawns one `ShardServer` process per shard on 127.0.0.1 (tcp, free
port) or ipc://, waits until each is bound, and returns a `ServerGroup` (addresses, kill/restart one shard, stop all).
Every server process sets torch.set_num_threads(1); SIGTERM ends it at once; `idle_timeout` ends an orphan.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError, PSError
from .server import ServerConfig, ShardServer


def _server_main(cfg: dict[str, Any], conn: Any) -> None:
    import torch
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    try:
        server = ShardServer(ServerConfig(**cfg))
        conn.send(("ok", server.bind()))
    except Exception as e:  # report start-up errors (bad checkpoint, port in use) to the parent
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.close()
    server.serve_forever()


@dataclass
class ServerGroup:
    """Shard server processes started by `start_servers`; use as a context manager or call `stop()`."""

    configs: list[ServerConfig]
    processes: list[Any] = field(default_factory=list)
    addresses: list[str] = field(default_factory=list)
    start_timeout: float = 60.0
    _tmpdir: str | None = None

    def start(self, shard: int) -> str:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_server_main, args=(asdict(self.configs[shard]), child), daemon=True,
                        name=f"pslab-shard-{shard}")
        p.start()
        child.close()
        if not parent.poll(self.start_timeout):
            p.kill()
            raise PSError(f"shard {shard} did not start within {self.start_timeout:g}s")
        try:
            status, info = parent.recv()
        except EOFError:
            status, info = "error", f"the process exited during start-up (exit code {p.exitcode})"
        parent.close()
        if status != "ok":
            p.join(5)
            raise PSError(f"shard {shard} failed to start: {info}")
        while len(self.processes) <= shard:
            self.processes.append(None)
            self.addresses.append("")
        self.processes[shard], self.addresses[shard] = p, info
        return info

    def kill(self, shard: int, sig: int = signal.SIGKILL) -> None:
        p = self.processes[shard]
        if p is not None and p.is_alive():
            os.kill(p.pid, sig)
            p.join(10)

    def alive(self, shard: int) -> bool:
        p = self.processes[shard]
        return p is not None and p.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        for p in self.processes:
            if p is not None and p.is_alive():
                p.terminate()
        deadline = time.monotonic() + timeout
        for p in self.processes:
            if p is not None:
                p.join(max(0.1, deadline - time.monotonic()))
                if p.is_alive():
                    p.kill()
                    p.join(5)
        if self._tmpdir:
            for f in Path(self._tmpdir).glob("*"):
                f.unlink(missing_ok=True)
            os.rmdir(self._tmpdir)
            self._tmpdir = None

    def __enter__(self) -> "ServerGroup":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start_servers(num_shards: int = 1, num_workers: int = 1, policy: str = "asp", optimizer: str = "sgd:lr=0.01",
                  *, transport: str = "tcp", checkpoint_dir: str | None = None, checkpoint_every: int = 0,
                  request_timeout: float = 120.0, idle_timeout: float = 600.0,
                  start_timeout: float = 60.0) -> ServerGroup:
    """Spawn one server process per shard on 127.0.0.1 (tcp) or ipc:// and return them with their addresses.

    `checkpoint_dir` gets one sub-directory per shard (shard-<i>). `idle_timeout` makes orphaned servers exit.
    """
    if transport not in ("tcp", "ipc"):
        raise ConfigError(f"transport must be 'tcp' or 'ipc', got {transport!r}")
    tmp = tempfile.mkdtemp(prefix="pslab-ps-") if transport == "ipc" else None
    configs = []
    for i in range(num_shards):
        bind = f"ipc://{tmp}/shard-{i}-{uuid.uuid4().hex[:6]}" if tmp else "tcp://127.0.0.1:0"
        ck = str(Path(checkpoint_dir) / f"shard-{i}") if checkpoint_dir else None
        configs.append(ServerConfig(bind=bind, shard_id=i, num_workers=num_workers, policy=str(policy),
                                    optimizer=_opt_str(optimizer), checkpoint_dir=ck, checkpoint_every=checkpoint_every,
                                    request_timeout=request_timeout, idle_timeout=idle_timeout))
    for c in configs:
        c.validate()
    group = ServerGroup(configs, start_timeout=start_timeout, _tmpdir=tmp)
    try:
        for i in range(num_shards):
            group.start(i)
    except BaseException:
        group.stop()
        raise
    return group


def _opt_str(optimizer: Any) -> str:
    """OptimizerSpec (or string) -> its string form (kept for callers of the early API; see OptimizerSpec.to_string)."""
    from .optim import OptimizerSpec
    return optimizer.to_string() if isinstance(optimizer, OptimizerSpec) else str(optimizer)
