"""Fewer torch calls per request: a shard's parameters in one buffer per dtype, and runs of adjacent tensors.

On the 2-core machine a Python-level torch call costs ~5 µs, and a push used to make about ten per tensor on the
shard (finite check: sum, isfinite, bool; reshape; step: add_; reply: copy_; ...). For a model of a few tensors that
is more time than the arithmetic on its 4 MB, and it is paid again on every shard. So:

    pack(params)     every parameter becomes a view of one contiguous buffer per dtype, laid out in `order(keys)`:
                     whole tensors first (by name), then split pieces ("name[a:b]", by name):
                         [ w1 | b1 | w2 | b2 | ... | piece | piece ]
    runs(dsts, srcs) the (dst, src) pairs sorted by dst address; consecutive pairs whose dsts are adjacent in one
                     storage AND whose srcs are adjacent in one storage merge into one flat (dst, src) pair.

The client lays its push arena out the same way (ps.shm_arena.places: per shard, that shard's whole tensors by
name, back to back), and the shard lays out its reply segment in its buffer's order, so in the steady state all of
a shard's whole tensors are ONE run on both sides: one finite check, one add_, one reply copy for all of them (and
one per split piece; every view of one shared-memory mapping shares its storage, collectives.shm.Inbox).
Elementwise operations on a float32/float64 run give the same bits as on its pieces (tested against torch.optim.SGD;
float16/bfloat16 tensors are never merged: torch rounds their vector body and scalar tail differently); a merged view never
reaches beyond the tensors it merges (same storage, adjacent ranges). `RunCache` keeps the plan for the last few
address lists, so the steady state costs one address read per tensor.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

MAX_PLANS = 8                      # address lists remembered (a client that moves its tensors gets a new plan)


def order(keys: Iterable[str]) -> list[str]:
    """Whole tensors first, then split pieces (keys "name[a:b]"), each group by name: the buffer layout."""
    return sorted(keys, key=lambda k: (k.endswith("]") and "[" in k, k))


def pack(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tensors (values copied) as views of one contiguous buffer per dtype, laid out in `order`; the dict
    keeps its key order."""
    place: dict[str, tuple[torch.dtype, int]] = {}
    total: dict[torch.dtype, int] = {}
    for k in order(params):
        t = params[k]
        place[k] = (t.dtype, total.get(t.dtype, 0))
        total[t.dtype] = total.get(t.dtype, 0) + t.numel()
    bufs = {dt: torch.empty(n, dtype=dt) for dt, n in total.items()}
    out = {}
    for k, t in params.items():
        dt, off = place[k]
        view = bufs[dt][off:off + t.numel()].view(t.shape)
        view.copy_(t)
        out[k] = view.detach()         # shares the buffer without holding it as `_base`: a repack frees it
    return out


def repack(params: dict[str, torch.Tensor]) -> None:
    """Give every parameter fresh storage, keeping each tensor object (optimizers hold them) and the layout of
    `pack`: copy-on-write for buffers handed out by a zero-copy read."""
    fresh = pack({k: p.detach() for k, p in params.items()})
    for k, p in params.items():
        p.data = fresh[k]


MERGED_DTYPES = (torch.float32, torch.float64)   # float16/bfloat16: torch's vector body and scalar tail round
                                                # differently, so merging would move bits (per-tensor is kept)


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.dtype in MERGED_DTYPES and a.is_contiguous() and b.is_contiguous()
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.data_ptr() + a.numel() * a.element_size() == b.data_ptr())


def _span(ts: Sequence[torch.Tensor]) -> torch.Tensor:
    if len(ts) == 1:
        return ts[0].reshape(-1)
    return ts[0].as_strided((sum(t.numel() for t in ts),), (1,))


def _groups(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of the pairs, sorted by dst address and cut where dsts or srcs stop being adjacent."""
    idx = sorted(range(len(dsts)), key=lambda i: (dsts[i].untyped_storage().data_ptr(), dsts[i].data_ptr()))
    out: list[list[int]] = []
    for i in idx:
        if out and _adjacent(dsts[out[-1][-1]], dsts[i]) and _adjacent(srcs[out[-1][-1]], srcs[i]):
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _merge(groups: list[list[int]], dsts: Sequence[torch.Tensor],
           srcs: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(_span([dsts[i] for i in g]), _span([srcs[i] for i in g])) for g in groups]


def runs(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Merge (dst_i, src_i) pairs of equal numel into as few flat (dst, src) pairs as adjacency allows."""
    if len(dsts) != len(srcs):
        raise ValueError("runs needs as many sources as destinations")
    return _merge(_groups(dsts, srcs), dsts, srcs)


class RunCache:
    """`runs` whose grouping is remembered by the pairs' addresses (and the sources' storages, sizes, dtypes and
    contiguity; destinations are tensors that keep their size and dtype at an address, as a shard's parameters do):
    the same tensors at the same places get the same groups without re-checking adjacency. Plans keep indices only
    (no tensor: a cached view would pin a peer's shared-memory segment). The one exception is the last call: the same
    tensor objects again, still at the same addresses (a shard's parameters and the cached views of a client's
    segment, request after request), get the same merged pairs back without building a key (~15 µs a call); those
    tensors are held until the next call or `clear()`."""

    def __init__(self) -> None:
        self._plans: dict[tuple, list[list[int]]] = {}
        self._last: tuple[tuple, tuple, tuple, list] | None = None

    def get(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if len(dsts) != len(srcs):
            raise ValueError("runs needs as many sources as destinations")
        last = self._last
        if (last is not None and len(last[0]) == len(dsts) and all(a is b for a, b in zip(last[0], dsts))
                and all(a is b for a, b in zip(last[1], srcs))
                and last[2] == tuple(t.data_ptr() for t in dsts) + tuple(t.data_ptr() for t in srcs)):
            return last[3]
        key = tuple((d.data_ptr(), s.data_ptr(), s.untyped_storage().data_ptr(), s.numel(), s.dtype,
                     s.is_contiguous()) for d, s in zip(dsts, srcs))
        groups = self._plans.get(key)
        if groups is None:
            groups = _groups(dsts, srcs)
            if len(self._plans) >= MAX_PLANS:
                self._plans.pop(next(iter(self._plans)))
            self._plans[key] = groups
        pairs = _merge(groups, dsts, srcs)
        self._last = (tuple(dsts), tuple(srcs), tuple(k[0] for k in key) + tuple(k[1] for k in key), pairs)
        return pairs

    def forget_last(self) -> None:
        """Drop the last call's tensors (e.g. before their memory is given back)."""
        self._last = None

    def clear(self) -> None:
        self._plans.clear()
        self._last = None


__all__ = ["RunCache", "order", "pack", "repack", "runs"]
