"""Shard servers as processes: `start_servers` is the one way to start them, for a plain run (one shard set) and for
the parallelism engines (one shard set per *slot group*: pipeline stage x tensor-parallel coordinate).

    with start_servers(num_shards=2, num_workers=4, policy="bsp", optimizer="sgd:lr=0.1") as servers:
        client = connect(servers.addresses, worker=w, params=...)            # one shard set

    with start_servers(1, num_workers=dp, policy="bsp", groups=pp * tp, start_method="fork") as servers:
        client = connect(servers.group_addresses[g], worker=dp_rank, ...)    # slot group g's shards

Every process is started first and then all are awaited (start-up runs in parallel; forked shards start in
milliseconds, spawned ones import torch afresh). If any shard fails or is late, everything started is stopped and a
PSError names the shard and its slot group. A server process ignores SIGINT (its parent stops it, so a Ctrl-C in the
terminal prints no tracebacks from shards), on SIGTERM finishes the message at hand, writes a final checkpoint (with
a checkpoint_dir) and exits, runs torch with one thread, and exits by itself after `idle_timeout` seconds without a
message (so an orphan does not linger).

Liveness and restart (`ServerGroup.check`, called from the job's supervisor loop in the parent; no thread):
every shard writes (time.monotonic(), version) into its slot of a shared double array (`multiprocessing.RawArray`,
fork- and spawn-safe) at each loop iteration (<= 50 ms apart) and after each push. A shard is dead when its process
has exited (any exit: a shard never ends on its own during a run) and hung when its beat is older than detect_s
and it is stopped (SIGSTOP) or has used no CPU within detect_s (then it is SIGKILLed); a shard still using CPU
(a long step, or starved on a loaded machine) is hung only past BUSY_FACTOR x detect_s (collectives/procstate.py).
Either is restarted from its latest valid checkpoint on the SAME address (the ipc path or tcp
port it first bound), so the clients' DEALER sockets reconnect by themselves; updates lost = the last version the
shard reported minus the version it restored. Under an aggregating policy a slot group of several shards restarts
together from its newest common checkpoint version, so that all its shards hold the same clock. Each incarnation
notes its shared-memory segments in a sweep directory of its own, swept as soon as it is dead.

Authentication: the shards admit only holders of the job's secret (ps.admission). `start_servers(secret=...)` uses
the given one, else PSLAB_JOB_SECRET / PSLAB_JOB_SECRET_FILE, else makes a new one. Nothing is
written to the environment: a client in this process finds the secret by the shards' addresses
(`admission.secret_for`), other processes are handed `ServerGroup.secret` (the launcher passes it to the ranks it
starts); `ServerGroup.admin()` connects as "admin".
The secret reaches the shard processes through their start-up arguments, never through a store or a file.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import multiprocessing.connection
import os
import re
import shutil
import signal
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from pslab.collectives import cleanup, flight, forking, trace
from pslab.collectives.procstate import BUSY_FACTOR, CpuProgress, is_stopped

from .admission import check_secret, forget_secret, job_secret, new_job_secret, remember_secret
from .checkpoint import list_checkpoints
from .consistency import policy_from_string
from .errors import ConfigError, PSError
from .optim import OptimizerSpec, optimizer_from_string
from .server import ServerConfig, ShardServer

START_METHODS = ("spawn", "fork")
_CKPT = re.compile(r"ckpt-(\d{12})\.pslab")
TRANSPORTS = ("tcp", "ipc")


def _warm_up_torch_optim() -> None:
    """Do the lazy imports the first torch.optim optimizer triggers (torch._dynamo, ~1 s, once per process): in the
    parent before forking (every forked shard inherits them) and in a shard right after it reports ready (so its
    first `init` does not pay for them)."""
    import torch
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def _server_main(config: ServerConfig, conn: Any, sweep_dir: str | None = None, beats: Any = None,
                 slot: int = 0) -> None:
    """A shard server process: report ("ok", address, restore info) or ("error", why) through `conn`, then serve
    until stopped. Its shared-memory segments are noted in `sweep_dir`, which the ServerGroup sweeps when the shard is
    gone; it beats into beats[2 * slot] (monotonic time) and beats[2 * slot + 1] (version)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)            # the parent stops us (SIGTERM); Ctrl-C is for the parent
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))   # until serving: nothing to checkpoint yet
    forking.release()                                       # what arrived while the parent started us
    if sweep_dir:
        os.environ[cleanup.ENV] = sweep_dir
    flight.set_identity(f"shard{config.shard_id}")      # its flight record (into PSLAB_FLIGHT_DIR, if set)
    flight.install_signal()
    import torch
    torch.set_num_threads(1)
    server: ShardServer | None = None
    try:
        server = ShardServer(config)
        info = {"restored_from": server.restored_from,
                "restored_version": server.state.version if server.state is not None else None}
        reply: tuple[Any, ...] = ("ok", server.bind(), info)
        if beats is not None:
            def beat(now: float, version: int, b: Any = beats, i: int = 2 * slot) -> None:
                b[i], b[i + 1] = now, float(version)
            server.heartbeat = beat
            beat(time.monotonic(), info["restored_version"] if info["restored_version"] is not None else -1)
        stopping = server
        flight.RECORDER.context("gate", lambda: {"waits": stopping.gate_waits(time.monotonic())})
        signal.signal(signal.SIGTERM, lambda *_: stopping.request_stop("SIGTERM"))   # final checkpoint, then exit
    except Exception as e:  # start-up errors (bad checkpoint, address in use, missing keys) go to the parent
        server, reply = None, ("error", f"{type(e).__name__}: {e}")
    try:
        conn.send(reply)
        conn.close()
    except OSError:         # the parent is gone: nobody will connect
        return
    if server is not None:
        _warm_up_torch_optim()
        if os.environ.get(trace.ENV_DIR):          # a traced run: this shard's timeline, written when it stops
            trace.start(os.environ[trace.ENV_DIR], f"shard{config.shard_id}", role="shard", shard=config.shard_id)
        try:
            server.serve_forever()
        finally:
            trace.stop()


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
    restored: list[list[dict[str, Any]]] = field(default_factory=list, init=False)   # per shard: its last start's
    restarts: list[dict[str, Any]] = field(default_factory=list, init=False)         # restore info; check()'s log
    membership: tuple[list[int], int] | None = field(default=None, init=False)      # the last set_members
    _procs: list[list[Any]] = field(default_factory=list, init=False, repr=False)
    _tmpdir: str | None = None
    _sweeps: list[list[str | None]] = field(default_factory=list, init=False, repr=False)  # per shard incarnation
    _beats: Any = field(default=None, init=False, repr=False)         # RawArray('d'): [time, version] per shard

    def __post_init__(self) -> None:
        self.group_addresses = [["" for _ in g] for g in self.configs]
        self.restored = [[{} for _ in g] for g in self.configs]
        self._procs = [[None for _ in g] for g in self.configs]
        self._sweeps = [[None for _ in g] for g in self.configs]
        n = sum(len(g) for g in self.configs)
        self._beats = mp.get_context(self.start_method).RawArray("d", 2 * max(n, 1))
        self._cpu = CpuProgress()                     # when each shard's CPU time last grew (check: busy, not hung)

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
        """(Re)start one shard with its config and wait for it; returns its address: the one it bound first (the
        config's bind is pinned to it at the first start, so clients reconnect by themselves). A shard with a
        checkpoint directory resumes from its latest checkpoint. Raises PSError if it is still running or fails to
        start (e.g. its tcp port was taken meanwhile)."""
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

    def who(self, shard: int, group: int = 0) -> str:
        """The shard's name in events: "shard:<i>", or "g<g>-shard:<i>" with several slot groups."""
        return f"shard:{shard}" if self.groups == 1 else f"g{group}-shard:{shard}"

    def heartbeat(self, shard: int, group: int = 0) -> tuple[float, int]:
        """(monotonic time of the shard's last beat, the version it last reported; -1 before init)."""
        i = 2 * (group * self.num_shards + shard)
        return float(self._beats[i]), int(self._beats[i + 1])

    def check(self, detect_s: float, restart: bool = True) -> list[dict[str, Any]]:
        """Find dead shards (process exited, any way) and hung ones (no beat for `detect_s` s: SIGKILLed), and with
        `restart` start each again from its latest checkpoint on its address. Under an aggregating policy (bsp,
        ssp-agg, backup) a slot group of several shards is restarted together from its newest common checkpoint
        version (the survivors are SIGKILLed): every shard is then at the same clock, so the workers, rewound to it,
        stay in step on all of them. Returns events in the events.jsonl schema (experiments.faults.spec), time_s
        None for the caller: {"event": "detect", "who", "how", "detect_s" (age of the last beat: time since it died,
        to within a beat)} and per restarted shard {"event": "shard_restart", "who", "how", "lost_updates",
        "restored_version", "version_before", "checkpoint", "restart_s"}, or {"event": "abort", ...} if a restart
        failed. restart=False only reports (at every call while a shard is dead). Call only while the run is going
        (a shard that exits then is a failure)."""
        if not detect_s > 0:
            raise ConfigError(f"detect_s must be > 0 seconds; got {detect_s!r}")
        events: list[dict[str, Any]] = []
        for g, row in enumerate(self._procs):
            failed: dict[int, int] = {}                      # shard -> the version it last reported
            for i, p in enumerate(row):
                if p is None:
                    continue
                beat, version = self.heartbeat(i, g)
                age = time.monotonic() - beat
                busy = self._cpu.busy(p.pid, detect_s)      # (sampled at every check: it must see the ticks move)
                if not p.is_alive():
                    p.join(1)
                    how = _exit_how(p.exitcode)
                elif age > detect_s and (is_stopped(p.pid) or not busy or age > BUSY_FACTOR * detect_s):
                    how = f"no heartbeat for {age:.1f} s"
                    p.kill()
                    p.join(5)
                else:
                    continue
                failed[i] = version
                events.append({"event": "detect", "who": self.who(i, g), "how": how, "time_s": None,
                               "detect_s": round(age, 3)})
            if failed and restart:
                events += self._restart(g, failed)
        return events

    def set_members(self, alive: Sequence[int], version: int, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Set the versioned membership (admin op "members", ps/README.md) on every shard of every slot group and
        remember it: a shard that check() restarts gets it again (its checkpoint may predate it). Returns the
        shards' replies, group-major. Raises what the shards answer (e.g. MembershipError for a stale version)."""
        self.membership = (sorted({int(w) for w in alive}), int(version))
        return [r for g in range(self.groups) for r in self._send_members(g, timeout)]

    def _send_members(self, group: int, timeout: float = 30.0) -> list[dict[str, Any]]:
        assert self.membership is not None
        alive, version = self.membership
        with self.admin(group, timeout=timeout) as admin:
            return admin.set_members(alive, version).result(timeout)

    def common_restore_point(self, group: int) -> int | None:
        """The newest checkpoint version every shard of `group` holds (None: there is none, or no checkpoints)."""
        common: set[int] | None = None
        for cfg in self.configs[group]:
            if not cfg.checkpoint_dir:
                return None
            versions = {int(m.group(1)) for p in list_checkpoints(cfg.checkpoint_dir)
                        if (m := _CKPT.fullmatch(p.name))}
            common = versions if common is None else common & versions
        return max(common) if common else None

    def _restart(self, group: int, failed: dict[int, int]) -> list[dict[str, Any]]:
        """Restart the failed shards of `group` (all of them, from the common restore point, when the group must
        move together); one event per restarted shard."""
        bound = None
        if self.num_shards > 1 and policy_from_string(self.configs[group][0].policy).aggregate:
            bound = self.common_restore_point(group)
            if bound is not None:
                for i, p in enumerate(self._procs[group]):
                    if i not in failed and p is not None and p.is_alive():
                        failed[i] = self.heartbeat(i, group)[1]
                        p.kill()
                        p.join(5)
        t0 = time.monotonic()
        try:
            self._await({self._launch(group, i, bound): (group, i) for i in sorted(failed)})
        except PSError as e:
            return [{"event": "abort", "who": self.who(min(failed), group), "how": f"restart failed: {e}",
                     "time_s": None}]
        took = round(time.monotonic() - t0, 3)
        resent: Any = None
        if self.membership is not None:             # the restored checkpoint may predate the last change
            try:
                self._send_members(group)
                resent = self.membership[1]
            except PSError as e:
                resent = f"not re-sent: {e}"
        events = []
        for i, version in sorted(failed.items()):
            info = self.restored[group][i]
            restored = info.get("restored_version")
            how = f"from {info['restored_from']}" if info.get("restored_from") else "empty (no checkpoint)"
            ev = {"event": "shard_restart", "who": self.who(i, group), "time_s": None, "restart_s": took,
                  "how": how + (f" (slot group's common restore point {bound})" if bound is not None else ""),
                  "checkpoint": info.get("restored_from"), "restored_version": restored, "version_before": version,
                  "lost_updates": max(0, version - (restored or 0)) if version >= 0 else 0}
            if self.membership is not None:
                ev["membership"] = resent
            self.restarts.append(ev)
            events.append(ev)
        return events

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
            for row in self._sweeps:            # segments of shards that died without unlinking them
                for d in row:
                    cleanup.sweep(d)
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
    def _launch(self, group: int, shard: int, restore_max_version: int | None = None) -> Any:
        """Start one shard's process (without waiting); returns the read end of its start-up pipe. With
        `restore_max_version`, this start restores the newest checkpoint of at most that version."""
        if self.start_method == "fork":
            _warm_up_torch_optim()
        ctx = mp.get_context(self.start_method)
        old = self._procs[group][shard]
        if old is not None and not old.is_alive():
            old.join(1)
            cleanup.sweep(self._sweeps[group][shard])       # the dead incarnation's segments
        self._sweeps[group][shard] = cleanup.make_dir("pslab-ps-sweep-")
        parent, child = ctx.Pipe(duplex=False)
        name = f"pslab-shard-{shard}" if self.groups == 1 else f"pslab-g{group}-shard-{shard}"
        slot = group * self.num_shards + shard
        self._beats[2 * slot], self._beats[2 * slot + 1] = time.monotonic(), -1.0   # start-up counts as a beat
        cfg = self.configs[group][shard]
        if restore_max_version is not None:
            cfg = dataclasses.replace(cfg, restore_max_version=restore_max_version)
        p = ctx.Process(target=_server_main, args=(cfg, child, self._sweeps[group][shard],
                                                   self._beats, slot), daemon=True, name=name)
        self.group_addresses[group][shard] = ""
        try:
            forking.start(p, self.start_method)      # SIGINT/SIGTERM held until _server_main has its handlers
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()   # now only the child holds the write end: its exit reads as EOF here
            if p.pid is not None:       # started (a signal held across start() may raise once it returned):
                self._procs[group][shard] = p       # stop() ends and joins every started process, only those
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
                        status, info, *extra = conn.recv()
                    except EOFError:
                        p = self._procs[g][i]
                        p.join(2)
                        status, info = "error", f"the process exited during start-up (exit code {p.exitcode})"
                        extra = []
                    finally:
                        conn.close()
                    if status != "ok":
                        self._reap(g, i)
                        raise PSError(f"{_label(g, i)} failed to start: {info}")
                    self.group_addresses[g][i] = info
                    self.restored[g][i] = dict(extra[0]) if extra else {}
                    cfg = self.configs[g][i]
                    if cfg.bind != info:     # pin the bound address: a restart binds the same one
                        self.configs[g][i] = dataclasses.replace(cfg, bind=info)
        finally:
            for conn in pending:
                conn.close()

    def _reap(self, group: int, shard: int) -> None:
        p = self._procs[group][shard]
        if p is not None:
            if p.is_alive():
                p.kill()
            p.join(5)


def _exit_how(code: int | None) -> str:
    """How a process ended, as events name it: "SIGKILL", "SIGTERM", "exit code 1"."""
    if code is not None and code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


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
