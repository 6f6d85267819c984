"""pslab's sharded parameter server: ASP, BSP, SSP(s) and BSP with backup workers, with exact staleness tracking.

Layers: `ShardState` is the sans-IO core (no sockets, no clock: callers pass `now`); `ps.server` wraps it in a
ZeroMQ ROUTER loop, one process per shard; `ps.client` is the worker side (DEALER per shard, futures). The
experiments' simulator wraps the very same `ShardState` in virtual time.

Where each mechanism lives:

    shard.py        ShardState: params, version, clocks, the consistency gate, push/read, state_dict
    consistency.py  ASP / BSP / SSP(s) / BackupBSP: when a read may proceed, whether a clock is averaged
    optim.py        OptimizerSpec (the one optimizer description) and the server-side SGD / momentum / Adam,
                    staleness-aware lr, DC-ASGD
    staleness.py    StalenessStats: the exact (worker, tau, version) series, histograms, waits, drops
    partition.py    names + shapes -> shards, balanced by bytes, big tensors split into flat ranges
    config.py       ServerConfig (bind address, policy, optimizer, checkpoints, timeouts, secret/CURVE, nonfinite
                    policy, shm link cap), validated
    server.py       ShardServer: the ZeroMQ ROUTER loop around one ShardState; liveness sweep; `serve`
    parking.py      reads that wait at the consistency gate (parked, retried, timed out)
    admission.py    who may do what: handshake identities (PLAIN / CURVE User-Id), one live registration per
                    worker, owner-only init, admin-only checkpoint/shutdown; the job-secret helpers
    processes.py    start_servers / ServerGroup: the one way to start shard processes (slot groups, fork/spawn);
                    heartbeats, check(): dead/hung shard detection and restart on the same address
    client.py       PSClient / connect: DEALER per shard, push / pull / push_pull futures, grad_buffers
    compression.py  compressed pushes (connect(..., compress="topk:0.01" | "sign")): a worker's encoder with its
                    error-feedback residual per shard, the shard's validating decoder
    admin.py        AdminClient / connect_admin: the job controller's connection (init, checkpoint, shutdown)
    handshake.py    a client's authenticated sockets; a refused handshake is an AuthenticationError at once
    futures.py      the futures the client returns (driven by the waiting thread)
    shm_path.py     the same-host shared-memory payload path, negotiated and proven at register
    lane.py         ... and its headers: push/pull requests and replies in a shared-memory slot pair per
                    registration, woken through FIFO doorbells, instead of ZeroMQ messages
    shm_arena.py    one push (and pull) segment per client laid out shard by shard: split tensors copy-free
    flat.py         a shard's parameters in one buffer per dtype; runs of adjacent tensors take one torch call
    checkpoint.py   atomic checksummed checkpoints, every descriptor checked; restore_latest falls back
    restore.py      checkpoint -> ShardState: every meta field checked against the state_dict schema
    secret_file.py  `pslab server`'s job secret: --secret-file, the environment, or a new 0600 file
    protocol.py     message fields, roles and limits;  errors.py

Public API
----------
Core (sans-IO)::

    st = ShardState(params, optimizer="sgd:lr=0.1", policy="ssp:3", num_workers=4)
        # params: {name: np.ndarray | torch.Tensor}; a shard stores flat float tensors (copies)
    st.may_read(worker, clock, now=None) -> bool        # consistency gate; remembers when a read first blocked
    st.blocking_workers(clock) -> list[int]              # who a read at `clock` is waiting for
    st.read(worker, clock, now=None, copy=True) -> ReadResult
        # .version, .clock (backup-BSP may move it up), .committed_clock, .params {name: torch.Tensor}
    st.push(worker, clock, read_version, grads, now=None) -> PushResult
        # .status "applied" | "buffered" (waits for the rest of its clock) | "dropped" (late backup gradient)
        # .version (after), .staleness [(worker, tau), ...] for every update applied by this push
    st.version, st.clocks, st.committed_clock, st.stats (StalenessStats: .summary(), .histogram(), .percentile(q),
    .series [(now, worker, tau, version)], .waits {worker: [seconds per read, the first max_series]},
    .wait_total, .wait_count, .dropped), st.params (live),
    st.state_dict() -> (tensors, meta) / ShardState.from_state_dict(tensors, meta)

    Workers are 0..num_workers-1. A worker's clock c = number of pushes it has made; a push is stamped with the
    worker's current clock, and a pull "at clock c" is the read before computing the clock-c gradient.

Consistency policies (ps.consistency)::

    policy_from_string("asp" | "bsp" | "ssp:3" | "ssp-agg:3" | "bsp-backup:1") -> Policy
    ASP(), BSP(), SSP(s) (Ho et al., read-my-writes), SSP(s, eager=False) (aggregate), BackupBSP(backups=b)

Optimizers (ps.optim), state lives on the shard::

    OptimizerSpec(name="sgd"|"momentum"|"adam", lr=0.01, momentum=0.9, betas=(0.9, 0.999), eps=1e-8,
                  weight_decay=0.0, nesterov=False, staleness_lr=False, staleness_rule="gradient"|"mean",
                  dc_lambda=None, dc_adaptive=False, dc_decay=0.95)                      # dc_lambda=None: no DC-ASGD; 0.0 runs DC with lambda 0
    optimizer_from_string("adam:lr=1e-3,staleness_lr=1") -> OptimizerSpec (an OptimizerSpec passes through)
    spec.to_string() -> "adam:lr=0.001,staleness_lr=1"   # the inverse: name, lr and the non-default options

Partitioning (ps.partition), a pure function of (names, shapes, num_shards)::

    make_partition({name: shape_or_tensor}, num_shards, max_piece_bytes=None) -> Partition
    Partition.slices (list[Slice(name, key, shard, start, stop, shape)]), .keys_of(shard), .bytes_per_shard()

Server and client::

    servers = start_servers(num_shards=1, num_workers=1, policy="asp", optimizer="sgd:lr=0.01",  # or OptimizerSpec
                            *, groups=1, start_method="spawn" | "fork", bind_host="127.0.0.1", curve_keys_dir=None,
                            transport="tcp" | "ipc", checkpoint_dir=None, checkpoint_every=0, request_timeout=120.0,
                            idle_timeout=600.0, start_timeout=60.0, secret=None, nonfinite="reject") -> ServerGroup
        # `groups` independent shard sets ("slot groups": one per pipeline stage x tp coordinate), each of num_shards
        # shards serving num_workers workers; all start in parallel; a failure stops all and raises PSError
        # ("shard 1 of slot group 0 failed to start: ..."). Shards ignore SIGINT, on SIGTERM write a final
        # checkpoint (with checkpoint_dir) and exit, run 1 torch thread.
        # checkpoint_dir/shard-<i> (g<g>-shard-<i> with groups > 1). Beyond loopback needs curve_keys_dir.
        # secret: the job secret every shard admits (default: PSLAB_JOB_SECRET[_FILE], else a new one; nothing is
        # written to the environment: clients in this process find it by the shards' addresses); nonfinite: "reject" | "skip" NaN/Inf pushes.
    servers.secret                          # hand it to workers: connect(..., secret=servers.secret)
    servers.admin(group=0, params=None)     # AdminClient of that group (checkpoint, shutdown, stats, init)
    servers.group_addresses[g]              # group g's shard addresses, in shard order (what connect takes)
    servers.addresses                       # flat, group-major; with groups=1 == group_addresses[0]
    servers.kill(shard, sig=SIGKILL, group=0) / .alive(shard, group=0) / .start(shard, group=0) -> its address
    servers.check(detect_s, restart=True) -> list[dict]   # events.jsonl dicts: "detect" / "shard_restart" / "abort"
        # (who "shard:<i>", how, detect_s, lost_updates, restored_version, checkpoint, restart_s; time_s None)
    servers.heartbeat(shard, group=0) -> (monotonic time, version)    servers.restarts, servers.who(shard, group)
    servers.set_members(alive, version) -> list[dict]     # every group's shards; re-sent to a restarted shard
    servers.processes, servers.configs[g][i], servers.stop()            # also a context manager
    serve(ServerConfig(bind="tcp://127.0.0.1:0", shard_id=0, num_workers=1, policy="asp",
                       optimizer="sgd:lr=0.01",    # OptimizerSpec | str, held as an OptimizerSpec (cfg.spec typed)
                       checkpoint_dir=None, checkpoint_every=0, request_timeout=120.0, idle_timeout=0.0,
                       curve_keys_dir=None, secret=None, nonfinite="reject", max_shm_links=0,
                       sweep_interval=1.0, shm_idle_timeout=30.0),
          ready=lambda address: ...)                                      # blocking loop (`pslab server ...`)
    client = connect(servers.addresses, worker=0, params=model_state,     # params: {name: tensor or shape}
                     secret=None,           # the job secret; None: PSLAB_JOB_SECRET / PSLAB_JOB_SECRET_FILE
                     compress=None)         # "topk:<fraction>" | "sign": pushes compressed, error feedback on
                                            # (error_feedback=False: off); one push in flight at a time
    client.init(model_state).result()       # only the owner (worker 0 or admin), once; the others' pulls wait
    fut = client.pull()                     # Future[PullResult(.params {name: np.ndarray}, .versions, .clocks)]
    # futures are driven by the waiting thread (no background I/O thread): call .result() to make progress
    fut = client.push(grads)                # Future[list of per-shard acks {status, version, clock, staleness}];
                                            # stamps the current clock and advances it; status "skipped" if the
                                            # shard runs nonfinite="skip" and the push held NaN/Inf
    client.clocks, client.versions          # per shard: this worker's clock, version of its last pull
    client.stats(series=False)              # Future[list of per-shard dicts: version, clocks, stats (summary),
                                            #   counters, and with series=True [[now, worker, tau, version], ...]]
    client.resync()                         # adopt the shards' clocks/versions (after an error or a restart)
    client.restarts, client.last_restart    # restarts seen at resync: {shard, restored_version, lost_updates, ...}
    client.lost, client.checkpoint_errors   # shards dropped since the last register (ShardLostError until resync);
                                            # per shard: the failed periodic checkpoint its last push ack reported
    client.close()
    admin = connect_admin(addresses, params=None, secret=None)            # authenticated as "admin"
    admin.checkpoint() / admin.shutdown_servers() / admin.stats() / admin.init(params) / admin.close()
    admin.set_members(alive, version)       # versioned membership: gates stop waiting for the dead (ps/README.md)
    st.set_members(alive, version, now=None), st.members, st.membership_version, st.membership_log, st.rejoin_clock()

Who may do what (ps.admission): a connection proves "worker:<w>" or "admin" at the handshake; it registers and
pushes/pulls only as that worker, one live registration per worker id; init by worker 0 or admin, once;
checkpoint and shutdown by admin only. A socket without the job's credential never reaches the shard.

Errors: every error raised on purpose derives from `ps.errors.PSError`.
"""

