"""The same-host latency path (collectives/shm_channel.py): small all-reduce / broadcast / barrier through
shared-memory slots. Results against numpy and bit for bit against the zmq direct exchange, the same bytes counted,
N = 1..5, dtypes, uneven sizes, back-to-back calls, sub-groups, a killed peer named in bounded time, mismatches,
malformed segments and slot headers, and no segment left behind."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch

from pslab import collectives
from pslab.collectives import ring, shm_channel
from pslab.collectives.errors import CollectiveMismatchError, PeerTimeoutError, WireError
from pslab.collectives.launcher import RankFailure

pytestmark = pytest.mark.skipif(not shm_channel.supported(), reason="the shm channel path needs x86-64 and /dev/shm")

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8]
SIZES = [0, 1, 7, 1001, 8191]            # 8191 float32 = 32764 bytes: just under small_bytes (32 KiB)
OPS = ["sum", "avg", "max", "min"]


def _data(rank: int, dtype: torch.dtype, n: int, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + i)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g, dtype=torch.float64) * 10 ** (rank % 3)).to(dtype)
    hi = 4 if dtype == torch.uint8 else 1000
    return torch.randint(0, hi, (n,), generator=g, dtype=dtype)


def w_cases(group, with_sub: bool):
    """Every (dtype, size, op) all-reduce, broadcasts from every src, a barrier; results and traffic."""
    out, i = [], 0
    for dtype in DTYPES:
        for n in SIZES:
            for op in OPS:
                if op == "avg" and not dtype.is_floating_point:
                    continue
                t = _data(group.rank, dtype, n, i)
                group.all_reduce(t, op=op)
                out.append(t.view(torch.uint8).numpy().copy() if n else np.zeros(0, np.uint8))
                i += 1
            for src in range(group.world_size):
                t = _data(group.rank, dtype, n, i)
                group.broadcast(t, src=src)
                out.append(t.view(torch.uint8).numpy().copy() if n else np.zeros(0, np.uint8))
                i += 1
    a = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2] * (group.rank + 1)   # non-contiguous numpy
    group.all_reduce(a)
    out.append(a.copy())
    group.barrier()
    sub = None
    if with_sub and group.world_size >= 3:
        sg = group.new_group([0, group.world_size - 1])
        if sg is not None:
            s = torch.full((5,), float(group.rank + 1))
            sg.all_reduce(s)
            sub = s.tolist()
    snap = group.traffic_counter.snapshot()
    used = bool(group.local.chan) if group.world_size > 1 else None
    return out, {k: snap[k] for k in ("sent", "recv", "messages", "header_bytes")}, used, sub


def _reference(world: int) -> list[np.ndarray]:
    """numpy's answer for w_cases' all-reduces and broadcasts (floats reduced in float64 here, compared loosely)."""
    ref, i = [], 0
    for dtype in DTYPES:
        for n in SIZES:
            for op in OPS:
                if op == "avg" and not dtype.is_floating_point:
                    continue
                xs = np.stack([_data(r, dtype, n, i).double().numpy() for r in range(world)])
                ref.append({"sum": xs.sum(0), "avg": xs.mean(0), "max": xs.max(0), "min": xs.min(0)}[op])
                i += 1
            for src in range(world):
                ref.append(_data(src, dtype, n, i).double().numpy())
                i += 1
    return ref


def _as(b: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    return torch.from_numpy(b.copy()).view(dtype).double().numpy() if b.size else np.zeros(0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_results_equal_numpy_and_the_zmq_path_bit_for_bit(world):
    """Channel path == numpy (exact for integers, to rounding for floats) and == the zmq direct exchange bit for
    bit (same rank-order summation), with the same bytes and message counts in the traffic counter."""
    fast = collectives.launch(w_cases, world, "zmq", args=(True,), timeout=100)
    ref = _reference(world)
    for rank_out, _, used, _ in fast:
        assert used in (None, True)
        k = 0
        for dtype in DTYPES:
            tol = {torch.float16: 2e-2, torch.bfloat16: 1e-1, torch.float32: 1e-5}.get(dtype, 1e-12)
            for _ in SIZES:
                for _ in range(len(OPS) - (0 if dtype.is_floating_point else 1) + world):
                    got, want = _as(rank_out[k], dtype), ref[k]
                    if dtype.is_floating_point:
                        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * world * 1000)
                    else:
                        np.testing.assert_array_equal(got, want)
                    k += 1
        np.testing.assert_array_equal(rank_out[-1], np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]
                                      * sum(range(1, world + 1)))
    if world in (3, 5):        # summation order matters: compare with the zmq path, and the accounting
        old = collectives.launch(w_cases, world, "zmq", args=(True,), timeout=100, shm_channel=False)
        for (fo, ft, _, fs), (oo, ot, oused, os_) in zip(fast, old):
            assert oused is False
            assert len(fo) == len(oo) and all(np.array_equal(a, b) for a, b in zip(fo, oo))
            assert ft == ot and fs == os_
        assert fast[0][3] == [1.0 + world] * 5


def w_many(group, calls: int):
    """Back-to-back small collectives of changing kinds, sizes and roots: every result checked, exactly."""
    n, r = group.world_size, group.rank
    bad = 0
    for i in range(calls):
        k = i % 4
        m = 1 + (i * 7) % 300
        if k == 0:
            t = torch.full((m,), r + i, dtype=torch.int64)
            group.all_reduce(t)
            bad += int((t != n * i + n * (n - 1) // 2).any())
        elif k == 1:
            t = torch.full((m,), r, dtype=torch.int32)
            group.broadcast(t, src=i % n)
            bad += int((t != i % n).any())
        elif k == 2:
            group.barrier()
        else:
            t = torch.full((m,), float(r), dtype=torch.float64)
            group.all_reduce(t, op="max")
            bad += int((t != n - 1).any())
    w = group.local.chan.waiter
    return bad, w.spins + w.sleeps


@pytest.mark.timeout(120)
def test_many_back_to_back_calls_stay_exact():
    """3000 mixed calls on 3 ranks (more than the 4 slots ahead: broadcast roots run ahead and wait for slots)."""
    res = collectives.launch(w_many, 3, "zmq", args=(3000,), timeout=100)
    assert [b for b, _ in res] == [0, 0, 0]
    assert all(waits > 0 for _, waits in res)


def w_die(group, tmp: str):
    with open(os.path.join(tmp, f"job{group.rank}"), "w") as f:
        f.write(group.tr._job)
    for _ in range(20):
        group.all_reduce(torch.ones(100))
    if group.rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        for _ in range(1000):
            group.all_reduce(torch.ones(100))
    except PeerTimeoutError as e:
        return ("timeout", time.monotonic() - t0, e.op, e.peer)
    return ("finished", time.monotonic() - t0, "", -1)


@pytest.mark.timeout(60)
def test_killed_peer_is_named_in_bounded_time_and_segments_are_swept(tmp_path):
    """Rank 2 is SIGKILLed between small all-reduces: ranks 0 and 1 raise PeerTimeoutError naming rank 2 within the
    1.5 s group timeout (+ slack); afterwards no /dev/shm segment of any rank's job is left."""
    res = collectives.launch(w_die, 3, "zmq", args=(str(tmp_path),), timeout=50, group_timeout=1.5,
                             return_exceptions=True)
    assert isinstance(res[2], RankFailure) and res[2].exitcode == -signal.SIGKILL
    for r in (0, 1):
        kind, elapsed, op, peer = res[r]
        assert (kind, op, peer) == ("timeout", "all_reduce", 2) and elapsed < 1.5 + 2.0, res[r]
    jobs = [(tmp_path / f"job{r}").read_text() for r in range(3)]
    left = [n for n in os.listdir("/dev/shm") if any(n.startswith(f"pslab-{j}-") for j in jobs)]
    assert left == []


