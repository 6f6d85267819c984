"""Placement of ranks on emulated hosts (collectives/topology.py: "packed" r // per_host, "spread" r % hosts) and
what it does to hierarchical all-reduce's choice for sub-groups of the world (collectives/hierarchical.py).

References are written out by hand: the host of each rank, the sub-groups hierarchical all-reduce must form for a
mesh's dp group, and the bytes each rank puts on each link class for a 2 x 2 world under either placement."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pslab import collectives
from pslab.collectives import hierarchical as hier
from pslab.collectives.topology import ENV, Topology, TopologyError, from_env, link_bytes, reset_link_bytes


def test_host_of_each_rank_by_placement():
    packed, spread = Topology(2, 4), Topology(2, 4, placement="spread")
    assert [packed.host(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [spread.host(r) for r in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert [spread.local(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert spread.ranks_of(1) == [1, 3, 5, 7] and packed.ranks_of(1) == [4, 5, 6, 7]
    assert packed.link(0, 1) == "intra" and spread.link(0, 1) == "inter" and spread.link(0, 2) == "intra"


def test_placement_validated_and_round_trips(monkeypatch):
    with pytest.raises(TopologyError, match="placement must be one of packed, spread, explicit") as e:
        Topology(2, 2, placement="round-robin")
    assert "\n" not in str(e.value)
    t = Topology(2, 2, 1e-5, 2e9, 1e-3, 5e7, placement="spread")
    assert Topology.from_json(t.to_json()) == t
    assert Topology.from_json('{"hosts": 2, "per_host": 2}').placement == "packed"     # older JSON: packed
    monkeypatch.setenv(ENV, t.to_json())
    assert from_env() == t


def test_explicit_placement_takes_a_host_per_rank():
    """placement "explicit": host_of[r] is rank r's host, each host holding per_host ranks; local() counts within the
    host in rank order; a wrong list, or host_of without "explicit", is one line; JSON round-trips it."""
    t = Topology(2, 4, placement="explicit", host_of=[0, 0, 1, 1, 0, 0, 1, 1])
    assert [t.host(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [t.local(r) for r in range(8)] == [0, 1, 0, 1, 2, 3, 2, 3]
    assert t.ranks_of(1) == [2, 3, 6, 7] and t.link(0, 4) == "intra" and t.link(0, 2) == "inter"
    assert Topology.from_json(t.to_json()) == t
    for bad in ([0] * 8, [0, 0, 1, 1], [0, 0, 1, 1, 0, 0, 1, 2]):
        with pytest.raises(TopologyError, match="host_of must name a host 0..1 for each of the 8 ranks"):
            Topology(2, 4, placement="explicit", host_of=bad)
    with pytest.raises(TopologyError, match="goes with placement"):
        Topology(2, 4, host_of=[0, 0, 1, 1, 0, 0, 1, 1])


def _fake(topo: Topology, ranks: list[int]) -> SimpleNamespace:
    """What hierarchical.layout reads of a group: its transport's topology, its members' global ranks."""
    return SimpleNamespace(tr=SimpleNamespace(links=SimpleNamespace(topology=topo)), ranks=tuple(ranks),
                           world_size=len(ranks))


def test_layout_of_mesh_subgroups_uses_global_ranks():
    # 2 hosts x 4, dp 4 x tp 2 (tp innermost): dp groups {0,2,4,6}, {1,3,5,7}; tp groups {0,1}, {2,3}, ...
    packed, spread = Topology(2, 4), Topology(2, 4, placement="spread")
    # packed: dp {0,2,4,6} sits on hosts 0,0,1,1 -> group ranks [0,1] on host 0, [2,3] on host 1 (hierarchical)
    assert hier.layout(_fake(packed, [0, 2, 4, 6])) == [[0, 1], [2, 3]]
    assert hier.layout(_fake(packed, [1, 3, 5, 7])) == [[0, 1], [2, 3]]
    # spread: every dp member on one host (0 or 1): no hierarchy, the flat ring stays inside the host
    assert hier.layout(_fake(spread, [0, 2, 4, 6])) is None
    assert hier.layout(_fake(spread, [1, 3, 5, 7])) is None
    # spread world group: hosts interleaved, group ranks [0,2,4,6] on host 0 and [1,3,5,7] on host 1
    assert hier.layout(_fake(spread, list(range(8)))) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # a sub-group with one member per host has nothing to reduce inside a host
    assert hier.layout(_fake(Topology(4, 2), [0, 2, 4, 6])) is None
    # uneven members per host: no hierarchy
    assert hier.layout(_fake(packed, [0, 1, 2, 4])) is None


def w_groups(group, numel: int) -> dict:
    """Bytes per link class of one all-reduce on: the world (auto), the 'tp' pairs {0,1},{2,3}, the 'dp' pairs
    {0,2},{1,3} (every rank makes every group, in one order)."""
    tp = [group.new_group(m) for m in ([0, 1], [2, 3])]
    dp = [group.new_group(m) for m in ([0, 2], [1, 3])]
    mine_tp = next(g for g in tp if g is not None)
    mine_dp = next(g for g in dp if g is not None)
    group.all_reduce(torch.ones(8), algorithm="hierarchical")      # makes the world's sub-groups (+ a barrier)
    out = {}
    for name, g in (("world", group), ("tp", mine_tp), ("dp", mine_dp)):
        group.barrier()
        reset_link_bytes(group)
        t = torch.full((numel,), float(group.rank + 1))
        g.all_reduce(t)
        want = sum(float(r + 1) for r in g.ranks)
        out[name] = (link_bytes(group), bool(torch.all(t == want)))
    return out


@pytest.mark.parametrize("placement", ["packed", "spread"])
def test_subgroup_bytes_follow_the_placement(placement):
    numel = 1 << 14                                         # 64 KiB: above small_bytes, the ring / hierarchical
    S = numel * 4
    topo = Topology(2, 2, inter_latency_s=1e-4, inter_bandwidth_Bps=1e9, placement=placement)
    out = collectives.launch(w_groups, 4, "zmq", args=(numel,), timeout=60, topology=topo)
    for r, o in enumerate(out):
        assert all(ok for _, ok in o.values()), (r, o)
        # world: hierarchical under both placements (2 members on each host): S/2 per rank across, S inside
        assert o["world"][0] == {"intra": S, "inter": S // 2}, (r, o["world"])
        # a pair's ring all-reduce: each rank sends 2(2-1)/2 · S = S, on the pair's link
        across, inside = ("dp", "tp") if placement == "packed" else ("tp", "dp")
        assert o[across][0] == {"intra": 0, "inter": S}, (r, placement, o)
        assert o[inside][0] == {"intra": S, "inter": 0}, (r, placement, o)
    assert [o["world"][0]["inter"] for o in out] == hier.exact_inter_bytes(numel, 4, 2, 2, "hierarchical", placement)


def test_exact_inter_bytes_spread_by_hand():
    # spread 2 x 2: ring 0-1-2-3-0 crosses hosts on every hop: each rank sends its whole 2(N-1)/N share across
    assert hier.exact_inter_bytes(8, 4, 2, 2, "ring", "spread") == [2 * 3 / 4 * 8 * 4] * 4
    # hierarchical: rank r is local index r // 2 on host r % 2: ranks 0, 1 hold shard 0 (5 of 9 elements), 2, 3
    # shard 1 (4); across the 2 hosts each sends half its shard twice: 5 -> 3 + 2, 4 -> 2 + 2 elements
    assert hier.exact_inter_bytes(9, 4, 2, 2, "hierarchical", "spread") == [(3 + 2) * 4, (2 + 3) * 4, 16, 16]
