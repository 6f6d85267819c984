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

Split tensors (ps.shm_arena). The client's push segment is one segment for all of its shard links, laid out tensor
by tensor (one name per shard), so a tensor split across shards is one array whose pieces are ranges of it; pieces
of split tensors come back through the client's pull arena, which the shards write into. Steady-state descriptors
are cached on both sides (the same descriptor on the same mapping is the same, already validated, view).

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
frames), and maps client segments read-only (except a client's pull arena, offered for the shard to write split
pieces into: read-write, after the checks of ps.shm_arena.Into.accept). Only authenticated, registered connections
get a link (ps.admission), at most `max_shm_links` at once (one per worker by default; beyond: ShmLimitError). The
shard's reply segment is made lazily (a one-page probe at register, the real one at the first shm reply), freed when
the link has been idle for `shm_idle_timeout` (re-made on demand), and a link dies with its connection (unregister,
or a vanished peer).
"""

from __future__ import annotations

import mmap
import os
import secrets
import warnings
from typing import Any, Mapping

import numpy as np
import torch

from pslab.collectives import shm
from pslab.collectives.cleanup import note_shm_job
from pslab.collectives.errors import WireError
from pslab.collectives.wire import wire_dtype

from . import flat
from .shm_arena import ALIGN, Into, PullArena, PushArena

MAX_TENSORS = 4096


def wanted(address: str) -> bool:
    """Whether the shard at `address` may share this host's memory (loopback tcp or ipc) and /dev/shm is usable."""
    local = address.startswith("ipc://") or address.startswith(("tcp://127.", "tcp://localhost:", "tcp://[::1]:"))
    return local and shm.available()


