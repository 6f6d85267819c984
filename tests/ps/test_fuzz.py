"""Fuzz: 12,000 hostile messages from authenticated raw pyzmq sockets against a shard server process -- random
frames, and one-field mutations of valid messages (every op, every header field, every meta field, descriptors,
tensor frames, shared-memory descriptors, compressed-push fields). The server never dies, the parameters stay bitwise unchanged, and the
job's own client is served correctly throughout."""

from __future__ import annotations

import copy
import random
import time

import msgpack
import numpy as np
import pytest

from pslab.collectives.wire import encode
from pslab.ps.client import connect
from pslab.ps.processes import start_servers

from .rawsock import Raw

PARAMS = {"w": np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8), "b": np.arange(5, dtype=np.float32)}
MESSAGES = 12_000
ODD = [None, -1, 0, 1, 2, 3, 7, 1 << 40, (1 << 63) - 1, -(1 << 63), 2.5, float("nan"), True, "", "x" * 300, "0",
       [1, 2], [[1]], {"a": 1}, {1: 2}, b"\x00\xff"]


def valid(rng: random.Random, seq: int) -> tuple[dict, list[bytes]]:
    """A well-formed request worker 1 could send now (header as a dict, tensor frames); a push would be applied."""
    grads = [np.full(64, 1e6, np.float32).tobytes(), np.full(5, 1e6, np.float32).tobytes()]
    t = [["w", "float32", [64]], ["b", "float32", [5]]]
    op = rng.choice(["register", "pull", "push", "push_pull", "push", "init", "stats", "ping", "checkpoint",
                     "shutdown", "unregister"])
    meta = {"register": {"worker": 1, "token": "ab" * 16, "shm_probe": ["pslab-0123456789ab-1-0-1", 1 << 20, 0,
                                                                        "uint8", [16]], "shm_token": "0" * 32},
            "pull": {"clock": 0, "shm_reply": True}, "push": {"clock": 0, "version": 0},
            "push_pull": {"clock": 0, "version": 0, "pull": True, "shm_reply": True},
            "init": {"worker": 1}, "stats": {"series": True}}.get(op, {})
    header = {"v": 1, "op": "push" if op == "push_pull" else op, "seq": seq, "src": 1, "meta": meta,
              "t": t if op in ("push", "push_pull", "init") else []}
    return header, grads if header["t"] else []


def mutate(rng: random.Random, header: dict, frames: list[bytes]) -> list[bytes]:
    """One field of a valid message changed: anything for requests that change no parameters (worker 1 may never
    init, so init too); for a push, one change of those that make it invalid, so a correct shard refuses it."""
    h, fr = copy.deepcopy(header), list(frames)
    if h["op"] == "push":
        _break_push(rng, h, fr)
    else:
        kind = rng.randrange(5)
        if kind == 0:                               # a header field
            field = rng.choice(["v", "op", "seq", "src", "meta", "t"])
            h[field] = rng.choice([v for v in ODD if field != "seq" or not (isinstance(v, int) and v > 1 << 30)])
        elif kind == 1 and h["meta"]:               # a meta field: another value, or removed
            key = rng.choice(list(h["meta"]))
            if rng.random() < 0.3:
                del h["meta"][key]
            else:
                h["meta"][key] = rng.choice(ODD)
        elif kind == 2:                             # a meta field that does not belong there
            h["meta"][rng.choice(["shm", "pull", "clock", "version", "worker", "series", "zz"])] = rng.choice(ODD)
            if rng.random() < 0.3:                  # ... or a compressed push (ps.compression) whose frames are not
                h["meta"]["compress"] = rng.choice(ODD + ["topk", "sign"])     # what it says
                h["meta"]["keys"] = rng.choice(ODD + [["w", "b"], ["b", "w"], ["w"], ["w", "w", "b"]])
        elif kind == 3 and h["t"]:                  # a descriptor field
            d = h["t"][rng.randrange(len(h["t"]))]
            d[rng.randrange(3)] = rng.choice(ODD + ["float64", "int8", [8, 8], [1 << 47], [-1]])
        else:                                       # frame count
            fr = rng.choice([fr[:-1], fr + [b"x"], fr + fr])
    try:
        raw = msgpack.packb(h)
    except (TypeError, ValueError, OverflowError):
        raw = msgpack.packb({k: v for k, v in h.items() if k != "meta"})
    return [raw, *fr]


