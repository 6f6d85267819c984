"""Split tensors on the same-host path (ps.shm_arena): one push segment and one pull segment per client, laid out
tensor by tensor, so a tensor split over 2 or 3 shards is pushed and read without a copy; the values equal a
single-shard run with frames; malformed pull-arena offers are refused; without shared memory everything falls back
to frames; nothing is left in /dev/shm."""

from __future__ import annotations

import errno
import os
import secrets

import numpy as np
import pytest
import torch

from pslab.ps import shm_arena, shm_path
from pslab.ps.client import connect
from tests.ps.rawsock import Raw

pytestmark = pytest.mark.skipif(not shm_path.shm.available(), reason="/dev/shm is not writable here")

# w (float32) is split on 2 and 3 shards, d (float64) on 3, into uneven pieces (odd element counts); h (float16)
# and b stay whole
SHAPES = {"w": (301, 77), "d": (7001,), "h": (1001,), "b": (33,)}
DTYPES = {"w": np.float32, "d": np.float64, "h": np.float16, "b": np.float32}


def tensors(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (rng.standard_normal(s) * 0.1).astype(DTYPES[k]) for k, s in SHAPES.items()}


def _inside(a: np.ndarray, box) -> bool:
    base = box.bytes.data_ptr()
    p = a.__array_interface__["data"][0]
    return base <= p and p + a.nbytes <= base + box.size


def leftovers(jobs: set[str]) -> list[str]:
    """/dev/shm names of these jobs (other processes on the machine may hold pslab segments of their own)."""
    return [n for n in os.listdir(shm_path.shm.SHM_DIR) if any(n.startswith(f"pslab-{j}-") for j in jobs)]


def run(addresses, *, shm: bool, steps: int = 6, check_zero_copy: bool = False, monkeypatch=None,
        jobs: set[str] | None = None, servers=None):
    """Push gradients written into grad_buffers and read with push_pull(copy=False); the reads, step by step.
    `jobs` collects the segment job ids of the client and (`servers`: ThreadServers) of the shards' links."""
    seen = []
    with connect(addresses, 0, tensors(0), timeout=30, shm=shm) as c:
        c.init(tensors(0)).result(30)
        c.pull().result(30)
        bufs = c.grad_buffers()
        writes: list = []
        if check_zero_copy:
            split = [n for n, sl in c._slices_of.items() if len(sl) > 1]
            assert split and all(_inside(bufs[n], c._arena) for n in bufs)     # split tensors too
            assert all(link.into_ok for link in c._links if any(s.key in link.into_places
                                                                for s in c._keys_of[link.shard]))
            real = shm_path.shm.Outbox.write
            monkeypatch.setattr(shm_path.shm.Outbox, "write", lambda self, off, t: writes.append(self)
                                or real(self, off, t))
        for step in range(steps):
            g = tensors(100 + step)
            for k in SHAPES:
                bufs[k][...] = g[k]
            _, r = c.push_pull(bufs, copy=False).result(30)
            if check_zero_copy:
                assert c._arena not in writes                              # the push copied nothing
                for n in split:                                            # read in place: the pull arena
                    assert _inside(r.params[n], c._into) and not r.params[n].flags.writeable
            seen.append({k: np.array(v) for k, v in r.params.items()})
        seen.append(c.pull().result(30).params)                            # copy=True agrees
        if jobs is not None:
            jobs |= {a.job for a in (c._arena, c._into) if a is not None} | {link.job for link in c._links}
            jobs |= {link.job for srv in (servers.servers if servers else []) for link in srv.links.values()}
    return seen


