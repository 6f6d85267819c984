"""Helpers for the hostile-peer tests: sockets aimed at a rank from inside a launched job, as a member would open
them (`user="rank:0"`: with that rank's credential from PSLAB_JOB_SECRET) or as a stranger would (no credential)."""

from __future__ import annotations

import os
import time
from typing import Any

import msgpack
import numpy as np
import zmq

from pslab.collectives import wire
from pslab.collectives.auth import job_secret, plain_client
from pslab.collectives.errors import PeerTimeoutError


def endpoints(group: Any, rank: int) -> dict[str, str]:
    """{"ipc": ..., "tcp": ...} that `rank` published in the job's store (the signature, if any, cut off)."""
    record = group.tr.store.get(f"addr/{rank}").decode()
    if "#" in record:
        record = record.rpartition("#")[0]
    _, *eps = record.split("|")
    return {e.split("://")[0]: e for e in eps}


def push_to(group: Any, rank: int, via: str = "tcp", user: str | None = None) -> zmq.Socket:
    """A PUSH socket connected to `rank`'s PULL socket over `via`; with `user`, authenticated as that role."""
    s = zmq.Context.instance().socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 2000)
    s.setsockopt(zmq.SNDTIMEO, 5000)
    if user is not None:
        plain_client(s, job_secret(), user)
    s.connect(endpoints(group, rank)[via])
    return s


def message(op: str, key: list, src: int, tensors: list | None = None, seq: int = 0, **meta: Any) -> list:
    return wire.encode(op, tensors if tensors is not None else [np.zeros(4, np.float32)], seq=seq, src=src,
                       meta={"k": key, **meta})


def raw(header: dict, *frames: bytes) -> list:
    return [msgpack.packb(header, use_bin_type=True), *frames]


def drain(group: Any, until: int, seconds: float = 5.0) -> int:
    """Read the socket (filing or dropping whatever comes) until `until` messages were dropped or `seconds` pass."""
    tr = group.tr
    old, tr.timeout = tr.timeout, 0.1
    deadline = time.monotonic() + seconds
    try:
        while tr.dropped < until and time.monotonic() < deadline:
            try:
                tr.recv(0, ("never",), "drain")
            except PeerTimeoutError:
                pass
    finally:
        tr.timeout = old
    return tr.dropped


def rss() -> int:
    """Resident memory of this process, bytes."""
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def listening(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket in LISTEN state owned by one of `pids` (/proc/net/tcp, tcp6)."""
    owner: dict[str, int] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                owner[link[8:-1]] = pid
    out = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(path).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A" and f[9] in owner:
                addr, port = f[1].split(":")
                out.append((owner[f[9]], _address(addr), int(port, 16)))
    return out


def _address(hexaddr: str) -> str:
    import ipaddress
    raw_bytes = bytes.fromhex(hexaddr)
    if len(raw_bytes) == 4:
        return str(ipaddress.IPv4Address(raw_bytes[::-1]))
    words = b"".join(raw_bytes[i:i + 4][::-1] for i in range(0, 16, 4))
    return str(ipaddress.IPv6Address(words))
