"""How a `ZmqGroup` uses the shared-memory channels: `SameHost`, the group's same-host latency path.

A group takes the path when `shm_channel=True` (the default), the transport uses shared memory, no topology is
emulated (the link emulation lives on the zmq path), the CPU orders stores (shm_channel.supported) and every member
published the same host identity as this rank (its signed address record: transport.py). It decides on first use
and keeps two sets of channels (shm_channel.py), made lazily:

    chan    small slots (capacity = small_bytes, 4 per pair): the direct all-reduce (small, or algorithm="direct"),
            barrier, small broadcast
    dchan   payload-free descriptors (RING_SLOTS per pair): the ring's per-segment headers (shm_ring.py)

The collectives here are the zmq path's, message for message: the direct all-reduce posts the whole tensor to every
peer and reduces the N contributions in rank order 0..N-1 (its own read back from its outgoing slot), a small
broadcast posts from src to each; the traffic counter gets the same add_sent / add_recv per message.

Mismatches across paths: a rank waiting on one path (ZeroMQ, or one set of channels) that finds a peer's message for
this collective, or an earlier one, on another path raises `CollectiveMismatchError` naming that peer (`scan`, run
while waiting on ZeroMQ and, with what ZeroMQ delivered meanwhile, while blocked on a channel: `idle`).
"""

from __future__ import annotations

from typing import Any

import torch

from . import shm_channel
from .errors import CollectiveMismatchError


class SameHost:
    """The channel state of one group (`group.local`)."""

    def __init__(self, group: Any, enabled: bool) -> None:
        self.g, self.enabled = group, enabled
        self.chan: shm_channel.Channels | bool | None = None     # None: not decided yet; False: not for this group
        self.dchan: shm_channel.Channels | None = None
        self.path: shm_channel.Channels | None = None           # what the collective in progress waits on

    @property
    def active(self) -> bool:
        return bool(self.chan)

    def small(self, nbytes: int) -> shm_channel.Channels | None:
        """The small channels if this group takes the path and `nbytes` fits a slot (decided on first use)."""
        if self.chan is None:
            self.chan = False
            g = self.g
            tr = g.tr
            if self.enabled and tr.use_shm and tr.links is None and g.world_size > 1 and shm_channel.supported():
                peers = [r for r in g.ranks if r != tr.rank]
                for r in peers:
                    tr._peer_socket(r)                  # reads the signed address: host id and shm job id
                if all(tr._same_host.get(r) for r in peers):
                    self.chan = shm_channel.Channels(tr._job, g.rank, g.ranks, g.gid, max(64, g.small_bytes),
                                                     tr._peer_job.__getitem__, shm_channel.Waiter(g.timeout, self.idle))
        ch = self.chan
        return ch if ch and nbytes <= ch.capacity else None     # type: ignore[return-value]

    def ring_channels(self) -> shm_channel.Channels | None:
        """The descriptor channels of shm_ring.py, where this group takes the path at all."""
        if self.dchan is None and (ch := self.small(0)) is not None:
            g = self.g
            self.dchan = shm_channel.Channels(ch.job, g.rank, g.ranks, g.gid + "/ring", 0, ch.peer_job, ch.waiter,
                                              slots=shm_channel.RING_SLOTS)
        return self.dchan

    # ---- waiting -----------------------------------------------------------------------------------------------
    def idle(self) -> None:
        """While blocked on a channel: interrupt (elastic), what ZeroMQ delivered (a peer on the zmq path here is a
        mismatch), the other channels."""
        g = self.g
        if g.tr.interrupt is not None:
            g.tr.interrupt()
        g.tr.poll_arrivals(g._check)
        seq = g._cur[1]
        for (s, k), q in list(g.tr.mailbox.items.items()):
            if k[0] == g.gid and k[1] == seq:
                g._check(s, q[0][1])
        self.scan()

    def scan(self) -> None:
        """A peer's message for this collective (or an earlier one) in channels this collective does not use: that
        peer took another path here."""
        g = self.g
        op, seq, n = g._cur
        for ch in (self.chan, self.dchan):
            if not ch or ch is self.path:
                continue
            for peer, s_op, numel, s_seq in ch.pending(seq):      # type: ignore[union-attr]
                raise CollectiveMismatchError(
                    f"collective #{seq} of group {g.gid}: rank {peer} called {s_op}(numel={numel}) as its collective "
                    f"#{s_seq} while rank {g.tr.rank} called {op}(numel={n}); rank {peer} diverged from this rank's "
                    "program order")

    # ---- collectives -------------------------------------------------------------------------------------------
    def direct_all_reduce(self, name: str, seq: int, buf: torch.Tensor, op: str) -> bool:
        """zmq_group's direct exchange through the small channels; False (nothing done) if they do not apply."""
        nbytes = buf.numel() * buf.element_size()
        ch = self.small(nbytes)
        if ch is None:
            return False
        g = self.g
        n, r, count = g.world_size, g.rank, g.traffic_counter
        self.path = ch
        own = buf
        for d in range(n):
            if d != r:
                own = ch.post(d, name, seq, buf)
                count.add_sent(g.ranks[d], name, nbytes)
        parts, held = [], []
        for s in range(n):
            if s == r:
                parts.append(own)
                continue
            seg, v = ch.take(s, name, seq, buf)
            count.add_recv(g.ranks[s], name, nbytes)
            parts.append(v)
            held.append(seg)
        shm_channel.reduce_into(buf, parts, op)
        for seg in held:
            ch.release(seg)
        self.path = None
        return True

    def broadcast(self, seq: int, buf: torch.Tensor, src: int) -> bool:
        """zmq_group's small broadcast (direct sends from src) through the small channels; False if they do not
        apply."""
        nbytes = buf.numel() * buf.element_size()
        ch = self.small(nbytes)
        if ch is None:
            return False
        g = self.g
        self.path = ch
        if g.rank == src:
            for d in range(g.world_size):
                if d != src:
                    ch.post(d, "broadcast", seq, buf)
                    g.traffic_counter.add_sent(g.ranks[d], "broadcast", nbytes)
        else:
            seg, v = ch.take(src, "broadcast", seq, buf)
            buf.copy_(v)
            ch.release(seg)
            g.traffic_counter.add_recv(g.ranks[src], "broadcast", nbytes)
        self.path = None
        return True

    def close(self, linger: float, lingers: dict[int, float] | None) -> None:
        for ch in (self.chan, self.dchan):
            if ch:
                ch.close(linger, lingers)                      # type: ignore[union-attr]
        self.chan, self.dchan = False, None
