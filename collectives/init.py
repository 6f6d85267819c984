"""Forming a group: rendezvous through torch.distributed's TCPStore, then a `zmq` or `torch` ProcessGroup.

The environment is torchrun's: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (SLURM's SLURM_PROCID/SLURM_NTASKS are
read when RANK/WORLD_SIZE are absent). Rank 0 hosts the TCPStore on MASTER_PORT unless torchrun's agent already
does (TORCHELASTIC_USE_AGENT_STORE=True), exactly like torch's `env://` rendezvous, which we use; when MASTER_ADDR
is a loopback address the store listens on 127.0.0.1 only (torch's own server would listen on every interface).

The zmq backend authenticates every connection with the job's secret (auth.py): `secret=`, else PSLAB_JOB_SECRET
or PSLAB_JOB_SECRET_FILE; a multi-rank zmq group without one is refused with a line saying how to set it (under
CURVE keys without a secret the group forms, members authenticated by the cluster key but not bound to a rank).
The secret never goes through the store; the store holds only endpoints, signed with it.
"""

from __future__ import annotations

import os
import signal
import socket
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from . import flight
from .auth import HOW, job_secret
from .curve import is_loopback
from .errors import AuthError, RendezvousError
from .group import ProcessGroup
from .mailbox import MAILBOX_BYTES, SEQ_WINDOW
from .topology import from_env as topology_from_env
from .transport import CurveKeys, Transport

BACKENDS = ("zmq", "torch")


def _env_int(*names: str) -> int | None:
    for n in names:
        v = os.environ.get(n)
        if v is not None:
            try:
                return int(v)
            except ValueError:
                raise RendezvousError(f"environment variable {n}={v!r} is not an integer") from None
    return None


