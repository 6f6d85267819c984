"""Bytes a group's TCP connections carried, as the kernel counted them: how the `torch` backend's traffic is observed.

gloo sends over TCP connections it opens when a group forms and reports no byte counts. The kernel keeps them per
socket: `getsockopt(IPPROTO_TCP, TCP_INFO)` returns `struct tcp_info` (linux/tcp.h; the fields below since Linux
4.19), from which, for one socket,

    written  = tcpi_bytes_sent − tcpi_bytes_retrans + tcpi_notsent_bytes     bytes the process handed to the socket
    received = tcpi_bytes_received                                           bytes that arrived from the peer

(`bytes_sent` counts what TCP transmitted, retransmissions included; `notsent_bytes` what still waits in the send
queue, so `written` is exact the moment gloo reports an op complete, even if the kernel has not sent it all yet).
That is TCP *payload*: gloo's own 48-byte header per message is in it (6 × 8 bytes: nbytes, opcode, slot, offset,
length, roffset), TCP/IP headers are not. `ss -ti` prints the same counters.

A group's sockets are the connected TCP sockets that appeared in this process while it formed (`new_sockets`, a diff
of /proc/self/fd; each one's ports and whether it listens read with getsockopt/getsockname/getpeername on its
descriptor, checked to be the same inode -- not from /proc/self/net/tcp{,6}, whose every read walks the kernel's whole
connection table: 7 ms idle, ~25 ms on a busy machine, for each rank and group), less those of the rendezvous store (a
connection to its port, or one it accepted, if this process serves it). gloo opens exactly one connection to each peer
per device, so a group of N ranks must show (N−1) × devices of them: any other count (a socket another thread opened
meanwhile, torch's debug wrapper group) makes the group not observable rather than wrongly counted; so does
TORCH_GLOO_LAZY_INIT, whatever is found (gloo connects at each peer's first op, so a fast peer's may or may not have
landed before this rank looks). Each socket is remembered with its inode: a descriptor that gloo closed and the
process reused for something else stops being read, never misread.

`SocketMeter.claim()` returns the bytes written and received since the previous claim. The torch backend claims
once at the end of each op it ran on the group (a group runs one collective at a time), so every byte is counted
once and belongs to the op that sent it. p2p sends are claimed when their waits return, receives with their
connection's next claim (torch_group's `_settle`: one read a hop), on the
peer's connection only once `label_peers` has learnt which connection leads to which rank: a connection is the same
port pair seen from both ends, (local, remote) here and (remote, local) there, so each rank publishes its pairs in
the rendezvous store under the pair's name, then a flag saying whether it could (under keys of the group's own),
and reads its peers' (one set and one read per connection and per peer, once per group; a rank that observes
nothing publishes "0", so no peer waits for it). Reading one connection costs ~4 µs (a `getsockopt` and an
`fstat`), so a pipeline's many p2p waits on a 4-rank group pay a third of what reading all three did. Unlabelled
(a peer without labels, the store not answering in time, a pair not found), a wait claims every connection: the
total is still exact, the split between several in flight is not.
Where nothing can be observed (NCCL on GPUs, a kernel without these fields, no socket found) `observable` is False
and the caller says so instead of printing a number.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import threading
from datetime import timedelta
from typing import Any

_TCP_INFO = getattr(socket, "TCP_INFO", 11)
_INFO_LEN = 232                       # struct tcp_info up to tcpi_snd_wnd (Linux >= 5.4; 216 suffice)
LAZY_OFF = frozenset({"", "0", "false", "no", "off"})   # TORCH_GLOO_LAZY_INIT values that leave gloo eager
_NOTSENT, _BYTES_RECEIVED, _BYTES_SENT, _BYTES_RETRANS = 144, 128, 200, 208   # offsets of the fields used
_NEEDED = _BYTES_RETRANS + 8
# the four counters in one unpack, from _BYTES_RECEIVED on: received, notsent, sent, retrans (native order, no padding)
_COUNTERS = struct.Struct(f"=Q{_NOTSENT - _BYTES_RECEIVED - 8}xI{_BYTES_SENT - _NOTSENT - 4}xQQ")
_NS = "pslab_sockmeter/"             # store keys: {ns}{rank} = "1" | "0" (labelled or not), {ns}{local}-{remote} = rank

try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _getsockopt = _libc.getsockopt
    _getsockopt.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32)]
except (OSError, AttributeError):     # not a libc platform: nothing observable
    _getsockopt = None


def _tcp_info(fd: int, buf: ctypes.Array) -> bool:
    """Whether the socket's tcp_info was read into `buf` (False: `fd` is not a TCP socket or the kernel's struct lacks
    the byte counters)."""
    if _getsockopt is None:
        return False
    n = ctypes.c_uint32(_INFO_LEN)
    return _getsockopt(fd, socket.IPPROTO_TCP, _TCP_INFO, buf, ctypes.byref(n)) == 0 and n.value >= _NEEDED


def socket_fds() -> dict[int, int]:
    """{descriptor: inode} of every socket this process holds now."""
    out = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out[int(name)] = int(link[8:-1])
    return out


def _int_opt(fd: int, level: int, opt: int) -> int | None:
    """An integer socket option of `fd` (None: not readable)."""
    v, n = ctypes.c_int(0), ctypes.c_uint32(4)
    if _getsockopt is None or _getsockopt(fd, level, opt, ctypes.byref(v), ctypes.byref(n)) != 0:
        return None
    return v.value


def _port(call: Any, fd: int) -> int | None:
    """The port of getsockname / getpeername on `fd` (sockaddr_in and sockaddr_in6 both hold it big-endian at byte
    2), or None (not connected)."""
    buf, n = ctypes.create_string_buffer(128), ctypes.c_uint32(128)
    if call(fd, buf, ctypes.byref(n)) != 0 or n.value < 4:
        return None
    return int.from_bytes(buf.raw[2:4], "big")


def _tcp_ports(fd: int, ino: int) -> tuple[int, int, bool] | None:
    """(local port, remote port, listening) of descriptor `fd` if it is still socket `ino` and a TCP socket that
    listens or is connected (else None): read with getsockopt / getsockname / getpeername, which change nothing."""
    try:
        if os.fstat(fd).st_ino != ino:                        # closed and reused meanwhile: not that socket
            return None
    except OSError:
        return None
    if (_int_opt(fd, socket.SOL_SOCKET, socket.SO_DOMAIN) not in (socket.AF_INET, socket.AF_INET6)
            or _int_opt(fd, socket.SOL_SOCKET, socket.SO_TYPE) != socket.SOCK_STREAM):
        return None
    local = _port(_libc.getsockname, fd)
    if local is None:
        return None
    if _int_opt(fd, socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        return local, 0, True
    remote = _port(_libc.getpeername, fd)
    return None if remote is None else (local, remote, False)


class SocketMeter:
    """Written / received TCP payload bytes of a fixed set of sockets, claimed as deltas (thread-safe)."""

    def __init__(self, sockets: list[tuple[int, int]], why_not: str = "",
                 ports: list[tuple[int, int]] | None = None) -> None:
        """why_not: why the group cannot be observed (then `sockets` is ignored); ports: each socket's (local port,
        remote port), for `label_peers`."""
        self.sockets = [] if why_not else list(sockets)       # (fd, inode)
        self.ports = list(ports) if ports is not None and len(ports) == len(self.sockets) else []
        self._of_peer: dict[int, list[tuple[int, int]]] = {}  # group rank -> its sockets, once labelled
        self._buf = ctypes.create_string_buffer(_INFO_LEN)
        self._lock = threading.Lock()
        self._last: dict[tuple[int, int], tuple[int, int]] = {}
        self.why_not = why_not or ("" if self.sockets else "no connection of the group was found")
        self.observable = not self.why_not
        self._read_all(self.sockets)           # the baseline: what formation itself sent is nobody's op

    @classmethod
    def new_sockets(cls, before: dict[int, int], store_ports: tuple[int, ...] = (), expected: int | None = None
                    ) -> SocketMeter:
        """A meter over the connected TCP sockets that are in `socket_fds()` now but were not in `before` (less the
        store's); not observable unless there are exactly `expected` of them (when given)."""
        if _getsockopt is None:
            return cls([], "the kernel's TCP_INFO cannot be read here")
        if expected is not None and os.environ.get("TORCH_GLOO_LAZY_INIT", "0").strip().lower() not in LAZY_OFF:
            return cls([], "TORCH_GLOO_LAZY_INIT is set: gloo connects at each peer's first op, after the group "
                           "formed, so its connections cannot be told apart")
        buf = ctypes.create_string_buffer(_INFO_LEN)
        held = sorted(socket_fds().items())
        tcp_of = {fd: _tcp_ports(fd, ino) for fd, ino in held}
        serving = {t[0] for t in tcp_of.values() if t is not None and t[2]}
        found, ports = [], []
        for fd, ino in held:
            tcp = tcp_of[fd]
            if before.get(fd) == ino or tcp is None or tcp[2]:    # held before the group formed, not TCP, listening
                continue
            local, remote, _ = tcp
            if remote in store_ports or (local in store_ports and local in serving):
                continue                        # the store's: a client connection, or one this process accepted
            if not _tcp_info(fd, buf):
                return cls([], "the kernel's TCP_INFO has no byte counters (Linux < 4.19)")
            found.append((fd, ino))
            ports.append((local, remote))
        if expected is not None and len(found) != expected:
            return cls([], f"found {len(found)} new TCP connections where gloo opens {expected}: "
                           "TORCH_GLOO_LAZY_INIT, torch's debug wrapper group or another thread's socket")
        return cls(found, ports=ports)

    def label_peers(self, store: Any, rank: int, world_size: int, timeout: float = 30.0, ns: str = _NS) -> bool:
        """Learn which group rank each socket leads to, through `store` (every member calls this once, right after
        the group formed; `rank` is this process's rank in the group, `ns` a key prefix of this group's own). Every
        member first publishes its connections' port pairs (if it could tell them), then a flag saying whether it
        did, so a member that could not (not observable) costs its peers no wait. Each connection must come out as a
        peer's, every peer with as many as the others; else (or when the store does not answer within `timeout`
        seconds) nothing is labelled and claims read every socket. Returns whether the sockets were labelled."""
        mine = self.observable and bool(self.ports)
        try:
            for local, remote in self.ports if mine else ():
                store.set(f"{ns}{local}-{remote}", str(rank))
            store.set(f"{ns}{rank}", "1" if mine else "0")
            flags = [f"{ns}{r}" for r in range(world_size) if r != rank]
            store.wait(flags, timedelta(seconds=timeout))
            if not mine or any(store.get(k) != b"1" for k in flags):
                return False
            peers = [int(store.get(f"{ns}{remote}-{local}")) for local, remote in self.ports]
        except Exception:               # noqa: BLE001 -- a store that fails or times out leaves claims whole
            return False
        of_peer: dict[int, list[tuple[int, int]]] = {}
        for key, peer in zip(self.sockets, peers):
            of_peer.setdefault(peer, []).append(key)
        if (set(of_peer) != set(range(world_size)) - {rank}
                or len({len(v) for v in of_peer.values()}) != 1):
            return False
        self._of_peer = of_peer
        return True

    def _read(self, fd: int, ino: int) -> tuple[int, int] | None:
        try:
            if os.fstat(fd).st_ino != ino:
                return None
        except OSError:
            return None
        buf = self._buf
        if not _tcp_info(fd, buf):
            return None
        received, notsent, sent, retrans = _COUNTERS.unpack_from(buf, _BYTES_RECEIVED)
        return sent - retrans + notsent, received

    def _read_all(self, sockets: list[tuple[int, int]]) -> tuple[int, int]:
        """Bytes written and received since the last read, summed over `sockets` still open."""
        dw = dr = 0
        for key in sockets:
            now = self._read(*key)
            if now is None:                    # closed (a peer left, the group is gone): its last count stands
                continue
            w0, r0 = self._last.get(key, now)
            dw, dr = dw + now[0] - w0, dr + now[1] - r0
            self._last[key] = now
        return dw, dr

    def knows(self, peer: int | None) -> bool:
        """Whether a claim for group rank `peer` reads that peer's connections alone (they are labelled)."""
        return peer in self._of_peer

    def claim(self, peer: int | None = None) -> tuple[int, int]:
        """(written, received) bytes since the previous claim: on the connections to group rank `peer` if the sockets
        are labelled (`label_peers`), else on all of them."""
        with self._lock:
            return self._read_all(self._of_peer.get(peer, self.sockets) if peer is not None else self.sockets)


__all__ = ["SocketMeter", "socket_fds"]
