"""Hierarchical all-reduce: keep the slow inter-host link for 1/L of the data.

With H hosts of L ranks each (a `Topology`; N = H·L) and a tensor of S bytes:

    1. reduce-scatter inside each host     (ring over the L local ranks)  -> local rank l owns shard l, S/L bytes,
                                                                             summed over its host
    2. all-reduce of each shard across hosts (ring over the H ranks with the same local index l)
                                                                          -> shard l summed over all N ranks
    3. all-gather inside each host          (ring over the L local ranks)  -> every rank has the whole result

Bytes each rank puts on the slow (inter-host) link: only step 2 crosses hosts, a ring all-reduce of S/L bytes over
H ranks:

    hierarchical:  2(H-1)/H · S/L  per rank, on each of N links          (total 2(H-1)·S)
    flat ring:     ranks in order 0..N-1, so the ring crosses hosts H times (rank L·h+L-1 -> L·(h+1));
                   each crossing rank sends its whole ring share 2(N-1)/N · S over it          (total H·2(N-1)/N·S)

For 2 hosts x 2 ranks: 0.5·S on each of 4 slow links vs 1.5·S on each of 2, so when the slow link is the
bottleneck the flat ring's time tends to 3x the hierarchical one's slow-link time (plus, for the latter, the
intra-host phases: `pslab bench topology` measures both). The slow link's latency is paid 2(H-1) times instead
of 2(N-1). Each rank's total is unchanged: 2(L-1)/L · S inside the host + 2(H-1)/H · S/L across = 2(N-1)/N · S,
the flat ring's (so byte models of all-reduce such as parallelism/comm.py's hold for both; only where the bytes go
differs). `inter_bytes_per_rank` etc. give the formulas, `exact_inter_bytes` the exact per-rank count for sizes
that do not divide evenly (chunk_bounds' rule, at every level).

Sub-groups and placement: the hosts of a group are those of its members' global ranks (`Topology.host`, which
honours the placement), so a mesh's dp or tp group is judged by where its own members sit. E.g. 2 hosts x 4 ranks,
dp 4 x tp 2 (tp innermost): packed puts dp group {0, 2, 4, 6} on hosts 0, 0, 1, 1 (hierarchical: host-local pairs
{0, 2}, {4, 6}, cross-host pairs {0, 4}, {2, 6}) and each tp pair inside a host; spread puts that dp group on
host 0 only (one host: the flat ring, all intra) and each tp pair across the hosts. A group with one member per
host (dp 2 x tp 2 on 2 x 2, packed) has nothing to reduce inside a host: the flat ring (or direct exchange) over
the inter link. The formulas below are for the world group; `exact_inter_bytes` takes the placement.

`ZmqGroup.all_reduce` takes this path by itself (algorithm "auto") when the transport has a topology, the tensor
is larger than `small_bytes` (smaller ones take the one-step direct exchange) and the group's ranks span more than
one host with the same number (> 1) of them on each; algorithm="ring" (or the group's `hierarchical=False`) forces
the flat ring, algorithm="hierarchical" asks for this one (ValueError where it does not apply). The host-local and
cross-host sub-groups are made on the first call (every member calls all_reduce, so every member makes them in the
same order; then one barrier of the group, 1 byte to each peer, so that nobody sends on a sub-group a peer has not
made yet) and kept; their traffic is counted in the parent group's TrafficCounter, under the sub-collectives'
names (reduce_scatter, all_reduce, all_gather). Results are bitwise identical on every rank (each shard is reduced
once, by one ring, and copied); the summation order differs from the flat ring's, so floats differ from it by
rounding.
"""

from __future__ import annotations

from typing import Any

import torch

from .group import chunk_bounds


def layout(group: Any) -> list[list[int]] | None:
    """The group's members (group ranks) per emulated host, in host order, when hierarchical all-reduce applies:
    more than one host, the same number > 1 of members on each; else None."""
    links = getattr(group.tr, "links", None)
    if links is None or group.world_size < 4:
        return None
    by_host: dict[int, list[int]] = {}
    for i, g in enumerate(group.ranks):
        by_host.setdefault(links.topology.host(g), []).append(i)
    hosts = [by_host[h] for h in sorted(by_host)]
    if len(hosts) < 2 or len({len(h) for h in hosts}) != 1 or len(hosts[0]) < 2:
        return None
    return hosts


