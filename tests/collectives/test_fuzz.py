"""Fuzzing a live rank: 12,000 messages (random frames, random msgpack, and one-field mutations of valid messages of
every kind: direct-exchange, ring segment, p2p, shared-memory payload) from a socket authenticated as rank 0, plus
some over sockets without the credential (tcp and ipc). The victim neither crashes nor hangs; every message that
reached it is accounted for (dropped and counted, or filed as a p2p message nobody waits for, which a member may
legitimately send); the next collectives are exact.

Integers put into fields are boundary values (negative, 0 = stale after the warm-up, >= 2^63): a positive
sequence number inside the window under the fuzzer's own authenticated rank would be that rank's legitimate
traffic, which the victim rightly files or treats as a collective of that rank."""

from __future__ import annotations

import copy
import os
import random
import time
import uuid

import msgpack
import numpy as np
import torch
import zmq

from pslab import collectives
from pslab.collectives import wire

from .hostile import drain, push_to
from .test_hostile import expected, rounds

N_FUZZ = 12_000
HOSTILE = [None, True, False, -1, 0, -(1 << 63), 1 << 63, (1 << 64) - 1, 1.5, float("nan"), "", "x" * 300, "w", "p2p",
           "d", "ack", b"\0" * 8, [], [1], [[1]], [None] * 7, {}, {"k": 1}, ["w", [0]], {"t": []}]
PATHS = [("v",), ("op",), ("seq",), ("src",), ("meta",), ("t",), ("meta", "k"), ("meta", "n"), ("meta", "shm"),
         ("meta", "k", 0), ("meta", "k", 1), ("meta", "k", 2), ("meta", "k", 3), ("t", 0), ("t", 0, 0), ("t", 0, 1),
         ("t", 0, 2), ("t", 0, 2, 0), ("meta", "shm", 0), ("meta", "shm", 1), ("meta", "shm", 2), ("meta", "shm", 3),
         ("meta", "shm", 4), ("meta", "shm", 4, 0)]


def bases(job: str) -> list[list]:
    z = np.zeros(4, np.float32)
    shm = [f"pslab-{job}-0-1-1", 4096, 0, "float32", [4]]
    return [wire.encode("all_reduce", [z], seq=0, src=0, meta={"k": ["w", 0, "d"], "n": 4}),
            wire.encode("all_reduce", [z], seq=0, src=0, meta={"k": ["w", 0, 0, 0], "n": 8}),
            wire.encode("p2p", [z], src=0, meta={"k": ["p2p", "w", 0, 0]}),
            wire.encode("all_reduce", [], seq=0, src=0, meta={"k": ["w", 0, 0, 0], "n": 4, "shm": shm}),
            wire.encode("p2p", [], src=0, meta={"k": ["p2p", "w", -7, 0], "shm": shm})]


def _set(h: dict, path: tuple, value: object) -> bool:
    node = h
    for p in path[:-1]:
        try:
            node = node[p]
        except (KeyError, IndexError, TypeError):
            return False
    try:
        if isinstance(node, list) and not -len(node) <= path[-1] < len(node):
            return False
        node[path[-1]] = value
    except (TypeError, IndexError):
        return False
    return True


def mutate(rng: random.Random, base: list) -> list:
    """One random change to a valid message: a header field, a frame, or the header bytes."""
    frames = [bytes(f) for f in base]
    kind = rng.random()
    if kind < 0.6:
        h = msgpack.unpackb(frames[0])
        if rng.random() < 0.1:
            h.pop(rng.choice(list(h)), None) if rng.random() < 0.5 else h.update({"zz": rng.choice(HOSTILE)})
        elif not _set(h, rng.choice(PATHS), copy.deepcopy(rng.choice(HOSTILE))):
            h["seq"] = -1
        try:
            frames[0] = msgpack.packb(h, use_bin_type=True)
        except (OverflowError, TypeError, ValueError):
            frames[0] = frames[0][:-1]
    elif kind < 0.85:
        i = rng.randrange(len(frames))
        frames[i] = rng.choice([b"", frames[i][:-1], frames[i] + b"\0", os.urandom(len(frames[i]))])
        if rng.random() < 0.3:
            frames.append(frames[-1]) if rng.random() < 0.5 else frames.pop()
    else:
        raw = bytearray(frames[0])
        raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        frames[0] = bytes(raw)
    return frames or [b""]


