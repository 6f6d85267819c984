"""Hostile messages at a live rank, one test per family of issue 10: each leaves every rank alive and every result
exact. The junk comes from rank 0's process over a socket of its own, authenticated as rank 0 (a member's
credential: what gets past the handshake and must then be validated), or over a socket without the credential
(a stranger: refused at the handshake, on tcp and on ipc). Ranks compute collectives with known results before and
after the victim (rank 1) has read and dropped all of it."""

from __future__ import annotations

import ipaddress
import os
import time
import uuid

import numpy as np
import pytest
import zmq

from pslab import collectives
from pslab.collectives.auth import new_job_secret, plain_client
from pslab.collectives.errors import LaunchError

from .hostile import drain, endpoints, listening, message, push_to, rss

N_SMALL = 1000       # float32: 4 KB, the one-step direct exchange
N_RING = 100_000     # 400 KB: the streamed ring (through shared memory)


def rounds(group) -> list[float]:
    """A direct all-reduce, a ring all-reduce and a broadcast from the last rank: (min, max) of each result."""
    n, r = group.world_size, group.rank
    small = np.full(N_SMALL, r + 1.0, np.float32)
    group.all_reduce(small)
    big = np.full(N_RING, r + 1.0, np.float32)
    group.all_reduce(big)
    b = np.full(10, float(r), np.float32)
    group.broadcast(b, src=n - 1)
    return [float(small.min()), float(small.max()), float(big.min()), float(big.max()), float(b.min())]


def expected(n: int) -> list[float]:
    s = n * (n + 1) / 2
    return [s, s, s, s, float(n - 1)]


def attack(group, send, drops: int, wait: tuple[int, ...] = ()) -> tuple:
    """Rank 0 runs `send()` (the junk, aimed at rank 1) and gives it 0.3 s to be queued there; ranks in `wait`
    start late, so rank 1 reads the junk while it waits for them. Rank 1 drains until `drops` were dropped."""
    if group.rank == 0:
        send()
        time.sleep(0.3)
    if group.rank in wait:
        time.sleep(0.6)
    first = rounds(group)
    if group.rank == 1:
        drain(group, drops)
    group.barrier()
    return first, rounds(group), group.tr.dropped


def check(res: list, n: int, drops: int) -> None:
    for r, (first, second, _) in enumerate(res):
        assert first == expected(n) and second == expected(n), (r, first, second)
    assert res[1][2] == drops, res[1][2]


# ---- keys ----------------------------------------------------------------------------------------------------------
def unhashable_key(group):
    def send():
        s = push_to(group, 1, user="rank:0")
        for key in (["w", [1], 0], ["w", 0, {"a": 1}], [["w"], 0, "d"], ["w", 0, [[]]], "w", []):
            s.send_multipart(message("all_reduce", key, src=0, n=N_SMALL))
        s.close()
    return attack(group, send, 6)


def test_unhashable_or_malformed_keys_are_dropped():
    """Keys holding a list or a map (unhashable), a key that is no list, an empty key: dropped and counted (used
    to kill the rank with TypeError: unhashable)."""
    check(collectives.launch(unhashable_key, 2, timeout=60, group_timeout=10), 2, 6)


# ---- tensor counts, sizes, dtypes ----------------------------------------------------------------------------------
def bad_tensors(group):
    def send():
        s = push_to(group, 1, user="rank:0")
        z = np.zeros(N_SMALL, np.float32)
        for ts in ([], [z, z], [np.zeros(1, np.float32)], [np.zeros(N_SMALL, np.float64)], [z[:-1]]):
            s.send_multipart(message("all_reduce", ["w", 0, "d"], src=0, tensors=ts, n=N_SMALL))
        s.close()
    return attack(group, send, 5)


def test_messages_without_the_one_tensor_of_the_right_size_and_dtype_are_dropped():
    """Under the key rank 1 waits for: no tensor (was StopIteration), two tensors, one element (torch broadcast it
    into the sum), float64 and one element short: dropped; the real contribution is used."""
    check(collectives.launch(bad_tensors, 2, timeout=60, group_timeout=10), 2, 5)