@pytest.mark.parametrize("num_shards", [2, 3])
def test_split_tensors_train_like_one_shard_with_frames(thread_servers, monkeypatch, num_shards):
    """Adam over 2 or 3 shards through the arenas (split float32 and float64 tensors, uneven pieces, a float16 and
    a tiny tensor whole) gives, at every step, bitwise the values of one shard with frames; the push copies nothing
    and split tensors are read as views of the pull arena."""
    ref_servers = thread_servers(1, num_workers=1, optimizer="adam:lr=0.01")
    ref = run(ref_servers.addresses, shm=False)
    servers = thread_servers(num_shards, num_workers=1, optimizer="adam:lr=0.01")
    got = run(servers.addresses, shm=True, check_zero_copy=True, monkeypatch=monkeypatch)
    assert not np.array_equal(ref[-1]["w"], tensors(0)["w"])
    for step, (a, b) in enumerate(zip(got, ref)):
        for k in SHAPES:
            assert a[k].dtype == b[k].dtype == DTYPES[k] and a[k].shape == SHAPES[k]
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"step {step} {k}")


def test_ordinary_arrays_and_copying_reads_on_split_tensors(thread_servers):
    """Arrays that are not the arena's are copied into their places; pull() copies (writable arrays, not views of
    the arena); a resync renews both segments and the path keeps working; the values equal frames."""
    finals = {}
    for shm in (False, True):
        servers = thread_servers(3, num_workers=1, optimizer="sgd:lr=0.1")
        with connect(servers.addresses, 0, tensors(0), timeout=30, shm=shm) as c:
            c.init(tensors(0)).result(30)
            for step in range(4):
                c.push(tensors(10 + step)).result(30)
                p = c.pull().result(30).params
                assert all(v.flags.writeable for v in p.values())
                if shm:
                    assert not _inside(p["w"], c._into)
                if step == 1:
                    names = (c._arena.name, c._into.name) if shm else None
                    c.resync()
                    assert c.shm == [shm] * 3
                    if shm:
                        assert c._arena.name != names[0] and c._into.name != names[1]
            finals[shm] = p
        servers.stop()
    for k in SHAPES:
        np.testing.assert_array_equal(finals[True][k], finals[False][k])


def test_no_pull_arena_or_no_shm_falls_back(thread_servers, monkeypatch):
    """A pull arena that cannot be allocated: pushes still go through the push arena, split tensors come back
    through the reply segments (reassembled); /dev/shm full at connect: frames throughout. Same values."""
    jobs: set[str] = set()
    ref_servers = thread_servers(1, num_workers=1, optimizer="adam:lr=0.01")
    ref = run(ref_servers.addresses, shm=False, steps=3)

    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(shm_arena.PullArena, "reserve_all", no_space)
    servers = thread_servers(2, num_workers=1, optimizer="adam:lr=0.01")
    got = run(servers.addresses, shm=True, steps=3, jobs=jobs, servers=servers)
    monkeypatch.undo()
    monkeypatch.setattr(os, "posix_fallocate", lambda fd, off, n: no_space())
    servers2 = thread_servers(2, num_workers=1, optimizer="adam:lr=0.01")
    with connect(servers2.addresses, 0, tensors(0), timeout=30) as c:
        assert c.shm == [False, False]
    got2 = run(servers2.addresses, shm=True, steps=3, jobs=jobs, servers=servers2)
    monkeypatch.undo()
    for a, b, r in zip(got, got2, ref):
        for k in SHAPES:
            np.testing.assert_array_equal(a[k], r[k])
            np.testing.assert_array_equal(b[k], r[k])
    for s in (servers, servers2, ref_servers):
        s.stop()
    assert len(jobs) >= 3 and leftovers(jobs) == []


def test_no_segment_outlives_split_clients(thread_servers):
    """Both arenas of 2- and 3-shard clients, and the shards' reply segments, are gone after close and stop."""
    jobs: set[str] = set()
    for n in (2, 3):
        servers = thread_servers(n, num_workers=1)
        run(servers.addresses, shm=True, steps=2, jobs=jobs, servers=servers)
        servers.stop()
    assert len(jobs) >= 4 and leftovers(jobs) == []


