"""The job's credential (auth.py), the signed address records, and the mailbox's rules (mailbox.py), in one process:
secrets from the environment or a 0600 file, PLAIN and CURVE connections that carry their role as User-Id, a
group refused without a secret, records not signed with the secret refused, byte budget and sequence window."""

from __future__ import annotations

import hashlib
import hmac
import shutil
import tempfile

import numpy as np
import pytest
import torch
import zmq

from pslab import collectives
from pslab.collectives import auth, wire
from pslab.collectives.errors import AuthError, MailboxOverflowError, RendezvousError, WireError
from pslab.collectives.mailbox import OVERHEAD, Mailbox, routing_key
from pslab.collectives.transport import Transport


@pytest.fixture
def no_secret(monkeypatch):
    monkeypatch.delenv(auth.ENV_SECRET, raising=False)
    monkeypatch.delenv(auth.ENV_SECRET_FILE, raising=False)


def test_secret_from_environment_or_a_private_file(no_secret, monkeypatch, tmp_path):
    """PSLAB_JOB_SECRET wins; else PSLAB_JOB_SECRET_FILE, which must be 0600; short secrets are refused."""
    assert auth.job_secret() is None
    s = auth.new_job_secret()
    assert len(s) == 64 and int(s, 16) >= 0 and s != auth.new_job_secret()
    f = tmp_path / "secret"
    f.write_text(s + "\n")
    f.chmod(0o600)
    monkeypatch.setenv(auth.ENV_SECRET_FILE, str(f))
    assert auth.job_secret() == s
    f.chmod(0o644)
    with pytest.raises(AuthError, match="mode 0600"):
        auth.job_secret()
    monkeypatch.setenv(auth.ENV_SECRET, "short")
    with pytest.raises(AuthError, match="at least 32"):
        auth.job_secret()
    monkeypatch.setenv(auth.ENV_SECRET, s)
    assert auth.job_secret() == s
    assert auth.credential(s, "rank:3") == hmac.new(s.encode(), b"rank:3", hashlib.sha256).hexdigest()


ARRIVES_S = 15.0         # how long an admitted client's message may take: the handshake and the ZAP thread's reply,
                         # on a loaded machine too (a wait ends when it arrives; 1.5 s failed once beside the hog)


def _pair(server_setup, client_setup, wait: float = ARRIVES_S):
    """A PULL socket (set up by `server_setup(ctx, sock)`) on tcp and ipc, and what a client set up by
    `client_setup(sock)` delivers to it: [(via, User-Id or None)]. `wait`: for a client expected to be admitted,
    the bound on its arrival; for one expected to be refused, how long nothing must arrive."""
    ctx = zmq.Context()
    d = tempfile.mkdtemp(prefix="pslab-test-")
    pull = ctx.socket(zmq.PULL)
    handle = server_setup(ctx, pull)
    eps = {"ipc": f"ipc://{d}/s", "tcp": None}
    pull.bind(eps["ipc"])
    eps["tcp"] = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
    got = []
    try:
        for via, ep in eps.items():
            push = ctx.socket(zmq.PUSH)
            try:
                push.setsockopt(zmq.LINGER, 0)
                push.setsockopt(zmq.SNDTIMEO, int(wait * 1000))   # bounded: a send never hangs the test
                client_setup(push)
                push.connect(ep)
                try:
                    push.send(b"hello")
                except zmq.Again:           # no pipe to queue on (a refused handshake dropped it): nothing sent
                    got.append((via, None))
                    continue
                if pull.poll(int(wait * 1000)):
                    got.append((via, pull.recv(copy=False).get("User-Id")))
                else:
                    got.append((via, None))
            finally:
                push.close()                # (an unclosed socket would block ctx.term() below)
    finally:
        pull.close(0)
        handle.stop()
        ctx.term()
        shutil.rmtree(d, ignore_errors=True)
    return got


def test_plain_connections_carry_their_role_and_strangers_get_nothing():
    """A client with the role's credential arrives with User-Id = the role, over tcp and ipc; no credential,
    another job's secret, an unknown role: nothing arrives."""
    s = auth.new_job_secret()
    server = lambda ctx, sock: auth.plain_server(ctx, sock, s, ["rank:0", "rank:1"])  # noqa: E731
    assert _pair(server, lambda c: auth.plain_client(c, s, "rank:1")) == [("ipc", "rank:1"), ("tcp", "rank:1")]
    for client in (lambda c: None, lambda c: auth.plain_client(c, auth.new_job_secret(), "rank:1"),
                   lambda c: auth.plain_client(c, s, "rank:7")):
        assert _pair(server, client, wait=0.3) == [("ipc", None), ("tcp", None)]


def test_curve_role_keys_carry_their_role():
    """CURVE with the cluster key pair as server identity and role keys derived from the secret: User-Id is the
    role; the cluster key itself, or another job's role key, is not admitted."""
    from pslab.collectives.curve import generate_keys, load_keys
    with tempfile.TemporaryDirectory() as d:
        generate_keys(d)
        keys = load_keys(d)
    s = auth.new_job_secret()
    server = lambda ctx, sock: auth.curve_server(ctx, sock, keys, s, ["rank:0", "rank:1"])  # noqa: E731
    assert _pair(server, lambda c: auth.curve_client(c, keys, s, "rank:0")) == [("ipc", "rank:0"), ("tcp", "rank:0")]
    from pslab.collectives.curve import connect_curve
    for client in (lambda c: connect_curve(c, keys),
                   lambda c: auth.curve_client(c, keys, auth.new_job_secret(), "rank:0")):
        assert _pair(server, client, wait=0.3) == [("ipc", None), ("tcp", None)]