def _layout(sizes: Mapping[str, tuple[int, int]]) -> tuple[list[tuple[str, int]], int]:
    """(key, offset) for tensors of these (nbytes, itemsize) laid out in order, back to back (each at a multiple
    of its itemsize: tensors of one dtype stay adjacent, so the other side can treat a run of them as one, ps.flat);
    and the total."""
    offs, pos = [], 0
    for k, (n, item) in sizes.items():
        pos = -(-pos // item) * item
        offs.append((k, pos))
        pos += int(n)
    return offs, pos


def _sizes(tensors: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    return {k: (int(t.nbytes), int(t.itemsize) or 1) for k, t in tensors.items()}


def _as_torch(a: Any) -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        return a
    if not isinstance(a, np.ndarray) or a.flags.writeable:       # (catch_warnings costs ~50 us a call)
        return torch.from_numpy(np.ascontiguousarray(a))
    with warnings.catch_warnings():              # a read-only array is only read here (the copy's source)
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(a))


def write(box: shm.Outbox, tensors: Mapping[str, Any]) -> list[list[Any]]:
    """Copy `tensors` into `box` (growing it if needed) and return their [key, descriptor] list for the header.
    A tensor that already lies at its place in the segment (a `ClientLink.buffers` view) is not copied."""
    offs, total = _layout(_sizes(tensors))
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


def read(box: shm.Inbox, src: int, entries: Any, cache: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Validate a header's [key, descriptor] list and return read-only views (no copy) by key. With `cache`, a
    descriptor equal to the one this key had last time, on the same mapping, gets the same view again (it was
    validated then against that very segment): the steady state of a same-host push costs no per-tensor checks."""
    if not isinstance(entries, list) or len(entries) > MAX_TENSORS:
        raise WireError(f"shm entries must be a list of at most {MAX_TENSORS} [key, descriptor] pairs")
    out: dict[str, torch.Tensor] = {}
    mapped = box.maps.get(src)
    for e in entries:
        if not (isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and len(e[0]) <= 1024):
            raise WireError("each shm entry must be [key, descriptor] with a string key")
        if e[0] in out:
            raise WireError(f"shm entries name tensor {e[0]!r:.60} twice")
        hit = cache.get(e[0]) if cache is not None else None
        if hit is not None and mapped is not None and hit[1] is mapped[1] and hit[0] == e[1]:
            out[e[0]] = hit[2]
            continue
        out[e[0]] = box.view(src, e[1])
        mapped = box.maps.get(src)
        if cache is not None and mapped is not None:
            cache[e[0]] = (e[1], mapped[1], out[e[0]])
    return out


class ClientLink:
    """A client's shared-memory path to one shard: its slots of the push arena (ps.shm_arena: one segment for all
    of the client's links, or a private one), its view of the shard's reply segment, and (split tensors) its
    pieces' places in the client's pull arena, which the shard writes."""

    def __init__(self, worker: int, shard: int, enabled: bool, arena: PushArena | None = None,
                 places: Mapping[str, tuple[int, int]] | None = None, into: PullArena | None = None,
                 into_places: Mapping[str, tuple[int, int]] | None = None,
                 into_dtypes: Mapping[str, np.dtype] | None = None) -> None:
        self.worker, self.shard, self.enabled = worker, shard, enabled
        self._own = arena is None                 # a private arena: tensors laid out in push order
        self.arena = arena if arena is not None else (PushArena(secrets.token_hex(6), worker, [shard])
                                                      if enabled else None)
        self.job = self.arena.job if self.arena is not None else secrets.token_hex(6)
        self.places = dict(places) if places is not None else None
        self.into = into
        self.into_places = dict(into_places or {})
        self.into_dtypes = dict(into_dtypes or {})
        self.inbox = shm.Inbox()
        self.push_ok = self.pull_ok = self.into_ok = False
        self.peer = shard
        self.push_seq: int | None = None          # the shm push / pull in flight, if any
        self.pull_seq: int | None = None
        self._copy: dict[int, bool] = {}          # seq -> copy flag, for every read that asked for an shm reply
        self._token = b""
        self._desc: dict[tuple[str, str], list[Any]] = {}
        self._desc_for = ""
        self._last: tuple[Mapping[str, Any], list[list[Any]]] | None = None   # _write's last all-in-place answer
        self._views: dict[str, Any] = {}           # read()'s cache of reply-segment views
        self._np: dict[str, tuple[Any, np.ndarray]] = {}        # their numpy views
        self._into_cache: dict[str, np.ndarray] = {}            # views of our pull arena, per generation
        self._into_for = ""

    @property
    def outbox(self) -> PushArena | None:
        """The push segment (shared by the client's links unless private)."""
        return self.arena

    def probe(self) -> dict[str, Any]:
        """Register-meta entries offering the path: a random token in this shard's slot of a fresh push segment
        (the client renews a shared one), and the pull arena where split tensors' pieces go (empty if disabled)."""
        self.close()
        self.push_ok = self.pull_ok = self.into_ok = False
        if not self.enabled or self.arena is None:
            return {}
        try:
            self._token = secrets.token_bytes(16)
            desc = self.arena.token(self.shard, self._token)
        except OSError:
            self.enabled = False
            self.close()
            return {}
        meta: dict[str, Any] = {"shm_probe": desc, "shm_token": self._token.hex()}
        if self.into is not None and self.into_places and self.into.total and self.into.size >= self.into.total:
            try:
                meta.update(self.into.offer(self.shard, self.into_places))
            except OSError:
                pass                                        # split tensors come back through the reply segment
        return meta

    def accept(self, reply: Mapping[str, Any]) -> None:
        """Adopt the register reply: push through shm if the shard read our token; pull through shm if we can read
        the token the shard wrote into its reply segment; split pieces into our pull arena if the shard wrote its
        token there (each direction proven separately)."""
        self.peer = int(reply.get("shard", self.shard))   # the shard's id, as its segment names carry it
        self.push_ok = bool(self.arena is not None and self.arena.mm is not None and reply.get("shm") is True)
        self.pull_ok = self.into_ok = False
        self.push_seq = self.pull_seq = None               # the shard cancelled this connection's parked reads
        if self.push_ok:
            token = reply.get("shm_reply_token")
            try:
                seen = read(self.inbox, self.peer, [["token", reply.get("shm_reply_probe")]])["token"]
                self.pull_ok = isinstance(token, str) and seen.numpy().tobytes().hex() == token
            except (WireError, OSError, TypeError, ValueError):
                self.pull_ok = False
            self.into_ok = bool(self.pull_ok and self.into is not None and self.into_places
                                and self.into.proven(self.shard, reply.get("shm_into_token")))
        if not self.push_ok:
            self.close()

    def take_push(self, seq: int, tensors: Mapping[str, Any]) -> list[list[Any]] | None:
        """Write a push's tensors into their places if the path is free; returns the header entries or None.
        A tensor that already lies at its place (a `grad_buffers()` view) is described, not copied."""
        if not self.push_ok or self.push_seq is not None or self.arena is None:
            return None
        try:
            entries = self._write(tensors)
        except OSError:                                     # /dev/shm full: this and later pushes go as frames
            self.push_ok = False
            return None
        if entries is not None:
            self.push_seq = seq
        return entries

    def _write(self, tensors: Mapping[str, Any]) -> list[list[Any]] | None:
        box = self.arena
        assert box is not None
        head = ALIGN * len(box.shards)
        if self.places is None:                             # a private arena: laid out in push order
            offs, total = _layout(_sizes(tensors))
            box.reserve(head + max(total, 1))
            where = {k: (head + off, int(tensors[k].nbytes)) for k, off in offs}
        else:
            box.reserve_all()
            where = self.places
        base = box.bytes.data_ptr() if box.bytes is not None else -1
        if self._desc_for != box.name:                      # descriptors of in-place tensors, per generation
            self._desc, self._desc_for, self._last = {}, box.name, None
        last = self._last                                   # the same pieces (the client's _split memo: the
        if last is not None and last[0] is tensors:         # same arrays), all in place last time: same header
            return last[1]
        out, in_place = [], True
        for k, a in tensors.items():
            place = where.get(k)
            if place is None:
                return None
            if isinstance(a, np.ndarray) and a.flags.c_contiguous and a.nbytes == place[1] and a.nbytes:
                d = self._desc.get((k, a.dtype.str))        # a grad_buffers() view: no torch conversion either
                if d is not None and a.__array_interface__["data"][0] == base + place[0]:
                    out.append([k, d])
                    continue
            in_place = in_place and isinstance(a, np.ndarray)
            t = _as_torch(a).reshape(-1)
            if t.numel() * t.element_size() != place[1]:
                return None                                 # not this client's layout (another dtype): frames
            if t.numel() and t.data_ptr() == base + place[0]:    # written in place: describe it, copy nothing
                d = box.describe(self.shard, place[0], t)
                if isinstance(a, np.ndarray):
                    self._desc[(k, a.dtype.str)] = d
                out.append([k, d])
            else:
                in_place = False
                out.append([k, box.put(self.shard, place[0], t)])
        self._last = (tensors, out) if in_place else None
        return out

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
        for copy=False) read-only views into the shard's reply segment and our pull arena, valid until the next
        read. A segment that cannot be read turns the shm reply path off (later reads come as frames)."""
        if seq == self.push_seq:
            self.push_seq = None
        if seq == self.pull_seq:
            self.pull_seq = None
        copy = self._copy.pop(seq, None)
        entries, into = meta.get("shm"), meta.get("shm_into")
        if copy is None or (entries is None and into is None):   # not a read that asked for shm, or frames
            return None
        try:
            views = {k: self._numpy(k, v) for k, v in read(self.inbox, self.peer, entries or [], self._views).items()}
            if into is not None:
                views.update(self._into_views(into, views))
        except WireError:
            self.pull_ok = False
            raise
        if copy:
            return {k: v.copy() for k, v in views.items()}
        return views

    def _numpy(self, key: str, t: torch.Tensor) -> np.ndarray:
        """A read-only numpy view of a reply-segment view, the same array again for the same (cached) view."""
        hit = self._np.get(key)
        if hit is not None and hit[0] is t:
            return hit[1]
        a = t.numpy()
        a.flags.writeable = False
        self._np[key] = (t, a)
        return a

    def _into_views(self, keys: Any, seen: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The pieces the shard says it wrote into our pull arena: views at their places."""
        if not (self.into_ok and self.into is not None and self.into.bytes is not None and isinstance(keys, list)
                and len(keys) <= MAX_TENSORS):
            raise WireError("shm_into names pieces this link did not offer a pull arena for")
        if self._into_for != self.into.name:             # views of one generation of the pull arena
            self._into_cache, self._into_for = {}, self.into.name
        out = {}
        for k in keys:
            if not isinstance(k, str) or k not in self.into_places or k in seen or k in out:
                raise WireError(f"shm_into names {k!r:.60}: not a piece this link offered, or named twice")
            a = self._into_cache.get(k)
            if a is None:
                off, n = self.into_places[k]
                a = self._into_cache[k] = self.into.bytes.numpy()[off:off + n].view(self.into_dtypes[k])
                a.flags.writeable = False
            out[k] = a
        return out

    def on_timeout(self, seq: int) -> None:
        """A request timed out: a late answer could still write into the segment, so stop using that direction."""
        if seq == self.push_seq:
            self.push_ok, self.push_seq = False, None
        if seq == self.pull_seq:
            self.pull_ok, self.pull_seq = False, None
        self._copy.pop(seq, None)

    def close(self) -> None:
        """Drop the mappings of the shard's segments; a private push arena is closed too (the client closes its
        shared arenas)."""
        if self._own and self.arena is not None:
            self.arena.close()
        self._views, self._np, self._into_cache, self._into_for = {}, {}, {}, ""
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
        self.into: Into | None = None               # the client's pull arena, where split pieces go
        self._plan: Any = None                      # the last reply's layout: (signature, segment, views, ...)
        self._views: dict[str, Any] = {}           # read()'s cache of push-segment views
        self._runs = flat.RunCache()                # the reply's copy runs (ps.flat)
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
        if ok and "shm_into" in meta:                # split tensors' pieces: into the client's pull arena
            try:
                offered = Into.accept(shard, worker, meta)
            except (WireError, OSError, ValueError, TypeError):
                offered = None                       # they come back through the reply segment
            if offered is not None:
                link.into = offered[0]
                link.reply_probe["shm_into_token"] = offered[1]
        if not ok:
            link.close()
            return None
        return link

    def grads(self, entries: Any) -> dict[str, torch.Tensor]:
        return read(self.inbox, self.worker, entries, self._views)

    def reply(self, tensors: Mapping[str, torch.Tensor], now: float = 0.0) -> tuple[list[list[Any]], list[str]]:
        """Write a read's values: pieces the client gave a place in its pull arena go there, the rest into the
        reply segment (OSError if /dev/shm cannot hold them: answer with frames). Returns (the reply segment's
        [key, descriptor] entries, the keys written into the pull arena)."""
        self._drop_probe()
        self.last_reply = now
        sig = tuple((k, t.dtype, t.numel()) for k, t in tensors.items())
        plan = self._plan
        if plan is not None and plan[0] == sig and plan[1] == self.outbox.name:
            for dst, t in self._runs.get(plan[2], list(tensors.values())):   # the same layout as last time: one
                dst.copy_(t)                                   # copy_ per run of tensors adjacent on both sides
            return plan[3], plan[4]
        into, rest = [], {}
        for k in flat.order(tensors):                          # the shard's buffer order: whole tensors adjacent
            t = tensors[k]
            if self.into is not None and self.into.put(k, t):
                into.append(k)
            else:
                rest[k] = t
        self._plan = None
        entries = write(self.outbox, rest) if rest or not into else []
        where = {k: (self.outbox.bytes, d[2]) for k, d in entries}
        if self.into is not None:
            where.update({k: (self.into.bytes, self.into.pieces[k][0]) for k in into})
        dsts = []
        for k, t in tensors.items():
            buf, off = where[k]
            n = t.numel() * t.element_size()
            dsts.append(buf[off:off + n].view(t.dtype) if n else torch.empty(0, dtype=t.dtype))
        self._plan = (sig, self.outbox.name, dsts, entries, into)
        return entries, into

    def release_reply(self) -> bool:
        """Free the reply segment (the next reply makes a new one, which the client maps by its new name)."""
        self._drop_probe()
        self._plan = None                          # its views would pin the segment
        self._runs.forget_last()                   # (and so would the last run's)
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
        self._plan = None
        self._runs.clear()
        if self.into is not None:
            self.into.close()
            self.into = None
        self.outbox.close()
        self.inbox.close()
        self._views = {}


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


def segments() -> frozenset[str]:
    """The names of the pslab segments now in /dev/shm. Tests check that nothing is left behind as "no name that was
    not there before" (`segments() <= before`): another job's segments may come and go meanwhile."""
    try:
        return frozenset(n for n in os.listdir(shm.SHM_DIR) if n.startswith("pslab-"))
    except OSError:
        return frozenset()


__all__ = ["ALIGN", "ClientLink", "ServerLink", "read", "segments", "wanted", "write"]
