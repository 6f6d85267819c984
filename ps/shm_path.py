"""Same-host fast path: push and pull payloads through shared memory, ZeroMQ carrying only the headers.

Through a socket a 4 MB gradient is copied by the kernel twice (client -> socket buffer -> server) in pieces, with a
wake-up per piece, and the weights come back the same way; for a small model on one host that, not the optimizer
step, is the cost of an update. When client and shard are on one host the payload instead takes one memcpy into a
segment the other side has mapped (`collectives.shm`, the segments the ring uses):

    push   client:  outbox[off_k : off_k + n_k] = grad_k          meta {"shm": [[key, descriptor], ...]}, no frames
           shard:   grads = views into the client's segment        the optimizer reads them in place
    pull   client:  meta {"shm_reply": true}                       "answer through your segment" (also push_pull)
           shard:   outbox[off_k : ...] = param_k                  reply meta {"shm": [[key, descriptor], ...]}
           client:  copies the values out before anything else can be written there

Negotiation. `register` carries a probe: the descriptor of a random token the client wrote into its new segment.
The shard answers {"shm": true} only if it could map that segment and read the same token, and adds a token of its
own written into its reply segment; the client uses shm replies only if it can read that one. So each direction is
proven, and two processes that do not share /dev/shm (other hosts, containers, users) fall back to frames without
an error. A segment that cannot be allocated (/dev/shm full) also falls back to frames, for that direction.
A re-register (resync) cancels the connection's parked reads with an error reply: slots start afresh.

Reuse rule. Each side rewrites a segment only when the other has consumed it: a client has at most one shm push and
one shm pull in flight per shard (more go as frames); a shard consumes a push while handling it (aggregating
policies copy the gradient), and a client copies a pull reply out as soon as it arrives. A request that times out
turns the path off for that shard and direction, since a late answer could still write into the segment.

Validation. A shard maps only names of the `collectives.shm` form that carry the registered worker's id, checks
every descriptor against the segment's size and the gradient against the shard's keys, shapes and dtypes (as for
frames), and maps client segments read-only. Only authenticated, registered connections get a link (ps.admission),
at most `max_shm_links` at once (one per worker by default; beyond: ShmLimitError). The shard's reply segment is
made lazily (a one-page probe at register, the real one at the first shm reply), freed when the link has been idle
for `shm_idle_timeout` (re-made on demand), and a link dies with its connection (unregister, or a vanished peer).
"""

from __future__ import annotations

import mmap
import os
import secrets
import warnings
from typing import Any, Mapping

import numpy as np
import torch

from collectives import shm
from collectives.cleanup import note_shm_job
from collectives.errors import WireError
from collectives.wire import wire_dtype

ALIGN = 64                      # every tensor starts on a cache line
MAX_TENSORS = 4096


def wanted(address: str) -> bool:
    """Whether the shard at `address` may share this host's memory (loopback tcp or ipc) and /dev/shm is usable."""
    local = address.startswith("ipc://") or address.startswith(("tcp://127.", "tcp://localhost:", "tcp://[::1]:"))
    return local and shm.available()


def _layout(nbytes: Mapping[str, int]) -> tuple[list[tuple[str, int]], int]:
    """(key, offset) for tensors of these sizes laid out in order, each on a cache line; and the total."""
    offs, pos = [], 0
    for k, n in nbytes.items():
        offs.append((k, pos))
        pos += -(-int(n) // ALIGN) * ALIGN
    return offs, pos


def _as_torch(a: Any) -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        return a
    with warnings.catch_warnings():              # a read-only array is only read here (the copy's source)
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(a))


def write(box: shm.Outbox, tensors: Mapping[str, Any]) -> list[list[Any]]:
    """Copy `tensors` into `box` (growing it if needed) and return their [key, descriptor] list for the header.
    A tensor that already lies at its place in the segment (a `ClientLink.buffers` view) is not copied."""
    offs, total = _layout({k: t.nbytes for k, t in tensors.items()})
    box.reserve(max(total, 1))
    base = box.bytes.data_ptr() if box.bytes is not None else -1
    out = []
    for k, off in offs:
        t = _as_torch(tensors[k]).reshape(-1)
        if t.numel() and t.data_ptr() == base + off:       # written in place: describe it, copy nothing
            out.append([k, [box.name, box.size, off, wire_dtype(t), list(t.shape)]])
        else:
            out.append([k, box.write(off, t)])
    return out


def read(box: shm.Inbox, src: int, entries: Any) -> dict[str, torch.Tensor]:
    """Validate a header's [key, descriptor] list and return read-only views (no copy) by key."""
    if not isinstance(entries, list) or len(entries) > MAX_TENSORS:
        raise WireError(f"shm entries must be a list of at most {MAX_TENSORS} [key, descriptor] pairs")
    out: dict[str, torch.Tensor] = {}
    for e in entries:
        if not (isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and len(e[0]) <= 1024):
            raise WireError("each shm entry must be [key, descriptor] with a string key")
        if e[0] in out:
            raise WireError(f"shm entries name tensor {e[0]!r:.60} twice")
        out[e[0]] = box.view(src, e[1])
    return out


