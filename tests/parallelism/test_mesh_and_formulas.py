"""Mesh layout (named axes, validation, TP on adjacent ranks) and the ZeRO memory formulas."""

from __future__ import annotations

import pytest

from pslab import collectives
from pslab.parallelism.mesh import DeviceMesh, MeshError, MeshLayout
from pslab.parallelism.zero_memory import FP32_ADAM, MIXED_PRECISION_ADAM, zero_bytes_per_rank


def test_layout_tp_adjacent_and_groups_partition():
    """tp groups are runs of adjacent ranks; each axis' groups partition the world; coords round-trip."""
    lay = MeshLayout(dp=2, pp=2, tp=2)
    assert lay.groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert lay.groups("pp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert lay.groups("dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    for axis in ("dp", "pp", "tp"):
        assert sorted(r for g in lay.groups(axis) for r in g) == list(range(8))
    for r in range(8):
        assert lay.rank_of(**lay.coords(r)) == r


def test_layout_cp_and_ep_axes():
    """cp and ep sit between pp and tp (tp innermost): r = (((dp·P + pp)·C + cp)·E + ep)·T + tp; a worker's mp
    group holds all its cp and ep ranks; the old three-axis arithmetic is unchanged at cp = ep = 1."""
    lay = MeshLayout(dp=2, cp=2, tp=2)
    assert lay.groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert lay.groups("cp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert lay.groups("dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert lay.mp_groups() == [(0, 1, 2, 3), (4, 5, 6, 7)]
    ep = MeshLayout(dp=2, ep=2)
    assert ep.groups("ep") == [(0, 1), (2, 3)] and ep.groups("dp") == [(0, 2), (1, 3)]
    assert ep.model_parallel == 2 and ep.world_size == 4
    full = MeshLayout(dp=2, pp=2, tp=2, cp=3, ep=2)
    seen = set()
    for r in range(full.world_size):
        c = full.coords(r)
        assert full.rank_of(**c) == r
        assert c["tp"] == r % 2 and c["ep"] == (r // 2) % 2 and c["cp"] == (r // 4) % 3 and c["dp"] == r // 24
        seen.add(tuple(c.values()))
    assert len(seen) == full.world_size
    for axis in ("dp", "pp", "cp", "ep", "tp"):
        assert sorted(r for g in full.groups(axis) for r in g) == list(range(full.world_size))
    old = MeshLayout(dp=2, pp=2, tp=2)
    assert all(old.coords(r)["cp"] == old.coords(r)["ep"] == 0 for r in range(8))
    assert [old.rank_of(dp=d, pp=p, tp=t) for d in range(2) for p in range(2) for t in range(2)] == list(range(8))


def test_layout_mp_groups_are_one_replica_each():
    """The model-parallel group of dp coordinate d is every (pp, tp) rank of d, in rank order."""
    lay = MeshLayout(dp=2, pp=2, tp=2)
    assert lay.mp_groups() == lay.groups("mp") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert MeshLayout(dp=3).mp_groups() == [(0,), (1,), (2,)]
    assert MeshLayout(pp=2, tp=2).mp_groups() == [(0, 1, 2, 3)]
    for r in range(8):
        assert {lay.coords(m)["dp"] for m in lay.group_of("mp", r)} == {lay.coords(r)["dp"]}


def test_layout_errors():
    """Unknown axes, non-positive sizes and a mesh that does not fit the world raise MeshError with the numbers."""
    with pytest.raises(MeshError, match="unknown mesh axis"):
        MeshLayout(2).groups("sp")
    with pytest.raises(MeshError, match=">= 1"):
        MeshLayout(dp=0)

    class _World:
        world_size, rank, ranks = 4, 0, (0, 1, 2, 3)
    with pytest.raises(MeshError, match="= 6 ranks, but the world group has 4"):
        DeviceMesh(_World(), dp=3, tp=2)


def _mesh_worker(group):
    import torch
    mesh = DeviceMesh(group, dp=2, tp=2)
    t = torch.tensor([float(group.rank)])
    mesh.group("tp").all_reduce(t)          # sums over my tp group only
    return mesh.coords, mesh.group("tp").ranks, mesh.group("dp").ranks, float(t[0]), mesh.group("mp").ranks


def test_device_mesh_subgroups():
    """On 4 ranks, dp=2 x tp=2: the tp sub-group of rank r is its adjacent pair and collectives stay inside it;
    the mp group (one model replica) is the same pair."""
    out = collectives.launch(_mesh_worker, 4, backend="zmq", timeout=60)
    assert [o[1] for o in out] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [o[2] for o in out] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert [o[3] for o in out] == [1.0, 1.0, 5.0, 5.0]
    assert [o[4] for o in out] == [(0, 1), (0, 1), (2, 3), (2, 3)]   # pp = 1: the model-parallel group is tp


def test_zero_formulas_match_paper():
    """The ZeRO paper's Figure 1 example: 7.5B parameters, N = 64, mixed-precision Adam (K = 12) gives 120 GB,
    31.4 GB, 16.6 GB and 1.9 GB per device for stages 0–3; fp32 Adam is (4+4+8)Ψ at stage 0."""
    psi, n = 7_500_000_000, 64
    got = [zero_bytes_per_rank(s, psi, n, MIXED_PRECISION_ADAM).total / 1e9 for s in range(4)]
    assert got == pytest.approx([120, 31.4, 16.6, 1.9], abs=0.06)
    assert zero_bytes_per_rank(0, 10, 4, FP32_ADAM).total == 160
    assert zero_bytes_per_rank(3, 10, 4, FP32_ADAM).total == 40
    with pytest.raises(ValueError, match="stage"):
        zero_bytes_per_rank(4, 10, 2)


def test_hosts_by_axis_order():
    """Ranks fill hosts along an axis order, innermost first: the mesh's own order (tp, ep, cp, pp, dp) is packed
    (r // per_host); "tp,dp,pp" on dp 2 x pp 2 x tp 2 puts each pp stage on its own host (rank = (dp·2 + pp)·2 +
    tp, so ranks 2, 3, 6, 7 are stage 1); "dp,pp,tp" puts each tp rank on its own host. Orders that skip a split
    axis or repeat one are refused."""
    from pslab.parallelism.mesh import MeshError, MeshLayout
    m = MeshLayout(dp=2, pp=2, tp=2)
    assert m.hosts_by_order(("tp", "ep", "cp", "pp", "dp"), 4) == [r // 4 for r in range(8)]
    assert m.hosts_by_order(("tp", "dp", "pp"), 4) == [0, 0, 1, 1, 0, 0, 1, 1]
    assert m.hosts_by_order(("dp", "pp", "tp"), 4) == [0, 1, 0, 1, 0, 1, 0, 1]
    assert m.hosts_by_order(("tp", "dp", "pp"), 2) == [0, 0, 2, 2, 1, 1, 3, 3]
    for bad in (("tp", "pp"), ("tp", "dp", "pp", "tp"), ("tp", "dp", "pp", "xx")):
        with pytest.raises(MeshError, match="at most once and every axis of degree > 1"):
            m.hosts_by_order(bad, 4)
