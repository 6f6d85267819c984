"""The `ProcessGroup` interface shared by both backends (`zmq`: ours; `torch`: torch.distributed).

Names and in-place semantics follow torch.distributed so users feel at home. Tensors may be numpy arrays or CPU
torch tensors (CUDA tensors only on the `torch` backend with NCCL). Collectives operate on the flattened tensor.

Uneven sizes. `reduce_scatter(out, inp)` and `all_gather(out, inp)` split a flat buffer of n elements into N chunks
with `chunk_bounds(n, N)` (numpy.array_split rule: the first n mod N chunks get one extra element). When n is
divisible by N this is exactly torch's `reduce_scatter_tensor` / `all_gather_into_tensor`.

Every collective gets a per-group sequence number; ranks that disagree on the op at a sequence number get a
`CollectiveMismatchError` that names the diverging rank. Every public call of a backend leaves an entry in the
flight recorder (flight.py), which `pslab diagnose` matches across ranks after a hang.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

import numpy as np

from .traffic import TrafficCounter
from .wire import Tensor

REDUCE_OPS = ("sum", "avg", "max", "min")


def chunk_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of each of `parts` chunks of n elements (numpy.array_split rule)."""
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


class Work(Protocol):
    """Handle of a non-blocking operation."""

    def wait(self, timeout: float | None = None) -> Any: ...

    def is_completed(self) -> bool: ...


class ProcessGroup(ABC):
    """A set of ranks that run collectives together. `rank` is the rank inside this group."""

    backend: str
    rank: int
    world_size: int
    ranks: tuple[int, ...]  # global ranks of the members, in group-rank order
    timeout: float
    _flight_gi: Any = None   # the flight recorder's per-group cache (flight.py)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Every backend's public calls leave a flight-recorder entry (flight.py): both backends record alike."""
        super().__init_subclass__(**kwargs)
        from .flight import TRACED_OPS
        from .flight_wrap import recorded
        for op in TRACED_OPS:
            fn = cls.__dict__.get(op)
            if fn is not None and not getattr(fn, "__isabstractmethod__", False):
                setattr(cls, op, recorded(op, fn))

    @abstractmethod
    def all_reduce(self, tensor: Tensor, op: str = "sum") -> Tensor:
        """Reduce `tensor` across ranks in place; every rank gets the result."""

    @abstractmethod
    def reduce_scatter(self, output: Tensor, input: Tensor, op: str = "sum") -> Tensor:
        """Reduce `input` across ranks; this rank keeps chunk `rank` (see chunk_bounds) in `output`."""

    @abstractmethod
    def all_gather(self, output: Tensor, input: Tensor) -> Tensor:
        """Concatenate every rank's `input` (chunk i from rank i) into `output`."""

    @abstractmethod
    def broadcast(self, tensor: Tensor, src: int = 0) -> Tensor:
        """Copy group-rank `src`'s tensor into every rank's `tensor`."""

    @abstractmethod
    def all_to_all(self, output: Tensor, input: Tensor) -> Tensor:
        """Chunk j of `input` goes to rank j; chunk i of `output` comes from rank i (equal chunks)."""

    @abstractmethod
    def barrier(self) -> None:
        """Return only after every rank has entered the barrier."""

    @abstractmethod
    def send(self, tensor: Tensor, dst: int, tag: int = 0) -> None:
        """Send `tensor` to group-rank `dst`."""

    @abstractmethod
    def recv(self, tensor: Tensor, src: int, tag: int = 0) -> Tensor:
        """Receive into `tensor` from group-rank `src`."""

    @abstractmethod
    def isend(self, tensor: Tensor, dst: int, tag: int = 0) -> Work:
        """Non-blocking send; do not modify `tensor` until `wait()` returns."""

    @abstractmethod
    def irecv(self, tensor: Tensor, src: int, tag: int = 0) -> Work:
        """Non-blocking receive into `tensor`; valid after `wait()`."""

    @abstractmethod
    def new_group(self, ranks: list[int] | tuple[int, ...]) -> ProcessGroup | None:
        """Sub-group of the given *global* ranks. Every rank of this group must call it, in the same order
        (as in torch.distributed); non-members get None."""

    @abstractmethod
    def destroy(self) -> None:
        """Release sockets and stores."""

    # ---- traffic accounting (bytes of tensor payload, per peer global rank and per op) -------------------------
    traffic_counter: TrafficCounter

    def traffic(self) -> dict[str, Any]:
        """Bytes sent/received per peer (global rank) and per op since the last reset."""
        return self.traffic_counter.snapshot()

    def reset_traffic(self) -> None:
        self.traffic_counter.reset()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()


def check_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}; expected one of {', '.join(REDUCE_OPS)}")


def flat_numel(t: Tensor) -> int:
    return int(t.size) if isinstance(t, np.ndarray) else int(t.numel())
