"""Emulated topologies (collectives/topology.py) and hierarchical all-reduce (collectives/hierarchical.py).

References are independent of the code under test: results against numpy, delays against the link model's lower
bound on one machine-wide clock (never an upper bound on wall time), bytes on the slow link against the closed-form
2(H-1)/H · S/L and 2(N-1)/N · S written out by hand for 2 hosts x 2 ranks."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from pslab import collectives
from pslab.collectives import hierarchical as hier
from pslab.collectives.group import chunk_bounds
from pslab.collectives.topology import ENV, Topology, TopologyError, from_env, link_bytes, reset_link_bytes

FAST = Topology(2, 2, intra_latency_s=0.0, intra_bandwidth_Bps=5e9, inter_latency_s=1e-4, inter_bandwidth_Bps=1e9)
SIZES = [1, 3, 7, 1001, 30011]


def _data(rank: int, n: int, dtype: str, salt: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * salt + rank)
    if dtype.startswith("int"):
        return rng.integers(-50, 50, n).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


def _results(group, algorithms: tuple[str, ...]) -> list[str]:
    """Every (algorithm, op, dtype, size) all-reduce against numpy; also which algorithm `auto` moved bytes like."""
    bad = []
    n, r, salt = group.world_size, group.rank, 0
    for alg in algorithms:
        for dtype in ("float32", "float64", "int64"):
            for op in ("sum", "avg", "max"):
                if op == "avg" and dtype == "int64":
                    continue
                for size in SIZES:
                    salt += 1
                    xs = [_data(k, size, dtype, salt) for k in range(n)]
                    t = torch.from_numpy(xs[r].copy()) if salt % 2 else xs[r].copy()
                    group.all_reduce(t, op=op, algorithm=alg)
                    got = t.numpy() if isinstance(t, torch.Tensor) else t
                    st = np.stack(xs).astype(np.float64)
                    want = {"sum": st.sum(0), "avg": st.mean(0), "max": st.max(0)}[op]
                    tol = {"float32": 1e-5, "float64": 1e-12, "int64": 0}[dtype]
                    if got.dtype != np.dtype(dtype) or not np.allclose(got, want, rtol=tol, atol=tol):
                        bad.append(f"rank {r} {alg} {op} {dtype}[{size}]: {got[:4]} vs {want[:4]}")
    return bad


def _bytes_of(group, numel: int, alg: str) -> dict[str, int]:
    reset_link_bytes(group)
    group.all_reduce(torch.ones(numel, dtype=torch.float32), algorithm=alg)
    return link_bytes(group)


def _auto_bytes(group, numel: int) -> dict[str, int]:
    return _bytes_of(group, numel, "auto")


def w_results(group) -> tuple[list[str], dict[str, int]]:
    bad = _results(group, ("hierarchical", "ring", "auto"))
    t = torch.full((4,), float(group.rank))
    group.all_reduce(t, algorithm="direct")              # the other algorithms still work under a topology
    if t.tolist() != [6.0] * 4:
        bad.append(f"direct: {t.tolist()}")
    return bad, _auto_bytes(group, 30011)


def test_all_reduce_equals_numpy_with_and_without_hierarchy():
    out = collectives.launch(w_results, 4, "zmq", timeout=60, topology=FAST, small_bytes=0)
    want = hier.exact_inter_bytes(30011, 4, 2, 2, "hierarchical")
    for r, (bad, auto) in enumerate(out):
        assert bad == [], bad[:5]
        assert auto["inter"] == want[r], (r, auto)         # auto picked hierarchical


def w_flat_auto(group) -> dict[str, int]:
    return _auto_bytes(group, 30011)


def test_hierarchical_false_forces_flat_ring():
    out = collectives.launch(w_flat_auto, 4, "zmq", timeout=60, topology=FAST, hierarchical=False)
    assert [b["inter"] for b in out] == hier.exact_inter_bytes(30011, 4, 2, 2, "ring")


def w_bytes(group, sizes: list[int]) -> list[dict]:
    group.all_reduce(torch.ones(8), algorithm="hierarchical")   # the first call makes the sub-groups (+ a barrier)
    return [{alg: _bytes_of(group, n, alg) for alg in ("hierarchical", "ring")} for n in sizes]


def test_inter_host_bytes_equal_formula():
    numel = 1 << 16                                        # S = 256 KiB, divisible by every chunking level
    S = numel * 4
    out = collectives.launch(w_bytes, 4, "zmq", args=([numel, 30011, 5],), timeout=60, topology=FAST)
    # by hand, 2 hosts x 2 ranks: hierarchical 2(H-1)/H · S/L = S/2 from every rank; the flat ring 0-1|2-3 crosses
    # at 1->2 and 3->0, each crossing rank sending its whole share 2(N-1)/N · S = 1.5 S, the others nothing
    assert hier.inter_bytes_per_rank(S, 2, 2) == S / 2
    assert hier.flat_ring_inter_bytes_per_crossing(S, 2, 2) == 1.5 * S
    assert [o[0]["hierarchical"]["inter"] for o in out] == [S // 2] * 4
    assert [o[0]["ring"]["inter"] for o in out] == [0, 3 * S // 2, 0, 3 * S // 2]
    assert sum(o[0]["hierarchical"]["inter"] for o in out) == hier.inter_bytes_total(S, 2, 2, "hierarchical")
    assert sum(o[0]["ring"]["inter"] for o in out) == hier.inter_bytes_total(S, 2, 2, "ring")
    # intra: hierarchical's reduce-scatter + all-gather inside the host, (L-1)/L · S each; the ring's other hops
    assert [o[0]["hierarchical"]["intra"] for o in out] == [S] * 4
    assert [o[0]["ring"]["intra"] for o in out] == [3 * S // 2, 0, 3 * S // 2, 0]
    for i, numel in enumerate([30011, 5], start=1):       # uneven sizes: chunk_bounds' rule at every level
        for alg in ("hierarchical", "ring"):
            assert [o[i][alg]["inter"] for o in out] == hier.exact_inter_bytes(numel, 4, 2, 2, alg), (numel, alg)


def test_exact_inter_bytes_by_hand():
    # 5 elements over 2 x 2: local shards chunk_bounds(5, 2) = 3 | 2 elements; across 2 hosts each rank sends one
    # half of its shard per phase: shard 3 -> halves 2 | 1, shard 2 -> 1 | 1
    assert chunk_bounds(5, 2) == [(0, 3), (3, 5)]
    assert hier.exact_inter_bytes(5, 4, 2, 2, "hierarchical") == [(2 + 1) * 4, (1 + 1) * 4, (1 + 2) * 4, (1 + 1) * 4]
    # flat ring of 4 over 5 elements (chunks 2,1,1,1): rank r sends chunks r, r-1, ..., 6 of them
    sizes = [2, 1, 1, 1]
    crossing = {r: sum(sizes[(r - k) % 4] for k in range(6)) * 4 for r in (1, 3)}
    assert hier.exact_inter_bytes(5, 4, 2, 2, "ring") == [0, crossing[1], 0, crossing[3]]


# ---- emulated delay ----------------------------------------------------------------------------------------------
def w_delay(group, nbytes: int, count: int) -> list[float]:
    """Rank 0 sends `count` messages back to back; returns (rank 0) its send time, (rank 1) each arrival time."""
    group.barrier()
    buf = torch.zeros(nbytes // 4, dtype=torch.float32)
    if group.rank == 0:
        t0 = time.monotonic()
        works = [group.isend(buf, 1, tag=7) for _ in range(count)]
        for w in works:
            w.wait()
        return [t0]
    out = []
    for _ in range(count):
        group.recv(buf, 0, tag=7)
        out.append(time.monotonic())
    return out


def test_slow_link_latency_is_observed():
    lat = 0.05
    topo = Topology(2, 1, inter_latency_s=lat, inter_bandwidth_Bps=1e12)
    (t0,), arrivals = collectives.launch(w_delay, 2, "zmq", args=(4, 1), timeout=60, topology=topo)
    assert arrivals[0] - t0 >= lat


def test_bandwidth_shaping_and_link_serialisation():
    bw, nbytes = 100e6, 1 << 20                            # 1 MiB at 100 MB/s: >= 10.5 ms each, back to back
    topo = Topology(2, 1, inter_latency_s=0.0, inter_bandwidth_Bps=bw)
    (t0,), arrivals = collectives.launch(w_delay, 2, "zmq", args=(nbytes, 2), timeout=60, topology=topo)
    assert arrivals[0] - t0 >= nbytes / bw
    assert arrivals[1] - t0 >= 2 * nbytes / bw             # the second waited for the first to leave the link


def test_intra_link_uses_intra_parameters():
    topo = Topology(1, 2, intra_latency_s=0.03, inter_latency_s=10.0)
    (t0,), arrivals = collectives.launch(w_delay, 2, "zmq", args=(4, 1), timeout=60, topology=topo)
    assert arrivals[0] - t0 >= 0.03


# ---- configuration -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, words", [
    (dict(hosts=0, per_host=2), "hosts must be an integer >= 1"),
    (dict(hosts=2, per_host=1.5), "per_host must be an integer"),
    (dict(hosts=True, per_host=2), "hosts must be an integer"),
    (dict(hosts=2, per_host=2, inter_bandwidth_Bps=0), "inter_bandwidth_Bps must be a number of bytes/s > 0"),
    (dict(hosts=2, per_host=2, intra_latency_s=-1e-6), "intra_latency_s must be a finite number"),
    (dict(hosts=2, per_host=2, inter_latency_s=float("inf")), "inter_latency_s must be a finite number"),
    (dict(hosts=2, per_host=2, intra_bandwidth_Bps="fast"), "intra_bandwidth_Bps must be a number"),
])
def test_bad_topology_one_line(kwargs, words):
    with pytest.raises(TopologyError, match=words) as e:
        Topology(**kwargs)
    assert "\n" not in str(e.value)


def test_topology_json_and_env(monkeypatch):
    t = Topology(2, 4, 1e-5, 2e9, 2e-4, 1e8)
    assert Topology.from_json(t.to_json()) == t
    assert Topology.from_json('{"hosts": 2, "per_host": 1}').inter_bandwidth_Bps == float("inf")
    for text, words in [('{"hosts": 2}', "needs per_host"), ('{"hosts": 2, "per_host": 1, "speed": 3}',
                        "unknown topology field"), ("[1]", "must be an object"), ("{", "does not parse")]:
        with pytest.raises(TopologyError, match=words) as e:
            Topology.from_json(text)
        assert "\n" not in str(e.value)
    with pytest.raises(TopologyError, match="but the job has 3"):
        t.check_world(3)
    monkeypatch.setenv(ENV, '{"hosts": 1, "per_host": 1, "intra_latency_s": 0.001}')
    assert from_env() == Topology(1, 1, intra_latency_s=0.001)
    group = collectives.init_process_group("zmq", rank=0, world_size=1, store=dist.HashStore())
    try:
        assert group.tr.links is not None and group.tr.links.topology == from_env()
    finally:
        group.destroy()
    with pytest.raises(ValueError, match="zmq backend only"):
        collectives.init_process_group("torch", rank=0, world_size=1, store=dist.HashStore())
    monkeypatch.setenv(ENV, '{"hosts": 0, "per_host": 1}')
    with pytest.raises(TopologyError, match=f"{ENV}: topology hosts"):
        from_env()


def w_nothing(group) -> int:
    return group.rank


def test_topology_of_the_wrong_size_is_refused_by_launch():
    with pytest.raises(collectives.LaunchError, match="but the job has 2"):
        collectives.launch(w_nothing, 2, "zmq", timeout=60, topology=Topology(2, 2))


def w_late_rank(group) -> float:
    """Rank 3 sits in a receive (reading its socket) while ranks 0 and 2 already make the hierarchical sub-groups
    and would send on them: nothing may be sent on a sub-group before every member has made it."""
    if group.rank == 1:
        time.sleep(0.5)
        group.isend(torch.ones(1), 3, tag=5).wait()
    if group.rank == 3:
        group.recv(torch.ones(1), 1, tag=5)
    t = torch.full((1 << 14,), float(group.rank))
    group.all_reduce(t, algorithm="hierarchical")
    return float(t[0])


def test_first_hierarchical_call_while_a_rank_is_still_busy():
    assert collectives.launch(w_late_rank, 4, "zmq", timeout=60, group_timeout=10, topology=FAST) == [6.0] * 4


def test_a_network_card_serialises_a_ranks_flows_that_per_pair_wires_keep_apart() -> None:
    """nic=True: one outgoing link per rank and class (two sends to different peers queue), and one incoming link
    (two messages due at once are taken one after the other); nic=False: a private wire per pair."""
    from pslab.collectives.topology import LinkEmulator
    msg = torch.zeros(25_000)                                  # 100 kB: 0.05 s on a 2 MB/s link
    for nic in (False, True):
        topo = Topology(hosts=3, per_host=1, inter_latency_s=0.0, inter_bandwidth_Bps=2e6, nic=nic)
        out = LinkEmulator(topo, 0, 3)
        a, b = out.stamp(1, [msg]), out.stamp(2, [msg])
        gap = b["due"] - a["due"]
        assert (abs(gap - 0.05) < 1e-9) if nic else (abs(gap) < 0.01), (nic, gap)
        assert ("nb" in a) == nic
    inbox = LinkEmulator(Topology(hosts=3, per_host=1, inter_bandwidth_Bps=2e6, nic=True), 2, 3)
    now = time.monotonic()
    for _ in range(2):                                         # both due now, from two different senders
        inbox.hold({"meta": {"due": now, "dly": 0.0, "nb": 100_000, "lc": "inter"}})
    assert inbox.in_busy["inter"] >= now + 0.05 and inbox.held_s >= 0.04     # the second waited for the first
    with pytest.raises(TopologyError, match="nic must be true"):
        Topology(hosts=2, per_host=1, nic="yes")               # type: ignore[arg-type]
    assert Topology.from_json(Topology(hosts=2, per_host=1, nic=True).to_json()).nic is True