def w_diverge(group, case: str):
    r = group.rank
    try:
        if case == "op":
            if r == 1:
                group.broadcast(np.ones(10, np.float32), src=0)
            else:
                group.all_reduce(np.ones(10, np.float32))
        elif case == "numel":
            group.all_reduce(np.ones(10 + (r == 1), np.float32))
        elif case == "dtype":
            group.all_reduce(np.ones(10, np.float64 if r == 1 else np.float32))
        else:                         # "path": rank 1 above small_bytes (zmq ring), the others on the channels
            group.all_reduce(np.ones(20_000 if r == 1 else 10, np.float32))
    except CollectiveMismatchError as e:
        return ("mismatch", str(e))
    except PeerTimeoutError as e:
        return ("timeout", str(e))
    return ("ok", "")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["op", "numel", "dtype", "path"])
def test_mismatches_name_the_diverging_rank(case):
    """A rank that calls another collective, size, dtype or (through size) path is reported by name, and no rank
    returns as if it had succeeded."""
    res = collectives.launch(w_diverge, 3, "zmq", args=(case,), timeout=40, group_timeout=1.0)
    mism = [msg for kind, msg in res if kind == "mismatch"]
    assert mism, res
    assert any("rank 1" in m for m in mism), mism
    assert all(kind != "ok" for kind, _ in res), res