from __future__ import annotations

from .errors import PSError

__all__ = [
    "PSError", "ShardState", "ReadResult", "PushResult", "Policy", "ASP", "BSP", "SSP", "BackupBSP",
    "policy_from_string", "OptimizerSpec", "optimizer_from_string", "Partition", "Slice", "make_partition",
    "StalenessStats", "ServerConfig", "serve", "start_servers", "ServerGroup", "PSClient", "connect",
    "AdminClient", "connect_admin",
]

_LAZY = {
    "ShardState": "shard", "ReadResult": "shard", "PushResult": "shard",
    "Policy": "consistency", "ASP": "consistency", "BSP": "consistency", "SSP": "consistency",
    "BackupBSP": "consistency", "policy_from_string": "consistency",
    "OptimizerSpec": "optim", "optimizer_from_string": "optim",
    "Partition": "partition", "Slice": "partition", "make_partition": "partition",
    "StalenessStats": "staleness",
    "ServerConfig": "config", "serve": "server", "start_servers": "processes", "ServerGroup": "processes",
    "PSClient": "client", "connect": "client", "AdminClient": "admin", "connect_admin": "admin",
}


def __getattr__(name: str):  # lazy: `from pslab import ps` stays light and the server/client pull in zmq only when used
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'ps' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f".{mod}", __name__), name)
