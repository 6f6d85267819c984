"""The same-host doorbell lane: a registered connection's request and reply headers through a shared-memory slot pair,
woken through FIFOs, instead of as ZeroMQ messages.

Why. On one host the payloads of push and pull already travel through shared memory (ps.shm_path); what is left of
a request is its header, and a ZeroMQ request/reply costs six thread wake-ups for it (the client, its I/O thread,
the shard's I/O thread, the shard, and back) and tens of µs of CPU on each side. Measured on the 2-core machine,
2 clients x 2 servers, a round trip to both servers: ZeroMQ (ipc) 78 µs of client CPU and 37 µs per server message;
FIFO doorbells 7 µs and 3.5 µs. With 2 shards a worker pays the per-message cost twice, so this is what decides
whether a second shard on the same cores helps.

    lane (client -> one shard)  one /dev/shm segment per registration, made by the client, mapped by the shard
      [0, 64)                   header: magic, version, worker, shard, capacity C (int64 words)
      [64, 128)                 request slot: seq, nbytes            then C bytes of header
      [128 + C, 192 + C)        reply slot:   seq, nbytes            then C bytes of header
    bell                        one FIFO per process, /dev/shm/pslab-<job>-<w|s><id>-bell: the shard's is rung by
                                every client with a request, each client's by the shards with a reply; both sides
                                poll it together with their ZeroMQ sockets (zmq.Poller takes a file descriptor)

    send:  seq = -1 (being written); copy the header bytes, store nbytes, then seq (x86-64 keeps stores in order:
           TSO); ring the peer's bell
    take:  seq >= 0 and changed -> copy nbytes (<= C) out, re-read seq (changed meanwhile: torn, dropped) -> decode

Protocol. The bytes are exactly the header frame ZeroMQ would carry (collectives.wire: same limits, same handlers,
same replies), so the lane changes where a header travels, not what it says. A request takes the lane only if it is
one frame (its payload already in shared memory), the lane is free (one request in flight per lane) and no ZeroMQ
request to that shard is pending; otherwise it goes through ZeroMQ as before. Order per connection holds: a later
ZeroMQ request is sent after the lane's request was written, and the shard serves a connection's lane before each
ZeroMQ message of that connection, so it cannot overtake; a lane request is never sent behind a pending ZeroMQ one.
A reply goes back the way its request came (one too large for the slot, or with tensor frames, through ZeroMQ; the
client takes either).

Negotiation, at register over the authenticated connection: the client offers {"lane": [segment name, size],
"lane_bell": its bell}; a shard that maps the segment (collectives.shm's rules: the name carries the registered worker
and this shard, a regular file of this account; then the header must match) and opens the bell answers {"lane":
true, "lane_bell": its own}; the client uses the lane once it has opened that one. Every registration (resync, a
restarted shard) gets a new segment; the old one stays open until the register replies are in, so that an answer the
shard wrote there before it handled the register is still read. A request that times out turns the lane off until
the next registration (a late answer would land in the slot; a ZeroMQ request that timed out could still be unread at
the shard, and a lane request would overtake it); a dropped connection fails the lane's request like any other (an
answer already in the slot is dispatched first, as ZeroMQ answers that came before the drop are).

Security, as the shm path: same account only (files 0600, opened O_NOFOLLOW, type and owner checked after the open),
so another local account can open neither file. Slot bytes are copied out before they are parsed, then validated
like any ZeroMQ frame; a bell carries no data (a byte means "look"). Both sides open bells O_RDWR | O_NONBLOCK, so
ringing never blocks (a full FIFO already holds a wake-up) and never raises SIGPIPE (a FIFO with the ringer's own
read side always has a reader). x86-64 only (the ordering argument), as collectives.shm_channel.
What the lane does not defend against, like the shm payload path: a process of the job's own account (the client
that made the segment) can truncate it and so crash the shard with SIGBUS at its next look, as it could kill it with
a signal; processes of one account are one trust domain here, the worker credentials separate roles within it.
A shard serves every lane once per pass and then looks at ZeroMQ (a busy lane cannot starve remote peers).
Before sleeping in poll both sides spin a little on the slots (collectives.shm_channel.Waiter.spin: sched_yield,
5-200 µs, adaptive): an answer seen then costs no wake-up (on a virtual machine a halted core is slow to wake).
"""

from __future__ import annotations

import atexit
import mmap
import os
import re
import secrets
import stat
from typing import Any, Mapping, Sequence

import numpy as np

from pslab.collectives import shm
from pslab.collectives.cleanup import note_shm_job
from pslab.collectives.errors import WireError
from pslab.collectives.shm_channel import Waiter, supported

