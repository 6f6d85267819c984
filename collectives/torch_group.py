"""`TorchGroup`: the `torch` backend — the same `ProcessGroup` API delegated to torch.distributed.

gloo for CPU tensors, NCCL when the tensors live on CUDA. numpy arrays are wrapped zero-copy with `torch.from_numpy`.
gloo has no `avg` and no uneven reduce-scatter/all-gather, so:
  avg            = sum, then divide by N
  reduce_scatter = a ring over gloo's p2p sends, (N−1)/N·S per rank (`_ring`)                     [gloo]
                   reduce_scatter_single when chunks are equal, else all_reduce of a copy        [nccl]
  all_gather     = the same ring, forwarding chunks                                               [gloo]
                   pad every chunk to the largest, all_gather_single (all_gather_into_tensor before torch 2.13),
                   then unpad                                                                     [nccl]
Summation order is gloo's/NCCL's own: compare floats with the `zmq` backend to a tolerance, integers exactly.
Traffic is what the kernel counted on the group's gloo connections (sockmeter.py: TCP payload written and received,
gloo's 48-byte message headers included), claimed at the end of each op -- but a receive, whose bytes are claimed
with its connection's next claim (a send to that peer, or before an op of another kind or a read of the counters:
`_settle`), so a pipeline hop reads the kernel's counters once, not twice; the algorithms set the figure (gloo's ring
all-reduce 2(N−1)/N·S, a binomial-tree broadcast, ...; the rings above (N−1)/N·S). Where it cannot be observed
(NCCL, a group formed before pslab saw it, no TCP_INFO), `traffic()["observed"]` is False and no byte is counted:
a report says "not observable" instead of a number.

Two kinds of group: the job's default (world) group and its `new_group`s, driven through `torch.distributed.*`; or a
standalone gloo group (`gloo_groups.standalone_gloo`: one per elastic generation, elastic.py), whose backend methods are called
directly (no global registry). Every op is issued async and waited on; when `interrupt` is set (elastic), the wait
runs in slices of `interrupt_every` seconds with a call to `interrupt` between them (an op that completes returns
its result, as on the zmq backend: news comes at the next wait), and the op runs on private copies of its buffers:
an abandoned gloo op may still complete later (a SIGSTOPped peer wakes up) and must not write into the caller's
tensors (one copy in and one out per op: measured ~1.1-1.3x a plain op's time on a loaded 2-core host). A gloo error
(a killed peer closes its connections) then becomes a wait for the next membership (`interrupt` raises), else
`PeerFailedError` after the timeout. A standalone group destroyed with work in flight is leaked on purpose: its
destructor would join gloo's threads, which wait for the dead peer.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .errors import PeerFailedError, PeerTimeoutError
from .group import ProcessGroup, check_op, chunk_bounds
from .ring import combine
from .gloo_groups import group_meter, standalone_gloo
from .sockmeter import SocketMeter, socket_fds
from .traffic import TrafficCounter, untallied
from .wire import Tensor
from .zmq_group import as_flat, write_back

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single (the old names warn); pyproject
# allows older torch
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_RING_TAG = 1 << 30        # tags of the p2p rings inside reduce_scatter / all_gather (a user's p2p tags stay below)


def _opts(cls: Any, **fields: Any) -> Any:
    o = cls()
    for k, v in fields.items():
        setattr(o, k, v)
    return o


_NEW_GROUPS = 0     # dist.new_group calls of this process (a group's key for its socket labels)
_ABANDONED: list[Any] = []      # standalone groups destroyed with work in flight (see the module docstring)


class TorchGroup(ProcessGroup):
    backend = "torch"

    def __init__(self, pg: Any, ranks: Sequence[int], rank_global: int, timeout: float, *,
                 standalone: bool = False, meter: SocketMeter | None = None) -> None:
        """meter: the group's gloo connections (sockmeter.py); None: its traffic is not observable."""
        self.pg = pg
        self.ranks = tuple(ranks)
        self.world_size = len(self.ranks)
        self.rank = self.ranks.index(rank_global)
        self._grank = rank_global
        self.timeout = timeout
        self.traffic_counter = TrafficCounter()
        self._standalone = standalone              # pg: a bare ProcessGroupGloo; ranks are 0..N-1
        self.interrupt: Callable[[], None] | None = None
        self.interrupt_every = 0.05
        self._inflight: list[Any] = []             # works whose wait was interrupted
        self._children = 0
        self.store: Any = None                     # the store of a standalone group (its new_groups rendezvous)
        self._route: tuple[Any, list[int]] | None = None     # CPU p2p's (process group, its ranks): _p2p_route
        self._unclaimed: set[int] = set()          # group ranks whose receives' bytes are not claimed yet: _settle
        self.meter = meter if meter is not None and meter.observable and self.world_size > 1 else None
        self.unobserved_why = ("" if self.meter is not None or self.world_size == 1 else
                               meter.why_not if meter is not None else "NCCL or a group formed outside pslab")

    # ---- issuing and waiting -----------------------------------------------------------------------------------
    def _private(self, t: torch.Tensor) -> torch.Tensor:
        """The buffer the op writes into: `t` itself, or a copy when a wait may be abandoned (interrupt set)."""
        return t if self.interrupt is None else t.clone()

    def _wait(self, work: Any, op: str, pollable: bool = True) -> None:
        """Wait for `work`; under `interrupt`, in slices of `interrupt_every`, calling `interrupt` between them
        (gloo's p2p works complete only inside an unbounded wait(): a helper thread waits for those)."""
        if self.interrupt is None:
            work.wait()
            return
        deadline = time.monotonic() + self.timeout
        if not pollable:
            self._wait_p2p(work, op, deadline)
            return
        slice_ = timedelta(seconds=self.interrupt_every)
        try:
            while True:
                try:
                    work.wait(slice_)           # c10d: "timed out" leaves the work pending; wait again
                    break
                except RuntimeError:
                    if work.is_completed():     # completed after the slice's timeout, or failed
                        err = self._failed(work)
                        if err is None:
                            break
                        self._peer_failed(op, err, deadline)   # gloo: a peer closed its connection (killed)
                self.interrupt()
                if time.monotonic() >= deadline:
                    raise PeerTimeoutError(op, 0, -1, self.timeout, "gloo work not completed")
        except BaseException:
            if not work.is_completed():
                self._inflight.append(work)
            raise

    @staticmethod
    def _failed(work: Any) -> RuntimeError | None:
        """The error of a completed `work`, None if it succeeded. A sliced wait's timeout ("Operation timed out!")
        races with the work completing: is_completed() may then be True for a work that succeeded, and only an
        unbounded wait on the completed work tells (it returns at once, or raises the op's own error)."""
        try:
            work.wait()
            return None
        except RuntimeError as err:
            return err

    def _wait_p2p(self, work: Any, op: str, deadline: float) -> None:
        finished, failed = threading.Event(), []

        def waiter() -> None:
            try:
                work.wait()
            except RuntimeError as e:
                failed.append(e)
            finished.set()
        threading.Thread(target=waiter, daemon=True, name="pslab-gloo-p2p").start()
        try:
            while not finished.wait(self.interrupt_every):
                self.interrupt()
                if time.monotonic() >= deadline:
                    raise PeerTimeoutError(op, 0, -1, self.timeout, "gloo work not completed")
        except BaseException:
            self._inflight.append(work)
            raise
        if failed:
            self._peer_failed(op, failed[0], deadline)

    def _peer_failed(self, op: str, e: Exception, deadline: float) -> None:
        """A peer died mid-op: wait for the coordinator's next membership (`interrupt` raises), else give up."""
        while time.monotonic() < deadline:
            self.interrupt()
            time.sleep(self.interrupt_every)
        raise PeerFailedError(f"{op}: a peer of this {self.world_size}-rank group failed ({str(e)[:200]}) and no "
                              f"newer membership came within {self.timeout:g}s") from None

    def _all_reduce_work(self, buf: torch.Tensor, op: str) -> Any:
        if self._standalone:
            return self.pg.allreduce([buf], _opts(dist.AllreduceOptions, reduceOp=_OPS[op]))
        return dist.all_reduce(buf, op=_OPS[op], group=self.pg, async_op=True)

    def _count(self, op: str, peer: int = -1, local: int | None = None) -> None:
        """Claim the bytes the group's connections carried since the last claim for `op` (sockmeter.py): those to
        group rank `local` only, when given and the meter knows them."""
        if self.meter is not None:
            self.traffic_counter.add_both(peer, op, *self.meter.claim(local))

    def _settle(self) -> None:
        """Claim as p2p what the connections of receives not claimed yet carried. A receive's wait does not claim (a
        claim reads the kernel's counters: ~5 µs, on every hop of a pipeline's critical path); its bytes are
        claimed with the next claim on that connection -- a send to the same peer, or this, called before an op of
        another kind is issued and before the counters are read. So every byte keeps its op and its peer. (Outside
        any `tally`: the op that happens to settle them must not take them into its own CommLog record.)"""
        if not self._unclaimed:
            return
        with untallied():
            while self._unclaimed:
                try:
                    local = self._unclaimed.pop()
                except KeyError:                     # (another thread settled it)
                    return
                self._count("p2p", self.ranks[local], local)

    def reset_traffic(self) -> None:
        self._settle()
        super().reset_traffic()

    @property
    def observable(self) -> bool:
        """Whether this group's bytes are counted (gloo on TCP), or cannot be observed (NCCL, no meter)."""
        return self.meter is not None or self.world_size == 1

    def traffic(self) -> dict[str, Any]:
        self._settle()
        snap = super().traffic()
        snap["observed"] = self.observable
        if not self.observable:
            snap["unobserved_why"] = self.unobserved_why
        return snap

    def all_reduce(self, tensor: Tensor, op: str = "sum") -> Tensor:
        self._settle()                   # (a receive's bytes stay p2p's)
        check_op(op)
        buf, orig = as_flat(tensor) if not _is_cuda(tensor) else (tensor, None)
        work_buf = self._private(buf)
        self._wait(self._all_reduce_work(work_buf, op), "all_reduce")
        if work_buf is not buf:
            buf.copy_(work_buf)
        self._count("all_reduce")
        if op == "avg":
            buf.div_(self.world_size)
        write_back(buf, orig)
        return tensor

    def reduce_scatter(self, output: Tensor, input: Tensor, op: str = "sum") -> Tensor:
        self._settle()                   # (a receive's bytes stay p2p's)
        check_op(op)
        src, _ = as_flat(input) if not _is_cuda(input) else (input.view(-1), None)
        out, orig = as_flat(output) if not _is_cuda(output) else (output.view(-1), None)
        n = self.world_size
        a, b = chunk_bounds(src.numel(), n)[self.rank]
        if out.numel() != b - a:
            raise ValueError(f"reduce_scatter: output has {out.numel()} elements, rank {self.rank}'s chunk is {b - a}")
        if not src.is_cuda:
            self._ring("reduce_scatter", out, src, op)
        elif src.numel() % n == 0 and not self._standalone:
            self._wait(_reduce_scatter_single(out, src, op=_OPS[op], group=self.pg, async_op=True),
                       "reduce_scatter")
        else:
            tmp = src.clone()
            self._wait(self._all_reduce_work(tmp, op), "reduce_scatter")
            out.copy_(tmp[a:b])
        self._count("reduce_scatter")
        if op == "avg":
            out.div_(n)
        write_back(out, orig)
        return output

    def all_gather(self, output: Tensor, input: Tensor) -> Tensor:
        self._settle()                   # (a receive's bytes stay p2p's)
        src, _ = as_flat(input) if not _is_cuda(input) else (input.view(-1), None)
        out, orig = as_flat(output) if not _is_cuda(output) else (output.view(-1), None)
        n = self.world_size
        bounds = chunk_bounds(out.numel(), n)
        if src.numel() != bounds[self.rank][1] - bounds[self.rank][0]:
            raise ValueError(f"all_gather: input has {src.numel()} elements, rank {self.rank}'s chunk is "
                             f"{bounds[self.rank][1] - bounds[self.rank][0]}")
        if not src.is_cuda:
            self._ring("all_gather", out, src)
            self._count("all_gather")
            write_back(out, orig)
            return output
        width = max(b - a for a, b in bounds) if bounds else 0
        padded_in = torch.zeros(width, dtype=src.dtype, device=src.device)
        padded_in[:src.numel()] = src
        padded_out = torch.empty(width * n, dtype=src.dtype, device=src.device)
        if self._standalone:
            work = self.pg._allgather_base(padded_out, padded_in)
        else:
            work = _all_gather_single(padded_out, padded_in, group=self.pg, async_op=True)
        self._wait(work, "all_gather")
        self._count("all_gather")
        for i, (a, b) in enumerate(bounds):
            out[a:b] = padded_out[i * width:i * width + (b - a)]
        write_back(out, orig)
        return output

    def _ring(self, kind: str, out: torch.Tensor, src: torch.Tensor, op: str = "sum") -> None:
        """A ring reduce-scatter or all-gather of CPU tensors over gloo's point-to-point sends (gloo has neither for
        uneven chunks, and its reduce-scatter would all-reduce a copy): N−1 steps around the ring, (N−1)/N·S sent
        per rank, as the zmq backend's ring (collectives/ring.py). Step s sends to rank r+1 and receives from rank
        r−1: reduce-scatter sends the partial of chunk r−s−1 (its own at s = 0) and adds its own to the partial of
        chunk r−s−2 it receives (the last: chunk r, complete); all-gather forwards chunk r−s and receives chunk
        r−s−1 into `out`. Receives land in fresh buffers while `interrupt` is set (an abandoned op must not write
        into the caller's tensors later). Not ring.ring_pass: that pass works in place on one buffer (a copy of the
        input for a reduce-scatter) and closes with an acknowledgement because its sends are untracked; gloo's are
        waited here, so each step receives straight into its place and no ack message is needed."""
        n, r = self.world_size, self.rank
        bounds = chunk_bounds(out.numel() if kind == "all_gather" else src.numel(), n)
        part = lambda t, i: t[bounds[i][0]:bounds[i][1]]      # noqa: E731
        private = self.interrupt is not None
        if kind == "all_gather":
            part(out, r).copy_(src)
            send = part(out, r)
        elif n == 1:
            out.copy_(src)
        else:
            send = part(src, (r - 1) % n)
        for s in range(n - 1):
            i = (r - s - 1) % n if kind == "all_gather" else (r - s - 2) % n
            into = part(out, i) if kind == "all_gather" else out if s == n - 2 else None   # (else a partial)
            got = into if into is not None and not private else torch.empty(bounds[i][1] - bounds[i][0],
                                                                              dtype=src.dtype)
            works = [self._p2p(got, (r - 1) % n, _RING_TAG + s, send=False),
                     self._p2p(send.contiguous(), (r + 1) % n, _RING_TAG + s, send=True)]
            for w in works:
                self._wait(w, kind, pollable=False)
            if kind == "reduce_scatter":
                combine(got, part(src, i), op)
            if into is not None and got is not into:
                into.copy_(got)
            send = got

    def _p2p(self, buf: torch.Tensor, peer: int, tag: int, send: bool) -> Any:
        """The backend's send or receive of `buf` to / from this group's rank `peer`: its raw work, unrecorded and
        unmetered (`_isend` / `_irecv` wrap it; a ring step waits it as part of its collective)."""
        if not buf.is_cuda:           # straight to the ProcessGroup, by its own rank numbers (see _p2p_route)
            pg, rank = self._route if self._route is not None else self._p2p_route()
            return pg.send([buf], rank[peer], tag) if send else pg.recv([buf], rank[peer], tag)
        if send:
            return dist.isend(buf, dst=self.ranks[peer], group=self.pg, tag=tag)
        return dist.irecv(buf, src=self.ranks[peer], group=self.pg, tag=tag)

    def _p2p_route(self) -> tuple[Any, list[int]]:
        """(process group, its rank of each of this group's ranks) for CPU p2p, computed once: torch.distributed's
        isend / irecv wrappers resolve the group and translate the rank on every call, then end in this same
        `ProcessGroup.send / recv` (no difference measurable here on its own: one path for both kinds of group)."""
        if self._standalone:
            pg, rank = self.pg, list(range(self.world_size))
        else:
            pg = self.pg if self.pg is not None else dist.distributed_c10d._get_default_group()
            rank = [dist.get_group_rank(pg, r) for r in self.ranks]
        self._route = (pg, rank)
        return self._route

    def broadcast(self, tensor: Tensor, src: int = 0) -> Tensor:
        self._settle()                   # (a receive's bytes stay p2p's)
        buf, orig = as_flat(tensor) if not _is_cuda(tensor) else (tensor, None)
        work_buf = self._private(buf)
        if self._standalone:
            work = self.pg.broadcast([work_buf], _opts(dist.BroadcastOptions, rootRank=src, rootTensor=0))
        else:
            work = dist.broadcast(work_buf, src=self.ranks[src], group=self.pg, async_op=True)
        self._wait(work, "broadcast")
        self._count("broadcast")         # gloo's tree: the root and inner ranks send, leaves only headers
        if work_buf is not buf:
            buf.copy_(work_buf)
        write_back(buf, orig)
        return tensor

    def all_to_all(self, output: Tensor, input: Tensor) -> Tensor:
        self._settle()                   # (a receive's bytes stay p2p's)
        src, _ = as_flat(input) if not _is_cuda(input) else (input.view(-1), None)
        out, orig = as_flat(output) if not _is_cuda(output) else (output.view(-1), None)
        n = self.world_size
        if src.numel() % n or out.numel() != src.numel():
            raise ValueError(f"all_to_all needs input and output of equal size divisible by {n}")
        work_out = self._private(out)
        if self._standalone:
            work = self.pg.alltoall_base(work_out, src, [], [], dist.AllToAllOptions())
        else:
            work = dist.all_to_all_single(work_out, src, group=self.pg, async_op=True)
        self._wait(work, "all_to_all")
        self._count("all_to_all")
        if work_out is not out:
            out.copy_(work_out)
        write_back(out, orig)
        return output

    def barrier(self) -> None:
        self._settle()                   # (a receive's bytes stay p2p's)
        if self._standalone:
            self._wait(self.pg.barrier(dist.BarrierOptions()), "barrier")
        else:
            self._wait(dist.barrier(group=self.pg, async_op=True), "barrier")
        self._count("barrier")

    def send(self, tensor: Tensor, dst: int, tag: int = 0) -> None:
        self._isend(tensor, dst, tag).wait()

    def recv(self, tensor: Tensor, src: int, tag: int = 0) -> Tensor:
        return self._irecv(tensor, src, tag).wait()

    def isend(self, tensor: Tensor, dst: int, tag: int = 0) -> Any:
        return self._isend(tensor, dst, tag)

    def _isend(self, tensor: Tensor, dst: int, tag: int = 0) -> Any:
        buf, _ = as_flat(tensor) if not _is_cuda(tensor) else (tensor, None)
        return _TorchWork(self, self._p2p(self._private(buf), dst, tag, send=True), "send", tensor,
                          peer=self.ranks[dst], local=dst)

    def irecv(self, tensor: Tensor, src: int, tag: int = 0) -> Any:
        return self._irecv(tensor, src, tag)

    def _irecv(self, tensor: Tensor, src: int, tag: int = 0) -> Any:
        buf, orig = as_flat(tensor) if not _is_cuda(tensor) else (tensor, None)
        work_buf = self._private(buf)
        return _TorchWork(self, self._p2p(work_buf, src, tag, send=False), "recv", tensor, buf, orig, work_buf,
                          peer=self.ranks[src], local=src)

    def new_group(self, ranks: list[int] | tuple[int, ...]) -> TorchGroup | None:
        ranks = tuple(int(r) for r in ranks)
        if self._standalone:   # a standalone gloo group of its own, over this group's store
            if len(set(ranks)) != len(ranks) or not set(ranks) <= set(self.ranks):
                raise ValueError(f"new_group ranks {ranks} must be distinct members of this group {self.ranks}")
            self._children += 1
            if self._grank not in ranks:
                return None
            pg, meter = standalone_gloo(dist.PrefixStore(f"sub{self._children}/", self.store),
                                        ranks.index(self._grank), len(ranks), self.timeout)
            child = TorchGroup(pg, ranks, self._grank, self.timeout, standalone=True,
                               meter=meter if self.meter is not None else
                               SocketMeter([], self.unobserved_why or "the parent group's"))
            child.store, child.interrupt, child.interrupt_every = self.store, self.interrupt, self.interrupt_every
            return child
        before = socket_fds()
        pg = dist.new_group(list(ranks))
        global _NEW_GROUPS
        _NEW_GROUPS += 1                 # every rank calls dist.new_group in one order: the same number everywhere
        if self._grank not in ranks:
            return None
        meter = group_meter(before, self.store, ranks.index(self._grank), len(ranks), self.timeout,
                            f"new{_NEW_GROUPS}", "" if self.meter is not None else
                            self.unobserved_why or "the parent group's")
        child = TorchGroup(pg, ranks, self._grank, self.timeout, meter=meter)
        child.store = self.store
        return child

    def destroy(self) -> None:
        self._route = None                      # (it holds the process group: let it go with the group)
        if self._standalone:
            pg, self.pg = self.pg, None
            if pg is not None and any(not w.is_completed() for w in self._inflight):
                _ABANDONED.append((pg, self._inflight))   # never destroyed: see the module docstring
            self._inflight = []
            return
        if self.pg is None and dist.is_initialized():
            dist.destroy_process_group()


