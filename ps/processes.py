"""Shard servers as processes: `start_servers` is the one way to start them, for a plain run (one shard set) and for
the parallelism engines (one shard set per *slot group*: pipeline stage x tensor-parallel coordinate).

    with start_servers(num_shards=2, num_workers=4, policy="bsp", optimizer="sgd:lr=0.1") as servers:
        client = connect(servers.addresses, worker=w, params=...)            # one shard set

    with start_servers(1, num_workers=dp, policy="bsp", groups=pp * tp, start_method="fork") as servers:
        client = connect(servers.group_addresses[g], worker=dp_rank, ...)    # slot group g's shards

Every process is started first and then all are awaited (start-up runs in parallel; forked shards start in
milliseconds, spawned ones import torch afresh). If any shard fails or is late, everything started is stopped and a
PSError names the shard and its slot group. A server process ignores SIGINT (its parent stops it, so a Ctrl-C in the
terminal prints no tracebacks from shards), exits at once on SIGTERM, runs torch with one thread, and exits by itself
after `idle_timeout` seconds without a message (so an orphan does not linger).

Authentication: the shards admit only holders of the job's secret (ps.admission). `start_servers(secret=...)` uses
the given one, else PSLAB_JOB_SECRET / PSLAB_JOB_SECRET_FILE, else makes a new one. Nothing is
written to the environment: a client in this process finds the secret by the shards' addresses
(`admission.secret_for`), other processes are handed `ServerGroup.secret` (the launcher passes it to the ranks it
starts); `ServerGroup.admin()` connects as "admin".
The secret reaches the shard processes through their start-up arguments, never through a store or a file.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collectives import cleanup

from .admission import check_secret, forget_secret, job_secret, new_job_secret, remember_secret
from .errors import ConfigError, PSError
from .optim import OptimizerSpec, optimizer_from_string
from .server import ServerConfig, ShardServer

START_METHODS = ("spawn", "fork")
TRANSPORTS = ("tcp", "ipc")


def _warm_up_torch_optim() -> None:
    """Do the lazy imports the first torch.optim optimizer triggers (torch._dynamo, ~1 s, once per process): in the
    parent before forking (every forked shard inherits them) and in a shard right after it reports ready (so its
    first `init` does not pay for them)."""
    import torch
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def _server_main(config: ServerConfig, conn: Any, sweep_dir: str | None = None) -> None:
    """A shard server process: report ("ok", address) or ("error", why) through `conn`, then serve until stopped.
    Its shared-memory segments are noted in `sweep_dir`, which the ServerGroup sweeps when it stops the shard."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)            # the parent stops us (SIGTERM); Ctrl-C is for the parent
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))   # no cleanup needed here: the parent sweeps sweep_dir
    if sweep_dir:
        os.environ[cleanup.ENV] = sweep_dir
    import torch
    torch.set_num_threads(1)
    server: ShardServer | None = None
    try:
        server = ShardServer(config)
        reply = ("ok", server.bind())
    except Exception as e:  # start-up errors (bad checkpoint, address in use, missing keys) go to the parent
        server, reply = None, ("error", f"{type(e).__name__}: {e}")
    try:
        conn.send(reply)
        conn.close()
    except OSError:         # the parent is gone: nobody will connect
        return
    if server is not None:
        _warm_up_torch_optim()
        server.serve_forever()


def _label(group: int, shard: int) -> str:
    return f"shard {shard} of slot group {group}"