def init_process_group(backend: str = "zmq", *, rank: int | None = None, world_size: int | None = None,
                       master_addr: str | None = None, master_port: int | None = None, store: Any = None,
                       timeout: float = 60.0, bind_host: str = "127.0.0.1", curve_keys_dir: str | None = None,
                       torch_backend: str | None = None, store_prefix: str = "zmq/", use_ipc: bool = True,
                       use_shm: bool = True, secret: str | None = None, mailbox_bytes: int = MAILBOX_BYTES,
                       seq_window: int = SEQ_WINDOW, **group_options: Any) -> ProcessGroup:
    """Join (or create) the world group of this job. Missing arguments come from torchrun/SLURM variables.

    backend: "zmq" (ours, over ZeroMQ) or "torch" (torch.distributed: gloo on CPU, or `torch_backend="nccl"`).
    store: an existing torch.distributed Store (the launcher passes one); else one is made by env:// rendezvous.
    secret: the job's secret (zmq backend; default: PSLAB_JOB_SECRET / PSLAB_JOB_SECRET_FILE, see auth.py).
    mailbox_bytes, seq_window: limits of the early-arrival mailbox (mailbox.py).
    topology= (in group_options, else PSLAB_TOPOLOGY as JSON): emulated hosts and links, zmq only (topology.py).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    rank = rank if rank is not None else _env_int("RANK", "SLURM_PROCID")
    world_size = world_size if world_size is not None else _env_int("WORLD_SIZE", "SLURM_NTASKS")
    if rank is None or world_size is None:
        raise RendezvousError("rank and world size unknown: pass rank=/world_size= or set RANK and WORLD_SIZE "
                              "(torchrun does), or run under collectives.launch")
    if not 0 <= rank < world_size:
        raise RendezvousError(f"rank {rank} is outside world size {world_size}")
    if not flight.RECORDER.who:       # torchrun/SLURM: this process's flight record (written where PSLAB_FLIGHT_DIR says)
        flight.set_identity(f"rank{rank}")
        if signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL:
            flight.install_signal()
    topology = group_options.pop("topology", None) or topology_from_env()     # emulated links: topology.py
    if topology is not None:
        if backend != "zmq":
            raise ValueError("a topology (links of different speeds) is emulated by the zmq backend only; use "
                             "backend='zmq' or unset PSLAB_TOPOLOGY")
        topology.check_world(world_size)
    if backend == "zmq":
        secret = secret or job_secret()
        if secret is None and curve_keys_dir is None and world_size > 1 and rank > 0:
            raise AuthError(f"rank {rank}: a {world_size}-rank zmq group needs the job's secret: {HOW}")
        # (rank 0 forms the store first, so that a port in use is what it reports; then Transport refuses)
    if store is None:
        store = _env_store(rank, world_size, master_addr, master_port, timeout)
    if backend == "torch":
        from .torch_group import TorchGroup
        from .sockmeter import SocketMeter, socket_fds
        from .gloo_groups import group_meter
        tb = torch_backend or "gloo"
        meter = SocketMeter([], "torch.distributed was initialised before this group: its connections are unknown")
        if not dist.is_initialized():
            before = socket_fds()
            dist.init_process_group(tb, store=dist.PrefixStore("torch/", store), rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout))
            meter = (group_meter(before, store, rank, world_size, timeout, "world")
                     if tb == "gloo" else SocketMeter([], f"{tb}'s traffic does not cross this process's sockets"))
        group = TorchGroup(None, range(world_size), rank, timeout, meter=meter)
        group.store = store
        return group
    from .zmq_group import ZmqGroup
    curve = CurveKeys(curve_keys_dir) if curve_keys_dir else None
    if not bind_host or any(c in bind_host for c in ";,/ \t\n"):
        raise RendezvousError(f"bind_host {bind_host!r} must be one host address (e.g. 127.0.0.1 or 10.0.0.5), "
                              "not an endpoint or a list")
    if not is_loopback(bind_host) and curve is None:
        raise RendezvousError(f"binding to {bind_host} exposes the group beyond this host: pass curve_keys_dir= "
                              "to encrypt and authenticate (see collectives.curve.generate_keys)")
    tr = Transport(rank, world_size, dist.PrefixStore(store_prefix, store), timeout=timeout, bind_host=bind_host,
                   curve=curve, use_ipc=use_ipc, use_shm=use_shm, secret=secret,
                   mailbox_bytes=mailbox_bytes, seq_window=seq_window, namespace=store_prefix)
    group = ZmqGroup(tr, range(world_size), topology=topology, **group_options)
    group.store = store  # the job's store, e.g. to form a second (torch) group beside this one
    return group


def _env_store(rank: int, world_size: int, addr: str | None, port: int | None, timeout: float) -> Any:
    addr = addr or os.environ.get("MASTER_ADDR")
    port = port if port is not None else _env_int("MASTER_PORT")
    if not addr or port is None:
        raise RendezvousError("no rendezvous address: set MASTER_ADDR and MASTER_PORT (torchrun does) or pass "
                              "master_addr=/master_port=")
    use_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    master = rank == 0 and not use_agent
    try:
        fd = _loopback_listener(port) if master and is_loopback(addr) else None
        return dist.TCPStore(addr, port, world_size, is_master=master, timeout=timedelta(seconds=timeout),
                             wait_for_workers=False, master_listen_fd=fd)
    except Exception as e:  # RuntimeError/DistNetworkError/OSError: port in use, host unreachable
        raise RendezvousError(f"rank {rank}: rendezvous at {addr}:{port} failed ({e}); is the port free / the "
                              "master reachable?") from None


def _loopback_listener(port: int) -> int:
    """A socket listening on 127.0.0.1:`port` (the store's server takes the descriptor over)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)    # as torch's own server does
    try:
        s.bind(("127.0.0.1", port))
        s.listen(512)
    except OSError as e:
        s.close()
        raise OSError(e.errno, f"cannot listen on 127.0.0.1:{port}: {e.strerror.lower()}") from None
    return s.detach()
