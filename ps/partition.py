"""Partitioning: parameter keys -> shards, balanced by bytes; big tensors are split into flat key ranges (ps-lite).

Let B = total bytes, S = shards, fair = ceil(B / S). A tensor of more than `max_piece_bytes` (default: fair) is cut
along its flattened index into ceil(bytes / max_piece_bytes) near-equal pieces. Pieces are then placed greedily,
largest first (ties by name, then start), each on the currently lightest shard (ties: lowest index) -- the LPT rule,
whose makespan is at most 4/3 of optimal. The result depends only on (names, shapes, dtypes, S): every worker and
every server computes the same map. A shard stores a piece as a flat tensor under the key "name" (whole tensor) or
"name[start:stop]" (flat element range).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from .errors import ConfigError


@dataclass(frozen=True)
class Slice:
    """Elements [start, stop) of the flattened parameter `name` (full shape `shape`) live on `shard` under `key`."""

    name: str
    key: str
    shard: int
    start: int
    stop: int
    shape: tuple[int, ...]
    itemsize: int = 4

    @property
    def numel(self) -> int:
        return self.stop - self.start

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class Partition:
    num_shards: int
    slices: tuple[Slice, ...]

    def keys_of(self, shard: int) -> list[Slice]:
        """The slices a shard owns, in a fixed order (by name, then start)."""
        return [s for s in self.slices if s.shard == shard]

    def slices_of(self, name: str) -> list[Slice]:
        return [s for s in self.slices if s.name == name]

    def bytes_per_shard(self) -> list[int]:
        out = [0] * self.num_shards
        for s in self.slices:
            out[s.shard] += s.nbytes
        return out

    @property
    def names(self) -> list[str]:
        return sorted({s.name for s in self.slices})


def _shape_and_itemsize(v: Any) -> tuple[tuple[int, ...], int]:
    if hasattr(v, "shape") and hasattr(v, "dtype"):
        item = getattr(v, "itemsize", None)
        if item is None:
            item = v.element_size() if hasattr(v, "element_size") else np.dtype(v.dtype).itemsize
        return tuple(int(d) for d in v.shape), int(item)
    if isinstance(v, Sequence) and all(isinstance(d, int) and d >= 0 for d in v):
        return tuple(v), 4
    raise ConfigError(f"partition needs a tensor or a shape (tuple of ints) per parameter, got {type(v).__name__}")


def make_partition(params: Mapping[str, Any], num_shards: int, max_piece_bytes: int | None = None) -> Partition:
    """Map {name: tensor or shape} onto `num_shards` shards (see module docstring)."""
    if not isinstance(num_shards, int) or num_shards < 1:
        raise ConfigError(f"number of shards must be an integer >= 1, got {num_shards!r}")
    if not params:
        raise ConfigError("cannot partition an empty parameter set")
    info = {str(n): _shape_and_itemsize(v) for n, v in params.items()}
    total = sum(math.prod(sh) * it for sh, it in info.values())
    fair = max(1, math.ceil(total / num_shards))
    limit = max_piece_bytes or fair
    pieces: list[tuple[str, int, int, tuple[int, ...], int]] = []
    for name in sorted(info):
        shape, item = info[name]
        numel = math.prod(shape)
        n_pieces = max(1, math.ceil(numel * item / limit)) if num_shards > 1 else 1
        n_pieces = min(n_pieces, max(1, numel))
        bounds = [numel * i // n_pieces for i in range(n_pieces + 1)]
        for a, b in zip(bounds, bounds[1:]):
            pieces.append((name, a, b, shape, item))
    pieces.sort(key=lambda p: (-(p[2] - p[1]) * p[4], p[0], p[1]))
    load = [0] * num_shards
    slices = []
    for name, a, b, shape, item in pieces:
        shard = min(range(num_shards), key=lambda s: (load[s], s))
        load[shard] += (b - a) * item
        whole = a == 0 and b == math.prod(shape)
        slices.append(Slice(name, name if whole else f"{name}[{a}:{b}]", shard, a, b, shape, item))
    slices.sort(key=lambda s: (s.name, s.start))
    return Partition(num_shards, tuple(slices))