def random_message(rng: random.Random) -> list:
    if rng.random() < 0.5:
        return [os.urandom(rng.randrange(0, 64)) for _ in range(rng.randrange(1, 4))]
    obj = {"v": 1, "op": rng.choice(["all_reduce", "p2p", "x"]), "seq": rng.choice(HOSTILE), "src": 0,
           "meta": {"k": [rng.choice(HOSTILE) for _ in range(rng.randrange(0, 5))], "n": rng.choice(HOSTILE)},
           "t": [[rng.choice(["0", 1]), rng.choice(["float32", "int8", "q"]), [rng.choice([0, 1, 4, -1])]]]}
    try:
        return [msgpack.packb(obj, use_bin_type=True), os.urandom(rng.choice([0, 4, 16]))]
    except (OverflowError, TypeError, ValueError):
        return [os.urandom(8)]


def in_window(frames: list) -> bool:
    """Whether a message names a positive sequence number or step in its key (a bit flip can make one): it could
    be rank 0's legitimate traffic, so the fuzzer does not send it (see the module docstring)."""
    try:
        h = msgpack.unpackb(frames[0], strict_map_key=False)
        k = h["meta"]["k"]
        return any(isinstance(x, int) and 0 < x < 1 << 40 for x in k)
    except Exception:
        return False


def fuzz(group, n: int, seed: int, job: str):
    r = group.rank
    warm = rounds(group)                                         # collectives #0..#2: 0 is a stale seq from now on
    p = np.zeros(3, np.float32)
    if r == 0:
        group.send(np.ones(3, np.float32), 1, tag=0)             # p2p tag 0, count 0: stale from now on
    else:
        group.recv(p, 0, tag=0)
    group.barrier()                                              # ... at rank 1 too, before the fuzz starts
    seg = f"/dev/shm/pslab-{job}-0-1-1"
    sent = torch.zeros(1, dtype=torch.int64)
    t0 = time.monotonic()
    if r == 0:
        with open(seg, "wb") as f:                               # a real segment, for the unmutated shm bases
            f.write(bytes(4096))
        rng = random.Random(seed)
        member = push_to(group, 1, user="rank:0")
        strangers = [push_to(group, 1, via="tcp"), push_to(group, 1, via="ipc")]
        kinds = bases(job)
        for i in range(n):
            frames = random_message(rng) if rng.random() < 0.2 else mutate(rng, rng.choice(kinds))
            while in_window(frames):
                frames = mutate(rng, rng.choice(kinds))
            if i % 20 == 19:
                try:
                    rng.choice(strangers).send_multipart(frames, flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass
                continue
            member.send_multipart(frames)
            sent += 1
        for s in (member, *strangers):
            s.close()
    group.broadcast(sent, src=0)
    accounted = 0
    if r == 1:
        box = group.tr.mailbox

        def filed() -> int:                                      # p2p messages only a fuzzer sent (see docstring)
            return sum(len(q) for (_, k), q in box.items.items() if k[0] == "p2p")
        deadline = time.monotonic() + 20
        while group.tr.dropped + filed() < int(sent) and time.monotonic() < deadline:
            drain(group, int(sent) - filed(), seconds=0.5)
        accounted = group.tr.dropped + filed()
    group.barrier()
    return warm, rounds(group), rounds(group), int(sent), accounted, time.monotonic() - t0


def test_fuzzed_rank_survives_and_stays_exact():
    """>= 10,000 fuzzed messages at rank 1: no crash, all accounted for, the collectives after them exact, < 30 s."""
    t0 = time.monotonic()
    job = uuid.uuid4().hex[:12]
    try:
        res = collectives.launch(fuzz, 2, args=(N_FUZZ, 10, job), timeout=90, group_timeout=30)
    finally:
        for name in os.listdir("/dev/shm"):
            if name.startswith(f"pslab-{job}-"):
                os.unlink(os.path.join("/dev/shm", name))
    for r, (warm, a, b, _, _, _) in enumerate(res):
        assert warm == a == b == expected(2), (r, warm, a, b)
    sent, accounted = res[1][3], res[1][4]
    assert sent >= 10_000 and accounted == sent, (sent, accounted)
    assert time.monotonic() - t0 < 30
