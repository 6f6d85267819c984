"""Ring collectives, streamed: reduce-scatter, all-gather and all-reduce as one pipelined ring pass.

The buffer (n elements) is cut into N chunks (`chunk_bounds`). With c0 the chunk rank r sends first, at ring step g
rank r sends chunk (c0 - g) mod N to its right neighbour and receives chunk (c0 - g - 1) mod N from its left one,
combining it into its own copy (add/max/min for the reduce-scatter steps, copy for the all-gather steps).

    reduce_scatter   c0 = r - 1, N-1 reducing steps          -> rank r ends owning the reduced chunk r
    all_gather       c0 = r,     N-1 copying steps           -> every rank ends with every chunk
    all_reduce       c0 = r,     N-1 reducing + N-1 copying  -> reduce-scatter then all-gather

Each rank sends (N-1) chunks per phase, so all-reduce moves 2(N-1)/N x n x itemsize bytes per rank whatever N is
(Patarasuk & Yuan 2009), against (N-1) x n x itemsize through the root of a gather + broadcast.

Streaming: chunks are cut further into segments; a segment is forwarded to the right neighbour as soon as it has
been combined, so step g+1 of segment j overlaps step g of segment j+1 and a large tensor flows like a pipeline
instead of waiting on whole chunks. Sends are zero-copy and untracked: a segment sent is never written again in
the same pass (it is final, or overwritten only after data that causally follows its delivery has come back), and
the pass ends with an empty acknowledgement from the right neighbour, so every buffer we sent has been delivered
before the caller may touch it again. One extra latency, instead of tracking every message.

Summation order: the reduced chunk c is ((x_{c+1} + x_{c+2}) + ...) + x_c (ranks in ring order starting after c's
owner in the pass); all ranks receive the same bits for each chunk, and integers are exact.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .group import chunk_bounds

SendFn = Callable[[int, tuple, torch.Tensor], None]        # (dst group rank, key, tensor), zero-copy
RecvFn = Callable[[int, tuple, torch.Tensor], torch.Tensor]  # (src group rank, key, slice it lands in) -> tensor


def combine(dst: torch.Tensor, src: torch.Tensor, how: str) -> None:
    """dst <- dst (op) src, in place."""
    if how == "copy":
        dst.copy_(src)
    elif how in ("sum", "avg"):
        dst.add_(src)
    elif how == "max":
        torch.maximum(dst, src, out=dst)
    elif how == "min":
        torch.minimum(dst, src, out=dst)
    else:
        raise ValueError(f"unknown combine {how!r}")


def segments(start: int, end: int, seg: int) -> list[tuple[int, int]]:
    return [(a, min(a + seg, end)) for a in range(start, end, seg)]


def ring_pass(buf: torch.Tensor, rank: int, world: int, c0: int, combines: list[str], seg_elems: int,
              send: SendFn, recv: RecvFn) -> None:
    """Run one streamed ring pass over the flat tensor `buf` (see the module docstring)."""
    if world == 1 or not combines:
        return
    bounds = chunk_bounds(buf.numel(), world)
    right, left = (rank + 1) % world, (rank - 1) % world
    for j, (a, b) in enumerate(segments(*bounds[c0 % world], seg_elems)):
        send(right, (0, j), buf[a:b])
    for g, how in enumerate(combines):
        c = (c0 - g - 1) % world
        forward = g + 1 < len(combines)
        for j, (a, b) in enumerate(segments(*bounds[c], seg_elems)):
            combine(buf[a:b], recv(left, (g, j), buf[a:b]), how)
            if forward:
                send(right, (g + 1, j), buf[a:b])
    send(left, ("ack",), buf[:0])
    recv(right, ("ack",), buf[:0])


def all_reduce_steps(world: int, op: str) -> list[str]:
    return [op] * (world - 1) + ["copy"] * (world - 1)