def _subgroups(group: Any, hosts: list[list[int]]) -> tuple[Any, Any]:
    """(this rank's host-local group, this rank's cross-host group), made once per group and cached."""
    cached = getattr(group, "_hier_groups", None)
    if cached is not None:
        return cached
    mine_intra = mine_inter = None
    for members in hosts:                                   # every member creates every sub-group, in one order
        g = group.new_group([group.ranks[i] for i in members])
        if g is not None:
            mine_intra = g
    for l in range(len(hosts[0])):
        g = group.new_group([group.ranks[h[l]] for h in hosts])
        if g is not None:
            mine_inter = g
    # a rank files early messages only for the one sub-group a peer may create next (zmq_group._expect_child):
    # nobody sends on these before every member has made all of them
    group.barrier()
    for g in (mine_intra, mine_inter):
        g.traffic_counter = group.traffic_counter           # the parent's traffic() shows what crossed where
        g._flight_quiet = True         # its steps are the parent's call: one flight entry (flight.py)
    group._hier_groups = (mine_intra, mine_inter)
    return group._hier_groups


def all_reduce(group: Any, buf: torch.Tensor, op: str) -> None:
    """In place on the flat tensor `buf` (op "avg" is reduced as "sum": the caller divides)."""
    hosts = layout(group)
    if hosts is None:
        raise ValueError(f"hierarchical all_reduce needs a topology and a group spanning >= 2 hosts with the same "
                         f"number (>= 2) of its ranks on each; group {group.gid} has ranks {group.ranks}")
    how = "sum" if op == "avg" else op
    intra, inter = _subgroups(group, hosts)
    L, l = intra.world_size, intra.rank
    a, b = chunk_bounds(buf.numel(), L)[l]
    # in place on buf (no copies): the reduce-scatter ring leaves the host's sum in chunk l (the other chunks hold
    # partial sums that the all-gather overwrites), the cross-host ring reduces that chunk, the all-gather spreads it
    seq = intra._begin("reduce_scatter", buf.numel())
    intra._ring("reduce_scatter", seq, buf, (l - 1) % L, [how] * (L - 1))
    inter.all_reduce(buf[a:b], op=how, algorithm="ring")
    seq = intra._begin("all_gather", buf.numel())
    intra._ring("all_gather", seq, buf, l, ["copy"] * (L - 1))


# ---- bytes on the slow link --------------------------------------------------------------------------------------
def inter_bytes_per_rank(nbytes: float, hosts: int, per_host: int) -> float:
    """Hierarchical: bytes each rank sends over the inter-host link, 2(H-1)/H · S/L."""
    return 2 * (hosts - 1) / hosts * nbytes / per_host


def flat_ring_inter_bytes_per_crossing(nbytes: float, hosts: int, per_host: int) -> float:
    """Flat ring: bytes each of the H host-crossing ranks sends over the inter-host link, 2(N-1)/N · S."""
    n = hosts * per_host
    return 2 * (n - 1) / n * nbytes


def inter_bytes_total(nbytes: float, hosts: int, per_host: int, algorithm: str) -> float:
    """All ranks together: hierarchical 2(H-1)·S; flat ring H · 2(N-1)/N · S."""
    if algorithm == "hierarchical":
        return hosts * per_host * inter_bytes_per_rank(nbytes, hosts, per_host)
    if algorithm == "ring":
        return hosts * flat_ring_inter_bytes_per_crossing(nbytes, hosts, per_host)
    raise ValueError(f"algorithm must be 'hierarchical' or 'ring', got {algorithm!r}")


def _ring_sent(numel: int, world: int, pos: int) -> int:
    """Elements a rank at ring position `pos` sends in a ring all-reduce of `numel` (chunks pos, pos-1, ...)."""
    bounds = chunk_bounds(numel, world)
    return sum(bounds[(pos - k) % world][1] - bounds[(pos - k) % world][0] for k in range(2 * (world - 1)))


def exact_inter_bytes(numel: int, itemsize: int, hosts: int, per_host: int, algorithm: str,
                      placement: str = "packed") -> list[int]:
    """Bytes each rank (global rank order) sends over inter-host links in one all-reduce of `numel` elements by
    the world group, exactly (chunk_bounds at every level); sums to `inter_bytes_total` when the sizes divide
    evenly (packed; spread's flat ring crosses hosts on every hop)."""
    from .topology import Topology
    topo = Topology(hosts, per_host, placement=placement)
    n = hosts * per_host
    if algorithm == "hierarchical":
        out = []
        for r in range(n):            # local index = place among the host's ranks; host index = cross-host ring place
            a, b = chunk_bounds(numel, per_host)[topo.local(r)]
            out.append(_ring_sent(b - a, hosts, topo.host(r)) * itemsize)
        return out
    if algorithm == "ring":
        crosses = [topo.host(r) != topo.host((r + 1) % n) for r in range(n)]   # r -> r+1 on another host
        return [_ring_sent(numel, n, r) * itemsize if crosses[r] else 0 for r in range(n)]
    raise ValueError(f"algorithm must be 'hierarchical' or 'ring', got {algorithm!r}")
