"""One segment of a client's shared by all of its shard links, laid out tensor by tensor: split tensors stay whole.

The partition (ps.partition) may cut a big tensor into flat pieces on several shards. With one segment per shard
link the pieces of such a tensor lie in different segments, so a gradient computed into one array had to be copied
piece by piece into the segments, and a pulled tensor reassembled from the shards' reply segments by another copy:
8 MB of memcpy per update of a 4 MB tensor on 2 shards. An arena is one segment per client and direction in which
every tensor has its own place,

    [ H = 64 * shards (one probe slot each) | shard 0's whole tensors | shard 1's ... | split tensors ]
    whole tensors of one shard: by name, back to back (each at a multiple of its itemsize); every group and every
    split tensor starts on a 64-byte line
    piece [start, stop) of split t on shard s:   bytes [offset(t) + start * itemsize, offset(t) + stop * itemsize)

so a split tensor is one contiguous array whose pieces are ranges of it, the pieces of different shards never
overlap, and a shard's whole tensors lie back to back in the order of the shard's own parameter buffer (ps.flat):
the shard checks, steps and answers all of them with one torch call each. The segment gets one name per shard, `pslab-<job>-<worker>-<shard>-<gen>` (hard links of one tmpfs file):
each shard maps and unlinks only its own name (collectives.shm rules: name form, source, own account, size), and
the client unlinks whatever names are left when it closes or replaces the segment (a new generation).

    push arena  (PushArena)  the client writes, shards map it read-only (collectives.shm.Inbox): the gradients of
                             `grad_buffers()` are views of it, a push of them copies nothing; other arrays are
                             copied into their place.
    pull arena  (PullArena)  only for split tensors: the shard maps it read-write (`map_writable`) after checking
                             the client's token in its slot, writes its own token next to it (the client checks
                             it: the direction is proven), and answers a read by copying each piece of a split
                             tensor straight to its place; the client then reads the whole tensor without a copy.

Reuse rule: unchanged, per shard link: a region belonging to shard s is rewritten only when link s has no push
(push arena) / shm read (pull arena) in flight, and the regions of different shards are disjoint.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import secrets
from typing import Any, Mapping, Sequence

import torch

from pslab.collectives import shm
from pslab.collectives.shm import _is_int
from pslab.collectives.errors import WireError

ALIGN = 64                      # probe slots, each shard's group of whole tensors and each split tensor start
                                # on a cache line
TOKEN = 16                       # bytes of a probe token; a slot holds the client's token, then the shard's
_NAME = re.compile(r"^pslab-[0-9a-f]{12}-(?P<src>\d+)-(?P<dst>\d+)-\d+$")


def places(slices: Sequence[Any], num_shards: int, only: set[str] | None = None) -> tuple[dict[str, tuple[int, int]],
                                                                                         dict[str, int], int]:
    """({piece key: (offset, nbytes)}, {tensor name: offset}, total bytes) of the arena layout (module docstring)
    over the partition's slices, restricted to the tensors named in `only` if given."""
    pos = ALIGN * num_shards
    start: dict[str, int] = {}
    chosen = [s for s in sorted(slices, key=lambda s: (s.name, s.start)) if only is None or s.name in only]
    whole = {s.name: s for s in chosen if s.start == 0 and s.stop == math.prod(s.shape)}
    for shard in range(num_shards):                  # each shard's whole tensors, back to back
        for name, s in whole.items():
            if s.shard == shard:
                pos = -(-pos // s.itemsize) * s.itemsize
                start[name] = pos
                pos += s.nbytes
        pos = -(-pos // ALIGN) * ALIGN
    for s in chosen:                                 # then every split tensor, whole
        if s.name not in start:
            start[s.name] = pos
            pos += -(-math.prod(s.shape) * s.itemsize // ALIGN) * ALIGN
    out = {s.key: (start[s.name] + s.start * s.itemsize, s.nbytes) for s in slices if s.name in start}
    return out, start, pos


class Arena(shm.Outbox):
    """A growable segment named once per shard (hard links); `names[shard]` is the name that shard maps."""

    def __init__(self, job: str, worker: int, shards: Sequence[int], total: int = 0) -> None:
        super().__init__(job, worker, shards[0])
        self.total = total               # what reserve_all() makes room for: the whole layout
        self.shards = list(shards)
        self.slot = {s: ALIGN * i for i, s in enumerate(self.shards)}
        self.names: dict[int, str] = {}

    def reserve(self, nbytes: int) -> None:
        if nbytes <= self.size:
            return
        super().reserve(nbytes)          # closes (unlinks) the old generation, makes pslab-<job>-<w>-<shards[0]>-<gen>
        self.names = {self.shards[0]: self.name}
        try:
            for s in self.shards[1:]:
                name = f"pslab-{self.job}-{self.src}-{s}-{self.gen}"
                os.link(os.path.join(shm.SHM_DIR, self.name), os.path.join(shm.SHM_DIR, name))
                self.names[s] = name
        except OSError:
            self.close()
            raise

    def reserve_all(self) -> None:
        """Room for the whole layout at once: growing later would replace the segment under another shard's push."""
        self.reserve(max(self.total, ALIGN * len(self.shards)))

    def describe(self, shard: int, offset: int, t: torch.Tensor) -> list[Any]:
        """The descriptor of `t` lying at `offset`, under the name `shard` maps."""
        from pslab.collectives.wire import wire_dtype
        return [self.names[shard], self.size, offset, wire_dtype(t), list(t.shape)]

    def put(self, shard: int, offset: int, t: torch.Tensor) -> list[Any]:
        """Copy `t` to `offset` (Outbox.write) and describe it under `shard`'s name."""
        desc = self.write(offset, t)
        desc[0] = self.names[shard]
        return desc

    def token(self, shard: int, token: bytes, at: int = 0) -> list[Any]:
        """Write a probe token into `shard`'s slot (reserving the header first); its descriptor."""
        self.reserve(ALIGN * len(self.shards))
        return self.put(shard, self.slot[shard] + at, torch.frombuffer(bytearray(token), dtype=torch.uint8))

    def read(self, offset: int, n: int) -> bytes:
        return bytes(self.mm[offset:offset + n]) if self.mm is not None and offset + n <= self.size else b""

    def close(self) -> None:
        super().close()
        self.size, self.name, self.bytes = 0, "", None     # the next reserve makes a new generation
        for name in self.names.values():
            try:
                os.unlink(os.path.join(shm.SHM_DIR, name))
            except FileNotFoundError:
                pass                     # mapped (and unlinked) by its shard
        self.names = {}


class PushArena(Arena):
    """Gradients: the client writes, shards read (read-only maps)."""


class PullArena(Arena):
    """Split tensors' values: shards write their pieces, the client reads."""

    def offer(self, shard: int, pieces: Mapping[str, tuple[int, int]]) -> dict[str, Any]:
        """Register-meta entries offering the pull arena to `shard` for `pieces` {key: (offset, nbytes)}."""
        mine = secrets.token_bytes(TOKEN)
        desc = self.token(shard, mine)
        return {"shm_into": [desc[0], self.size, desc[2]], "shm_into_token": mine.hex(),
                "shm_into_keys": [[k, int(o), int(n)] for k, (o, n) in pieces.items()]}

    def proven(self, shard: int, token: Any) -> bool:
        """The shard wrote `token` next to ours in its slot: it can write into this arena."""
        return (isinstance(token, str) and self.mm is not None
                and self.read(self.slot[shard] + TOKEN, TOKEN).hex() == token)


class Into:
    """A shard's writable map of one client's pull arena, and where each of its pieces goes there."""

    def __init__(self, mm: mmap.mmap, pieces: dict[str, tuple[int, int]]) -> None:
        self.mm, self.pieces = mm, pieces
        self.bytes = torch.frombuffer(mm, dtype=torch.uint8)

    @classmethod
    def accept(cls, shard: int, worker: int, meta: Mapping[str, Any]) -> "tuple[Into, str] | None":
        """Map the offered pull arena if it is valid and holds the client's token; write our token. (Into, token)
        or None (then split tensors come back through the reply segment, as whole ones do)."""
        desc, token, keys = meta.get("shm_into"), meta.get("shm_into_token"), meta.get("shm_into_keys")
        if not (isinstance(desc, list) and len(desc) == 3 and isinstance(token, str) and len(token) == 2 * TOKEN
                and isinstance(keys, list) and 0 < len(keys) <= 4096):
            return None
        name, size, at = desc
        if not (_is_int(size) and _is_int(at) and 0 <= at and at + 2 * TOKEN <= size):
            return None
        pieces: dict[str, tuple[int, int]] = {}
        for e in keys:
            if not (isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) and len(e[0]) <= 1024
                    and _is_int(e[1]) and _is_int(e[2]) and e[1] >= 0 and e[2] > 0 and e[1] + e[2] <= size
                    and e[0] not in pieces):
                return None
            pieces[e[0]] = (e[1], e[2])
        spans = sorted(pieces.values()) + [(size, 0)]
        if (any(a + n > b for (a, n), (b, _) in zip(spans, spans[1:]))
                or any(a < at + 2 * TOKEN and at < a + n for a, n in spans)):
            return None                                    # overlapping pieces, or a piece over the probe slot
        try:
            mm = map_writable(name, size, worker, shard)
        except WireError:
            return None
        if bytes(mm[at:at + TOKEN]).hex() != token:
            mm.close()
            return None
        mine = secrets.token_bytes(TOKEN)
        mm[at + TOKEN:at + 2 * TOKEN] = mine
        return cls(mm, pieces), mine.hex()

    def put(self, key: str, t: torch.Tensor) -> bool:
        """Copy the flat tensor `t` to `key`'s place; False if `key` has no place of exactly its size."""
        where = self.pieces.get(key)
        n = t.numel() * t.element_size()
        if where is None or where[1] != n or where[0] % t.element_size():
            return False
        self.bytes[where[0]:where[0] + n].view(t.dtype).copy_(t.reshape(-1))
        return True

    def close(self) -> None:
        self.bytes = None
        try:
            self.mm.close()
        except BufferError:                   # a view is alive; the mapping goes with the process
            pass


def map_writable(name: str, size: int, worker: int, shard: int) -> mmap.mmap:
    """Map the client segment `name` read-write and unlink the name: only names of the collectives.shm form from
    `worker` to `shard`, regular files of this account holding at least `size` bytes; WireError otherwise."""
    m = _NAME.match(name) if isinstance(name, str) else None
    if m is None or int(m["src"]) != worker or int(m["dst"]) != shard:
        raise WireError(f"shm segment name {name!r:.60} is not one worker {worker} may offer shard {shard}")
    return shm.map_segment(name, size, writable=True)


__all__ = ["ALIGN", "Arena", "Into", "PullArena", "PushArena", "map_writable", "places"]
