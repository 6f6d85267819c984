"""How a gloo group's processes form one and see its connections: a standalone gloo group (not registered with
torch.distributed: one per elastic generation, elastic.py) and the meter of the TCP connections a group opens,
labelled by peer (sockmeter.py). torch_group.py drives the groups; init.py and elastic.py form them."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .sockmeter import SocketMeter, socket_fds

_LABEL_S = 10.0     # how long a new group's members wait for each other's socket labels before claiming whole


def store_ports(store: Any) -> tuple[int, ...]:
    """The TCP port of the TCPStore under `store` (PrefixStores unwrapped): its connections are not a group's."""
    while store is not None and not hasattr(store, "port") and hasattr(store, "underlying_store"):
        store = store.underlying_store
    port = getattr(store, "port", None)
    return (int(port),) if isinstance(port, int) else ()


def standalone_gloo(store: Any, rank: int, world_size: int, timeout: float) -> tuple[Any, SocketMeter]:
    """A gloo group of its own over `store` (e.g. a PrefixStore per generation), not registered with
    torch.distributed; on loopback unless GLOO_SOCKET_IFNAME names interfaces (comma-separated); with the meter of
    the connections it opened (sockmeter.py)."""
    before = socket_fds()
    pg = _standalone_gloo(store, rank, world_size, timeout)
    return pg, group_meter(before, store, rank, world_size, timeout)


def group_meter(before: dict[int, int], store: Any, rank: int, world_size: int, timeout: float,
                group: str = "g", why_not: str = "") -> SocketMeter:
    """The meter of the gloo connections a group just opened (those not in `before`; none when `why_not` says why
    this rank observes nothing), its sockets labelled by peer through `store` under keys of `group`'s own
    (sockmeter.py; every member calls this right after the group formed, an unobserving one too: its peers must
    read that it has no labels rather than wait for them)."""
    meter = (SocketMeter([], why_not) if why_not else
             SocketMeter.new_sockets(before, store_ports(store), gloo_connections(world_size)))
    meter.label_peers(store, rank, world_size, min(timeout, _LABEL_S), ns=f"pslab_sockmeter/{group}/")
    return meter


def gloo_connections(world_size: int) -> int:
    """The TCP connections a gloo group of `world_size` opens in each process: one per peer and device (one device
    per GLOO_SOCKET_IFNAME interface, else one)."""
    devices = len([x for x in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if x]) or 1
    return (world_size - 1) * devices


def _standalone_gloo(store: Any, rank: int, world_size: int, timeout: float) -> Any:
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=timeout)
    ifnames = [x for x in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if x]
    opts._devices = ([dist.ProcessGroupGloo.create_device(interface=x) for x in ifnames] if ifnames
                     else [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")])
    return dist.ProcessGroupGloo(store, rank, world_size, opts)