ctypes.pythonapi.Py_IncRef(ctypes.py_object(_ABANDONED))   # not even at interpreter exit (its items would block)


class _TorchWork:
    def __init__(self, group: TorchGroup, work: Any, op: str, tensor: Tensor, buf: torch.Tensor | None = None,
                 orig: Tensor | None = None, work_buf: torch.Tensor | None = None, peer: int = -1,
                 local: int | None = None) -> None:
        self._group, self._work, self._op, self._tensor = group, work, op, tensor
        self._buf, self._orig, self._work_buf, self._peer, self._local = buf, orig, work_buf, peer, local

    def wait(self, timeout: float | None = None) -> Tensor:
        g = self._group
        g._wait(self._work, self._op, pollable=False)
        if g.meter is not None:
            if self._op == "recv" and g.meter.knows(self._local):   # claimed with its connection's next claim
                g._unclaimed.add(self._local)                        # (TorchGroup._settle)
            else:                                # what the connection(s) to the peer carried until now (unlabelled:
                g._count("p2p", self._peer, self._local)             # every connection, claimed at once, as before)
                g._unclaimed.discard(self._local)    # (the receives from the peer: on the same connection)
        if self._buf is not None:
            if self._work_buf is not None and self._work_buf is not self._buf:
                self._buf.copy_(self._work_buf)
            write_back(self._buf, self._orig)
        return self._tensor

    def is_completed(self) -> bool:
        return self._work.is_completed()


def _is_cuda(t: Tensor) -> bool:
    return isinstance(t, torch.Tensor) and t.is_cuda