def test_two_servers_share_one_context_handler():
    """Two PLAIN servers in one context (zmq.auth allows one ZAP handler per context) each admit their own users;
    the handler stops with the last one."""
    ctx = zmq.Context()
    s = auth.new_job_secret()
    a, b = ctx.socket(zmq.PULL), ctx.socket(zmq.PULL)
    ha = auth.plain_server(ctx, a, s, ["rank:0"])
    hb = auth.plain_server(ctx, b, s, ["worker:1"])
    pa, pb = a.bind_to_random_port("tcp://127.0.0.1"), b.bind_to_random_port("tcp://127.0.0.1")
    got = []
    for port, sock, user, wait_s in ((pa, a, "rank:0", ARRIVES_S), (pb, b, "worker:1", ARRIVES_S),
                                     (pa, a, "worker:1", 1.5)):
        c = ctx.socket(zmq.PUSH)
        c.setsockopt(zmq.LINGER, 0)
        auth.plain_client(c, s, user)
        c.connect(f"tcp://127.0.0.1:{port}")
        c.send(b"x", zmq.NOBLOCK)
        got.append(sock.recv(copy=False).get("User-Id") if sock.poll(int(wait_s * 1000)) else None)
        c.close()
    ha.stop()
    assert auth._SHARED.get(id(ctx)) is not None
    hb.stop()
    assert auth._SHARED.get(id(ctx)) is None
    a.close(0)
    b.close(0)
    ctx.term()
    assert got == ["rank:0", "worker:1", None]


def test_a_multi_rank_zmq_group_without_a_secret_is_refused(no_secret):
    """One line saying how to set PSLAB_JOB_SECRET; a 1-rank group needs none."""
    with pytest.raises(AuthError) as e:
        collectives.init_process_group("zmq", rank=0, world_size=2, store=torch.distributed.HashStore(), timeout=5)
    assert "PSLAB_JOB_SECRET=" in str(e.value) and "\n" not in str(e.value)
    g = collectives.init_process_group("zmq", rank=0, world_size=1, store=torch.distributed.HashStore())
    g.destroy()


def test_bind_host_must_be_one_address():
    """A second ZeroMQ endpoint or a list in bind_host is refused before anything binds."""
    for host in ("127.0.0.1;0.0.0.0", "127.0.0.1:1;0.0.0.0:5", "tcp://127.0.0.1", "127.0.0.1,10.0.0.1", " "):
        with pytest.raises(RendezvousError, match="one host address"):
            collectives.init_process_group("zmq", rank=0, world_size=1, store=torch.distributed.HashStore(),
                                           bind_host=host)


def test_address_records_not_signed_with_the_secret_are_refused():
    """A record written by a stranger (or a rank with another secret) is refused: the rank never connects, so it
    never hands its credential to whoever wrote it."""
    store, s = torch.distributed.HashStore(), auth.new_job_secret()
    tr = Transport(0, 3, store, secret=s, use_shm=False)
    other = Transport(1, 3, store, secret=auth.new_job_secret(), use_shm=False)
    store.set("addr/2", "somehost|tcp://127.0.0.1:9")
    try:
        for dst in (1, 2):
            with pytest.raises(AuthError, match="not signed with this job's secret"):
                tr.send(dst, "x", ["w", 0, "d"], [np.zeros(1)])
    finally:
        tr.close(0)
        other.close(0)


def _msg() -> wire.Message:
    return wire.Message("x")


def test_mailbox_rules():
    """Keys: short flat lists of ints/strings only. Window: stale -> WireError, too far ahead -> loud. Budget:
    loud, naming mailbox_bytes. Several messages under one key are kept in arrival order."""
    for k in (["w", [1]], ["w", {"a": 1}], "w", [], ["w"] * 7, ["w", True], ["w", 1.5], ["x" * 65], ["w", 1 << 63]):
        with pytest.raises(WireError):
            routing_key(k)
    assert routing_key(["w", 3, "d"]) == ("w", 3, "d")
    box = Mailbox(1, budget=4 * OVERHEAD, window=8)
    box.in_window("collective", 5, 5, 0, ("w", 5))
    with pytest.raises(WireError, match="stale"):
        box.in_window("collective", 4, 5, 0, ("w", 4))
    with pytest.raises(MailboxOverflowError, match="seq_window="):
        box.in_window("collective", 13, 5, 0, ("w", 13))
    with pytest.raises(WireError, match="names no group"):
        box.route(0, ("zz", 1), {"t": [], "meta": {}}, False)
    box.route(0, ("zz", 1), {"t": [], "meta": {}}, True)        # someone waits for it: fine
    first, second = _msg(), _msg()
    box.file(0, ("w", 5), first, {}, 0)
    box.file(0, ("w", 5), second, {}, 0)
    assert len(box) == 2 and box.bytes == 2 * OVERHEAD
    with pytest.raises(MailboxOverflowError, match="mailbox_bytes="):
        box.file(0, ("w", 6), _msg(), {}, 3 * OVERHEAD)
    assert box.take(0, ("w", 5))[0] is first and box.take(0, ("w", 5))[0] is second and box.take(0, ("w", 5)) is None
    box.file(0, ("w", 1), _msg(), {}, 10)
    assert box.purge(lambda src, k: k[1] < 2) == 1 and box.bytes == 0 and len(box) == 0
