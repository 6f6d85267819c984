"""The same-host shared-memory payload path and push_pull: negotiated only where both sides share /dev/shm, bitwise
the same trajectory as frames, robust to bad descriptors, and leaving no segment behind."""

from __future__ import annotations

import threading

import numpy as np
import pytest


from pslab.ps import shm_path
from pslab.ps.client import connect
from tests.ps.rawsock import Raw

pytestmark = pytest.mark.skipif(not shm_path.shm.available(), reason="/dev/shm is not writable here")

SHAPES = {"w": (64, 33), "b": (33,), "v": (1000,)}


def tensors(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def train(addresses, *, shm: bool, fused: bool, steps: int = 20, worker: int = 0, init: bool = True):
    """Deterministic pushes (gradient = f(step)); returns the final params and whether shm was used."""
    with connect(addresses, worker, SHAPES, timeout=30, shm=shm) as c:
        if init:
            c.init(tensors(0)).result(30)
        c.pull().result(30)
        for step in range(steps):
            g = tensors(100 + step + 1000 * worker)
            if fused:
                acks, pr = c.push_pull(g).result(30)
                assert len(acks) == len(addresses) and pr.clocks == [step + 1] * len(addresses)
            else:
                c.push(g).result(30)
                c.pull().result(30)
        return c.pull().result(30).params, c.shm


def test_negotiated_on_loopback_refused_when_either_side_declines(thread_servers):
    """A loopback client and shard agree on shm; shm=False on the client, or shm=False on the shard, gives frames."""
    on = thread_servers(2, num_workers=1)
    off = thread_servers(1, num_workers=1, shm=False)
    with connect(on.addresses, 0, SHAPES) as c:
        assert c.shm == [True, True]
    with connect(on.addresses, 0, SHAPES, shm=False) as c:
        assert c.shm == [False, False]
    with connect(off.addresses, 0, SHAPES) as c:
        assert c.shm == [False]
    assert not shm_path.wanted("tcp://10.1.2.3:5555")


@pytest.mark.parametrize("policy", ["asp", "bsp"])
def test_shm_push_pull_and_frames_give_bitwise_equal_weights(thread_servers, policy):
    """The same pushes through frames, through shm, and fused as push_pull end at bitwise the same weights
    (adam on 2 shards: any lost, duplicated or misplaced byte would show)."""
    finals = {}
    for shm in (False, True):
        for fused in (False, True):
            servers = thread_servers(2, num_workers=1, policy=policy, optimizer="adam:lr=0.01")
            params, used = train(servers.addresses, shm=shm, fused=fused)
            assert used == [shm, shm]
            finals[(shm, fused)] = params
            servers.stop()
    ref = finals[(False, False)]
    assert not np.allclose(ref["w"], tensors(0)["w"])          # training moved the weights
    for key, got in finals.items():
        for n in SHAPES:
            np.testing.assert_array_equal(got[n], ref[n], err_msg=f"{key} {n}")


def test_push_pull_waits_at_the_bsp_gate(thread_servers):
    """Under BSP a push_pull's read is answered only once every worker has pushed that clock: two workers, one
    slower, every read is at the clock both completed and every staleness is 0."""
    servers = thread_servers(1, num_workers=2, policy="bsp", optimizer="sgd:lr=0.1")
    seen: dict[int, list[int]] = {0: [], 1: []}
    errors: list = []
    ready = threading.Event()

    def work(w: int) -> None:
        try:
            with connect(servers.addresses, w, SHAPES, timeout=30) as c:
                if w == 0:
                    c.init(tensors(0)).result(30)
                    ready.set()
                ready.wait(30)
                c.pull().result(30)
                for step in range(8):
                    if w == 1:
                        threading.Event().wait(0.01)
                    acks, pr = c.push_pull(tensors(10 * step + w)).result(30)
                    seen[w].append(pr.versions[0])
        except BaseException as e:
            errors.append(e)
    threads = [threading.Thread(target=work, args=(w,), daemon=True) for w in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert seen[0] == seen[1] == list(range(1, 9))              # read version = completed clocks
    with connect(servers.addresses, 0, SHAPES) as c:
        assert c.stats().result(30)[0]["stats"]["histogram"] == {"0": 16}


def test_bad_shared_memory_requests_get_errors_and_change_nothing(thread_servers):
    """Pushes naming segments they did not negotiate, bogus probes, and descriptors outside the segment are answered
    with errors; the weights stay bitwise unchanged and the shard keeps serving a valid client."""
    servers = thread_servers(1, num_workers=2)
    addr = servers.addresses[0]
    with connect([addr], 0, SHAPES) as good:
        good.init(tensors(0)).result(30)
        before = good.pull().result(30).params
        raw = Raw(addr, user="worker:1")
        try:
            r = raw.request("register", seq=1, meta={"worker": 1, "shm_probe": ["pslab-000000000000-1-0-1", 16, 0,
                                                                              "uint8", [16]], "shm_token": "0" * 32})
            assert r.op == "ok" and r.meta["shm"] is False       # no such segment: frames, no error
            link = shm_path.ClientLink(1, 0, True)               # a real segment, negotiated properly
            r = raw.request("register", seq=2, meta=dict({"worker": 1}, **link.probe()))
            assert r.op == "ok" and r.meta["shm"] is True
            link.accept(r.meta)
            entries = link.take_push(3, {k: v for k, v in tensors(5).items()})
            name, size, shape = entries[0][1][0], entries[0][1][1], entries[0][1][4]
            bad = [
                [["w", [name, size, size - 4, "float32", shape]]] + entries[1:],   # runs past the end
                [["w", ["/etc/passwd", size, 0, "float32", shape]]] + entries[1:],  # not a segment name
                [["w", [name.replace("-1-0-", "-0-0-"), size, 0, "float32", shape]]] + entries[1:],  # not its own
                entries[:1] + entries[:1] + entries[2:],                                  # a key twice
                [["w", [name, size, 0, "float64", shape]]] + entries[1:],              # wrong dtype
                "not a list",
            ]
            for i, e in enumerate(bad):
                r = raw.request("push", seq=10 + i, meta={"clock": 0, "version": 0, "shm": e})
                assert r.op == "error" and ("shared-memory" in r.meta["error"] or "dtype" in r.meta["error"]), \
                    (i, r.meta)
            r = raw.request("push", seq=30, meta={"clock": 0, "version": 0, "shm": entries},
                            tensors={"w": np.zeros((64, 33), np.float32)})
            assert r.op == "error" and "also sent frames" in r.meta["error"]
            after = good.pull().result(30).params
            for n in SHAPES:
                np.testing.assert_array_equal(after[n], before[n])
            r = raw.request("push", seq=31, meta={"clock": 0, "version": 0, "shm": entries})
            assert r.op == "ok" and r.meta["status"] == "applied", r.meta  # the valid request still goes through
            link.close()
        finally:
            raw.close()
        assert not np.array_equal(good.pull().result(30).params["w"], before["w"])


@pytest.mark.exclusive               # every pslab-* segment on the machine: alone under pytest -n
def test_no_segment_outlives_client_and_shard(thread_servers):
    """Every /dev/shm segment the path created is gone once the client is closed and the shard stopped."""
    before = shm_path.segments()
    servers = thread_servers(2, num_workers=1)
    train(servers.addresses, shm=True, fused=True, steps=3)
    servers.stop()
    assert shm_path.segments() <= before, shm_path.segments() - before



def test_grad_buffers_push_without_a_copy_and_views_are_read_only(thread_servers, monkeypatch):
    """Gradients written into `grad_buffers()` are pushed with no copy into the segment (they are the segment);
    `pull(copy=False)` returns read-only views equal to what `pull()` copies; both train bitwise like frames."""
    writes = []
    real_write = shm_path.shm.Outbox.write
    monkeypatch.setattr(shm_path.shm.Outbox, "write", lambda self, off, t: writes.append(self) or real_write(self, off, t))
    servers = thread_servers(1, num_workers=1, optimizer="adam:lr=0.01")
    ref_servers = thread_servers(1, num_workers=1, optimizer="adam:lr=0.01")
    with connect(servers.addresses, 0, SHAPES) as c, connect(ref_servers.addresses, 0, SHAPES, shm=False) as ref:
        for x in (c, ref):
            x.init(tensors(0)).result(30)
            x.pull().result(30)
        bufs = c.grad_buffers()
        assert {k: v.shape for k, v in bufs.items()} == SHAPES and all(v.flags.writeable for v in bufs.values())
        for step in range(5):
            g = tensors(50 + step)
            for k in SHAPES:
                bufs[k][...] = g[k]
            writes.clear()
            _, views = c.push_pull(bufs, copy=False).result(30)
            assert c._links[0].outbox not in writes                # the push copied nothing
            ref.push(g).result(30)
            want = ref.pull().result(30).params
            for k in SHAPES:
                assert not views.params[k].flags.writeable
                np.testing.assert_array_equal(views.params[k], want[k])
        ordinary = {k: v.copy() for k, v in bufs.items()}
        writes.clear()
        c.push(ordinary).result(30)
        assert writes.count(c._links[0].outbox) == len(SHAPES)     # arrays elsewhere are copied in
        copied = c.pull().result(30).params
        assert all(v.flags.writeable for v in copied.values())


BIG = {"big": (400_000,), "b": (33,)}     # 1.6 MB: larger than a new segment, so the first push must grow it


def test_full_dev_shm_falls_back_to_frames(thread_servers, monkeypatch):
    """When /dev/shm cannot hold a segment (posix_fallocate fails: ENOSPC) neither side dies of SIGBUS: the push
    and the reply go as frames and training gives bitwise the frames result."""
    import errno
    import os
    rng = np.random.default_rng(0)
    init = {k: rng.standard_normal(s).astype(np.float32) for k, s in BIG.items()}
    grads = [{k: rng.standard_normal(s).astype(np.float32) for k, s in BIG.items()} for _ in range(3)]
    results = {}
    for full in (False, True):
        servers = thread_servers(1, num_workers=1, optimizer="adam:lr=0.01")
        with connect(servers.addresses, 0, BIG, shm=full) as c:
            assert c.shm == [full]
            c.init(init).result(30)
            if full:
                def no_space(fd, offset, length):
                    raise OSError(errno.ENOSPC, "No space left on device")
                monkeypatch.setattr(os, "posix_fallocate", no_space)
            for g in grads:
                c.push(g).result(30)
                results[full] = c.pull().result(30).params
            if full:
                assert c._links[0].push_ok is False          # the client stopped offering shm pushes
        monkeypatch.undo()
        servers.stop()
    for k in BIG:
        np.testing.assert_array_equal(results[True][k], results[False][k])


def test_resync_cancels_a_parked_read_and_the_path_keeps_working(thread_servers):
    """Under BSP a push_pull parked at the gate, then resync(): the parked read is answered with a clear error (not
    lost), and afterwards reads through shared memory work again."""
    from pslab.ps.errors import ProtocolError
    servers = thread_servers(1, num_workers=2, policy="bsp", optimizer="sgd:lr=0.1")
    with connect(servers.addresses, 0, SHAPES) as a, connect(servers.addresses, 1, SHAPES) as b:
        a.init(tensors(0)).result(30)
        a.pull().result(30)
        b.pull().result(30)
        parked = a.push_pull(tensors(1))                   # waits for worker 1's clock-0 push
        assert a.resync() == [1]
        with pytest.raises(ProtocolError, match="registered again"):
            parked.result(30)
        b.push(tensors(2)).result(30)
        r = a.pull().result(30)                            # clock 1 is complete now
        assert r.versions == [1] and a.shm == [True]


def test_reply_direction_is_proven_separately(thread_servers, monkeypatch):
    """If the client cannot read the token the shard wrote into its reply segment, pushes still go through shared
    memory and reads come back as frames -- no error, same weights."""
    real = shm_path.ServerLink.accept_probe.__func__

    def unreadable_reply(cls, shard, worker, meta):
        link = real(cls, shard, worker, meta)
        if link is not None:
            link.reply_probe = dict(link.reply_probe, shm_reply_token="0" * 32)   # a token the client won't see
        return link
    monkeypatch.setattr(shm_path.ServerLink, "accept_probe", classmethod(unreadable_reply))
    servers = thread_servers(1, num_workers=1)
    params, _ = train(servers.addresses, shm=True, fused=True, steps=5)
    with connect(servers.addresses, 0, SHAPES) as c:
        assert (c._links[0].push_ok, c._links[0].pull_ok) == (True, False)
    monkeypatch.undo()
    ref = thread_servers(1, num_workers=1)
    want, _ = train(ref.addresses, shm=False, fused=True, steps=5)
    for k in SHAPES:
        np.testing.assert_array_equal(params[k], want[k])


def test_closed_clients_leave_no_link_on_the_shard(thread_servers):
    """A client's close() unregisters it: after five connect/close cycles the shard holds no link or
    registration for them (their mappings would otherwise stay pinned until the shard exits)."""
    import time
    servers = thread_servers(1, num_workers=1)
    shard = servers.servers[0]
    for _ in range(5):
        with connect(servers.addresses, 0, SHAPES) as c:
            assert c.shm == [True]
    deadline = time.monotonic() + 5
    while (shard.links or shard.registered) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert shard.links == {} and shard.registered == {}
