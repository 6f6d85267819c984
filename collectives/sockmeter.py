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
of /proc/self/fd), less those of the rendezvous store (its port). Each is remembered with its inode: a descriptor
that gloo closed and the process reused for something else stops being read, never misread.

`SocketMeter.claim()` returns the bytes written and received since the previous claim. The torch backend claims
once at the end of each op it ran on the group (a group runs one collective at a time), so every byte is counted
once and belongs to the op that sent it; p2p sends and receives are claimed when their waits return (several in
flight on one group share their claims: the total is exact, the split between them is not). Where nothing can be observed (NCCL on
GPUs, a kernel without these fields, no socket found) `observable` is False and the caller says so instead of
printing a number.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import threading

_TCP_INFO = getattr(socket, "TCP_INFO", 11)
_INFO_LEN = 232                       # struct tcp_info up to tcpi_snd_wnd (Linux >= 5.4; 216 suffice)
_NOTSENT, _BYTES_RECEIVED, _BYTES_SENT, _BYTES_RETRANS = 144, 128, 200, 208   # offsets of the fields used
_NEEDED = _BYTES_RETRANS + 8
_ESTABLISHED, _LISTEN = 1, 10        # tcpi_state values (TCP_ESTABLISHED, TCP_LISTEN)

try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _getsockopt = _libc.getsockopt
    _getsockopt.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32)]
except (OSError, AttributeError):     # not a libc platform: nothing observable
    _getsockopt = None


def _tcp_info(fd: int, buf: ctypes.Array) -> bytes | None:
    """The socket's tcp_info, or None if `fd` is not a TCP socket or the kernel's struct lacks the byte counters."""
    if _getsockopt is None:
        return None
    n = ctypes.c_uint32(_INFO_LEN)
    if _getsockopt(fd, socket.IPPROTO_TCP, _TCP_INFO, buf, ctypes.byref(n)) != 0 or n.value < _NEEDED:
        return None
    return buf.raw[:n.value]


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


def _ports(fd: int) -> tuple[int, int]:
    """(local port, peer port) of a connected inet socket (0 where unknown)."""
    try:
        s = socket.socket(fileno=fd)          # family and type from the descriptor
    except OSError:
        return 0, 0
    try:
        try:
            local = s.getsockname()
            peer = s.getpeername()
        except OSError:
            return 0, 0
        return (local[1] if isinstance(local, tuple) else 0), (peer[1] if isinstance(peer, tuple) else 0)
    finally:
        s.detach()                    # the descriptor stays gloo's


class SocketMeter:
    """Written / received TCP payload bytes of a fixed set of sockets, claimed as deltas (thread-safe)."""

    def __init__(self, sockets: list[tuple[int, int]]) -> None:
        self.sockets = list(sockets)          # (fd, inode)
        self._buf = ctypes.create_string_buffer(_INFO_LEN)
        self._lock = threading.Lock()
        self._last: dict[tuple[int, int], tuple[int, int]] = {}
        self.observable = bool(self.sockets)
        self._read_all()                       # the baseline: what formation itself sent is nobody's op

    @classmethod
    def new_sockets(cls, before: dict[int, int], exclude_ports: tuple[int, ...] = ()) -> SocketMeter:
        """A meter over the connected TCP sockets that are in `socket_fds()` now but were not in `before`."""
        buf = ctypes.create_string_buffer(_INFO_LEN)
        found = []
        for fd, ino in sorted(socket_fds().items()):
            if before.get(fd) == ino:
                continue
            info = _tcp_info(fd, buf)
            if info is None or info[0] == _LISTEN:
                continue
            if exclude_ports and set(_ports(fd)) & set(exclude_ports):
                continue
            found.append((fd, ino))
        return cls(found)

    def _read(self, fd: int, ino: int) -> tuple[int, int] | None:
        try:
            if os.fstat(fd).st_ino != ino:
                return None
        except OSError:
            return None
        info = _tcp_info(fd, self._buf)
        if info is None:
            return None
        (notsent,) = struct.unpack_from("I", info, _NOTSENT)
        (received,) = struct.unpack_from("Q", info, _BYTES_RECEIVED)
        sent, retrans = struct.unpack_from("QQ", info, _BYTES_SENT)
        return sent - retrans + notsent, received

    def _read_all(self) -> tuple[int, int]:
        """Bytes written and received since the last read, summed over the sockets still open."""
        dw = dr = 0
        for key in self.sockets:
            now = self._read(*key)
            if now is None:                    # closed (a peer left, the group is gone): its last count stands
                continue
            w0, r0 = self._last.get(key, now)
            dw, dr = dw + now[0] - w0, dr + now[1] - r0
            self._last[key] = now
        return dw, dr

    def claim(self) -> tuple[int, int]:
        """(written, received) bytes since the previous claim."""
        with self._lock:
            return self._read_all()


__all__ = ["SocketMeter", "socket_fds"]
