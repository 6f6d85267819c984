"""The same-host latency path: small collectives through shared-memory slots with sequence-number flags, no ZeroMQ.

Through ZeroMQ one small message costs a header encode, a socket write, an I/O-thread wake-up, a poll and a decode:
~100 µs per hop on a busy machine, while the payload copy of 4 KiB takes ~1 µs. When every rank of a group is on one
host (and no emulated `topology` is set: its link emulation lives on the zmq path), the direct exchange of small
all-reduces, broadcasts and barriers (the `small_bytes` path of zmq_group.py) goes here instead:

    channel src -> dst   one /dev/shm segment per (group, ordered pair), made by the sender, mapped by the receiver
      [0, 64)            header: magic, version, slots S, capacity C, src, dst (written before the name appears)
      [64, 72)           head: messages written (sender)      } separate cache lines: no false sharing
      [128, 136)         tail: messages consumed (receiver)   }
      slot i             64-byte slot header (group seq, op, numel, dtype, nbytes) + C payload bytes

    send message k:  wait until tail > k - S  (slot k mod S is free);  copy payload, slot header;  head = k + 1
    recv message k:  wait until head > k;  check the slot header;  reduce / copy straight from the slot;  tail = k + 1

The head store comes after the payload and slot-header stores, and x86-64 keeps stores (and loads) in program order
(TSO), so a reader that sees head > k sees the whole message; the path is enabled on x86-64 only. A large copy may
use non-temporal stores, which TSO does not order: `fence()` (a locked instruction, through a lock) drains them
before every head store. Each counter has
one writer. A message is never copied into a receive buffer: the receiver reduces from the slots, in rank order
0..N-1 exactly as the zmq direct exchange does (fused: the first two contributions land with one `torch.add(out=)`),
so the bits are the same; the sender's own contribution is read back from its own outgoing slot (no clone). Views
of the slots are cached per (slot, dtype, numel): no per-call allocation on the steady path.

Waiting (`Waiter`): a bounded spin that yields the core (`os.sched_yield`) on every poll (a busy first phase measured
slower on 2 shared cores: the peer needs the core we would hold), for at most `spin_s` (adapted to the recent
waits: twice the recent wait when it ended in the spin, shrinking by 10% per wait that did not; between 5 and
200 µs, or PSLAB_SHM_SPIN_US as the bound), then a blocking wait on the counter itself (Linux futex, 1 ms at a
time): the waiter raises its flag word, re-checks, sleeps in the kernel; the writer, after storing the counter,
wakes it if the flag is up. So ranks that outnumber the cores give theirs to the peer they wait for and are woken
as soon as it writes (a wake-up lost to the store/load race costs at most the 1 ms re-check). While blocked it
calls the transport's `interrupt` (elastic groups) and the group's `idle` (files what ZeroMQ delivered: a peer
that diverged onto another path is reported by name), and it ends at the group timeout with
`PeerTimeoutError` naming the silent rank (a killed peer cannot hang a rank).

Every message carries the group sequence number, op and numel of the sender's call: a receiver that finds another
collective, size or dtype raises `CollectiveMismatchError` naming the sender; a slot header that cannot be valid
(nbytes over the capacity or unlike numel x itemsize, unknown dtype) is a `WireError`.

Security (as shm.py): a receiver opens only the name it derives itself from the sender's job id in its signed address
record (`pslab-<job>-<src>-<dst>-c<group hash>`), never a name from the wire; only a regular file of its own account
(O_NOFOLLOW), whose header names that src, dst and the layout its size implies. It maps the channel read-write (it
writes its own counter and flag there; shm.py's payload segments stay read-only): a file of the same account, as
anything in /dev/shm that account could already open. The sender writes the file under a
random temporary name and renames it into place (the name never shows a half-written header), notes its job for the
starter's sweep (cleanup.py), and unlinks on close; the receiver unlinks the name as soon as it has mapped it.
Only a channel's first message needs the name (once mapped, a segment outlives its sender), so `close(linger)` waits
up to `linger` seconds (per peer: `lingers`) for receivers to map the names still there, like ZeroMQ's linger; a
receiver that closes first unlinks the names addressed to it that it never mapped (it will read nothing more), so a
sender does not wait out its linger for a peer that has left (a group ending in a mismatch took 5 s more to close).
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import platform
import stat
import threading
import time
import uuid
import weakref
from collections.abc import Callable

import numpy as np
import torch

from . import wire
from .cleanup import note_shm_job
from .errors import CollectiveMismatchError, PeerTimeoutError, WireError
from .ring import combine

SHM_DIR = "/dev/shm"
MAGIC = 0x3168636261_6c7370          # "pslabch1" little-endian-ish: any constant a stray file will not hold
VERSION = 1
SLOTS = 4
HEAD, TAIL = 8, 16                   # int64 indices of the two counters (bytes 64 and 128)
TAIL_WAIT, HEAD_WAIT = 9, 17         # flags: the sender sleeps on TAIL / the receiver sleeps on HEAD (own lines)
SLOT0 = 192                          # first slot's byte offset
SLOT_HDR = 128                       # 16 int64 words: seq, op, numel, dtype, nbytes, then up to 11 fields
RING_SLOTS = 256                     # descriptor channels (the ring's per-segment messages, no payload)
OPS = ("all_reduce", "broadcast", "barrier", "reduce_scatter", "all_gather")
_CODE = {wire._DTYPES[d][1]: i for i, d in enumerate(wire.WIRE_DTYPES)}     # torch dtype -> code
_OPCODE = {op: i for i, op in enumerate(OPS)}
_TORCH_DT = [wire._DTYPES[d][1] for d in wire.WIRE_DTYPES]
_ITEM = [wire._DTYPES[d][2] for d in wire.WIRE_DTYPES]


def supported() -> bool:
    """The ordering argument above holds on x86-64 (TSO); elsewhere the zmq path is used."""
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def segment_size(capacity: int, slots: int = SLOTS) -> int:
    return SLOT0 + slots * (SLOT_HDR + _align(max(capacity, 1)))


def _align(n: int) -> int:
    return (n + 63) // 64 * 64


def channel_name(job: str, src: int, dst: int, gid: str) -> str:
    return f"pslab-{job}-{src}-{dst}-c{hashlib.blake2s(gid.encode(), digest_size=6).hexdigest()}"


class _Segment:
    """A mapped channel segment: counters, slot headers and slot payload views (cached per dtype and numel)."""

    def __init__(self, mm: mmap.mmap, slots: int, capacity: int) -> None:
        self.mm, self.slots, self.capacity = mm, slots, capacity
        self.ctl = np.frombuffer(mm, np.int64, count=SLOT0 // 8)
        self.addr = self.ctl.ctypes.data
        stride = SLOT_HDR + _align(max(capacity, 1))
        self.hdr = [np.frombuffer(mm, np.int64, count=SLOT_HDR // 8, offset=SLOT0 + i * stride)
                    for i in range(slots)]
        self.data = [torch.frombuffer(mm, dtype=torch.uint8, count=max(capacity, 1),
                                      offset=SLOT0 + i * stride + SLOT_HDR) for i in range(slots)]
        self._views: dict[tuple[int, torch.dtype, int], torch.Tensor] = {}
        self.k = 0                       # messages written (sender) or consumed (receiver) so far

    def view(self, slot: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        v = self._views.get((slot, dtype, numel))
        if v is None:
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            v = self.data[slot][:nbytes].view(dtype) if nbytes else torch.empty(0, dtype=dtype)
            if len(self._views) > 64:
                self._views.clear()
            self._views[(slot, dtype, numel)] = v
        return v

    def close(self) -> None:
        self.ctl = None  # type: ignore[assignment]
        self.hdr, self.data, self._views = [], [], {}
        try:
            self.mm.close()
        except BufferError:          # a view escaped; the mapping goes with the process
            pass


_SYS_FUTEX = 202                     # x86-64 (the only platform of this path, see supported())
_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_MS = _Timespec(0, 1_000_000)
_LOCK = threading.Lock()


def fence() -> None:
    """A full memory barrier: acquiring a lock is a locked read-modify-write, which orders even non-temporal stores."""
    _LOCK.acquire()
    _LOCK.release()


def futex_wait(addr: int, value: int) -> None:
    """Sleep while the 32-bit word at `addr` holds the low 32 bits of `value`, at most 1 ms (FUTEX_WAIT, shared)."""
    v = value & 0xFFFFFFFF
    _syscall(_SYS_FUTEX, ctypes.c_void_p(addr), 0, ctypes.c_long(v - (1 << 32) if v >= 1 << 31 else v),
             ctypes.byref(_MS), None, 0)


def futex_wake(addr: int) -> None:
    _syscall(_SYS_FUTEX, ctypes.c_void_p(addr), 1, ctypes.c_long(1), None, None, 0)


class Waiter:
    """Bounded adaptive spin, then back-off sleeps; `idle()` runs while sleeping; PeerTimeoutError at the deadline."""

    MIN_SPIN, MAX_SPIN = 5e-6, 200e-6

    def __init__(self, timeout: float, idle: Callable[[], None] | None = None) -> None:
        self.timeout, self.idle = timeout, idle
        env = os.environ.get("PSLAB_SHM_SPIN_US")
        if env:
            self.MAX_SPIN = max(0.0, float(env)) * 1e-6
        self.spin_s = self.MAX_SPIN / 2
        self.spins = self.sleeps = 0          # how waits ended (visible cost of oversubscription)

    def spin(self, ready: Callable[[], bool]) -> bool:
        """The bounded adaptive spin alone: whether ready() became true within it (else the caller sleeps)."""
        now = time.perf_counter
        t0 = now()
        end_spin = t0 + self.spin_s
        while now() < end_spin:
            os.sched_yield()
            if ready():
                self.spins += 1
                self.spin_s = min(self.MAX_SPIN, max(self.MIN_SPIN, 0.5 * self.spin_s + 2 * (now() - t0)))
                return True
        self.sleeps += 1
        self.spin_s = max(min(self.MIN_SPIN, self.MAX_SPIN), self.spin_s * 0.9)   # long waits: spin less
        return False

    def until(self, ready: Callable[[], bool], op: str, seq: int, peer: int,
              word: tuple[np.ndarray, int, int, int] | None = None) -> None:
        """Return when ready(); `word` = (ctl, index, value, flag): ctl[index] == value while not ready (futex)."""
        if ready() or self.spin(ready):
            return
        deadline = time.monotonic() + self.timeout
        pause, last_idle = 20e-6, 0.0
        while not ready():
            t = time.monotonic()
            if t >= deadline:
                raise PeerTimeoutError(op, seq, peer, self.timeout, "shared-memory channel")
            if self.idle is not None and t - last_idle >= 1e-3:
                self.idle()
                last_idle = t
            if word is not None:
                ctl, i, value, flag = word
                ctl[flag] = 1
                if not ready():
                    futex_wait(ctl.ctypes.data + 8 * i, value)
                ctl[flag] = 0
            else:
                time.sleep(pause)
                pause = min(2 * pause, 1e-3)


class Channels:
    """The shared-memory channels of one group: outgoing ones made on first use, incoming ones mapped on first use."""

    def __init__(self, job: str, rank: int, ranks: tuple[int, ...], gid: str, capacity: int,
                 peer_job: Callable[[int], str], waiter: Waiter, slots: int = SLOTS) -> None:
        self.job, self.me, self.ranks, self.gid, self.capacity = job, rank, ranks, gid, capacity
        self.slots = slots
        self.peer_job, self.waiter = peer_job, waiter
        self.out: dict[int, _Segment] = {}
        self.inc: dict[int, _Segment] = {}
        self._names: list[str] = []
        self._unlink = weakref.finalize(self, _unlink_all, self._names)
        note_shm_job(job)
        _OPEN.add(self)

    # ---- segments ------------------------------------------------------------------------------------------------
    def _outgoing(self, dst: int) -> _Segment:
        seg = self.out.get(dst)
        if seg is None:
            seg = self.out[dst] = self._create(self.ranks[dst])
        return seg

    def _create(self, g: int) -> _Segment:
        name = channel_name(self.job, self.ranks[self.me], g, self.gid)
        size = segment_size(self.capacity, self.slots)
        tmp = os.path.join(SHM_DIR, f"pslab-{self.job}-t{uuid.uuid4().hex[:12]}")
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)      # backed now: no SIGBUS later on a full /dev/shm
            mm = mmap.mmap(fd, size)
        except OSError:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        hdr = np.frombuffer(mm, np.int64, count=8)
        hdr[:6] = (MAGIC, VERSION, self.slots, self.capacity, self.ranks[self.me], g)
        del hdr
        self._names.append(name)
        os.rename(tmp, os.path.join(SHM_DIR, name))
        return _Segment(mm, self.slots, self.capacity)

    def _incoming(self, src: int, op: str, seq: int) -> _Segment:
        seg = self.inc.get(src)
        if seg is None:
            g = self.ranks[src]
            name = self._inbound_name(g)
            box: list[_Segment] = []
            self.waiter.until(lambda: self._try_map(name, g, box), op, seq, g)
            seg = self.inc[src] = box[0]
        return seg

    def _inbound_name(self, g: int) -> str:
        """The name of global rank g's channel to this rank (KeyError: no address of g read yet)."""
        return channel_name(self.peer_job(g), g, self.ranks[self.me], self.gid)

    def _try_map(self, name: str, g: int, box: list) -> bool:
        """Map the sender's segment if it is there and valid (else False: not yet, or not a segment of that rank)."""
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size < SLOT0:
                return False
            mm = mmap.mmap(fd, st.st_size)
        except (OSError, ValueError):
            return False
        finally:
            os.close(fd)
        h = np.frombuffer(mm, np.int64, count=8).tolist()
        if (h[0] != MAGIC or h[1] != VERSION or h[2] != self.slots or h[3] != self.capacity
                or h[4] != g or h[5] != self.ranks[self.me] or st.st_size != segment_size(h[3], h[2])):
            mm.close()
            return False
        try:
            os.unlink(path)                       # mapped: the name is no longer needed
        except OSError:
            pass
        box.append(_Segment(mm, h[2], h[3]))
        return True

    # ---- messages ------------------------------------------------------------------------------------------------
    def post(self, dst: int, op: str, seq: int, t: torch.Tensor) -> torch.Tensor:
        """Write `t` as the next message to group-rank `dst`; returns the slot view holding it."""
        seg = self._outgoing(dst)
        k = seg.k
        ctl = seg.ctl
        if ctl[TAIL] <= k - seg.slots:
            self.waiter.until(lambda: ctl[TAIL] > k - seg.slots, op, seq, self.ranks[dst],
                              (ctl, TAIL, k - seg.slots, TAIL_WAIT))
        slot = k % seg.slots
        dt = _CODE.get(t.dtype)
        if dt is None:
            wire.wire_dtype(t)                  # raises the WireError naming the dtypes the wire carries
        n = t.numel()
        v = seg.view(slot, t.dtype, n)
        v.copy_(t)
        seg.hdr[slot][:5] = (seq, _OPCODE[op], n, dt, n * t.element_size())
        seg.k = k + 1
        fence()
        ctl[HEAD] = k + 1
        if ctl[HEAD_WAIT]:
            futex_wake(seg.addr + 8 * HEAD)
        return v

    def take(self, src: int, op: str, seq: int, like: torch.Tensor) -> tuple[_Segment, torch.Tensor]:
        """Wait for the next message from group-rank `src`, check it against this rank's call; returns the segment
        (hand it to `release` when done reading) and the slot view."""
        seg = self._incoming(src, op, seq)
        k = seg.k
        ctl = seg.ctl
        g = self.ranks[src]
        if ctl[HEAD] <= k:
            self.waiter.until(lambda: ctl[HEAD] > k, op, seq, g, (ctl, HEAD, k, HEAD_WAIT))
        slot = k % seg.slots
        s_seq, s_op, numel, dt, nbytes = seg.hdr[slot][:5].tolist()
        if not (0 <= dt < len(_ITEM) and 0 <= s_op < len(OPS) and 0 <= numel and nbytes == numel * _ITEM[dt]
                and nbytes <= seg.capacity):
            raise WireError(f"{op} #{seq}: rank {g}'s shared-memory slot header is invalid (op {s_op}, dtype {dt}, "
                            f"{numel} elements in {nbytes} of {seg.capacity} bytes)")
        if s_seq != seq or OPS[s_op] != op or numel != like.numel():
            raise CollectiveMismatchError(
                f"collective #{seq} of group {self.gid}: rank {g} called {OPS[s_op]}(numel={numel}) as its "
                f"collective #{s_seq} while rank {self.ranks[self.me]} called {op}(numel={like.numel()}); rank {g} "
                "diverged from this rank's program order")
        if _TORCH_DT[dt] != like.dtype:
            raise CollectiveMismatchError(f"{op} #{seq}: rank {g} sent {numel} x {_TORCH_DT[dt]}, this rank expects "
                                          f"{like.numel()} x {like.dtype}")
        return seg, seg.view(slot, like.dtype, numel)

    def post_fields(self, dst: int, op: str, seq: int, n_call: int, dtype: torch.dtype, numel: int,
                    fields: tuple[int, ...]) -> None:
        """A message without payload (a descriptor: where the payload lies, see zmq_group._dsend): the call's
        (seq, op, numel), the payload's dtype and numel, and up to 11 more integers."""
        seg = self._outgoing(dst)
        k, ctl = seg.k, seg.ctl
        if ctl[TAIL] <= k - seg.slots:
            self.waiter.until(lambda: ctl[TAIL] > k - seg.slots, op, seq, self.ranks[dst],
                              (ctl, TAIL, k - seg.slots, TAIL_WAIT))
        dt = _CODE.get(dtype)
        if dt is None:
            raise WireError(f"dtype {dtype} is not supported on the wire; use one of {', '.join(wire.WIRE_DTYPES)}")
        seg.hdr[k % seg.slots][:5 + len(fields)] = (seq, _OPCODE[op], n_call, dt, numel, *fields)
        seg.k = k + 1
        fence()
        ctl[HEAD] = k + 1
        if ctl[HEAD_WAIT]:
            futex_wake(seg.addr + 8 * HEAD)

    def take_fields(self, src: int, op: str, seq: int, n_call: int, like: torch.Tensor, nfields: int) -> list[int]:
        """The next descriptor from group-rank `src`, checked against this rank's call and `like` (the slice the
        payload lands in); its slot is free again when this returns."""
        seg = self._incoming(src, op, seq)
        k, ctl = seg.k, seg.ctl
        g = self.ranks[src]
        if ctl[HEAD] <= k:
            self.waiter.until(lambda: ctl[HEAD] > k, op, seq, g, (ctl, HEAD, k, HEAD_WAIT))
        h = seg.hdr[k % seg.slots][:5 + nfields].tolist()
        s_seq, s_op, s_n, dt, numel = h[:5]
        if not (0 <= dt < len(_ITEM) and 0 <= s_op < len(OPS)):
            raise WireError(f"{op} #{seq}: rank {g}'s shared-memory descriptor is invalid (op {s_op}, dtype {dt})")
        if s_seq != seq or OPS[s_op] != op or s_n != n_call:
            raise CollectiveMismatchError(
                f"collective #{seq} of group {self.gid}: rank {g} called {OPS[s_op]}(numel={s_n}) as its "
                f"collective #{s_seq} while rank {self.ranks[self.me]} called {op}(numel={n_call}); rank {g} "
                "diverged from this rank's program order")
        if _TORCH_DT[dt] != like.dtype or numel != like.numel():
            raise CollectiveMismatchError(f"{op} #{seq}: rank {g} sent {numel} x {_TORCH_DT[dt]}, this rank expects "
                                          f"{like.numel()} x {like.dtype}")
        seg.k = k + 1
        ctl[TAIL] = k + 1
        if ctl[TAIL_WAIT]:
            futex_wake(seg.addr + 8 * TAIL)
        return h[5:]

    @staticmethod
    def release(seg: _Segment) -> None:
        seg.k += 1
        seg.ctl[TAIL] = seg.k
        if seg.ctl[TAIL_WAIT]:
            futex_wake(seg.addr + 8 * TAIL)

    def pending(self, seq: int) -> list[tuple[int, str, int, int]]:
        """(global src, op, numel, seq) of messages waiting in the mapped incoming channels for collectives up to
        `seq` (a rank on the zmq path at `seq` uses this to spot a peer that took this path instead)."""
        out = []
        for src in range(len(self.ranks)):
            if src != self.me and src not in self.inc:
                g = self.ranks[src]
                box: list[_Segment] = []
                try:
                    name = self._inbound_name(g)
                except KeyError:               # no address of that peer read yet
                    continue
                if self._try_map(name, g, box):
                    self.inc[src] = box[0]
        for src, seg in self.inc.items():
            if seg.ctl[HEAD] > seg.k:
                s_seq, s_op, numel = seg.hdr[seg.k % seg.slots][:3].tolist()
                if s_seq <= seq and 0 <= s_op < len(OPS):
                    out.append((self.ranks[src], OPS[s_op], numel, s_seq))
        return out

    def close(self, linger: float = 0.0, lingers: dict[int, float] | None = None) -> None:
        """Unmap and unlink; first give each receiver (global rank g) up to lingers.get(g, linger) seconds to map
        a name it has not mapped yet (it is gone once mapped). Names addressed to this rank that it never mapped are
        unlinked first: it will not read them, and their senders then need not linger for it."""
        for src in range(len(self.ranks)):
            if src != self.me and src not in self.inc:
                g = self.ranks[src]
                try:
                    os.unlink(os.path.join(SHM_DIR, self._inbound_name(g)))
                except (KeyError, OSError):        # no address of that peer read yet / no such name (never sent)
                    pass
        t0 = time.monotonic()
        for dst, seg in self.out.items():
            g = self.ranks[dst]
            path = os.path.join(SHM_DIR, channel_name(self.job, self.ranks[self.me], g, self.gid))
            limit = t0 + (lingers or {}).get(g, linger)
            while seg.k and os.path.lexists(path) and time.monotonic() < limit:
                time.sleep(1e-3)
        for seg in (*self.out.values(), *self.inc.values()):
            seg.close()
        self.out.clear()
        self.inc.clear()
        self._unlink()


_OPEN: weakref.WeakSet[Channels] = weakref.WeakSet()


def close_job(job: str, linger: float = 0.0, lingers: dict[int, float] | None = None) -> None:
    """Close the channels of every group on the transport with shm job id `job` (its owner is closing it)."""
    for ch in [c for c in _OPEN if c.job == job]:
        ch.close(linger, lingers)


def _unlink_all(names: list[str]) -> None:
    for n in names:
        try:
            os.unlink(os.path.join(SHM_DIR, n))
        except OSError:
            pass          # the receiver unlinked it after mapping


_FUSED = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum}   # avg: a sum here


def reduce_into(buf: torch.Tensor, parts: list[torch.Tensor], op: str) -> None:
    """buf <- parts[0] (op) parts[1] (op) ... left to right: the zmq direct exchange's order, first step fused."""
    if len(parts) == 1:
        buf.copy_(parts[0])
        return
    _FUSED[op](parts[0], parts[1], out=buf)           # check_op allows only these four
    for p in parts[2:]:
        combine(buf, p, op)