def _break_push(rng: random.Random, h: dict, fr: list[bytes]) -> None:
    """Change one field of worker 1's valid clock-0 push so that it must be refused."""
    kind = rng.randrange(11)
    if kind == 0:
        h["v"] = rng.choice([v for v in ODD if v != 1])       # (True == 1: the wire reads it as version 1)
    elif kind == 1:
        h["op"] = rng.choice([v for v in ODD if isinstance(v, str)] + ["pull", "register", "init", "shutdown",
                                                                       "checkpoint", "nope"])
    elif kind == 2:                                  # a request id already used (1: the register), or not an int
        h["seq"] = rng.choice([1, -1, 0, None, 2.5, "7"])
    elif kind == 3:                                  # claims to be another worker
        h["src"] = rng.choice([v for v in ODD if v != 1 or isinstance(v, bool)])
    elif kind == 4:
        h["meta"] = rng.choice([None, [], "x", 3, {}, {"clock": 0}, {"version": 0}])
    elif kind == 5:
        h["meta"]["clock"] = rng.choice([v for v in ODD if v != 0 or isinstance(v, bool)])
    elif kind == 6:
        h["meta"]["version"] = rng.choice([v for v in ODD if v != 0 or isinstance(v, bool)])
    elif kind == 7:                                  # a descriptor: name, dtype or shape
        d = h["t"][rng.randrange(2)]
        i = rng.randrange(3)
        d[i] = rng.choice([["x", "", None, 3, "b" if d[0] == "w" else "w"],
                           ["float64", "int8", "float16", "float33", None], [[8, 8], [63], [65], [-1], [], None]][i])
    elif kind == 8:                                  # a tensor frame: truncated, longer, or holding NaN / Inf
        i = rng.randrange(2)
        bad = np.frombuffer(fr[i], np.float32).copy()
        bad[rng.randrange(bad.size)] = rng.choice([np.nan, np.inf, -np.inf])
        fr[i] = rng.choice([fr[i][:-4], fr[i] + b"\0\0\0\0", bad.tobytes()])
    elif kind == 9:                                  # frame count
        if rng.random() < 0.5:
            del fr[rng.randrange(len(fr))]
        else:
            fr.append(b"x" * 20)
    else:                                            # shared-memory descriptors it never negotiated
        h["meta"]["shm"] = rng.choice([[["w", ["pslab-0123456789ab-1-0-1", 256, 0, "float32", [64]]]],
                                       [["w", ["/etc/passwd", 10, 0, "uint8", [10]]]], "x", [[1, 2, 3]]])


def garbage(rng: random.Random) -> list[bytes]:
    kind = rng.randrange(4)
    if kind == 0:
        return [rng.randbytes(rng.randrange(0, 200))]
    if kind == 1:
        return [rng.randbytes(rng.randrange(1, 60)) for _ in range(rng.randrange(1, 6))]
    if kind == 2:
        return [msgpack.packb(rng.choice(ODD))]
    raw = bytearray(msgpack.packb(valid(rng, 5)[0]))
    for _ in range(rng.randrange(1, 4)):
        raw[rng.randrange(len(raw))] = rng.randrange(256)
    return [bytes(raw)]


@pytest.mark.timeout(60)
def test_fuzz_server_survives_and_params_unchanged():
    rng = random.Random(1234)
    t0 = time.monotonic()
    with start_servers(1, num_workers=2, policy="asp", optimizer="sgd:lr=1", idle_timeout=60,
                       start_method="fork") as servers:
        addr = servers.addresses[0]
        client = connect([addr], 0, PARAMS, timeout=20)
        client.init(PARAMS).result(20)
        stranger = Raw(addr, user="worker:1")        # authenticated, never registered
        member = Raw(addr, user="worker:1")          # registered as worker 1
        assert member.request("register", seq=1, meta={"worker": 1}).op == "ok"
        seq = 2
        for i in range(MESSAGES):
            if i % 4 == 0:
                stranger.send_frames(garbage(rng))
            else:
                header, frames = valid(rng, seq)
                (member if i % 4 != 1 else stranger).send_frames(mutate(rng, header, frames))
                seq += 1
            if i % 500 == 0:          # the job's client is served throughout, and sees unchanged weights
                r = client.pull().result(20)
                assert r.versions == [0]
                for k, v in PARAMS.items():
                    np.testing.assert_array_equal(r.params[k], v)
                stranger.drain()
                member.drain()
            if i % 20 == 0:           # a (mutated) unregister may have dropped member's registration
                member.send_frames(encode("register", seq=seq, src=1, meta={"worker": 1}))
                seq += 1
        for raw in (stranger, member):    # per-connection order: after this reply all its messages are in
            raw.send_frames(encode("ping", seq=1 << 50, src=1))
            while (m := raw.recv()).seq != 1 << 50:
                pass
            assert m.op == "ok", m.meta
        r = client.pull().result(20)
        for k, v in PARAMS.items():
            np.testing.assert_array_equal(r.params[k], v)
        stats = client.stats().result(20)[0]
        assert stats["version"] == 0 and stats["clocks"] == [0, 0]
        c = stats["counters"]
        assert c["messages"] >= MESSAGES                 # every message reached the loop (no disconnect, no crash)
        assert c["errors"] >= MESSAGES * 0.6             # most are refused (mutated pulls/stats may be valid)
        assert c["internal_errors"] == 0                 # each was caught by validation, not by the catch-all
        assert c["nonfinite_refused"] > 0 and c["refused"] > 0 and c["malformed"] > 0
        assert servers.alive(0)
        member.request("register", seq=(1 << 50) + 1, meta={"worker": 1})
        header, frames = valid(random.Random(0), (1 << 50) + 2)
        while header["op"] != "push" or "pull" in header["meta"]:
            header, frames = valid(rng, (1 << 50) + 2)
        member.send_frames([msgpack.packb(header), *frames])      # the unmutated message: valid, applied
        assert member.recv().meta["version"] == 1
        ack = client.push({"w": np.ones((8, 8), np.float32), "b": np.ones(5, np.float32)}).result(20)
        assert ack[0]["version"] == 2 and ack[0]["clock"] == 1     # worker 0's clock was never touched
        stranger.close()
        member.close()
        client.close()
    assert time.monotonic() - t0 < 30
