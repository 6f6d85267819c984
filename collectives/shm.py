"""Shared-memory payloads between ranks of one host (like NCCL's SHM transport); ZeroMQ still carries the messages.

Through a socket a payload is copied twice by the kernel (sender -> socket buffer -> receiver), in pieces, with a
wake-up per piece. Between processes of one host the sender can instead write the payload once into a memory
segment the receiver has mapped, and send only the header over ZeroMQ:

    sender:    outbox[dst][offset : offset + n] = payload          (one memcpy)
               send header {"shm": [name, size, offset, dtype, shape]} over ZeroMQ
    receiver:  view = inbox[src][offset : offset + n]               (no copy: combine reads it directly)

The outbox is one segment per destination, as large as the largest buffer sent in one collective; a collective
writes each chunk at the chunk's own offset. A region is rewritten only after the receiver has consumed it:
the ring's causality (a chunk comes back to its sender only after every rank, the receiver included, has combined
it) plus the acknowledgement that ends every pass, which the ring needs anyway for zero-copy sends.

Segments live in /dev/shm as `pslab-<job>-<src>-<dst>-<generation>`; the receiver unlinks a name as soon as it has
mapped it, and the sender unlinks its own on close, so nothing outlives the ranks but what a crash leaves behind.
A receiver opens only names of that form (never a path) whose source is the sender and whose destination is
itself, only regular files of its own account (no symlink, no directory), at least as large as announced, checks
offset + size against the segment, and maps it read-only; anything else, and any error while opening or mapping,
is a `WireError` (the message is dropped and counted).
"""

from __future__ import annotations

import math
import mmap
import os
import re
import stat
import warnings

import torch

from . import wire
from .cleanup import note_shm_job
from .errors import WireError

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"^pslab-(?P<job>[0-9a-f]{12})-(?P<src>\d+)-(?P<dst>\d+)-\d+$")  # pslab-<job>-<src>-<dst>-<gen>


def available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


class Outbox:
    """The sender's side: one growable segment per destination."""

    def __init__(self, job: str, src: int, dst: int) -> None:
        self.job, self.src, self.dst = job, src, dst
        note_shm_job(job)                 # swept by whoever started this process, even if it is killed
        self.gen, self.size, self.name = 0, 0, ""
        self.mm: mmap.mmap | None = None
        self.bytes: torch.Tensor | None = None

    def reserve(self, nbytes: int) -> None:
        """Make room for `nbytes`; call only between collectives (a new segment replaces the old one)."""
        if nbytes <= self.size:
            return
        self.close()
        self.gen += 1
        size = max(nbytes, 1 << 20)
        name = f"pslab-{self.job}-{self.src}-{self.dst}-{self.gen}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # allocate now: a sparse tmpfs file that cannot be backed later kills the writer with SIGBUS
            os.posix_fallocate(fd, 0, size)
            self.mm = mmap.mmap(fd, size)
        except OSError:
            os.close(fd)
            os.unlink(path)
            self.size, self.name = 0, ""                 # nothing reserved: the caller falls back to sockets
            raise
        os.close(fd)
        self.size, self.name = size, name
        self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)

    def write(self, offset: int, t: torch.Tensor) -> list:
        """Copy `t` to `offset`; returns the descriptor that goes into the message header."""
        n = t.numel() * t.element_size()
        if n == 0:
            offset = 0
        if offset < 0 or offset + n > self.size:
            raise ValueError(f"shm write of {n} bytes at {offset} exceeds the reserved {self.size}")
        if n:
            self.bytes[offset:offset + n].view(t.dtype).copy_(t.reshape(-1))
        return [self.name, self.size, offset, wire.wire_dtype(t), list(t.shape)]

    def close(self) -> None:
        if self.mm is not None:
            self.bytes = None
            try:
                self.mm.close()
            except BufferError:  # a view is still alive somewhere; the mapping goes with the process
                pass
            self.mm = None
        if self.name:
            try:
                os.unlink(os.path.join(SHM_DIR, self.name))
            except FileNotFoundError:
                pass  # the receiver already unlinked it after mapping


class Inbox:
    """The receiver's side: the current mapping of each sender's segment. With `rank`, only segments addressed
    to that rank are accepted."""

    def __init__(self, rank: int | None = None) -> None:
        self.rank = rank
        self.maps: dict[int, tuple[str, mmap.mmap]] = {}
        self._bytes: dict[int, tuple[mmap.mmap, torch.Tensor]] = {}   # one uint8 tensor per mapping: every view
                                                                       # shares its storage (ps.flat merges them)

    def view(self, src: int, desc: object, job: str | None = None) -> torch.Tensor:
        """Validate a header's shm descriptor and return a read-only tensor view of the payload. With `job` (the
        job id the sender published), only that sender's own segments are accepted."""
        if not (isinstance(desc, list) and len(desc) == 5):
            raise WireError("shm descriptor must be [name, size, offset, dtype, shape]")
        name, size, offset, dtype, shape = desc
        m = _NAME.match(name) if isinstance(name, str) else None
        if (m is None or int(m["src"]) != src or (self.rank is not None and int(m["dst"]) != self.rank)
                or (job is not None and m["job"] != job)):
            raise WireError(f"shm segment name {name!r:.60} is not one rank {src} may use")
        if not (_is_int(size) and _is_int(offset) and isinstance(shape, list) and len(shape) <= 8
                and all(_is_int(s) and 0 <= s < 1 << 48 for s in shape) and dtype in wire.WIRE_DTYPES):
            raise WireError("shm descriptor has fields of the wrong type")
        itemsize = wire._DTYPES[dtype][2]
        nbytes = math.prod(shape) * itemsize
        if offset < 0 or size <= 0 or offset + nbytes > size or offset % itemsize:
            raise WireError(f"shm payload [{offset}, {offset + nbytes}) lies outside the {size}-byte segment")
        cur = self.maps.get(src)
        if cur is None or cur[0] != name or len(cur[1]) < size:
            cur = self.maps[src] = (name, map_segment(name, size))
        if nbytes == 0:
            return torch.empty(shape, dtype=wire._DTYPES[dtype][1])
        whole = self._bytes.get(src)
        if whole is None or whole[0] is not cur[1]:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                whole = self._bytes[src] = (cur[1], torch.frombuffer(cur[1], dtype=torch.uint8))
        return whole[1][offset:offset + nbytes].view(wire._DTYPES[dtype][1]).view(shape)

    def close(self) -> None:
        self.maps.clear()
        self._bytes.clear()


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def map_segment(name: str, size: int, writable: bool = False) -> mmap.mmap:
    """Map segment `name` (read-only unless `writable`) and unlink its name; WireError for anything but a regular
    file of this account holding at least `size` bytes, and for any error on the way."""
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        raise WireError(f"shm segment {name} cannot be opened ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise WireError(f"shm segment {name} is not a regular file of this account")
        if st.st_size < size:
            raise WireError(f"shm segment {name} holds {st.st_size} bytes, less than the {size} announced")
        mm = mmap.mmap(fd, size) if writable else mmap.mmap(fd, size, prot=mmap.PROT_READ)
    except (OSError, ValueError, OverflowError) as e:
        raise WireError(f"shm segment {name} cannot be mapped ({type(e).__name__}: {e})") from None
    finally:
        os.close(fd)
    try:
        os.unlink(path)  # mapped: the name is no longer needed
    except OSError:
        pass
    return mm

