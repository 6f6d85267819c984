"""Forming a group: rendezvous through torch.distributed's TCPStore, then a `zmq` or `torch` ProcessGroup.

The environment is torchrun's: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (SLURM's SLURM_PROCID/SLURM_NTASKS are
read when RANK/WORLD_SIZE are absent). Rank 0 hosts the TCPStore on MASTER_PORT unless torchrun's agent already
does (TORCHELASTIC_USE_AGENT_STORE=True), exactly like torch's `env://` rendezvous, which we use.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .curve import is_loopback
from .errors import RendezvousError
from .group import ProcessGroup
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
                       torch_backend: str | None = None, store_prefix: str = "zmq/", use_ipc: bool = True, use_shm: bool = True,
                       **group_options: Any) -> ProcessGroup:
    """Join (or create) the world group of this job. Missing arguments come from torchrun/SLURM variables.

    backend: "zmq" (ours, over ZeroMQ) or "torch" (torch.distributed: gloo on CPU, or `torch_backend="nccl"`).
    store: an existing torch.distributed Store (the launcher passes one); else one is made by env:// rendezvous.
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
    if store is None:
        store = _env_store(rank, world_size, master_addr, master_port, timeout)
    if backend == "torch":
        from .torch_group import TorchGroup
        tb = torch_backend or "gloo"
        if not dist.is_initialized():
            dist.init_process_group(tb, store=dist.PrefixStore("torch/", store), rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout))
        group = TorchGroup(None, range(world_size), rank, timeout)
        group.store = store
        return group
    from .zmq_group import ZmqGroup
    curve = CurveKeys(curve_keys_dir) if curve_keys_dir else None
    if not is_loopback(bind_host) and curve is None:
        raise RendezvousError(f"binding to {bind_host} exposes the group beyond this host: pass curve_keys_dir= "
                              "to encrypt and authenticate (see collectives.curve.generate_keys)")
    tr = Transport(rank, world_size, dist.PrefixStore(store_prefix, store), timeout=timeout, bind_host=bind_host,
                   curve=curve, use_ipc=use_ipc, use_shm=use_shm)
    group = ZmqGroup(tr, range(world_size), **group_options)
    group.store = store  # the job's store, e.g. to form a second (torch) group beside this one
    return group


def _env_store(rank: int, world_size: int, addr: str | None, port: int | None, timeout: float) -> Any:
    addr = addr or os.environ.get("MASTER_ADDR")
    port = port if port is not None else _env_int("MASTER_PORT")
    if not addr or port is None:
        raise RendezvousError("no rendezvous address: set MASTER_ADDR and MASTER_PORT (torchrun does) or pass "
                              "master_addr=/master_port=")
    use_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        return dist.TCPStore(addr, port, world_size, is_master=(rank == 0 and not use_agent),
                             timeout=timedelta(seconds=timeout), wait_for_workers=False)
    except Exception as e:  # RuntimeError/DistNetworkError: port in use, host unreachable
        raise RendezvousError(f"rank {rank}: rendezvous at {addr}:{port} failed ({e}); is the port free / the "
                              "master reachable?") from None