@dataclass
class ServerGroup:
    """Shard server processes started by `start_servers`; use as a context manager or call `stop()`.

    `configs[g][i]` is slot group g's shard i. `group_addresses[g]` lists group g's shard addresses in shard order
    (what `ps.connect` takes). `addresses` is the flat list: with one group, that group's addresses; with several,
    every shard in group-major order (group g's shard i at index g * num_shards + i).
    """

    configs: list[list[ServerConfig]]
    start_method: str = "spawn"
    start_timeout: float = 60.0
    secret: str | None = field(default=None, repr=False)     # the job secret every shard admits
    group_addresses: list[list[str]] = field(default_factory=list, init=False)
    _procs: list[list[Any]] = field(default_factory=list, init=False, repr=False)
    _tmpdir: str | None = None
    _sweep: str | None = field(default=None, init=False, repr=False)   # where the shards note their shm segments

    def __post_init__(self) -> None:
        self._sweep = cleanup.make_dir("pslab-ps-sweep-")
        self.group_addresses = [["" for _ in g] for g in self.configs]
        self._procs = [[None for _ in g] for g in self.configs]

    @property
    def groups(self) -> int:
        """Number of slot groups (independent shard sets)."""
        return len(self.configs)

    @property
    def num_shards(self) -> int:
        """Shards per slot group."""
        return len(self.configs[0]) if self.configs else 0

    @property
    def addresses(self) -> list[str]:
        """All shard addresses, group-major; with one group exactly `group_addresses[0]`."""
        return [a for g in self.group_addresses for a in g]

    @property
    def processes(self) -> list[Any]:
        """The shard processes (multiprocessing.Process, or None if never started), group-major like `addresses`."""
        return [p for g in self._procs for p in g]

    # ------------------------------------------------------------------ one shard
    def start(self, shard: int, group: int = 0) -> str:
        """(Re)start one shard with its config and wait for it; returns its (new) address. A shard with a checkpoint
        directory resumes from its latest checkpoint. Raises PSError if it is still running or fails to start."""
        p = self._procs[group][shard]
        if p is not None and p.is_alive():
            raise PSError(f"{_label(group, shard)} is still running (pid {p.pid}); kill(shard) it before starting "
                          "it again")
        self._await({self._launch(group, shard): (group, shard)})
        return self.group_addresses[group][shard]

    def kill(self, shard: int, sig: int = signal.SIGKILL, *, group: int = 0, timeout: float = 10.0) -> None:
        """Send `sig` (default SIGKILL: no goodbye, no final checkpoint) to one shard and wait up to `timeout` s for
        it to exit. The server ignores SIGINT, so kill(shard, signal.SIGINT) returns after `timeout`, shard alive."""
        p = self._procs[group][shard]
        if p is not None and p.is_alive():
            os.kill(p.pid, sig)
            p.join(timeout)

    def alive(self, shard: int, group: int = 0) -> bool:
        """Whether slot group `group`'s shard `shard` has a running process."""
        p = self._procs[group][shard]
        return p is not None and p.is_alive()

    # ------------------------------------------------------------------ all
    def stop(self, timeout: float = 5.0) -> None:
        """Stop every shard (SIGTERM, then SIGKILL after `timeout` s) and remove the ipc temp directory. Idempotent."""
        try:
            procs = [p for p in self.processes if p is not None]
            for p in procs:
                if p.is_alive():
                    p.terminate()
            deadline = time.monotonic() + timeout
            for p in procs:
                p.join(max(0.1, deadline - time.monotonic()))
                if p.is_alive():
                    p.kill()
                    p.join(5)
        finally:
            forget_secret(a for g in self.group_addresses for a in g)
            cleanup.sweep(self._sweep)          # segments of shards that died without unlinking them
            if self._tmpdir:
                shutil.rmtree(self._tmpdir, ignore_errors=True)
                self._tmpdir = None

    def admin(self, group: int = 0, params: Any = None, timeout: float = 60.0) -> Any:
        """A client of slot group `group`'s shards as the job's admin (init, stats, checkpoint, shutdown)."""
        from .admin import connect_admin
        return connect_admin(self.group_addresses[group], params, secret=self.secret, timeout=timeout,
                             curve_keys_dir=self.configs[group][0].curve_keys_dir)

    def __enter__(self) -> "ServerGroup":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------ internals
    def _launch(self, group: int, shard: int) -> Any:
        """Start one shard's process (without waiting); returns the read end of its start-up pipe."""
        if self.start_method == "fork":
            _warm_up_torch_optim()
        ctx = mp.get_context(self.start_method)
        parent, child = ctx.Pipe(duplex=False)
        name = f"pslab-shard-{shard}" if self.groups == 1 else f"pslab-g{group}-shard-{shard}"
        p = ctx.Process(target=_server_main, args=(self.configs[group][shard], child, self._sweep), daemon=True,
                        name=name)
        self.group_addresses[group][shard] = ""
        try:
            p.start()
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()   # now only the child holds the write end: its exit reads as EOF here
        self._procs[group][shard] = p       # only started processes: stop() joins every one of them
        return parent

    def _await(self, pending: dict[Any, tuple[int, int]]) -> None:
        """Wait for every pending start-up pipe ({conn: (group, shard)}), in whatever order they answer; raise
        PSError for the first failure or at `start_timeout`. Failed shards' processes are reaped; the caller stops
        the rest."""
        deadline = time.monotonic() + self.start_timeout
        try:
            while pending:
                ready = mp.connection.wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
                if not ready:
                    g, i = min(pending.values())
                    more = f" (and {len(pending) - 1} more)" if len(pending) > 1 else ""
                    self._reap(g, i)
                    raise PSError(f"{_label(g, i)}{more} did not start within {self.start_timeout:g}s; raise "
                                  "start_timeout if the machine is busy, or use start_method='fork'")
                for conn in ready:
                    g, i = pending.pop(conn)
                    try:
                        status, info = conn.recv()
                    except EOFError:
                        p = self._procs[g][i]
                        p.join(2)
                        status, info = "error", f"the process exited during start-up (exit code {p.exitcode})"
                    finally:
                        conn.close()
                    if status != "ok":
                        self._reap(g, i)
                        raise PSError(f"{_label(g, i)} failed to start: {info}")
                    self.group_addresses[g][i] = info
        finally:
            for conn in pending:
                conn.close()

    def _reap(self, group: int, shard: int) -> None:
        p = self._procs[group][shard]
        if p is not None:
            if p.is_alive():
                p.kill()
            p.join(5)