def w_options(group):
    group.all_reduce(torch.ones(4))
    return bool(group.local.chan)


@pytest.mark.timeout(60)
def test_the_path_is_off_with_the_option_or_a_topology():
    """shm_channel=False, or an emulated topology (its link model lives on the zmq path): no channels."""
    from pslab.collectives.topology import Topology
    assert collectives.launch(w_options, 2, "zmq", timeout=40) == [True, True]
    assert collectives.launch(w_options, 2, "zmq", timeout=40, shm_channel=False) == [False, False]
    topo = Topology(hosts=1, per_host=2)
    assert collectives.launch(w_options, 2, "zmq", timeout=40, topology=topo) == [False, False]


RING_SIZES = [8193, 100_003, 1 << 20]       # float32 above small_bytes: uneven chunks; 4 MiB = one segment per chunk


def w_ring(group, no_outbox: bool):
    """Ring all-reduce (every op), reduce-scatter and all-gather above small_bytes; results, bytes, path used."""
    if no_outbox:                    # /dev/shm refuses the outbox: payloads through ZeroMQ, descriptors still here
        group.tr.shm_reserve = lambda dst, nbytes: False
    out = []
    for i, n in enumerate(RING_SIZES):
        for op in OPS:
            t = _data(group.rank, torch.float32, n, i)
            group.all_reduce(t, op=op)
            out.append(t.numpy().copy())
        full = _data(group.rank, torch.float64, n, i)
        a, b = collectives.chunk_bounds(n, group.world_size)[group.rank]
        part = torch.empty(b - a, dtype=torch.float64)
        group.reduce_scatter(part, full)
        out.append(part.numpy().copy())
        gathered = torch.empty(n, dtype=torch.float64)
        group.all_gather(gathered, full[a:b].clone())
        out.append(gathered.numpy().copy())
    snap = group.traffic_counter.snapshot()
    return out, {k: snap[k] for k in ("sent", "recv", "messages")}, group.local.dchan is not None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,no_outbox", [(2, False), (3, False), (4, False), (3, True)])