# ---- shared-memory descriptors -------------------------------------------------------------------------------------
def bad_segments(group, job):
    made = []

    def path(gen: int, dst: int = 1) -> str:
        p = f"/dev/shm/pslab-{job}-0-{dst}-{gen}"
        made.append(p)
        return p

    def send():
        open(path(1), "w").close()                                        # empty file
        os.mkdir(path(2))                                                  # a directory
        os.mkfifo(path(3))                                                 # a FIFO (open would block)
        with open(path(4), "wb") as f:                                     # smaller than announced
            f.write(bytes(100))
        os.symlink("/etc/hostname", path(5))                               # a link to elsewhere
        with open(path(6, dst=2), "wb") as f:                              # addressed to another rank
            f.write(bytes(4096))
        names = [os.path.basename(p) for p in made]
        descs = [[names[0], 0, 0, "float32", [0]], [names[1], 16, 0, "float32", [4]], [names[2], 16, 0, "float32", [4]],
                 [names[3], 4096, 0, "float32", [4]], [names[4], 4, 0, "uint8", [4]], [names[5], 4096, 0, "float32", [4]]]
        s = push_to(group, 1, user="rank:0")
        for d in descs:
            s.send_multipart(message("all_reduce", ["w", 0, "d"], src=0, tensors=[], n=N_SMALL, shm=d))
        s.close()
    return attack(group, send if group.rank == 0 else None, 6)


def test_shm_descriptors_naming_bad_files_are_dropped():
    """shm descriptors naming an empty file (was ValueError), a directory (was OSError), a FIFO, a file smaller
    than announced, a symlink, a segment addressed to another rank: each a WireError, dropped and counted."""
    job = uuid.uuid4().hex[:12]
    try:
        check(collectives.launch(bad_segments, 2, args=(job,), timeout=60, group_timeout=10), 2, 6)
    finally:
        for name in os.listdir("/dev/shm"):
            p = os.path.join("/dev/shm", name)
            if name.startswith(f"pslab-{job}-"):
                os.rmdir(p) if os.path.isdir(p) and not os.path.islink(p) else os.unlink(p)


# ---- spoofed sender ------------------------------------------------------------------------------------------------
def spoofed_op(group):
    def send():
        s = push_to(group, 1, user="rank:0")
        z = np.zeros(N_SMALL, np.float32)
        s.send_multipart(message("broadcast", ["w", 0, "d"], src=2, tensors=[z], n=N_SMALL))
        s.send_multipart(message("all_reduce", ["w", 0, "d"], src=2, tensors=[z[:5]], n=5))
        s.close()
    return attack(group, send, 2, wait=(2,))


def test_spoofed_op_at_the_current_sequence_is_dropped():
    """A message claiming to be rank 2's, with another op (or size) at the collective rank 1 is in, sent over a
    connection authenticated as rank 0: dropped (User-Id != src), no CollectiveMismatchError."""
    check(collectives.launch(spoofed_op, 3, timeout=60, group_timeout=10), 3, 2)


def forged_future(group):
    def send():
        s = push_to(group, 1, user="rank:0")
        poison = np.full(N_SMALL, 1000.0, np.float32)
        for seq in (0, 4):                 # the direct all-reduces of both rounds (the barrier between is #3)
            s.send_multipart(message("all_reduce", ["w", seq, "d"], src=2, tensors=[poison], n=N_SMALL))
        for seq in (2, 6):                 # the broadcasts from rank 2
            s.send_multipart(message("broadcast", ["w", seq, "d"], src=2, tensors=[poison[:10]], n=10))
        s.close()
    return attack(group, send, 4, wait=(2,))


def test_forged_src_under_future_keys_cannot_replace_a_contribution():
    """Messages claiming rank 2 as sender, filed early under the keys of the next collectives, used to replace
    rank 2's contribution (rank 1 summed 1000s); now dropped: every rank's sums and broadcasts are exact."""
    check(collectives.launch(forged_future, 3, timeout=60, group_timeout=10), 3, 4)


# ---- flooding ------------------------------------------------------------------------------------------------------
FLOOD = 48                 # messages of 4 MiB: 192 MiB


