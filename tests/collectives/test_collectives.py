"""Every collective of both backends equals a numpy reference, for N = 1..5, uneven/empty/one-element sizes and
several dtypes; sub-groups work; p2p works. Inputs are small integers, so float sums are exact in any order and the
comparison can be bitwise; a separate test compares random floats between backends to a tolerance."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pslab import collectives
from pslab.collectives.group import chunk_bounds

SIZES = [0, 1, 2, 7, 1001, 30011]   # 30011 float64 > small_bytes: exercises the streamed ring
DTYPES = ["float32", "float64", "int32", "int64", "float16"]


def make(rank: int, n: int, dtype: str, salt: int = 0) -> np.ndarray:
    x = ((np.arange(n) * (rank + 1 + salt) + 7 * rank + salt) % 23) - 11
    return x.astype(dtype)


def as_input(a: np.ndarray, i: int):
    return torch.from_numpy(a.copy()) if i % 2 else a.copy()   # alternate numpy arrays and torch tensors


def to_np(t) -> np.ndarray:
    return t.numpy() if isinstance(t, torch.Tensor) else t


def check_all(group, algorithms: tuple[str, ...]) -> list[str]:
    n, r = group.world_size, group.rank
    bad: list[str] = []

    def expect(name, got, want):
        got = to_np(got)
        if got.dtype != want.dtype or got.shape != want.shape or not np.array_equal(got, want):
            bad.append(f"rank {r} {name}: got {got.ravel()[:6]} want {want.ravel()[:6]}")

    i = 0
    for dtype in DTYPES:
        for size in SIZES:
            xs = [make(k, size, dtype) for k in range(n)]
            for op in ("sum", "max", "min", "avg"):
                if op == "avg" and not dtype.startswith("float"):
                    continue
                for alg in algorithms:
                    t = as_input(xs[r], i); i += 1
                    kw = {} if alg == "default" else {"algorithm": alg}
                    group.all_reduce(t, op=op, **kw)
                    stack = np.stack(xs).astype(np.float64)
                    ref = {"sum": stack.sum(0), "max": stack.max(0), "min": stack.min(0),
                           "avg": stack.sum(0) / n}[op].astype(dtype)
                    expect(f"all_reduce {op}/{alg} {dtype}[{size}]", t, ref)
            total = np.stack(xs).astype(np.float64).sum(0).astype(dtype)
            a, b = chunk_bounds(size, n)[r]
            out = as_input(np.zeros(b - a, dtype), i); i += 1
            group.reduce_scatter(out, as_input(xs[r], i))
            expect(f"reduce_scatter {dtype}[{size}]", out, total[a:b])
            full = np.concatenate([make(k, size, dtype)[slice(*chunk_bounds(size, n)[k])] for k in range(n)])
            out = as_input(np.zeros(size, dtype), i); i += 1
            group.all_gather(out, as_input(make(r, size, dtype)[a:b], i))
            expect(f"all_gather {dtype}[{size}]", out, full)
            t = as_input(xs[r], i); i += 1
            group.broadcast(t, src=n - 1)
            expect(f"broadcast {dtype}[{size}]", t, xs[n - 1])
        m = 3 * n
        inp = make(r, m, dtype, salt=5)
        out = as_input(np.zeros(m, dtype), i); i += 1
        group.all_to_all(out, as_input(inp, i))
        want = np.concatenate([make(k, m, dtype, salt=5)[3 * r:3 * r + 3] for k in range(n)])
        expect(f"all_to_all {dtype}", out, want)
    group.barrier()
    if n > 1:  # p2p around the ring, blocking and non-blocking
        right, left = (r + 1) % n, (r - 1) % n
        w = group.isend(make(r, 11, "int64"), right, tag=3)
        got = np.zeros(11, np.int64)
        group.irecv(got, left, tag=3).wait()
        w.wait()
        expect("isend/irecv", got, make(left, 11, "int64"))
        if r % 2 == 0:
            group.send(make(r, 5, "float32"), right)
            got = group.recv(np.zeros(5, np.float32), left)
        else:
            got = group.recv(np.zeros(5, np.float32), left)
            group.send(make(r, 5, "float32"), right)
        expect("send/recv", got, make(left, 5, "float32"))
    return bad


def run_checks(group, algorithms):
    return check_all(group, algorithms)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_zmq_collectives_match_numpy(world):
    """Our zmq backend: all collectives, all reduce ops and all-reduce algorithms, equal the numpy reference."""
    res = collectives.launch(run_checks, world, "zmq", args=(("default", "ring", "direct", "root"),), timeout=120,
                             segment_bytes=4096)  # small segments: many streamed segments per chunk
    assert res == [[]] * world


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_torch_backend_matches_numpy(world):
    """The torch.distributed (gloo) backend behind the same API gives the same results."""
    res = collectives.launch(run_checks, world, "torch", args=(("default",),), timeout=120)
    assert res == [[]] * world


def random_float_all_reduce(group, n):
    rng = np.random.default_rng(group.rank)
    t = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    group.all_reduce(t)
    bf = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(torch.bfloat16)
    group.all_reduce(bf)
    return t.numpy().copy(), bf.float().numpy().copy()


def test_backends_agree_on_random_floats():
    """Random float32 (and bfloat16) sums agree between zmq and gloo to rounding; ranks agree bitwise."""
    z = collectives.launch(random_float_all_reduce, 3, "zmq", args=(100_003,), timeout=60)
    g = collectives.launch(random_float_all_reduce, 3, "torch", args=(100_003,), timeout=60)
    for r in range(3):
        assert np.array_equal(z[r][0], z[0][0]), "every zmq rank must hold identical bits"
        np.testing.assert_allclose(z[r][0], g[r][0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(z[r][1], g[r][1], rtol=5e-2, atol=5e-2)


def subgroups(group):
    r = group.rank
    pairs = [group.new_group([0, 1]), group.new_group([2, 3])]
    evens = group.new_group([0, 2])
    mine = pairs[0] if r < 2 else pairs[1]
    t = np.array([float(r)], np.float32)
    mine.all_reduce(t)
    out = {"pair": float(t[0]), "pair_rank": mine.rank, "none_for_other": pairs[1 - r // 2] is None}
    if evens is not None:
        e = np.array([r + 1], np.int64)
        evens.all_reduce(e)
        g = np.zeros(2, np.int64)
        evens.all_gather(g, np.array([r], np.int64))
        out["evens"], out["gather"] = int(e[0]), g.tolist()
    group.barrier()
    return out


@pytest.mark.parametrize("backend", ["zmq", "torch"])
def test_subgroups(backend):
    """Sub-groups carved from a 4-rank world reduce only among their members; non-members get None."""
    res = collectives.launch(subgroups, 4, backend, timeout=60)
    assert [x["pair"] for x in res] == [1.0, 1.0, 5.0, 5.0]
    assert [x["pair_rank"] for x in res] == [0, 1, 0, 1]
    assert all(x["none_for_other"] for x in res)
    assert res[0]["evens"] == res[2]["evens"] == 4 and res[0]["gather"] == [0, 2]
    assert "evens" not in res[1]


@pytest.mark.parametrize("world, options", [(3, {"use_shm": False}), (4, {"use_shm": False, "use_ipc": False})])
def test_zmq_socket_paths_match_numpy(world, options):
    """The same checks with payloads through ipc:// sockets (no shared memory) and through tcp:// only."""
    res = collectives.launch(run_checks, world, "zmq", args=(("default", "ring"),), timeout=120,
                             segment_bytes=4096, **options)
    assert res == [[]] * world