def test_ring_over_descriptor_channels_is_bit_identical_to_the_zmq_ring(world, no_outbox):
    """shm_ring.py: the same ring, so the same bits as the zmq path (and numpy to rounding), the same bytes and
    messages counted; also when the outbox cannot be reserved (payloads through ZeroMQ)."""
    fast = collectives.launch(w_ring, world, "zmq", args=(no_outbox,), timeout=100)
    old = collectives.launch(w_ring, world, "zmq", args=(no_outbox,), timeout=100, shm_channel=False)
    for (fo, ft, fused), (oo, ot, oused) in zip(fast, old):
        assert fused and not oused
        assert all(np.array_equal(a, b) for a, b in zip(fo, oo))
        assert ft == ot
    k = 0
    for i, n in enumerate(RING_SIZES):
        xs = np.stack([_data(r, torch.float32, n, i).double().numpy() for r in range(world)])
        for op in OPS:
            want = {"sum": xs.sum(0), "avg": xs.mean(0), "max": xs.max(0), "min": xs.min(0)}[op]
            np.testing.assert_allclose(fast[0][0][k], want, rtol=1e-5, atol=1e-3)
            k += 1
        full = np.stack([_data(r, torch.float64, n, i).numpy() for r in range(world)])
        for r in range(world):
            a, b = collectives.chunk_bounds(n, world)[r]
            np.testing.assert_allclose(fast[r][0][k], full.sum(0)[a:b], rtol=1e-12, atol=1e-9)
            np.testing.assert_array_equal(fast[r][0][k + 1], np.concatenate(
                [full[q][slice(*collectives.chunk_bounds(n, world)[q])] for q in range(world)]))
        k += 2


# ---- one process, both ends: malformed segments and slot headers ------------------------------------------------
def _pair(timeout: float = 0.3, capacity: int = 256):
    jobs = ["a" + os.urandom(6).hex()[:11], "b" + os.urandom(6).hex()[:11]]
    mk = [shm_channel.Channels(jobs[r], r, (0, 1), "t", capacity, lambda g: jobs[g], shm_channel.Waiter(timeout))
          for r in (0, 1)]
    return jobs, mk


def test_malformed_segments_are_refused_until_the_real_one_appears():
    """At the name the receiver derives: a symlink, a directory, a short file, a file with a wrong header: none is
    mapped (PeerTimeoutError naming the sender); the sender's own segment then replaces the decoy and works, and
    no name is left once both ends are closed."""
    jobs, (c0, c1) = _pair()
    name = shm_channel.channel_name(jobs[0], 0, 1, "t")
    path = os.path.join("/dev/shm", name)
    like = torch.zeros(3)
    decoys = [lambda: os.symlink("/etc/passwd", path), lambda: os.mkdir(path),
              lambda: open(path, "wb").write(b"x" * 100),
              lambda: open(path, "wb").write(b"\0" * shm_channel.segment_size(256))]
    try:
        for make in decoys:
            make()
            with pytest.raises(PeerTimeoutError, match="rank 0 did not answer"):
                c1.take(0, "all_reduce", 0, like)
            (os.rmdir if os.path.isdir(path) and not os.path.islink(path) else os.unlink)(path)
        open(path, "wb").write(b"\0" * 100)          # a decoy still there when the sender creates its segment
        c0.post(1, "all_reduce", 0, torch.tensor([1.0, 2.0, 3.0]))
        seg, v = c1.take(0, "all_reduce", 0, like)
        assert v.tolist() == [1.0, 2.0, 3.0]
        c1.release(seg)
        assert not os.path.exists(path)              # mapped: the receiver unlinked the name
    finally:
        c0.close()
        c1.close()
        if os.path.lexists(path):
            os.unlink(path)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith((f"pslab-{jobs[0]}-", f"pslab-{jobs[1]}-"))]


@pytest.mark.timeout(30)
def test_a_receiver_that_closes_first_releases_its_senders_linger():
    """The sender made its channel (first message posted), the receiver closes without ever mapping it (it left in
    a mismatch, say): the name addressed to it goes with its close, so the sender's close does not wait out a linger
    (60 s here, beyond this test's bound) for a reader that will never come."""
    jobs, (c0, c1) = _pair()
    path = os.path.join("/dev/shm", shm_channel.channel_name(jobs[0], 0, 1, "t"))
    try:
        c0.post(1, "all_reduce", 0, torch.ones(3))
        assert os.path.exists(path)
        c1.close()
        assert not os.path.exists(path)
        c0.close(linger=60.0)
    finally:
        c0.close()
        c1.close()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith((f"pslab-{jobs[0]}-", f"pslab-{jobs[1]}-"))]


