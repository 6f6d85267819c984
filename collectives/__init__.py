"""pslab's communication layer: wire codec, ZeroMQ transport, process groups and ring collectives.

    from pslab import collectives

    def work(group, n):                       # runs in every rank
        t = np.ones(n, np.float32)
        group.all_reduce(t, op="sum")         # in place, like torch.distributed
        return float(t[0])

    collectives.launch(work, world_size=4, backend="zmq", args=(1000,), timeout=60)  # -> [4.0, 4.0, 4.0, 4.0]

    group = collectives.init_process_group(backend="zmq")   # under torchrun: RANK, WORLD_SIZE, MASTER_ADDR/PORT,
                                                            # and PSLAB_JOB_SECRET[_FILE] for a multi-rank group

Where each mechanism lives:

    wire.py          the message format: msgpack header + one raw frame per tensor, validated against WireLimits
    transport.py     one ZeroMQ PULL socket per rank, a PUSH per peer; ipc:// on one host, tcp:// otherwise;
                     signed address records; each message's sender checked (User-Id == header src); host identity
    auth.py          who may connect: the per-job secret (PSLAB_JOB_SECRET / _FILE, or made by launch), one
                     credential per role (HMAC), ZeroMQ PLAIN (or CURVE with role keys) via a per-context ZAP handler
    mailbox.py       early arrivals: routing keys type-checked, known groups, sequence window, byte budget
    shm.py           same-host payloads through shared-memory segments (ZeroMQ carries only the headers)
    shm_channel.py   the same-host latency path: small all-reduce / broadcast / barrier through shared-memory slots
                     with sequence-number flags (no ZeroMQ message), a bounded yielding spin then sleeps
    shm_ring.py      the same-host ring with its per-segment headers as descriptors in shared-memory channels
    shm_group.py     when a group takes that same-host path (group.local), and the direct exchanges over it
    curve.py         CURVE keys: generate, load, serve/connect encrypted + authenticated sockets; loopback test
    group.py         the ProcessGroup API (torch.distributed names and in-place semantics), chunk_bounds
    zmq_group.py     the zmq backend: ring all-reduce / reduce-scatter / all-gather, broadcast, all_to_all, p2p;
                     which keys a group accepts, and the size and dtype of every payload it takes
    ring.py          ring reduce-scatter / all-gather / all-reduce as one pipelined, streamed ring pass
    torch_group.py   the same API over torch.distributed (gloo on CPU, NCCL for CUDA tensors)
    gloo_groups.py   forming a gloo group: standalone ones (one per elastic generation), the meter of its connections
    elastic.py       elastic groups: a coordinator publishes signed, increasing membership generations in the store;
                     a member's waits raise MembershipChanged (or Expelled) soon after, and join() builds the next
                     generation's group (zmq: new transport; torch: new gloo group) without waiting on dead peers
    init.py          init_process_group: rendezvous through torch.distributed.TCPStore (torchrun variables; on
                     127.0.0.1 only for a loopback MASTER_ADDR), the job secret required for a multi-rank zmq group
    launcher.py      launch(fn, world_size): N local processes, a FileStore in a 0700 directory (no listener), a
                     fresh job secret through the process arguments; first failure ends all, hung-rank stacks
    forking.py       how a child is started: from a forkserver that imported torch once (forkserver_context), and
                     with SIGINT/SIGTERM held until its own handlers are in (a forked child must not run its
                     parent's: launcher ranks and PS shards)
    procstate.py     what the kernel says of a child: a pidfd (readable at its exit), its exit code as a zombie,
                     stopped or not (the launcher's watch)
    cleanup.py       what a killed rank or shard leaves (ipc dirs, /dev/shm segments), swept by its starter
                     (PSLAB_CLEANUP_DIR); start_sweeper: a watchdog that sweeps for a process killed outright
    traffic.py       bytes sent/received per peer and per op (what makes 2(N−1)/N visible)
    flight.py        the flight recorder: every process's last N calls of every group (both backends, recorded by
                     ProcessGroup's wrapper), in a memory-mapped ring that outlives a killed process; written as
                     JSON on a failed call, SIGUSR1, a launched rank's end
    flight_wrap.py   that wrapper: generated with each backend method's own signature, one slot per call
    diagnose.py      matches flight records across ranks: missing ranks, type / size / dtype / state mismatches,
                     receives nobody sent, a PS shard's own words (`pslab diagnose`; a timed-out launch's verdict)
    trace.py         the timeline (off unless started): spans of compute, communication, padding and waiting per
                     thread, written per process for `pslab trace` (experiments/results/timeline.py merges them)
    jsonfields.py    a dataclass of numbers as JSON (inf as null, unknown fields refused): Topology, Cluster
    topology.py      emulated hosts: Topology (rank r on host r // per_host, or r % hosts with placement "spread";
                     intra/inter latency + bandwidth), a serialising link per rank pair (sender stamps the due
                     time, receiver holds), bytes per link class;
                     launch(..., topology=) / init_process_group(topology=) / PSLAB_TOPOLOGY (JSON)
    hierarchical.py  hierarchical all-reduce (reduce-scatter in the host, all-reduce across hosts, all-gather in the
                     host): 2(H−1)/H · S/L per rank on the slow link; the formulas; picked by all_reduce("auto")
    tensorfile.py    the tensor file (named tensors + msgpack meta; atomic, sha256, validated; no pickle): PS shard
                     and engine checkpoints
    errors.py        PeerTimeoutError, CollectiveMismatchError, WireError, AuthError, MailboxOverflowError,
                     MembershipChanged, Expelled, PeerFailedError, ...

This package knows nothing of parameter servers or models.
"""

from .errors import (AuthError, CollectiveMismatchError, CollectivesError, Expelled, LaunchError, MailboxOverflowError,
                     MembershipChanged, PeerFailedError, PeerTimeoutError, RendezvousError, WireError)
from .group import REDUCE_OPS, ProcessGroup, Work, chunk_bounds
from .traffic import TrafficCounter, tally
from .wire import PROTOCOL_VERSION, Message, WireLimits, decode, encode

__all__ = [
    "AuthError", "CollectiveMismatchError", "CollectivesError", "Expelled", "LaunchError", "MailboxOverflowError",
    "MembershipChanged", "PeerFailedError", "PeerTimeoutError", "RendezvousError", "WireError",
    "REDUCE_OPS", "ProcessGroup", "Work", "chunk_bounds", "TrafficCounter", "tally", "PROTOCOL_VERSION", "Message",
    "WireLimits", "decode", "encode", "init_process_group", "launch",
]


def __getattr__(name: str):  # lazy: keep `import pslab.collectives.wire` light
    if name == "init_process_group":
        from .init import init_process_group
        return init_process_group
    if name == "launch":
        from .launcher import launch
        return launch
    raise AttributeError(name)
