"""A device mesh with named axes (dp, pp, cp, ep, tp) carved out of one world group.

Global rank r has coordinates (dp, pp, cp, ep, tp) in row-major order with tp innermost:

    r = (((dp · P + pp) · C + cp) · E + ep) · T + tp        (D × P × C × E × T = world size)

so the T ranks of a tensor-parallel group are adjacent (r, r+1, …) — the "TP inside a node" rule: TP talks every
layer and needs the fastest link; context (cp: the sequence split, ring attention) and expert parallelism (ep:
all-to-all in every MoE layer) next; PP only at stage boundaries; DP once per step, so it spans the outer axis.

Group kinds: one per axis (the ranks that differ only in that coordinate) plus "mp", the model-parallel group: the
P·C·E·T ranks that share this rank's dp coordinate, i.e. the ranks that together hold one whole model replica and
train on one data-parallel worker's batch (a contiguous run of ranks); `export.py` gathers the full model over it.
`MeshLayout` is the pure arithmetic; `DeviceMesh` adds the sub-groups (one `new_group` call per group, every rank
calls all of them in the same order — dp, pp, cp, ep, tp, then mp — as torch.distributed requires; a one-rank group
whose member already has one is reused, so size-1 axes cost no extra groups).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from pslab.collectives import ProcessGroup

AXES = ("dp", "pp", "cp", "ep", "tp")   # the coordinates (coords / rank_of), outermost first
GROUP_KINDS = AXES + ("mp",)        # the sub-groups a DeviceMesh builds; "mp" = all model-parallel ranks of one dp


class MeshError(ValueError):
    """The mesh shape does not fit the world, or an unknown axis was asked for."""


@dataclass(frozen=True)
class MeshLayout:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for ax in AXES:
            if getattr(self, ax) < 1:
                raise MeshError(f"mesh axis {ax} must be >= 1, got {getattr(self, ax)}")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.ep * self.tp

    @property
    def model_parallel(self) -> int:
        """Ranks per model replica (one data-parallel worker): P · C · E · T."""
        return self.pp * self.cp * self.ep * self.tp

    def size(self, axis: str) -> int:
        _check_axis(axis)
        return getattr(self, axis)

    def coords(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.world_size:
            raise MeshError(f"rank {rank} outside a mesh of {self.world_size} ranks")
        out, r = {}, rank
        for ax in reversed(AXES):           # tp innermost
            n = getattr(self, ax)
            out[ax] = r % n
            r //= n
        return {ax: out[ax] for ax in AXES}

    def rank_of(self, dp: int = 0, pp: int = 0, tp: int = 0, cp: int = 0, ep: int = 0) -> int:
        c = {"dp": dp, "pp": pp, "cp": cp, "ep": ep, "tp": tp}
        r = 0
        for ax in AXES:
            r = r * getattr(self, ax) + c[ax]
        return r

    def hosts_by_order(self, order: Sequence[str], per_host: int) -> list[int]:
        """The host of every rank when ranks fill hosts of `per_host` slots in the axis order `order`, innermost
        first (axes of degree 1 may be left out): rank r takes slot Σ_ax coord_ax · stride_ax, strides growing in
        that order, and host slot // per_host. ("tp", "ep", "cp", "pp", "dp") is the rank order itself (packed);
        ("tp", "dp", "pp") keeps tp and dp inside a host and sends pp across (Megatron's 3D placement)."""
        order = list(order)
        bad = [ax for ax in order if ax not in AXES] + [ax for ax in set(order) if order.count(ax) > 1]
        missing = [ax for ax in AXES if getattr(self, ax) > 1 and ax not in order]
        if bad or missing:
            raise MeshError(f"a placement order lists each of {', '.join(AXES)} at most once and every axis of degree "
                            f"> 1 ({', '.join(ax for ax in AXES if getattr(self, ax) > 1)}); got {','.join(order)}")
        if per_host < 1 or self.world_size % per_host:
            raise MeshError(f"{self.world_size} ranks do not fill hosts of {per_host}")
        full = order + [ax for ax in reversed(AXES) if ax not in order]
        out = []
        for r in range(self.world_size):
            c, slot, stride = self.coords(r), 0, 1
            for ax in full:
                slot += c[ax] * stride
                stride *= getattr(self, ax)
            out.append(slot // per_host)
        return out

    def groups(self, axis: str) -> list[tuple[int, ...]]:
        """All groups along `axis`: ranks that differ only in that coordinate, in coordinate order.
        `axis="mp"` gives `mp_groups()`."""
        if axis == "mp":
            return self.mp_groups()
        _check_axis(axis, GROUP_KINDS)
        others = [ax for ax in AXES if ax != axis]
        out = []
        for fixed in product(*(range(self.size(ax)) for ax in others)):
            c = dict(zip(others, fixed))
            out.append(tuple(self.rank_of(**{**c, axis: i}) for i in range(self.size(axis))))
        return out

    def mp_groups(self) -> list[tuple[int, ...]]:
        """The model-parallel groups, one per dp coordinate: the ranks with that dp coordinate (every pp × tp
        coordinate), in rank order — together they hold one whole model replica."""
        n = self.model_parallel
        return [tuple(range(d * n, (d + 1) * n)) for d in range(self.dp)]

    def group_of(self, axis: str, rank: int) -> tuple[int, ...]:
        return next(g for g in self.groups(axis) if rank in g)


def _check_axis(axis: str, kinds: tuple[str, ...] = AXES) -> None:
    if axis not in kinds:
        what = "axes" if kinds is AXES else "group kinds"
        raise MeshError(f"unknown mesh axis {axis!r}; {what} are {', '.join(kinds)}")


class DeviceMesh:
    """The layout plus this rank's sub-group of each kind (dp, pp, tp, mp). Build it on every rank of `world`."""

    def __init__(self, world: ProcessGroup, dp: int = 1, pp: int = 1, tp: int = 1, cp: int = 1, ep: int = 1) -> None:
        self.layout = MeshLayout(dp, pp, tp, cp, ep)
        if self.layout.world_size != world.world_size:
            shape = " x ".join(f"{ax}={getattr(self.layout, ax)}" for ax in AXES if ax in ("dp", "pp", "tp")
                               or getattr(self.layout, ax) > 1)
            raise MeshError(f"mesh {shape} = {self.layout.world_size} ranks, but the world group "
                            f"has {world.world_size}; choose sizes whose product is the world size")
        self.world = world
        self.rank = world.rank
        self.coords = self.layout.coords(world.rank)
        self._groups: dict[str, ProcessGroup] = {}
        singles: dict[int, ProcessGroup | None] = {}      # one-rank groups made so far, by their member
        for axis in GROUP_KINDS:
            for ranks in self.layout.groups(axis):
                members = tuple(world.ranks[r] for r in ranks)  # group ranks -> global ranks of the world
                if len(ranks) == world.world_size:
                    g = world
                elif len(ranks) == 1 and ranks[0] in singles:
                    g = singles[ranks[0]]
                else:
                    g = world.new_group(list(members))
                    if len(ranks) == 1:
                        singles[ranks[0]] = g
                if world.rank in ranks:
                    self._groups[axis] = g
        from pslab.collectives import flight
        for axis, g in self._groups.items():            # the flight recorder names a group by the axes it serves
            if g is not None and g.world_size > 1:
                flight.RECORDER.name_group(g, axis)

    def group(self, axis: str) -> ProcessGroup:
        """This rank's sub-group of kind `axis` (dp, pp, tp, or mp: the ranks of this rank's model replica)."""
        _check_axis(axis, GROUP_KINDS)
        return self._groups[axis]

    def size(self, axis: str) -> int:
        return self.layout.size(axis)

    def coord(self, axis: str) -> int:
        _check_axis(axis)
        return self.coords[axis]

    def __repr__(self) -> str:
        l = self.layout
        extra = "".join(f", {ax}={getattr(l, ax)}" for ax in ("cp", "ep") if getattr(l, ax) > 1)
        return f"DeviceMesh(dp={l.dp}, pp={l.pp}, tp={l.tp}{extra}, rank={self.rank}, coords={self.coords})"
