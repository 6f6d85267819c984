"""The cost of collectives on placed ranks: bytes per link class (summed over a group's members) and the seconds
one member spends, α-β on the link a message crosses (a message of B bytes: α + B/β, cluster.link("intra"|"inter")).

Where ranks sit (the mesh is dp, pp, cp, ep, tp with tp innermost: parallelism/mesh.py):

    packed   rank r on node r // gpus_per_node     (torchrun's packing: a tp group inside a node)
    spread   rank r on node r % nodes, nodes = min(cluster.nodes, ranks)     (consecutive ranks on different nodes)
    "tp,dp,pp"  an axis order, innermost first: nodes filled along tp, then dp, then pp (mesh.hosts_by_order)

One function per collective, each as pslab's collectives send it (N the group's size, S a tensor's bytes):

    ring          collectives/ring.py, chunks cut by chunk_bounds: all-reduce 2(N−1)/N·S per rank and 2(N−1)
                  latencies, reduce-scatter / all-gather (N−1)/N·S and N−1 (Patarasuk & Yuan 2009); bytes per link
                  exact, seconds on the slowest hop's link (the ring moves in lock-step)
    direct        every member sends its whole tensor to every other: (N−1)·S per rank (S <= 32 KiB)
    all_reduce    direct when small, hierarchical where the group spans H nodes with the same L > 1 ranks on each
                  (reduce-scatter inside, ring across of each rank's S/L, all-gather inside:
                  collectives/hierarchical.py), else the ring
    all_to_all    chunk j of the buffer to member j: (N−1)/N·S per member, one latency

`comm_model.py` adds up these costs per kind of communication of a training step.
"""

from __future__ import annotations

import functools
from typing import Iterable

import numpy as np

from pslab.collectives.group import chunk_bounds

from .cluster import Cluster
from .memory_model import Layout, MemoryModelError

AXES = ("dp", "pp", "cp", "ep", "tp")
PLACEMENTS = ("packed", "spread")


class CommModelError(MemoryModelError):
    """A layout, placement or algorithm the communication model cannot describe (the message says what to change)."""


# ---- where ranks sit -----------------------------------------------------------------------------------------