def _bind(transport: str, bind_host: str, tmpdir: str | None, tag: str) -> str:
    if transport == "ipc":
        return f"ipc://{tmpdir}/{tag}-{uuid.uuid4().hex[:6]}"
    return f"tcp://{bind_host}:0"


def start_servers(num_shards: int = 1, num_workers: int = 1, policy: str = "asp",
                  optimizer: OptimizerSpec | str = "sgd:lr=0.01", *, groups: int = 1, start_method: str = "spawn",
                  bind_host: str = "127.0.0.1", curve_keys_dir: str | None = None, transport: str = "tcp",
                  checkpoint_dir: str | None = None, checkpoint_every: int = 0, request_timeout: float = 120.0,
                  idle_timeout: float = 600.0, start_timeout: float = 60.0, secret: str | None = None,
                  nonfinite: str = "reject") -> ServerGroup:
    """Start `groups` independent shard sets of `num_shards` shard processes each, every shard serving
    `num_workers` workers under `policy` with `optimizer` (an OptimizerSpec or its string form), and wait until all
    are bound. Returns a `ServerGroup`: `.addresses` (one group: its shards in shard order), `.group_addresses[g]`.

    `start_method`: "spawn" (default; safe in any parent) or "fork" (milliseconds; the parent must not hold locks
    or threads the child would need). `transport`: "tcp" on `bind_host` (a host name or IPv4 address; a free port
    per shard) or "ipc" (sockets in a temp directory removed by stop()). Binding beyond loopback needs
    `curve_keys_dir` (CURVE encryption and authentication; see ServerConfig.validate). `checkpoint_dir` gets one
    sub-directory per shard: shard-<i>, or g<g>-shard-<i> with several groups. `idle_timeout` makes orphaned servers
    exit; `start_timeout` bounds the whole start-up. `secret`: the job secret the shards admit (default: the
    environment's, else a new one; a client in this process finds it by the shards' addresses, other processes get
    it from ServerGroup.secret; see the module docstring). `nonfinite`: "reject"
    (default) or "skip" a push holding NaN/Inf. Raises ConfigError for bad arguments (before starting anything)
    and PSError if a shard fails to start (after stopping every shard that did).
    """
    if start_method not in START_METHODS:
        raise ConfigError(f"start_method must be one of {', '.join(map(repr, START_METHODS))}; got {start_method!r}")
    if transport not in TRANSPORTS:
        raise ConfigError(f"transport must be one of {', '.join(map(repr, TRANSPORTS))}; got {transport!r}")
    if not (isinstance(num_shards, int) and num_shards >= 1 and isinstance(groups, int) and groups >= 1):
        raise ConfigError(f"num_shards and groups must be integers >= 1; got num_shards={num_shards!r}, "
                          f"groups={groups!r}")
    if transport == "tcp" and (not bind_host or any(c in bind_host for c in ":/ ")):
        raise ConfigError(f"bind_host must be a host name or IPv4 address without scheme or port (e.g. 127.0.0.1 or "
                          f"0.0.0.0); got {bind_host!r}")
    if start_timeout <= 0:
        raise ConfigError(f"start_timeout must be > 0 seconds; got {start_timeout!r}")
    spec = optimizer_from_string(optimizer)        # parsed once; every shard's config holds this (frozen) spec
    secret = check_secret(secret if secret is not None else job_secret() or new_job_secret())
    tmp = tempfile.mkdtemp(prefix="pslab-ps-") if transport == "ipc" else None
    try:
        configs = []
        for g in range(groups):
            row = []
            for i in range(num_shards):
                tag = f"shard-{i}" if groups == 1 else f"g{g}-shard-{i}"
                cfg = ServerConfig(bind=_bind(transport, bind_host, tmp, tag), shard_id=i, num_workers=num_workers,
                                   policy=str(policy), optimizer=spec,
                                   checkpoint_dir=str(Path(checkpoint_dir) / tag) if checkpoint_dir else None,
                                   checkpoint_every=checkpoint_every, request_timeout=request_timeout,
                                   idle_timeout=idle_timeout, curve_keys_dir=curve_keys_dir, secret=secret,
                                   nonfinite=nonfinite)
                cfg.validate()
                row.append(cfg)
            configs.append(row)
    except BaseException:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    servers = ServerGroup(configs, start_method=start_method, start_timeout=start_timeout, secret=secret, _tmpdir=tmp)
    try:
        pending = {}
        for g in range(groups):
            for i in range(num_shards):
                pending[servers._launch(g, i)] = (g, i)
        servers._await(pending)
        remember_secret((a for g in servers.group_addresses for a in g), secret)
    except BaseException:
        for conn in pending:
            conn.close()
        servers.stop()
        raise
    return servers