def _offer(worker: int = 1, shard: int = 0, size: int = 1 << 16):
    arena = shm_arena.PullArena(secrets.token_hex(6), worker, [shard], size)
    arena.reserve_all()
    return arena, arena.offer(shard, {"w": (4096, 400)})


def test_malformed_pull_arena_offers_are_refused():
    """The shard maps a pull arena only if every field is sound: pieces inside the segment, not overlapping, not
    over the probe slot; the client's token there; a segment name of this worker to this shard. Anything else is
    no arena (split pieces then go through the reply segment), never an error or a write out of range."""
    arena, good = _offer()
    try:
        into = shm_arena.Into.accept(0, 1, good)
        assert into is not None and arena.proven(0, into[1])
        into[0].close()
        size = good["shm_into"][1]
        bad = [
            dict(good, shm_into_keys=[["w", size - 100, 400]]),                       # runs past the end
            dict(good, shm_into_keys=[["w", 4096, 400], ["v", 4200, 400]]),           # overlapping
            dict(good, shm_into_keys=[["w", 0, 400]]),                                # over the probe slot
            dict(good, shm_into_keys=[["w", -64, 400]]),                              # negative
            dict(good, shm_into_keys=[["w", 4096, 400], ["w", 8192, 400]]),           # a key twice
            dict(good, shm_into_token="0" * 32),                                      # not the client's token
            dict(good, shm_into=["/etc/passwd", size, 0]),                            # not a segment name
            dict(good, shm_into=[good["shm_into"][0].replace("-1-0-", "-2-0-"), size, 0]),   # another worker's
            dict(good, shm_into=[good["shm_into"][0], size * 2, 0]),                  # larger than the segment
            dict(good, shm_into="nonsense"),
        ]
        for i, meta in enumerate(bad):
            assert shm_arena.Into.accept(0, 1, meta) is None, i
        assert shm_arena.Into.accept(1, 1, good) is None                               # meant for shard 0
    finally:
        arena.close()
    t = torch.ones(100)
    arena, good = _offer()
    try:
        into, _ = shm_arena.Into.accept(0, 1, good)
        assert not into.put("v", t) and not into.put("w", torch.ones(99))            # no place / wrong size
        assert into.put("w", t)
        np.testing.assert_array_equal(np.frombuffer(arena.read(4096, 400), np.float32), np.ones(100, np.float32))
        into.close()
    finally:
        arena.close()


def test_bogus_shm_into_keys_in_a_reply_are_refused(thread_servers):
    """A reply naming pieces the link did not offer a place for is refused (WireError: the client turns shm replies
    off) instead of being read from the arena."""
    from pslab.collectives.errors import WireError
    servers = thread_servers(2, num_workers=1)
    with connect(servers.addresses, 0, tensors(0), timeout=30) as c:
        link = next(x for x in c._links if x.into_places)
        assert link.into_ok
        for keys in (["nope"], "w", [list(link.into_places)[0]] * 2):
            assert link.take_pull(99, copy=False)
            with pytest.raises(WireError):
                link.on_reply(99, {"shm": [], "shm_into": keys})
            link.pull_ok = True


def test_register_with_a_malformed_pull_arena_still_gets_the_push_path(thread_servers):
    """Over the wire: a register whose pull-arena offer is malformed is answered ok with the shm push path and no
    pull-arena token (no error); the shard keeps serving."""
    servers = thread_servers(1, num_workers=2)
    raw = Raw(servers.addresses[0], user="worker:1")
    arena = None
    try:
        link = shm_path.ClientLink(1, 0, True)
        arena, offer = _offer()
        meta = dict({"worker": 1}, **link.probe(), **dict(offer, shm_into_keys=[["w", 1 << 20, 4]]))
        r = raw.request("register", seq=1, meta=meta)
        assert r.op == "ok" and r.meta["shm"] is True and "shm_into_token" not in r.meta
        link.close()
    finally:
        raw.close()
        if arena is not None:
            arena.close()
