"""`ZmqGroup`: the `zmq` backend — our collectives over `Transport`.

Algorithms (see ring.py for the ring and its byte count):
  all_reduce      ring reduce-scatter + all-gather, streamed in segments; tensors of at most `small_bytes` take a
                  one-step direct exchange instead (each rank sends its whole tensor to every peer and sums the N
                  contributions in rank order 0..N-1: 1 latency instead of 2(N-1), (N-1) x bytes instead of 2(N-1)/N)
  reduce_scatter  ring reduce-scatter;  all_gather  ring all-gather
  broadcast       streamed chain src -> src+1 -> ... for large tensors, direct sends for small ones
  all_to_all      direct sends;  barrier  direct exchange of one byte
Payloads of the streamed ring and chain go through shared memory when the neighbour is on the same host (shm.py:
one memcpy, no kernel copies; ZeroMQ carries only the header), else zero-copy over ipc:// or tcp://.
When every member is on this host and no topology is emulated (`shm_channel=True`, the default), no ZeroMQ message
is sent at all: the direct exchanges (small all-reduce, small broadcast, barrier) go through the shared-memory slots
of shm_channel.py, and the ring's per-segment headers become descriptors in shared-memory channels (shm_ring.py;
which group takes it: shm_group.py): the same algorithms, bytes counted and summation order.
Every message is keyed by (group id, sequence number, step, segment), so early arrivals wait in a mailbox and a rank
that runs another collective (or another size) at the same sequence number is reported by name
(`CollectiveMismatchError`). The group's route (`_route`) tells the mailbox which keys it may file: members only,
one tensor per message, keys of the shapes below, sequence numbers from the collective in progress on (p2p: counts
from the receives done); every payload taken must have the size and dtype of the slice it lands in, else it is
dropped (`WireError`) and the wait goes on. Until a rank creates its next sub-group (`new_group`), messages for it
are filed under this group's members and floors 0 (a peer that created it first may already send).

    collectives  [gid, seq, step, segment], [gid, seq, "ack" | "d" | "up" | "down"], [gid, seq, segment]
    p2p          ["p2p", gid, tag, count]

`interrupt` (the transport's: see transport.py) is called by every wait of the group and its sub-groups when set;
an elastic group (elastic.py) raises `MembershipChanged` from it. What it interrupts leaves that collective's
buffers undefined.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from functools import partial
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from . import hierarchical, ring, shm_ring
from .errors import CollectiveMismatchError, WireError
from .group import ProcessGroup, check_op, chunk_bounds
from .mailbox import Key, tensor_count
from .shm_channel import close_job as shm_channel_close_job
from .shm_group import SameHost
from .topology import LinkEmulator, Topology
from .traffic import TrafficCounter
from .transport import Transport
from .wire import Message, Tensor

_PARTS = ("d", "up", "down", "ack")         # the named key parts; the others are step / segment numbers


def _part(x: object) -> bool:
    return x in _PARTS if type(x) is str else x >= 0    # (routing_key let only ints and strings through)


def as_flat(t: Tensor) -> tuple[torch.Tensor, Tensor | None]:
    """A flat torch view of `t` sharing its memory, plus the original when a contiguous copy had to be made."""
    if isinstance(t, np.ndarray):
        if t.flags.c_contiguous and t.flags.writeable:
            return torch.from_numpy(t).view(-1), None
        return torch.from_numpy(np.ascontiguousarray(t)).view(-1).clone(), t
    if t.device.type != "cpu":
        raise ValueError(f"the zmq backend works on CPU tensors; got one on {t.device} (use backend='torch')")
    if t.is_contiguous():
        return t.detach().view(-1), None
    return t.detach().contiguous().view(-1), t


def write_back(flat: torch.Tensor, orig: Tensor | None) -> None:
    if orig is None:
        return
    if isinstance(orig, np.ndarray):
        orig[...] = flat.numpy().reshape(orig.shape)
    else:
        orig.detach().copy_(flat.view(orig.shape))


SMALL_BYTES = 32 << 10      # all-reduces and broadcasts of at most this many bytes take the one-step direct exchange

class _Work:
    def __init__(self, fn: Any) -> None:
        self._fn, self._done, self._result = fn, False, None

    def wait(self, timeout: float | None = None) -> Any:
        if not self._done:
            self._result, self._done = self._fn(), True
        return self._result

    def is_completed(self) -> bool:
        return self._done


class ZmqGroup(ProcessGroup):
    backend = "zmq"

    def __init__(self, transport: Transport, ranks: Sequence[int], gid: str = "w", *,
                 small_bytes: int = SMALL_BYTES, segment_bytes: int = 4 << 20,
                 traffic: TrafficCounter | None = None, owns_transport: bool = True,
                 topology: Topology | None = None, hierarchical: bool = True, shm_channel: bool = True) -> None:
        """topology: emulate links of different speeds on this transport (topology.py; all its groups share it);
        hierarchical: let all_reduce pick the hierarchical algorithm when the ranks span hosts (hierarchical.py);
        shm_channel: direct exchanges through shared-memory slots, and the ring's headers through shared-memory
        descriptors, when all members share this host and no topology is set (shm_channel.py, shm_ring.py)."""
        if topology is not None:
            transport.links = LinkEmulator(topology, transport.rank, transport.world_size)
        self.hierarchical = hierarchical
        self.use_channels = shm_channel
        self.local = SameHost(self, shm_channel)      # the same-host latency path (shm_group.py), decided on first use
        self.tr = transport
        self.ranks = tuple(ranks)
        self.world_size = len(self.ranks)
        self.rank = self.ranks.index(transport.rank)
        self.gid = gid
        self.timeout = transport.timeout
        self.small_bytes, self.segment_bytes = small_bytes, segment_bytes
        self.traffic_counter = traffic or TrafficCounter()
        self._seq = 0
        self._children = 0
        self._p2p_sent: dict[tuple[int, int], int] = defaultdict(int)
        self._p2p_recv: dict[tuple[int, int], int] = defaultdict(int)
        self._p2p_floor: dict[tuple[int, int], int] = {}   # (src, tag) -> lowest count not yet received
        self._p2p_early: dict[tuple[int, int], set[int]] = defaultdict(set)   # counts received above the floor
        self._owns = owns_transport
        self._cur: tuple[str, int, int] = ("", -1, -1)  # (op, seq, numel) of the collective in progress
        self._member = {g: i for i, g in enumerate(self.ranks)}   # global rank -> group rank
        transport.mailbox.routes[gid] = self._route
        self._expect_child()

    # ---- messaging with accounting -----------------------------------------------------------------------------
    def _send(self, dst: int, op: str, key: tuple, t: torch.Tensor, mode: str = "copy", base: torch.Tensor | None = None
              ) -> None:
        """mode "shm" writes `t` at its own byte offset inside `base` (the collective's buffer) in the outbox."""
        g = self.ranks[dst]
        off = 0 if base is None else t.data_ptr() - base.data_ptr()
        self.tr.send(g, op, (self.gid, *key), [t], seq=self._cur[1], meta={"n": self._cur[2]}, mode=mode,
                     shm_offset=off)
        self.traffic_counter.add_sent(g, op, t.numel() * t.element_size())

    def _recv(self, src: int, op: str, key: tuple, like: torch.Tensor) -> torch.Tensor:
        """The payload from group-rank `src` under `key`, with the numel and dtype of `like` (where it will land)."""
        g = self.ranks[src]

        def fits(msg: Message) -> torch.Tensor:
            t = next(iter(msg.tensors.values()))
            if t.dtype != like.dtype or t.numel() != like.numel():
                raise WireError(f"{op} #{self._cur[1]}: rank {g} sent {t.numel()} x {t.dtype} under {key!r:.40}, "
                                f"this rank expects {like.numel()} x {like.dtype}")
            return t
        t = self.tr.recv(g, (self.gid, *key), op, self._cur[1], check=self._check, expect=fits,
                         idle=self.local.scan if self.local.active else None)
        self.traffic_counter.add_recv(g, op, t.numel() * t.element_size())
        return t

    def _route(self, sender: int, key: Key, h: dict, wanted: bool) -> None:
        """Whether a legitimate member could have sent this now (see mailbox.py): WireError if not."""
        src = self._member.get(sender)
        if src is None:
            raise WireError(f"rank {sender} is not a member of group {self.gid}")
        if tensor_count(h) != 1:
            raise WireError(f"a message of group {self.gid} carries exactly one tensor, got {tensor_count(h)}")
        if type(h["meta"].get("n", 0)) is not int:
            raise WireError(f"meta 'n' must be an integer, got {h['meta']['n']!r:.40}")
        n = len(key)
        if key[0] == "p2p":
            if n != 4 or type(key[2]) is not int or type(key[3]) is not int:
                raise WireError(f"p2p key must be ['p2p', group, tag, count], got {key!r:.80}")
            if not wanted:
                self.tr.mailbox.in_window(f"p2p message (tag {key[2]})", key[3],
                                          self._p2p_floor.get((src, key[2]), 0), sender, key)
            return
        if not (3 <= n <= 4 and type(key[1]) is int and _part(key[2]) and (n == 3 or _part(key[3]))):
            raise WireError(f"collective key must be [group, seq, step/segment/part...], got {key!r:.80}")
        if not wanted:
            self.tr.mailbox.in_window("collective", key[1], max(self._cur[1], 0), sender, key)

    def _expect_child(self) -> None:
        """A peer may create the next sub-group and send to this rank before this rank has created it: until then,
        messages for it are filed if a member of this group could have sent them for the sub-group's first
        collectives (`_route` with this group's members and floors 0); `new_group` then installs the sub-group's
        own route (or removes this one where this rank is not a member)."""
        gid = f"{self.gid}.{self._children + 1}"
        pending = SimpleNamespace(gid=gid, tr=self.tr, _member=self._member, _cur=("", -1, -1), _p2p_floor={})
        self.tr.mailbox.routes[gid] = partial(ZmqGroup._route, pending)

    def _check(self, sender: int, h: dict) -> None:
        k = h["meta"]["k"]
        op, seq, n = self._cur
        if k[0] == self.gid and k[1] == seq:
            if h["op"] != op or h["meta"].get("n", n) != n:
                raise CollectiveMismatchError(
                    f"collective #{seq} of group {self.gid}: rank {sender} called {h['op']}(numel="
                    f"{h['meta'].get('n')}) while rank {self.tr.rank} called {op}(numel={n}); rank {sender} "
                    f"diverged from this rank's program order")

    def _begin(self, op: str, numel: int) -> int:
        seq = self._seq
        self._seq += 1
        self._cur = (op, seq, numel)
        box = self.tr.mailbox
        if len(box):   # leftovers of finished collectives: no legitimate peer sends for them any more
            self.tr.dropped += box.purge(lambda s, k: k[0] == self.gid and k[1] < seq)
        return seq

    def _ring(self, op: str, seq: int, buf: torch.Tensor, c0: int, combines: list[str]) -> None:
        seg = max(1, self.segment_bytes // max(1, buf.element_size()))
        right = (self.rank + 1) % self.world_size
        if shm_ring.ring_pass(self, op, seq, buf, c0, combines):
            return
        mode = "shm" if self.tr.shm_reserve(self.ranks[right], buf.numel() * buf.element_size()) else "zerocopy"
        ring.ring_pass(buf, self.rank, self.world_size, c0, combines, seg,
                       lambda d, k, t: self._send(d, op, (seq, *k), t, mode=mode if d == right else "copy", base=buf),
                       lambda s, k, like: self._recv(s, op, (seq, *k), like))
        self.tr.flush(op, seq)

    # ---- collectives -------------------------------------------------------------------------------------------
    def all_reduce(self, tensor: Tensor, op: str = "sum", algorithm: str = "auto") -> Tensor:
        """algorithm: "auto" (direct for <= small_bytes, else ring), "ring", "direct", or "root" (gather to rank 0,
        reduce there, broadcast back: the parameter-server pattern, (N-1) x bytes through the root), or
        "hierarchical" (hierarchical.py; "auto" picks it over the ring when a topology's hosts split the group)."""
        check_op(op)
        if algorithm not in ("auto", "ring", "direct", "root", "hierarchical"):
            raise ValueError(f"unknown all_reduce algorithm {algorithm!r}; use auto, ring, direct, root or "
                             "hierarchical")
        buf, orig = as_flat(tensor)
        if op == "avg" and not buf.is_floating_point():
            raise ValueError(f"op='avg' needs a floating-point tensor, got {buf.dtype}")
        seq = self._begin("all_reduce", buf.numel())
        n = self.world_size
        small = buf.numel() * buf.element_size() <= self.small_bytes
        if n == 1:
            pass
        elif algorithm == "root":
            self._root_all_reduce("all_reduce", seq, buf, op)
        elif algorithm == "direct" or (algorithm == "auto" and small):
            self._direct_all_reduce("all_reduce", seq, buf, op)
        elif algorithm == "hierarchical" or (algorithm == "auto" and self.hierarchical and self.tr.links is not None
                                             and hierarchical.layout(self) is not None):
            hierarchical.all_reduce(self, buf, op)
        else:
            self._ring("all_reduce", seq, buf, self.rank, ring.all_reduce_steps(n, op))
        if op == "avg" and n > 1:
            buf.div_(n)
        write_back(buf, orig)
        return tensor

    def _direct_all_reduce(self, name: str, seq: int, buf: torch.Tensor, op: str) -> None:
        if self.local.direct_all_reduce(name, seq, buf, op):
            return
        for d in range(self.world_size):
            if d != self.rank:
                self._send(d, name, (seq, "d"), buf)
        parts = {s: self._recv(s, name, (seq, "d"), buf) for s in range(self.world_size) if s != self.rank}
        self.tr.flush(name, seq)
        parts[self.rank] = buf.clone()
        buf.copy_(parts[0])
        for s in range(1, self.world_size):
            ring.combine(buf, parts[s], op)

    def _root_all_reduce(self, name: str, seq: int, buf: torch.Tensor, op: str) -> None:
        if self.rank == 0:
            for s in range(1, self.world_size):
                ring.combine(buf, self._recv(s, name, (seq, "up"), buf), op)
            for d in range(1, self.world_size):
                self._send(d, name, (seq, "down"), buf)
            self.tr.flush(name, seq)
        else:
            self._send(0, name, (seq, "up"), buf)
            self.tr.flush(name, seq)
            buf.copy_(self._recv(0, name, (seq, "down"), buf))

    def reduce_scatter(self, output: Tensor, input: Tensor, op: str = "sum") -> Tensor:
        check_op(op)
        src, _ = as_flat(input)
        out, orig = as_flat(output)
        a, b = chunk_bounds(src.numel(), self.world_size)[self.rank]
        if out.numel() != b - a:
            raise ValueError(f"reduce_scatter: output has {out.numel()} elements but rank {self.rank}'s chunk of "
                             f"{src.numel()} is {b - a} (chunk_bounds rule)")
        seq = self._begin("reduce_scatter", src.numel())
        buf = src.clone()
        self._ring("reduce_scatter", seq, buf, (self.rank - 1) % self.world_size, [op] * (self.world_size - 1))
        out.copy_(buf[a:b])
        if op == "avg":
            out.div_(self.world_size)
        write_back(out, orig)
        return output

    def all_gather(self, output: Tensor, input: Tensor) -> Tensor:
        src, _ = as_flat(input)
        out, orig = as_flat(output)
        a, b = chunk_bounds(out.numel(), self.world_size)[self.rank]
        if src.numel() != b - a:
            raise ValueError(f"all_gather: input has {src.numel()} elements but rank {self.rank}'s chunk of the "
                             f"{out.numel()}-element output is {b - a} (chunk_bounds rule)")
        seq = self._begin("all_gather", out.numel())
        out[a:b].copy_(src)
        self._ring("all_gather", seq, out, self.rank, ["copy"] * (self.world_size - 1))
        write_back(out, orig)
        return output

    def broadcast(self, tensor: Tensor, src: int = 0) -> Tensor:
        buf, orig = as_flat(tensor)
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast src {src} is not a rank of this {self.world_size}-rank group")
        seq = self._begin("broadcast", buf.numel())
        n, r = self.world_size, self.rank
        if n == 1:
            return tensor
        if (nbytes := buf.numel() * buf.element_size()) <= self.small_bytes and self.local.broadcast(seq, buf, src):
            pass
        elif nbytes <= self.small_bytes:
            if r == src:
                for d in range(n):
                    if d != r:
                        self._send(d, "broadcast", (seq, "d"), buf)
                self.tr.flush("broadcast", seq)
            else:
                buf.copy_(self._recv(src, "broadcast", (seq, "d"), buf))
        else:  # chain: position p = (r - src) mod n receives from p-1 and forwards to p+1
            pos = (r - src) % n
            seg = max(1, self.segment_bytes // buf.element_size())
            nxt, prv = (r + 1) % n, (r - 1) % n
            mode = "shm" if pos < n - 1 and self.tr.shm_reserve(self.ranks[nxt], buf.numel() * buf.element_size()) \
                else "zerocopy"
            for j, (a, b) in enumerate(ring.segments(0, buf.numel(), seg)):
                if pos > 0:
                    buf[a:b].copy_(self._recv(prv, "broadcast", (seq, j), buf[a:b]))
                if pos < n - 1:
                    self._send(nxt, "broadcast", (seq, j), buf[a:b], mode=mode, base=buf)
            if pos > 0:  # acknowledge, so the sender knows its zero-copy buffers were delivered
                self._send(prv, "broadcast", (seq, "ack"), buf[:0])
            if pos < n - 1:
                self._recv(nxt, "broadcast", (seq, "ack"), buf[:0])
        write_back(buf, orig)
        return tensor

    def all_to_all(self, output: Tensor, input: Tensor) -> Tensor:
        src, _ = as_flat(input)
        out, orig = as_flat(output)
        n = self.world_size
        if src.numel() % n or out.numel() != src.numel():
            raise ValueError(f"all_to_all needs input and output of equal size divisible by the group size {n}; "
                             f"got {src.numel()} and {out.numel()}")
        seq = self._begin("all_to_all", src.numel())
        c = src.numel() // n
        for d in range(n):
            if d != self.rank:
                self._send(d, "all_to_all", (seq, "d"), src[d * c:(d + 1) * c])
        out[self.rank * c:(self.rank + 1) * c].copy_(src[self.rank * c:(self.rank + 1) * c])
        for s in range(n):
            if s != self.rank:
                out[s * c:(s + 1) * c].copy_(self._recv(s, "all_to_all", (seq, "d"), src[s * c:(s + 1) * c]))
        self.tr.flush("all_to_all", seq)
        write_back(out, orig)
        return output

    def barrier(self) -> None:
        one = torch.zeros(1, dtype=torch.uint8)
        seq = self._begin("barrier", 1)
        if self.world_size > 1:
            self._direct_all_reduce("barrier", seq, one, "max")

    # ---- point to point ----------------------------------------------------------------------------------------
    def send(self, tensor: Tensor, dst: int, tag: int = 0) -> None:
        self._isend(tensor, dst, tag).wait()

    def recv(self, tensor: Tensor, src: int, tag: int = 0) -> Tensor:
        return self._irecv(tensor, src, tag).wait()

    def isend(self, tensor: Tensor, dst: int, tag: int = 0) -> _Work:
        return self._isend(tensor, dst, tag)

    def _isend(self, tensor: Tensor, dst: int, tag: int = 0) -> _Work:
        buf, _ = as_flat(tensor)
        count = self._p2p_sent[(dst, tag)]
        self._p2p_sent[(dst, tag)] += 1
        g = self.ranks[dst]
        self.tr.send(g, "p2p", ("p2p", self.gid, tag, count), [buf], mode="track")
        self.traffic_counter.add_sent(g, "p2p", buf.numel() * buf.element_size())
        return _Work(lambda: self.tr.flush("p2p", count, g))

    def irecv(self, tensor: Tensor, src: int, tag: int = 0) -> _Work:
        return self._irecv(tensor, src, tag)

    def _irecv(self, tensor: Tensor, src: int, tag: int = 0) -> _Work:
        buf, orig = as_flat(tensor)
        count = self._p2p_recv[(src, tag)]
        self._p2p_recv[(src, tag)] += 1
        g = self.ranks[src]

        def finish() -> Tensor:
            t = next(iter(self.tr.recv(g, ("p2p", self.gid, tag, count), "recv", count).tensors.values()))
            if t.numel() != buf.numel():
                raise CollectiveMismatchError(f"recv from rank {g} (tag {tag}): expected {buf.numel()} elements, "
                                              f"got {t.numel()}")
            self._p2p_received(src, tag, count)
            buf.copy_(t.view(-1).to(buf.dtype))
            self.traffic_counter.add_recv(g, "p2p", t.numel() * t.element_size())
            write_back(buf, orig)
            return tensor
        return _Work(finish)

    def _p2p_received(self, src: int, tag: int, count: int) -> None:
        """Advance the (src, tag) floor past every count received (irecvs may be waited out of order)."""
        floor, early = self._p2p_floor.get((src, tag), 0), self._p2p_early[(src, tag)]
        early.add(count)
        while floor in early:
            early.discard(floor)
            floor += 1
        self._p2p_floor[(src, tag)] = floor

    # ---- groups ------------------------------------------------------------------------------------------------
    def new_group(self, ranks: list[int] | tuple[int, ...]) -> ZmqGroup | None:
        ranks = tuple(int(r) for r in ranks)
        if len(set(ranks)) != len(ranks) or not set(ranks) <= set(self.ranks):
            raise ValueError(f"new_group ranks {ranks} must be distinct members of this group {self.ranks}")
        self._children += 1
        gid = f"{self.gid}.{self._children}"
        self._expect_child()
        if self.tr.rank not in ranks:
            self.tr.mailbox.routes.pop(gid, None)
            return None
        return ZmqGroup(self.tr, ranks, gid, small_bytes=self.small_bytes, segment_bytes=self.segment_bytes,
                        traffic=TrafficCounter(), owns_transport=False, hierarchical=self.hierarchical,
                        shm_channel=self.use_channels)

    @property
    def interrupt(self) -> Callable[[], None] | None:
        return self.tr.interrupt

    @interrupt.setter
    def interrupt(self, fn: Callable[[], None] | None) -> None:
        self.tr.interrupt = fn

    def destroy(self, linger: float = 5.0, lingers: dict[int, float] | None = None) -> None:
        """Close the transport (if this group owns it); queued messages get `linger` s to reach live peers
        (`lingers`: per peer rank; 0 drops them, e.g. for a dead peer)."""
        self.local.close(linger, lingers)
        if self._owns and self.tr is not None:
            shm_channel_close_job(self.tr._job, linger, lingers)   # the sub-groups' channels on this transport
            self.tr.close(linger, lingers)
            self.tr = None  # type: ignore[assignment]