def flood(group):
    before = rss()

    def send():
        s = push_to(group, 1, via="ipc", user="rank:0")
        big = np.zeros(1 << 20, np.float32)
        for i in range(FLOOD):
            key, src = [(["w", 10 + i, "d"], 1), (["zz", i, "d"], 0), (["p2p", "zz", 0, i], 0)][i % 3]
            s.send_multipart(message("all_reduce", key, src=src, tensors=[big], n=big.size))
        s.close()
    first, second, dropped = attack(group, send, FLOOD)
    return first, second, dropped, rss() - before


def test_mailbox_flooding_by_bytes_is_not_held():
    """192 MiB of messages a member could never have sent (forged src, unknown groups): the victim holds none of
    it (resident memory grows < 96 MiB; it used to keep all of it) and computes exactly."""
    res = collectives.launch(flood, 2, timeout=90, group_timeout=20)
    assert res[1][3] < 96 << 20, f"rank 1 grew by {res[1][3] >> 20} MiB"
    check([r[:3] for r in res], 2, FLOOD)


def overflow(group):
    if group.rank == 1:
        time.sleep(0.5)           # rank 2's contribution reaches the root first and waits in its mailbox
    group.all_reduce(np.ones(1 << 16, np.float32), algorithm="root")
    return "finished"


def test_legitimate_traffic_over_the_budget_fails_loudly():
    """Early arrivals from real members beyond mailbox_bytes are never dropped: the rank raises
    MailboxOverflowError naming the budget to raise."""
    with pytest.raises(LaunchError, match=r"MailboxOverflowError: .*mailbox budget of 131072 bytes.*mailbox_bytes="):
        collectives.launch(overflow, 3, timeout=60, group_timeout=10, mailbox_bytes=128 << 10)


# ---- strangers -----------------------------------------------------------------------------------------------------
def stranger(group, via):
    def send():
        poison = np.full(N_SMALL, 1000.0, np.float32)
        socks = [push_to(group, 1, via=via)]                                      # no credential at all
        wrong = zmq.Context.instance().socket(zmq.PUSH)                           # another job's secret
        wrong.setsockopt(zmq.LINGER, 2000)
        plain_client(wrong, new_job_secret(), "rank:0")
        wrong.connect(endpoints(group, 1)[via])
        socks.append(wrong)
        for s in socks:
            for _ in range(3):
                try:
                    s.send_multipart(message("all_reduce", ["w", 0, "d"], src=0, tensors=[poison], n=N_SMALL),
                                     flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass                                   # no connection was admitted: nothing to queue on
            s.close()                                      # linger: whatever was queued may still go out
    return attack(group, send, 0)


@pytest.mark.parametrize("via", ["tcp", "ipc"])
def test_sockets_without_the_credential_are_refused(via):
    """A plain PUSH socket from outside the job (no credential, or another job's), over tcp and over ipc, sends a
    well-formed message under the key rank 1 waits for: refused at the handshake, nothing arrives (it used to be
    summed in)."""
    check(collectives.launch(stranger, 2, args=(via,), timeout=60, group_timeout=10), 2, 0)


# ---- listeners -----------------------------------------------------------------------------------------------------
def sockets_of_the_job(group, launcher_pid):
    import torch
    pids = torch.zeros(group.world_size, dtype=torch.int64)
    mine = torch.tensor([os.getpid()], dtype=torch.int64)
    group.all_gather(pids, mine)
    found = listening([*pids.tolist(), launcher_pid, os.getppid()])
    group.barrier()
    return found


@pytest.mark.parametrize("backend", ["zmq", "torch"])
def test_nothing_listens_beyond_loopback(backend):
    """During a 2-rank launch, every TCP listener of the launcher, the forkserver and the ranks (read from
    /proc/net/tcp and tcp6) is bound to a loopback address; the rendezvous store used to listen on every
    interface."""
    res = collectives.launch(sockets_of_the_job, 2, backend, args=(os.getpid(),), timeout=60)
    found = res[0]
    assert found, "no listener seen at all: the test would prove nothing"
    assert all(ipaddress.ip_address(addr).is_loopback for _, addr, _ in found), found