MAGIC = 0x656E_616C_6261_6C73          # "pslablane", little-endian-ish: a constant no stray file holds
VERSION = 1
CAPACITY = 64 * 1024                   # header bytes per slot; a larger header goes through ZeroMQ
HEADER = 64
SLOT_HDR = 64
REQUEST = HEADER
REPLY = HEADER + SLOT_HDR + CAPACITY
SIZE = HEADER + 2 * (SLOT_HDR + CAPACITY)
_BELL = re.compile(r"^pslab-(?P<job>[0-9a-f]{12})-(?P<who>[ws]\d+)-bell$")
_DISABLE = "PSLAB_PS_LANE"             # "0": never offer the lane (A/B measurements)


def enabled() -> bool:
    """Whether this process may offer or accept lanes: x86-64 with a writable /dev/shm, and not PSLAB_PS_LANE=0."""
    return os.environ.get(_DISABLE, "1") != "0" and supported()


# names this process made in /dev/shm and has not removed yet: unlinked at interpreter exit, so a client that
# exits without close() (an exception in a script, no pslab supervisor to sweep) leaves no FIFO or segment
_OWNED: dict[str, int] = {}             # name -> the pid that made it (a forked child never removes its parent's)


def _own(name: str) -> None:
    _OWNED[name] = os.getpid()


def _disown(name: str) -> None:
    _OWNED.pop(name, None)


@atexit.register
def _remove_owned() -> None:
    for name, pid in list(_OWNED.items()):
        if pid == os.getpid():
            try:
                os.unlink(os.path.join(shm.SHM_DIR, name))
            except OSError:
                pass
    _OWNED.clear()


# ---------------------------------------------------------------------------------------------- bells
class Bell:
    """This process's doorbell: a FIFO it reads (to poll) and its peers ring. `who` is "w<worker>" or "s<shard>"."""

    def __init__(self, who: str, job: str | None = None) -> None:
        self.job = job or secrets.token_hex(6)
        note_shm_job(self.job)                 # swept by whoever started this process, even if it is killed
        self.name = f"pslab-{self.job}-{who}-bell"
        path = os.path.join(shm.SHM_DIR, self.name)
        os.mkfifo(path, 0o600)
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW)
        except OSError:
            os.unlink(path)
            raise
        _own(self.name)

    def drain(self) -> None:
        """Swallow the rings so far (call before looking at the lanes: a later ring wakes the next poll)."""
        try:
            while len(os.read(self.fd, 4096)) == 4096:
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        _disown(self.name)
        try:
            os.unlink(os.path.join(shm.SHM_DIR, self.name))
        except FileNotFoundError:
            pass


