"""`TorchGroup`: the `torch` backend — the same `ProcessGroup` API delegated to torch.distributed.

gloo for CPU tensors, NCCL when the tensors live on CUDA. numpy arrays are wrapped zero-copy with `torch.from_numpy`.
gloo has no `avg` and no uneven reduce-scatter/all-gather, so:
  avg            = sum, then divide by N
  reduce_scatter = all_reduce of a copy, keep own chunk (same result; not bandwidth-optimal)  [gloo]
                   reduce_scatter_tensor when chunks are equal                                  [nccl]
  all_gather     = pad every chunk to the largest, all_gather_into_tensor, then unpad
Summation order is gloo's/NCCL's own: compare floats with the `zmq` backend to a tolerance, integers exactly.
Traffic is accounted with the algorithm's textbook bytes per rank (torch does not report its own), marked
`"estimated": True` in `traffic()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .group import ProcessGroup, check_op, chunk_bounds
from .traffic import TrafficCounter
from .wire import Tensor
from .zmq_group import as_flat, write_back

_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class TorchGroup(ProcessGroup):
    backend = "torch"

    def __init__(self, pg: Any, ranks: Sequence[int], rank_global: int, timeout: float) -> None:
        self.pg = pg
        self.ranks = tuple(ranks)
        self.world_size = len(self.ranks)
        self.rank = self.ranks.index(rank_global)
        self._grank = rank_global
        self.timeout = timeout
        self.traffic_counter = TrafficCounter()

    def _account(self, op: str, nbytes: float) -> None:
        if self.world_size > 1:
            self.traffic_counter.add_sent(-1, op, int(nbytes))
            self.traffic_counter.add_recv(-1, op, int(nbytes))

    def traffic(self) -> dict[str, Any]:
        snap = super().traffic()
        snap["estimated"] = True
        return snap

    def all_reduce(self, tensor: Tensor, op: str = "sum") -> Tensor:
        check_op(op)
        buf, orig = as_flat(tensor) if not _is_cuda(tensor) else (tensor, None)
        dist.all_reduce(buf, op=_OPS[op], group=self.pg)
        if op == "avg":
            buf.div_(self.world_size)
        n = self.world_size
        self._account("all_reduce", 2 * (n - 1) / n * buf.numel() * buf.element_size())
        write_back(buf, orig)
        return tensor

    def reduce_scatter(self, output: Tensor, input: Tensor, op: str = "sum") -> Tensor:
        check_op(op)
        src, _ = as_flat(input) if not _is_cuda(input) else (input.view(-1), None)
        out, orig = as_flat(output) if not _is_cuda(output) else (output.view(-1), None)
        n = self.world_size
        a, b = chunk_bounds(src.numel(), n)[self.rank]
        if out.numel() != b - a:
            raise ValueError(f"reduce_scatter: output has {out.numel()} elements, rank {self.rank}'s chunk is {b - a}")
        if src.is_cuda and src.numel() % n == 0:
            dist.reduce_scatter_tensor(out, src, op=_OPS[op], group=self.pg)
        else:
            tmp = src.clone()
            dist.all_reduce(tmp, op=_OPS[op], group=self.pg)
            out.copy_(tmp[a:b])
        if op == "avg":
            out.div_(n)
        self._account("reduce_scatter", (n - 1) / n * src.numel() * src.element_size())
        write_back(out, orig)
        return output

    def all_gather(self, output: Tensor, input: Tensor) -> Tensor:
        src, _ = as_flat(input) if not _is_cuda(input) else (input.view(-1), None)
        out, orig = as_flat(output) if not _is_cuda(output) else (output.view(-1), None)
        n = self.world_size
        bounds = chunk_bounds(out.numel(), n)
        if src.numel() != bounds[self.rank][1] - bounds[self.rank][0]:
            raise ValueError(f"all_gather: input has {src.numel()} elements, rank {self.rank}'s chunk is "
                             f"{bounds[self.rank][1] - bounds[self.rank][0]}")
        width = max(b - a for a, b in bounds) if bounds else 0
        padded_in = torch.zeros(width, dtype=src.dtype, device=src.device)
        padded_in[:src.numel()] = src
        padded_out = torch.empty(width * n, dtype=src.dtype, device=src.device)
        dist.all_gather_into_tensor(padded_out, padded_in, group=self.pg)
        for i, (a, b) in enumerate(bounds):
            out[a:b] = padded_out[i * width:i * width + (b - a)]
        self._account("all_gather", (n - 1) / n * out.numel() * out.element_size())
        write_back(out, orig)
        return output

    def broadcast(self, tensor: Tensor, src: int = 0) -> Tensor:
        buf, orig = as_flat(tensor) if not _is_cuda(tensor) else (tensor, None)
        dist.broadcast(buf, src=self.ranks[src], group=self.pg)
        self._account("broadcast", buf.numel() * buf.element_size())
        write_back(buf, orig)
        return tensor

    def all_to_all(self, output: Tensor, input: Tensor) -> Tensor:
        src, _ = as_flat(input) if not _is_cuda(input) else (input.view(-1), None)
        out, orig = as_flat(output) if not _is_cuda(output) else (output.view(-1), None)
        n = self.world_size
        if src.numel() % n or out.numel() != src.numel():
            raise ValueError(f"all_to_all needs input and output of equal size divisible by {n}")
        dist.all_to_all_single(out, src, group=self.pg)
        self._account("all_to_all", (n - 1) / n * src.numel() * src.element_size())
        write_back(out, orig)
        return output

    def barrier(self) -> None:
        dist.barrier(group=self.pg)

    def send(self, tensor: Tensor, dst: int, tag: int = 0) -> None:
        self.isend(tensor, dst, tag).wait()

    def recv(self, tensor: Tensor, src: int, tag: int = 0) -> Tensor:
        return self.irecv(tensor, src, tag).wait()

    def isend(self, tensor: Tensor, dst: int, tag: int = 0) -> Any:
        buf, _ = as_flat(tensor) if not _is_cuda(tensor) else (tensor, None)
        self.traffic_counter.add_sent(self.ranks[dst], "p2p", buf.numel() * buf.element_size())
        return _TorchWork(dist.isend(buf, dst=self.ranks[dst], group=self.pg, tag=tag), tensor)

    def irecv(self, tensor: Tensor, src: int, tag: int = 0) -> Any:
        buf, orig = as_flat(tensor) if not _is_cuda(tensor) else (tensor, None)
        self.traffic_counter.add_recv(self.ranks[src], "p2p", buf.numel() * buf.element_size())
        return _TorchWork(dist.irecv(buf, src=self.ranks[src], group=self.pg, tag=tag), tensor, buf, orig)

    def new_group(self, ranks: list[int] | tuple[int, ...]) -> TorchGroup | None:
        ranks = tuple(int(r) for r in ranks)
        pg = dist.new_group(list(ranks))
        if self._grank not in ranks:
            return None
        return TorchGroup(pg, ranks, self._grank, self.timeout)

    def destroy(self) -> None:
        if self.pg is None and dist.is_initialized():
            dist.destroy_process_group()


class _TorchWork:
    def __init__(self, work: Any, tensor: Tensor, buf: torch.Tensor | None = None, orig: Tensor | None = None):
        self._work, self._tensor, self._buf, self._orig = work, tensor, buf, orig

    def wait(self, timeout: float | None = None) -> Tensor:
        self._work.wait()
        if self._buf is not None:
            write_back(self._buf, self._orig)
        return self._tensor

    def is_completed(self) -> bool:
        return self._work.is_completed()


def _is_cuda(t: Tensor) -> bool:
    return isinstance(t, torch.Tensor) and t.is_cuda