class Placement:
    """Node of each global rank, the link class between two ranks, and the mesh's groups along an axis."""

    def __init__(self, layout: Layout, cluster: Cluster, placement: str = "packed") -> None:
        n = layout.gpus()
        if n > cluster.gpus:
            raise CommModelError(f"the layout needs {n} GPUs but cluster {cluster.name} has {cluster.gpus} "
                                 f"({cluster.nodes} x {cluster.gpus_per_node}): add nodes or shrink the layout")
        self.cluster, self.placement, self.world = cluster, placement, n
        self.nodes = min(cluster.nodes, n)
        self.explicit: list[int] | None = None
        if placement not in PLACEMENTS:        # an axis order, innermost first (mesh.MeshLayout.hosts_by_order)
            from .mesh import MeshError
            try:
                self.explicit = layout.hosts_by_order([a.strip() for a in placement.split(",") if a.strip()],
                                                      cluster.gpus_per_node)
            except MeshError as e:
                raise CommModelError(f"placement must be one of {', '.join(PLACEMENTS)} or an axis order: {e}") \
                    from None
        self.sizes = {ax: getattr(layout, ax) for ax in AXES}
        self.stride: dict[str, int] = {}
        s = 1
        for ax in reversed(AXES):
            self.stride[ax] = s
            s *= self.sizes[ax]
        # looked up millions of times by a plan's search: each rank's node and each link class's (α, β), once
        G = cluster.gpus_per_node
        self.node_of: tuple[int, ...] = (tuple(self.explicit) if self.explicit is not None else
                                         _nodes(n, G if placement == "packed" else 0, self.nodes))
        self.links = {k: cluster.link(k) for k in ("intra", "inter")}
        self._classes: dict[str, list[tuple[list[int], int]]] = {}

    def node(self, r: int) -> int:
        return self.node_of[r]

    def link(self, a: int, b: int) -> str:
        return "intra" if self.node_of[a] == self.node_of[b] else "inter"

    def coord(self, r: int, axis: str) -> int:
        return (r // self.stride[axis]) % self.sizes[axis]

    def group_classes(self, axis: str) -> list[tuple[list[int], int]]:
        """One representative of each class of equivalent groups along `axis`, and how many there are: groups of
        the same pipeline stage whose members sit on nodes in the same pattern (`_pattern`: the nodes relabelled in
        order of first appearance) cost the same. Packed, a group's nodes are (r0 + i·stride) // G, spread
        (r0 + i·stride) % nodes, so its pattern is fixed by r0 mod G, resp. nodes: one pattern is computed per
        residue, and residues with equal patterns (e.g. the dp groups of the T tp ranks inside one node) merge.
        Computed once per axis (the list is shared: callers do not change it)."""
        if axis in self._classes:
            return self._classes[axis]
        st, n = self.stride[axis], self.sizes[axis]
        sp, P = self.stride["pp"], self.sizes["pp"]
        period = self.cluster.gpus_per_node if self.placement == "packed" else self.nodes
        first = (np.arange(0, self.world, st * n)[:, None] + np.arange(st)[None, :]).ravel()   # coordinate 0
        stages = np.zeros_like(first) if axis == "pp" else (first // sp) % P
        merged: dict[tuple, list] = {}       # (stage, pattern) -> [a representative group, how many]

        def add(stage: int, pattern: tuple, r: int, count: int) -> None:
            if (stage, pattern) in merged:
                merged[stage, pattern][1] += count
            else:
                merged[stage, pattern] = [[r + j * st for j in range(n)], count]

        if self.explicit is None:            # one pattern per residue r0 mod period, the same on every stage
            patterns: dict[int, tuple] = {}
            keys, at, counts = np.unique(stages * period + first % period, return_index=True, return_counts=True)
            for key, i, count in zip(keys.tolist(), at.tolist(), counts.tolist()):
                stage, residue = divmod(key, period)
                r = int(first[i])
                if residue not in patterns:
                    patterns[residue] = self._pattern([r + j * st for j in range(n)])
                add(stage, patterns[residue], r, count)
        else:
            for r, stage in zip(first.tolist(), stages.tolist()):
                add(stage, self._pattern([r + j * st for j in range(n)]), r, 1)
        self._classes[axis] = [(g, k) for g, k in merged.values()]
        return self._classes[axis]

    def _pattern(self, group: list[int]) -> tuple[int, ...]:
        """The group's nodes relabelled in order of first appearance: groups with equal patterns cost the same."""
        nodes = [self.node_of[r] for r in group]
        label = {x: i for i, x in enumerate(dict.fromkeys(nodes))}       # (in C loops: a plan calls this a lot)
        return tuple(map(label.__getitem__, nodes))

    def hosts_of(self, group: list[int]) -> list[list[int]] | None:
        """The group's positions per node when a hierarchical all-reduce applies (>= 2 nodes, the same number >= 2
        of its ranks on each: collectives/hierarchical.layout), else None."""
        by: dict[int, list[int]] = {}
        nd = self.node_of
        for i, r in enumerate(group):
            by.setdefault(nd[r], []).append(i)
        hosts = [by[h] for h in sorted(by)]
        if len(group) < 4 or len(hosts) < 2 or len({len(h) for h in hosts}) != 1 or len(hosts[0]) < 2:
            return None
        return hosts


@functools.lru_cache(maxsize=64)
def _nodes(world: int, per_node: int, nodes: int) -> tuple[int, ...]:
    """Each rank's node: packed (per_node > 0) r // per_node, spread r % nodes."""
    return tuple(r // per_node if per_node else r % nodes for r in range(world))


# ---- the cost of collectives on one group: bytes per link (summed over members), seconds of one member ---------

class Cost:
    """Bytes sent per link class (summed over the group's members) and one member's seconds per link class, of which
    `wire` are the bytes' B/β (the rest: latencies, each message's α)."""

    def __init__(self) -> None:
        self.bytes = {"intra": 0, "inter": 0}
        self.secs = {"intra": 0.0, "inter": 0.0}
        self.wire = {"intra": 0.0, "inter": 0.0}
        self.hierarchical = False          # a hierarchical all-reduce ran: its set-up barrier is a one-off

    def add(self, other: "Cost", times: int = 1) -> "Cost":
        self.hierarchical |= other.hierarchical and times > 0
        for k in self.bytes:
            self.bytes[k] += times * other.bytes[k]
            self.secs[k] += times * other.secs[k]
            self.wire[k] += times * other.wire[k]
        return self

    def send(self, pl: Placement, a: int, b: int, nbytes: int) -> None:
        self.bytes[pl.link(a, b)] += nbytes

    def wait(self, pl: Placement, cls: str, messages: int, nbytes: float) -> None:
        lat, bw = pl.links[cls]
        self.secs[cls] += messages * lat + nbytes / bw
        self.wire[cls] += nbytes / bw


def _slowest(links: Iterable[str]) -> str:
    return "inter" if "inter" in set(links) else "intra"


def pass_latency(pl: Placement, group: list[int], steps: int) -> float:
    """Latency seconds of one pslab ring pass of `steps` steps over `group` (collectives/ring.py), hop by hop: member
    i sends step j once it has received step j−1 from its left neighbour, so a step received over a fast hop lets
    the next one start early; then each member waits for its right neighbour's closing acknowledgement ("one extra
    latency": only after it may reuse its buffers). The pass ends when the last member is done. On N members of
    one link class: (steps + 1)·α; on 2 hosts × 2 packed, a reduce-scatter: 2α of data, 3α with the ack."""
    n = len(group)
    hop = [pl.links[pl.link(group[i], group[(i + 1) % n])][0] for i in range(n)]   # i -> i+1 (and back)
    sent = [0.0] * n
    for _ in range(steps):
        sent = [sent[i - 1] + hop[i - 1] for i in range(n)]      # received from the left: the next step leaves
    return max(max(sent[i], sent[(i + 1) % n] + hop[i]) for i in range(n))


def ring(pl: Placement, group: list[int], numel: int, e: int, phase: str, ack: bool = False) -> Cost:
    """One ring pass (collectives/ring.py) over `numel` elements of `e` bytes: phase "ar" (all-reduce: member i
    sends 2(N−1) chunks, all but chunks i+1 and i+2 twice), "rs" (reduce-scatter: all chunks but its own), "ag"
    (all-gather: all but chunk i+1). Bytes per link exact (chunk_bounds); seconds: the per-rank share of the bytes
    on the slowest hop's link, plus 2(N−1) (ar) or N−1 latencies of that link (textbook), or with `ack` (pslab's
    own ring) the pass's latency hop by hop with its closing acknowledgement (`pass_latency`)."""
    c, n = Cost(), len(group)
    if n == 1:
        return c
    nd = pl.node_of
    nodes = [nd[r] for r in group]
    cross = [i for i in range(n) if nodes[i] != nodes[(i + 1) % n]]
    total = (2 if phase == "ar" else 1) * (n - 1) * numel
    if len(cross) in (0, n):
        c.bytes["inter" if cross else "intra"] += total * e
    else:
        base, extra = divmod(numel, n)

        def size(j: int) -> int:
            return base + (1 if j % n < extra else 0)

        def sent(i: int) -> int:
            if phase == "ar":
                return numel if n == 2 else 2 * numel - size(i + 1) - size(i + 2)
            return numel - size(i if phase == "rs" else i + 1)
        x = sum(sent(i) for i in cross)
        c.bytes["inter"] += x * e
        c.bytes["intra"] += (total - x) * e
    steps = 2 * (n - 1) if phase == "ar" else n - 1
    if ack:
        cls = "inter" if cross else "intra"
        c.wait(pl, cls, 0, total / n * e)
        c.secs[cls] += pass_latency(pl, group, steps)
    else:
        c.wait(pl, "inter" if cross else "intra", steps, total / n * e)
    return c


def direct(pl: Placement, group: list[int], nbytes: int) -> Cost:
    """Every member sends its whole tensor to every other member (pslab's direct exchange, S <= 32 KiB).

    Time: the N−1 sends go to N−1 different peers, each over its own link (the emulation has one link per ordered
    pair, as a switch gives each pair its own path), so they travel side by side: one α + S/β on the slowest link
    the group spans, plus the software cost of each further send — taken as the intra link's α, which calibration
    measures as the per-message cost of one send + receive."""
    c, n = Cost(), len(group)
    if n == 1:
        return c
    per_node: dict[int, int] = {}
    nd = pl.node_of
    for r in group:
        per_node[nd[r]] = per_node.get(nd[r], 0) + 1
    inside = sum(k * (k - 1) for k in per_node.values())
    c.bytes["intra"] += inside * nbytes
    c.bytes["inter"] += (n * (n - 1) - inside) * nbytes
    c.wait(pl, "inter" if len(per_node) > 1 else "intra", 1, nbytes)
    c.secs["intra"] += (n - 2) * pl.cluster.intra_latency_s
    return c


def all_reduce(pl: Placement, group: list[int], numel: int, e: int, small: int = 0,
               hierarchical: bool = True, ack: bool = False) -> Cost:
    """All-reduce of numel·e bytes on every member: direct exchange when <= small, hierarchical where it applies
    (and is allowed), else the ring (`ack`: pslab's ring passes, see `ring`)."""
    n = len(group)
    if n == 1 or numel == 0:
        return Cost()
    if numel * e <= small:
        return direct(pl, group, numel * e)
    hosts = pl.hosts_of(group) if hierarchical else None
    if hosts is None:
        return ring(pl, group, numel, e, "ar", ack)
    c = Cost()
    c.hierarchical = True
    L = len(hosts[0])
    for members in hosts:                                     # reduce-scatter + all-gather inside each node
        sub = [group[i] for i in members]
        inside = ring(pl, sub, numel, e, "rs", ack).add(ring(pl, sub, numel, e, "ag", ack))
        c.bytes["intra"] += inside.bytes["intra"]
        c.bytes["inter"] += inside.bytes["inter"]
        if inside.secs["intra"] > c.secs["intra"]:
            c.secs["intra"], c.wire["intra"] = inside.secs["intra"], inside.wire["intra"]
    slowest = Cost()
    for l, (a, b) in enumerate(chunk_bounds(numel, L)):      # local rank l's shard, across the nodes
        across = ring(pl, [group[h[l]] for h in hosts], b - a, e, "ar", ack)
        c.bytes["intra"] += across.bytes["intra"]
        c.bytes["inter"] += across.bytes["inter"]
        if across.secs["inter"] > slowest.secs["inter"]:
            slowest = across
    c.secs["inter"] += slowest.secs["inter"]
    c.wire["inter"] += slowest.wire["inter"]
    return c


def setup_barrier(pl: Placement, group: list[int]) -> Cost:
    """The hierarchical all-reduce's one-off barrier on its first call: 1 byte from every member to every other."""
    return direct(pl, group, 1)


def all_to_all(pl: Placement, group: list[int], nbytes: int) -> Cost:
    """Chunk j of an S-byte buffer to member j: (N−1)/N·S per member, one latency."""
    return direct(pl, group, nbytes // len(group)) if len(group) > 1 else Cost()