def open_bell(name: Any, who: str) -> int:
    """A peer's bell, to ring: only a name of the bell form naming `who`, a FIFO of this account, mode 0600."""
    m = _BELL.match(name) if isinstance(name, str) else None
    if m is None or m["who"] != who:
        raise WireError(f"lane bell {name!r:.60} is not the bell of {who}")
    try:
        fd = os.open(os.path.join(shm.SHM_DIR, name), os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as e:
        raise WireError(f"lane bell {name} cannot be opened ({e.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISFIFO(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        os.close(fd)
        raise WireError(f"lane bell {name} is not a private FIFO of this account")
    return fd


def ring(fd: int) -> None:
    try:
        os.write(fd, b"\x01")
    except (BlockingIOError, OSError):
        pass                                   # full: the reader has wake-ups pending already


# ---------------------------------------------------------------------------------------------- slots
class _Slot:
    """One direction of a lane: (seq, nbytes) words, then up to CAPACITY bytes of header."""

    def __init__(self, mm: mmap.mmap, offset: int) -> None:
        self.mm, self.data = mm, offset + SLOT_HDR
        self.words = np.frombuffer(mm, np.int64, count=2, offset=offset)

    def put(self, seq: int, frame: Any) -> bool:
        n = len(frame)
        if not 0 < n <= CAPACITY:
            return False
        self.words[0] = -1                     # being written: a reader that looks now waits for the next pass
        self.mm[self.data:self.data + n] = frame
        self.words[1] = n
        self.words[0] = seq                    # last: a reader that sees it sees the bytes (TSO)
        return True

    def seq(self) -> int:
        return int(self.words[0])

    def take(self, seq: int) -> bytes:
        """The bytes written with `seq` (the reader saw it in the seq word); WireError if they cannot be."""
        n = int(self.words[1])
        if not 0 < n <= CAPACITY:
            raise WireError(f"lane slot claims {n} bytes; at most {CAPACITY}")
        data = self.mm[self.data:self.data + n]            # a copy: the writer cannot change what we parse
        if int(self.words[0]) != seq:
            raise WireError("lane slot rewritten while it was read")
        return data


def _header(mm: mmap.mmap) -> np.ndarray:
    return np.frombuffer(mm, np.int64, count=5)


# ---------------------------------------------------------------------------------------------- the two ends
class ClientLane:
    """A client's lane to one shard, for one registration: it makes the segment; the shard maps it."""

    def __init__(self, worker: int, shard: int, job: str, gen: int) -> None:
        note_shm_job(job)
        self.name = f"pslab-{job}-{worker}-{shard}-{gen}"         # collectives.shm's form: src worker, dst shard
        path = os.path.join(shm.SHM_DIR, self.name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        try:
            os.posix_fallocate(fd, 0, SIZE)    # backed now: a sparse file could SIGBUS a writer later
            self.mm: mmap.mmap | None = mmap.mmap(fd, SIZE)
        except OSError:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        _own(self.name)
        _header(self.mm)[:] = (MAGIC, VERSION, worker, shard, CAPACITY)
        self.request, self.reply = _Slot(self.mm, REQUEST), _Slot(self.mm, REPLY)
        self.bell = -1                         # the shard's bell (after accept)
        self.on = False
        self.inflight: int | None = None       # the seq of the request in the lane, if any

    def offer(self, bell: Bell) -> dict[str, Any]:
        return {"lane": [self.name, SIZE], "lane_bell": bell.name}

    def accept(self, reply: Mapping[str, Any], shard_id: int) -> None:
        """Use the lane if the shard mapped it and its bell opens; else give it up."""
        if reply.get("lane") is True:
            try:
                self.bell = open_bell(reply.get("lane_bell"), f"s{shard_id}")
                self.on = True
            except WireError:
                self.on = False
        if not self.on:
            self.close()

    def send(self, seq: int, frame: Any) -> bool:
        """Put request `seq` (one header frame) in the lane and ring the shard; False: send it through ZeroMQ."""
        if not self.on or self.inflight is not None or not self.request.put(seq, frame):
            return False
        self.inflight = seq
        ring(self.bell)
        return True

    def answered(self) -> bool:
        """The shard has written the reply to the request in flight."""
        return self.inflight is not None and self.reply.seq() == self.inflight

    def take_reply(self) -> bytes | None:
        """The reply to the request in flight, if the shard has written it (the lane is then free again)."""
        if not self.answered():
            return None
        seq, self.inflight = self.inflight, None
        try:
            return self.reply.take(seq)
        except WireError:
            self.on = False                    # cannot trust the slot any more: ZeroMQ until the next register
            return None

    def done(self, seq: int) -> None:
        """Request `seq` was answered another way (a reply through ZeroMQ) or failed: the lane is free."""
        if self.inflight == seq:
            self.inflight = None

    def off(self) -> None:
        """A request timed out: a late answer could still land in the slot, so no more lane until re-register."""
        self.on, self.inflight = False, None

    def close(self) -> None:
        self.on, self.inflight = False, None
        if self.bell >= 0:
            os.close(self.bell)
            self.bell = -1
        if self.mm is not None:
            self.request = self.reply = None  # type: ignore[assignment]   (their views pin the mapping)
            try:
                self.mm.close()
            except BufferError:
                pass
            self.mm = None
        _disown(self.name)
        try:
            os.unlink(os.path.join(shm.SHM_DIR, self.name))
        except FileNotFoundError:
            pass                               # the shard mapped it and unlinked the name


class ClientLanes:
    """A client's side of the protocol: its bell, its spin, and one lane per shard, renewed at every registration
    (a replaced lane with a request in flight stays open, off, until that is answered or failed)."""

    def __init__(self, worker: int, shards: int, wanted: bool) -> None:
        self.worker = worker
        self.lanes: list[ClientLane | None] = [None] * shards
        self.old: list[tuple[int, ClientLane]] = []
        self.job, self.gen = secrets.token_hex(6), 0
        self.spin = Waiter(0.0)                # before sleeping in poll, look a few µs (Waiter.spin)
        self.bell: Bell | None = None          # the shards ring it when a reply is in a lane
        if wanted and enabled():
            try:
                self.bell = Bell(f"w{worker}", self.job)
            except OSError:
                self.bell = None

    def __getitem__(self, shard: int) -> ClientLane | None:
        return self.lanes[shard]

    def offers(self, allowed: Sequence[bool]) -> list[dict[str, Any]]:
        """A new generation of lanes (where `allowed[shard]`): each shard's register offer ({} for none)."""
        self.gen += 1
        return [self._renew(i, ok) for i, ok in enumerate(allowed)]

    def _renew(self, shard: int, allowed: bool) -> dict[str, Any]:
        old, self.lanes[shard] = self.lanes[shard], None
        if old is not None:
            if old.inflight is not None:
                old.on = False                 # nothing new goes in
                self.old.append((shard, old))
            else:
                old.close()
        if self.bell is None or not allowed:
            return {}
        try:
            lane = self.lanes[shard] = ClientLane(self.worker, shard, self.job, self.gen)
        except OSError:                        # /dev/shm full: headers go through ZeroMQ
            return {}
        return lane.offer(self.bell)

    def accept(self, shard: int, reply: Mapping[str, Any], shard_id: int) -> None:
        lane = self.lanes[shard]
        if lane is not None:
            lane.accept(reply, shard_id)
            if not lane.on:
                self.lanes[shard] = None

    def free(self, shard: int) -> ClientLane | None:
        """Shard's lane if a request may go in now."""
        lane = self.lanes[shard]
        return lane if lane is not None and lane.on and lane.inflight is None else None

    def _every(self) -> list[tuple[int, ClientLane]]:
        return [(i, lane) for i, lane in enumerate(self.lanes) if lane is not None] + self.old

    def busy(self) -> bool:
        return any(lane.inflight is not None for _, lane in self._every())

    def answered(self) -> bool:
        return any(lane.answered() for _, lane in self._every())

    def replies(self, only: int | None = None) -> list[tuple[int, bytes]]:
        """(shard, reply header) of every answer in the lanes (of shard `only`); old lanes with nothing in flight
        any more are closed."""
        out = []
        for i, lane in self._every():
            if only is None or i == only:
                frame = lane.take_reply()
                if frame is not None:
                    out.append((i, frame))
        if self.old:
            for _, lane in self.old:
                if lane.inflight is None:
                    lane.close()
            self.old = [x for x in self.old if x[1].inflight is not None]
        return out

    def close(self) -> None:
        for _, lane in self._every():
            lane.close()
        self.lanes, self.old = [None] * len(self.lanes), []
        if self.bell is not None:
            self.bell.close()
            self.bell = None


class ServerLane:
    """A shard's end of one connection's lane."""

    def __init__(self, mm: mmap.mmap, bell: int, user: str | None) -> None:
        self.mm, self.bell, self.user = mm, bell, user
        self.request, self.reply = _Slot(mm, REQUEST), _Slot(mm, REPLY)
        self.last = self.request.seq()          # whatever was there before us is not a request to us
        self.inflight: int | None = None

    @classmethod
    def accept(cls, shard: int, worker: int, meta: Mapping[str, Any], user: str | None) -> "ServerLane | None":
        """The lane a register request offers, if it maps and its bell opens; None otherwise (ZeroMQ serves)."""
        desc, bell = meta.get("lane"), meta.get("lane_bell")
        if not (isinstance(desc, list) and len(desc) == 2 and isinstance(desc[0], str) and desc[1] == SIZE):
            return None
        m = shm._NAME.match(desc[0])
        if m is None or int(m["src"]) != worker or int(m["dst"]) != shard:
            return None
        try:
            mm = shm.map_segment(desc[0], SIZE, writable=True)
        except WireError:
            return None
        head = _header(mm)
        if tuple(int(x) for x in head) != (MAGIC, VERSION, worker, shard, CAPACITY):
            del head
            mm.close()
            return None
        try:
            fd = open_bell(bell, f"w{worker}")
        except WireError:
            del head
            mm.close()
            return None
        return cls(mm, fd, user)

    def waiting(self) -> bool:
        """The client wrote a request since the last take (not one being written: seq -1, looked at next pass)."""
        return self.request.seq() not in (self.last, -1)

    def take(self) -> bytes | None:
        """A new request's header bytes, if the client wrote one since the last take (WireError: unreadable)."""
        if not self.waiting():
            return None
        seq = self.last = self.request.seq()
        data = self.request.take(seq)
        self.inflight = seq
        return data

    def answer(self, seq: int, frame: Any) -> bool:
        """Reply to the lane's request `seq` through the lane and ring the client; False: use ZeroMQ."""
        if self.inflight != seq:
            return False
        self.inflight = None
        if not self.reply.put(seq, frame):
            return False
        ring(self.bell)
        return True

    def close(self) -> None:
        if self.bell >= 0:
            os.close(self.bell)
            self.bell = -1
        self.request = self.reply = None  # type: ignore[assignment]
        try:
            self.mm.close()
        except BufferError:
            pass


__all__ = ["Bell", "CAPACITY", "ClientLane", "ClientLanes", "SIZE", "ServerLane", "enabled", "open_bell", "ring"]
