"""Fuzz: thousands of malformed messages from raw pyzmq sockets against a shard server process. The server never
dies, the parameters stay bitwise unchanged, and a valid client is served throughout."""

from __future__ import annotations

import random

import msgpack
import numpy as np
import pytest

from collectives.wire import encode
from ps.client import connect
from ps.server import start_servers

from .rawsock import Raw

PARAMS = {"w": np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8), "b": np.arange(5, dtype=np.float32)}


def garbage(rng: random.Random) -> list[bytes]:
    """One malformed message (never a valid register)."""
    kind = rng.randrange(9)
    if kind == 0:
        return [rng.randbytes(rng.randrange(0, 200))]
    if kind == 1:
        return [rng.randbytes(rng.randrange(1, 60)) for _ in range(rng.randrange(1, 6))]
    header = {"v": 1, "op": rng.choice(["push", "pull", "init", "stats", "shutdown", "checkpoint", "nope", ""]),
              "seq": rng.randrange(1, 1 << 40), "src": 0, "meta": {"clock": 0, "version": 0},
              "t": [["w", "float32", [8, 8]], ["b", "float32", [5]]]}
    frames = [np.zeros(64, np.float32).tobytes(), np.zeros(5, np.float32).tobytes()]
    if kind == 2:      # corrupt one header field
        field = rng.choice(["v", "op", "seq", "src", "meta", "t"])
        header[field] = rng.choice([None, -1, "x" * 100, [1, 2], {"a": 1}, (1 << 64) - 1 if field != "t" else 3, 2.5])
    elif kind == 3:    # bad tensor descriptors
        header["t"] = rng.choice([[["w", "float33", [8, 8]]], [["w", "float32", [-1]]], [["w", "float32", [1 << 50]]],
                                  [[1, "float32", [8]]], [["w", "float32"]], [["w", "float32", [8, 8]]] * 5000])
    elif kind == 4:    # frame count / length mismatch
        frames = rng.choice([frames[:1], frames + [b"xx"], [frames[0][:-4], frames[1]]])
    elif kind == 5:    # bytes flipped in a valid header
        raw = bytearray(msgpack.packb(header))
        for _ in range(rng.randrange(1, 4)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        return [bytes(raw), *frames]
    elif kind == 6:    # truncated header
        raw = msgpack.packb(header)
        return [raw[: rng.randrange(len(raw))], *frames]
    elif kind == 7:    # well-formed but not allowed (unregistered connection)
        return [bytes(f) for f in encode(rng.choice(["push", "pull", "init", "shutdown", "checkpoint"]),
                                         {"w": np.ones((8, 8), np.float32), "b": np.ones(5, np.float32)},
                                         seq=rng.randrange(1, 1000), meta={"clock": 0, "version": 0, "worker": 0})]
    else:              # register with an impossible worker id or wrong types
        return [bytes(f) for f in encode("register", seq=rng.randrange(1, 1000),
                                         meta={"worker": rng.choice([-1, 2, 99, "0", None, 1.0])})]
    return [msgpack.packb(header), *frames]


def bad_push(rng: random.Random, seq: int) -> list:
    """A push from a registered connection that must be refused: wrong keys, shapes, dtypes, clock or version."""
    t = {"w": np.full((8, 8), 1e6, np.float32), "b": np.full(5, 1e6, np.float32)}
    meta = {"clock": 0, "version": 0}
    kind = rng.randrange(6)
    if kind == 0:
        t["extra"] = np.ones(2, np.float32)
    elif kind == 1:
        del t["b"]
    elif kind == 2:
        t["w"] = np.ones((8, 7), np.float32)
    elif kind == 3:
        t["b"] = np.ones(5, np.float64)
    elif kind == 4:
        meta["clock"] = rng.choice([1, 5, -1, "0"])
    else:
        meta["version"] = rng.choice([1, 100, -5, None])
    return encode("push", t, seq=seq, meta=meta)


@pytest.mark.timeout(120)
def test_fuzz_server_survives_and_params_unchanged():
    rng = random.Random(1234)
    with start_servers(1, num_workers=2, policy="asp", optimizer="sgd:lr=1", idle_timeout=60) as servers:
        addr = servers.addresses[0]
        client = connect([addr], 0, PARAMS, timeout=20)
        client.init(PARAMS).result(20)
        unregistered = Raw(addr)
        registered = Raw(addr)
        assert registered.request("register", seq=1, meta={"worker": 1}).op == "ok"
        seq = 2
        sent = 0
        for i in range(3000):
            if i % 3 == 2:
                registered.send_frames(bad_push(rng, seq))
                seq += 1
            else:
                unregistered.send_frames(garbage(rng))
            sent += 1
            if i % 250 == 0:          # the valid client is served throughout, and sees unchanged weights
                r = client.pull().result(20)
                assert r.versions == [0]
                for k, v in PARAMS.items():
                    np.testing.assert_array_equal(r.params[k], v)
                unregistered.drain()
                registered.drain()
        for raw in (unregistered, registered):    # per-connection order: after this reply all its messages are in
            raw.send_frames(encode("ping", seq=1 << 50))
            while (m := raw.recv()).seq != 1 << 50:
                pass
            assert m.op == "ok"
        r = client.pull().result(20)
        for k, v in PARAMS.items():
            np.testing.assert_array_equal(r.params[k], v)
        stats = client.stats().result(20)[0]
        assert stats["version"] == 0 and stats["clocks"] == [0, 0]
        c = stats["counters"]
        assert c["messages"] >= sent                 # every message reached the loop (no disconnect, no crash)
        assert c["errors"] >= sent * 0.9             # almost all are refused (a few mutations are valid 'stats')
        assert c["internal_errors"] == 0             # each was caught by validation, not by the catch-all
        assert servers.alive(0)
        # a correct push still works after the storm
        ack = client.push({"w": np.ones((8, 8), np.float32), "b": np.ones(5, np.float32)}).result(20)
        assert ack[0]["version"] == 1
        unregistered.close()
        registered.close()
        client.close()