def test_invalid_slot_headers_and_mismatches_raise():
    """A slot header announcing more than the capacity, or bytes unlike numel x itemsize, or an unknown dtype is a
    WireError; another seq / op / numel / dtype is a CollectiveMismatchError; a peer that never sends times out."""
    jobs, (c0, c1) = _pair()
    try:
        c0.post(1, "broadcast", 0, torch.ones(4))
        with pytest.raises(CollectiveMismatchError, match="rank 0 called broadcast"):
            c1.take(0, "all_reduce", 0, torch.zeros(4))
        with pytest.raises(CollectiveMismatchError, match="numel=4"):
            c1.take(0, "broadcast", 0, torch.zeros(5))
        with pytest.raises(CollectiveMismatchError, match="collective #0"):
            c1.take(0, "broadcast", 1, torch.zeros(4))
        with pytest.raises(CollectiveMismatchError, match="float64"):
            c1.take(0, "broadcast", 0, torch.zeros(4, dtype=torch.float64))
        seg = c0.out[1]
        for fields in ([0, 1, 4, 2, 10_000], [0, 1, 4, 2, 15], [0, 1, 4, 99, 16], [0, 7, 4, 2, 16]):
            seg.hdr[0][:5] = fields
            with pytest.raises(WireError, match="slot header is invalid"):
                c1.take(0, "broadcast", 0, torch.zeros(4))
        seg.hdr[0][:5] = [0, 1, 4, 2, 16]
        s, v = c1.take(0, "broadcast", 0, torch.zeros(4))
        assert v.tolist() == [1.0] * 4
        c1.release(s)
        with pytest.raises(PeerTimeoutError, match="broadcast #1: rank 0 did not answer"):
            c1.take(0, "broadcast", 1, torch.zeros(4))
    finally:
        c0.close()
        c1.close()


def test_a_sender_waits_for_free_slots_and_times_out_on_a_stuck_receiver():
    """SLOTS messages may be in flight; one more waits for the receiver, and PeerTimeoutError names it."""
    jobs, (c0, c1) = _pair()
    try:
        for i in range(shm_channel.SLOTS):
            c0.post(1, "broadcast", i, torch.full((2,), float(i)))
        with pytest.raises(PeerTimeoutError, match="rank 1 did not answer"):
            c0.post(1, "broadcast", shm_channel.SLOTS, torch.ones(2))
        s, v = c1.take(0, "broadcast", 0, torch.zeros(2))
        assert v.tolist() == [0.0, 0.0]
        c1.release(s)
        c0.post(1, "broadcast", shm_channel.SLOTS, torch.ones(2))      # a slot is free again
        for i in range(1, shm_channel.SLOTS + 1):
            s, v = c1.take(0, "broadcast", i, torch.zeros(2))
            assert v.tolist() == [float(i) if i < shm_channel.SLOTS else 1.0] * 2
            c1.release(s)
    finally:
        c0.close()
        c1.close()


def test_fused_reduction_matches_the_sequential_order():
    """reduce_into(buf, parts) == buf = parts[0]; buf op= parts[1]; ... bit for bit (fp16 / bf16 / float32)."""
    bits = {2: torch.int16, 4: torch.int32}
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        parts = [torch.randn(999, dtype=torch.float64).mul(10 ** i).to(dtype) for i in range(4)]
        for op in OPS:
            buf = torch.empty(999, dtype=dtype)
            shm_channel.reduce_into(buf, parts, op)
            ref = parts[0].clone()
            for p in parts[1:]:
                ring.combine(ref, p, op)
            assert torch.equal(buf.view(bits[dtype.itemsize]), ref.view(bits[dtype.itemsize])), (dtype, op)
