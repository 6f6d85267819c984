"""The streamed ring of zmq_group.py with its per-segment messages in shared-memory channels instead of ZeroMQ.

On a same-host ring pass the payload of every segment already lies in the sender's shared-memory outbox (shm.py);
what ZeroMQ still carried was one small header per segment (plus the closing acknowledgement), each an encode, a
socket write, an I/O-thread hop and a poll. Here that header is a descriptor in a payload-free channel
(shm_channel.py, RING_SLOTS slots per ordered pair, one per group):

    descriptor   call (seq, op, numel), payload (dtype, numel), then [step, segment, offset, generation, size]
                 step -1 = the acknowledgement; generation -1 = the payload went through ZeroMQ under the same key
                 (the outbox could not be reserved, e.g. /dev/shm full); numel 0 = no payload

Everything else is the zmq path's: `ring.ring_pass` (same chunks, segments, order of combines: the same bits), the
payload written once at the slice's own offset of the outbox to the right neighbour, the receiver combining straight
from its read-only mapping (shm.Inbox: the name derived from the sender's signed job id, the bounds checked), the
closing acknowledgement that makes rewriting the outbox safe, and the bytes each rank counts (`traffic`: the same
add_sent / add_recv per message, acknowledgements included). A descriptor for another collective, size, dtype or
step is a `CollectiveMismatchError` naming the sender; waits end with `PeerTimeoutError` naming it.

Deadlock freedom: a pass sends at most len(combines) x k + 1 descriptors per ordered pair (k = segments per chunk)
and the previous pass left at most one (its acknowledgement) unconsumed, so the path is taken only when
len(combines) x k + 2 <= RING_SLOTS: no send inside a pass ever waits for a slot.
"""

from __future__ import annotations

from typing import Any

import torch

from . import ring, wire
from .errors import CollectiveMismatchError
from .group import chunk_bounds
from .shm_channel import RING_SLOTS

ACK = -1


def ring_pass(group: Any, op: str, seq: int, buf: torch.Tensor, c0: int, combines: list[str]) -> bool:
    """Run zmq_group's ring pass over the group's descriptor channels; False (nothing done) where it does not
    apply: no channels for this group, or more segments per pass than RING_SLOTS allows."""
    n, r = group.world_size, group.rank
    nbytes = buf.numel() * buf.element_size()
    dch = group.local.ring_channels()
    if dch is None or n == 1 or not combines:
        return False
    seg = max(1, group.segment_bytes // max(1, buf.element_size()))
    longest = max(b - a for a, b in chunk_bounds(buf.numel(), n))
    if len(combines) * max(1, -(-longest // seg)) + 2 > RING_SLOTS:
        return False
    tr, right = group.tr, (r + 1) % n
    box = tr._outbox.get(group.ranks[right]) if tr.shm_reserve(group.ranks[right], nbytes) else None
    n_call = group._cur[2]
    counter = group.traffic_counter

    def send(d: int, key: tuple, t: torch.Tensor) -> None:
        nb = t.numel() * t.element_size()
        step, j = (ACK, 0) if key[0] == "ack" else key
        if nb == 0:
            fields: tuple[int, ...] = (step, j, 0, 0, 0)
        elif d == right and box is not None:
            off = t.data_ptr() - buf.data_ptr()
            box.write(off, t)
            fields = (step, j, off, box.gen, box.size)
        else:                         # no outbox: the payload through ZeroMQ (counted by _send), the descriptor here
            group._send(d, op, (seq, *key), t, mode="zerocopy", base=buf)
            dch.post_fields(d, op, seq, n_call, t.dtype, t.numel(), (step, j, 0, -1, 0))
            return
        dch.post_fields(d, op, seq, n_call, t.dtype, t.numel(), fields)
        counter.add_sent(group.ranks[d], op, nb)

    def recv(s: int, key: tuple, like: torch.Tensor) -> torch.Tensor:
        g = group.ranks[s]
        step, j, off, gen, size = dch.take_fields(s, op, seq, n_call, like, 5)
        want = (ACK, 0) if key[0] == "ack" else key
        if (step, j) != want:
            raise CollectiveMismatchError(f"{op} #{seq}: rank {g} sent ring step {step} segment {j} where this rank "
                                          f"expects {want[0]} / {want[1]} (different segment_bytes or program?)")
        if gen == -1:
            return group._recv(s, op, (seq, *key), like)
        if like.numel():
            job = tr._peer_job[g]
            like = tr._inbox.view(g, [f"pslab-{job}-{g}-{tr.rank}-{gen}", size, off, wire.wire_dtype(like),
                                      [like.numel()]], job)
        counter.add_recv(g, op, like.numel() * like.element_size())
        return like

    group.local.path = dch
    try:
        ring.ring_pass(buf, r, n, c0, combines, seg, send, recv)
    finally:
        group.local.path = None
    tr.flush(op, seq)
    return True