class ClientLink:
    """A client's shared-memory path to one shard: its push segment, its view of the shard's reply segment."""

    def __init__(self, worker: int, shard: int, enabled: bool) -> None:
        self.worker, self.shard, self.enabled = worker, shard, enabled
        self.job = secrets.token_hex(6)
        self.outbox: shm.Outbox | None = None
        self.inbox = shm.Inbox()
        self.push_ok = self.pull_ok = False
        self.peer = shard
        self.push_seq: int | None = None          # the shm push / pull in flight, if any
        self.pull_seq: int | None = None
        self._copy: dict[int, bool] = {}          # seq -> copy flag, for every read that asked for an shm reply
        self._token = b""

    def probe(self) -> dict[str, Any]:
        """Register-meta entries offering the path: a fresh segment holding a random token (empty if disabled)."""
        self.close()
        self.push_ok = self.pull_ok = False
        if not self.enabled:
            return {}
        try:
            self.outbox = shm.Outbox(self.job, self.worker, self.shard)
            self._token = secrets.token_bytes(16)
            desc = write(self.outbox, {"token": np.frombuffer(self._token, dtype=np.uint8)})[0][1]
        except OSError:
            self.enabled = False
            self.close()
            return {}
        return {"shm_probe": desc, "shm_token": self._token.hex()}

    def accept(self, reply: Mapping[str, Any]) -> None:
        """Adopt the register reply: push through shm if the shard read our token; pull through shm if we can read
        the token the shard wrote into its reply segment (each direction proven separately)."""
        self.peer = int(reply.get("shard", self.shard))   # the shard's id, as its segment names carry it
        self.push_ok = bool(self.outbox is not None and reply.get("shm") is True)
        self.pull_ok = False
        self.push_seq = self.pull_seq = None               # the shard cancelled this connection's parked reads
        if self.push_ok:
            token = reply.get("shm_reply_token")
            try:
                seen = read(self.inbox, self.peer, [["token", reply.get("shm_reply_probe")]])["token"]
                self.pull_ok = isinstance(token, str) and seen.numpy().tobytes().hex() == token
            except (WireError, OSError, TypeError, ValueError):
                self.pull_ok = False
        if not self.push_ok:
            self.close()

    def buffers(self, specs: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> dict[str, np.ndarray]:
        """Writable arrays (flat, by key, in push order) that ARE this shard's slots of the push segment: gradients
        written into them are pushed without a copy (until a re-register replaces the segment; then they are
        copied like any other array)."""
        if not self.push_ok or self.outbox is None:
            return {}
        sizes = {k: int(np.prod(shape)) * np.dtype(dt).itemsize for k, (shape, dt) in specs.items()}
        offs, total = _layout(sizes)
        try:
            self.outbox.reserve(max(total, 1))
        except OSError:                                     # /dev/shm full: pushes go as frames
            self.push_ok = False
            return {}
        raw = self.outbox.bytes.numpy()
        return {k: raw[off:off + sizes[k]].view(specs[k][1]) for k, off in offs}

    def take_push(self, seq: int, tensors: Mapping[str, Any]) -> list[list[Any]] | None:
        """Write a push's tensors into the segment if the path is free; returns the header entries or None."""
        if not self.push_ok or self.push_seq is not None or self.outbox is None:
            return None
        try:
            entries = write(self.outbox, tensors)
        except OSError:                                     # /dev/shm full: this and later pushes go as frames
            self.push_ok = False
            return None
        self.push_seq = seq
        return entries

    def take_pull(self, seq: int, copy: bool = True) -> bool:
        if not self.pull_ok or self.pull_seq is not None:
            return False
        self.pull_seq = seq
        self._copy[seq] = copy
        return True

    def release(self, seq: int) -> None:
        """The request `seq` was never sent: free what it held."""
        if seq == self.push_seq:
            self.push_seq = None
        if seq == self.pull_seq:
            self.pull_seq = None
        self._copy.pop(seq, None)

    def on_reply(self, seq: int, meta: Mapping[str, Any]) -> dict[str, np.ndarray] | None:
        """Free the path the request `seq` held; for an shm reply, return the values: copies, or (the read asked
        for copy=False) read-only views into the shard's reply segment, valid until the next read.
        A segment that cannot be read turns the shm reply path off (later reads come as frames)."""
        if seq == self.push_seq:
            self.push_seq = None
        if seq == self.pull_seq:
            self.pull_seq = None
        copy = self._copy.pop(seq, None)
        entries = meta.get("shm")
        if copy is None or entries is None:              # not a read that asked for an shm reply, or frames
            return None
        try:
            views = {k: v.numpy() for k, v in read(self.inbox, self.peer, entries).items()}
        except WireError:
            self.pull_ok = False
            raise
        if copy:
            return {k: v.copy() for k, v in views.items()}
        for v in views.values():
            v.flags.writeable = False
        return views

    def on_timeout(self, seq: int) -> None:
        """A request timed out: a late answer could still write into the segment, so stop using that direction."""
        if seq == self.push_seq:
            self.push_ok, self.push_seq = False, None
        if seq == self.pull_seq:
            self.pull_ok, self.pull_seq = False, None
        self._copy.pop(seq, None)

    def close(self) -> None:
        if self.outbox is not None:
            self.outbox.close()
            self.outbox = None
        self.inbox.close()


class ServerLink:
    """A shard's shared-memory path to one registered client connection. The reply segment is made lazily: at
    register only a one-page probe segment proves the reply direction; the first shm reply allocates the real one,
    and `release_reply` (an idle link) frees it again until the next reply."""

    def __init__(self, shard: int, worker: int) -> None:
        self.shard, self.worker = shard, worker
        self.job = secrets.token_hex(6)
        self.inbox = shm.Inbox()
        self.outbox = shm.Outbox(self.job, shard, worker)
        self.reply_probe: dict[str, Any] = {}
        self.last_reply = 0.0                       # monotonic time of the last shm reply (0: none yet)
        self._probe: tuple[str, mmap.mmap] | None = None

    @classmethod
    def accept_probe(cls, shard: int, worker: int, meta: Mapping[str, Any]) -> "ServerLink | None":
        """The link if the client's probe segment maps and holds the announced token, else None. The link's
        `reply_probe` (for the register reply) lets the client prove the other direction the same way."""
        desc, token = meta.get("shm_probe"), meta.get("shm_token")
        if not (isinstance(desc, list) and len(desc) == 5 and desc[3] == "uint8" and desc[4] == [16]
                and isinstance(token, str) and len(token) == 32):
            return None
        link = cls(shard, worker)
        try:
            seen = link.inbox.view(worker, desc)
            ok = seen.numpy().tobytes().hex() == token
            del seen
            if ok:
                mine = secrets.token_bytes(16)
                link._probe = _probe_segment(link.job, shard, worker, mine)
                link.reply_probe = {"shm_reply_probe": [link._probe[0], PROBE_BYTES, 0, "uint8", [16]],
                                    "shm_reply_token": mine.hex()}
        except (WireError, OSError, ValueError, TypeError):
            ok = False
        if not ok:
            link.close()
            return None
        return link

    def grads(self, entries: Any) -> dict[str, torch.Tensor]:
        return read(self.inbox, self.worker, entries)

    def reply(self, tensors: Mapping[str, torch.Tensor], now: float = 0.0) -> list[list[Any]]:
        """Write a read's values into the reply segment (OSError if /dev/shm cannot hold them: answer with frames)."""
        self._drop_probe()
        self.last_reply = now
        return write(self.outbox, tensors)

    def release_reply(self) -> bool:
        """Free the reply segment (the next reply makes a new one, which the client maps by its new name)."""
        self._drop_probe()
        if self.outbox.mm is None:
            return False
        gen = self.outbox.gen
        self.outbox.close()
        self.outbox = shm.Outbox(self.job, self.shard, self.worker)
        self.outbox.gen = gen                      # names never repeat: the client maps the new one
        return True

    def _drop_probe(self) -> None:
        if self._probe is not None:
            name, mm = self._probe
            self._probe = None
            mm.close()
            try:
                os.unlink(os.path.join(shm.SHM_DIR, name))
            except FileNotFoundError:
                pass                               # the client mapped it (and unlinked the name)

    def close(self) -> None:
        self._drop_probe()
        self.outbox.close()
        self.inbox.close()


PROBE_BYTES = 4096


def _probe_segment(job: str, src: int, dst: int, token: bytes) -> tuple[str, mmap.mmap]:
    """A one-page segment holding `token` (generation 0: the reply Outbox's names start at 1)."""
    name = f"pslab-{job}-{src}-{dst}-0"
    note_shm_job(job)                     # swept by whoever started this process (collectives/cleanup.py)
    path = os.path.join(shm.SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, PROBE_BYTES)
        mm = mmap.mmap(fd, PROBE_BYTES)
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    mm[:len(token)] = token
    return name, mm


def segment_count() -> int:
    """pslab segments currently in /dev/shm (tests check that nothing is left behind)."""
    try:
        return sum(1 for n in os.listdir(shm.SHM_DIR) if n.startswith("pslab-"))
    except OSError:
        return 0


__all__ = ["ALIGN", "ClientLink", "ServerLink", "read", "segment_count", "wanted", "write"]
