"""The local launcher and rendezvous: results in rank order, the first failure comes back with its traceback and
ends the other ranks, timeouts kill everything, torchrun-style environment variables work unchanged, and CURVE
keys encrypt + authenticate the zmq backend."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np
import pytest
import torch

from pslab import collectives
from pslab.collectives.errors import LaunchError, RendezvousError


def rank_and_threads(group):
    return group.rank, group.world_size, torch.get_num_threads()


def test_results_in_rank_order_and_one_thread():
    """launch returns one result per rank, in order, and every rank runs with torch.set_num_threads(1)."""
    assert collectives.launch(rank_and_threads, 3, timeout=30) == [(0, 3, 1), (1, 3, 1), (2, 3, 1)]


def fail_on_rank_1(group):
    if group.rank == 1:
        raise ValueError("boom from rank one")
    time.sleep(30)  # the others would hang around: the launcher must kill them


def test_first_exception_propagates_with_traceback_and_kills_others():
    """A ValueError on rank 1 becomes LaunchError naming rank 1, with its traceback, well before the sleepers end."""
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as e:
        collectives.launch(fail_on_rank_1, 3, timeout=60)
    assert "rank 1 failed: ValueError: boom from rank one" in str(e.value)
    assert "fail_on_rank_1" in str(e.value)  # the remote traceback
    assert time.monotonic() - t0 < 20


def sleep_forever(group):
    time.sleep(60)


def test_launch_timeout_kills_all():
    """A launch that outlives its timeout raises LaunchError listing the unfinished ranks, with each hung rank's
    Python stack (faulthandler) showing where it was."""
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"timed out after 2s; ranks \[0, 1\]") as e:
        collectives.launch(sleep_forever, 2, timeout=2)
    assert time.monotonic() - t0 < 10
    msg = str(e.value)
    assert msg.count("in sleep_forever") == 2 and "--- stacks of rank 1 ---" in msg, msg


SCRIPT = textwrap.dedent("""
    import os, sys, numpy as np, torch
    torch.set_num_threads(1)
    from pslab import collectives
    from tests.collectives.hostile import listening
    g = collectives.init_process_group(backend=sys.argv[1], timeout=20)
    t = np.array([g.rank + 1.0])
    g.all_reduce(t)
    print("RESULT", g.rank, g.world_size, t[0], flush=True)
    print("LISTEN", *sorted({addr for _, addr, _ in listening([os.getpid()])}), flush=True)
    g.barrier()
    g.destroy()
""")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(tmp_path, backend: str, secrets: list[str | None]) -> list[tuple[str, str]]:
    """Run SCRIPT as two processes with torchrun's variables (and PSLAB_JOB_SECRET each, where given)."""
    script = tmp_path / "w.py"
    script.write_text(SCRIPT)
    port = free_port()
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   PYTHONPATH=ROOT)
        env.pop("PSLAB_JOB_SECRET", None)
        env.pop("PSLAB_JOB_SECRET_FILE", None)
        if secrets[r] is not None:
            env["PSLAB_JOB_SECRET"] = secrets[r]
        procs.append(subprocess.Popen([sys.executable, str(script), backend], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        return [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()


@pytest.mark.parametrize("backend", ["zmq", "torch"])
def test_torchrun_environment(tmp_path, backend):
    """Processes started with only RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set (as torchrun does), plus the job's
    PSLAB_JOB_SECRET, form a group; rank 0's store and the zmq sockets listen on 127.0.0.1 only."""
    import ipaddress
    from pslab.collectives.auth import new_job_secret
    secret = new_job_secret()
    outs = torchrun(tmp_path, backend, [secret, secret])
    lines = sorted(line for out, _ in outs for line in out.splitlines() if line.startswith("RESULT"))
    assert lines == ["RESULT 0 2 3.0", "RESULT 1 2 3.0"], outs
    listen = [line.split()[1:] for out, _ in outs for line in out.splitlines() if line.startswith("LISTEN")]
    assert len(listen) == 2 and listen[0], outs
    if backend == "zmq":      # (gloo picks its interface from the host name: not ours to check)
        assert all(ipaddress.ip_address(a).is_loopback for addrs in listen for a in addrs), listen


def test_torchrun_without_a_secret_or_with_different_ones_is_refused(tmp_path):
    """No PSLAB_JOB_SECRET: each rank stops with one line saying how to set it. Different secrets: a rank refuses
    the other's address record (not signed with its secret)."""
    from pslab.collectives.auth import new_job_secret
    for out, err in torchrun(tmp_path, "zmq", [None, None]):
        last = err.strip().splitlines()[-1]
        assert "AuthError" in last and "PSLAB_JOB_SECRET=" in last and "RESULT" not in out, err
    errs = [err for _, err in torchrun(tmp_path, "zmq", [new_job_secret(), new_job_secret()])]
    assert any("is not signed with this job's secret" in e for e in errs), errs


def test_missing_environment_is_a_clear_error(monkeypatch):
    """Without rank information init_process_group says which variables to set."""
    for v in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(v, raising=False)
    with pytest.raises(RendezvousError, match="set RANK and WORLD_SIZE"):
        collectives.init_process_group("zmq")


def curve_sum(group):
    t = np.array([group.rank + 1.0])
    group.all_reduce(t)
    return float(t[0]), group.tr.pull.curve_server


def test_curve_encrypted_group(tmp_path):
    """With CURVE keys every socket is a CURVE server/client and the group still computes correctly."""
    from pslab.collectives.curve import generate_keys
    generate_keys(str(tmp_path))
    res = collectives.launch(curve_sum, 2, timeout=30, curve_keys_dir=str(tmp_path))
    assert res == [(3.0, True), (3.0, True)]


def test_non_loopback_bind_requires_curve(monkeypatch):
    """Binding beyond 127.0.0.1 without CURVE keys is refused with a message saying how to enable them."""
    store = torch.distributed.HashStore()
    with pytest.raises(RendezvousError, match="curve_keys_dir"):
        collectives.init_process_group("zmq", rank=0, world_size=1, store=store, bind_host="0.0.0.0")


def curve_rejects_strangers(group, member=False):
    """Rank 0 tries to inject a well-formed message into rank 1 over a socket without the keys (with `member`:
    a PLAIN socket with rank 0's credential)."""
    from pslab.collectives import wire
    from pslab.collectives.errors import PeerTimeoutError
    from .hostile import push_to
    import zmq
    if group.rank == 0:
        s = push_to(group, 1, user="rank:0" if member else None)
        try:
            s.send_multipart(wire.encode("evil", [np.zeros(1)], src=0, meta={"k": ["p2p", "w", 99, 0]}))
        except zmq.Again:       # the refused handshake tore the pipe down first: not even queued (also a refusal)
            pass
        s.close()
    group.barrier()
    got = None
    if group.rank == 1:
        group.tr.timeout = 1.0
        try:
            got = group.tr.recv(0, ("p2p", "w", 99, 0), "evil").op
        except PeerTimeoutError:
            got = "nothing arrived"
    group.tr.timeout = 30
    group.barrier()
    return got


def test_curve_rejects_unauthenticated_sockets(tmp_path):
    """A socket without the CURVE keys cannot deliver anything, even a well-formed message."""
    from pslab.collectives.curve import generate_keys
    generate_keys(str(tmp_path))
    res = collectives.launch(curve_rejects_strangers, 2, timeout=30, curve_keys_dir=str(tmp_path))
    assert res[1] == "nothing arrived"


def test_curve_binds_each_connection_to_its_rank(tmp_path):
    """With CURVE keys and the job's secret (the launcher always has one), each rank's client key pair is derived
    from the secret, so every message's User-Id is its sender's role: a group computes, and rank 1 saw rank 0 as
    "rank:0"."""
    from pslab.collectives.curve import generate_keys
    generate_keys(str(tmp_path))
    res = collectives.launch(curve_user_ids, 2, timeout=30, curve_keys_dir=str(tmp_path))
    assert res == [(3.0, True), (3.0, True)]


def curve_user_ids(group):
    t = np.array([group.rank + 1.0])
    group.all_reduce(t)
    return float(t[0]), group.tr.authenticated


def test_without_the_credential_the_same_injection_is_refused_and_with_it_arrives():
    """Without CURVE (PLAIN, the default) a stranger's message is refused as well; the same message over a socket
    with rank 0's credential is delivered (so the test above can fail)."""
    assert collectives.launch(curve_rejects_strangers, 2, timeout=30)[1] == "nothing arrived"
    assert collectives.launch(curve_rejects_strangers, 2, args=(True,), timeout=30)[1] == "evil"


def tensor_result(group):
    return {"t": torch.full((1000,), float(group.rank)), "n": np.arange(3)}


def test_torch_tensors_come_back_as_results():
    """Results holding torch tensors (shared-storage pickling) arrive intact: ranks outlive the hand-over."""
    res = collectives.launch(tensor_result, 3, timeout=30)
    assert [float(r["t"].sum()) for r in res] == [0.0, 1000.0, 2000.0]


def store_sum(group):
    import numpy as np
    t = np.array([float(group.rank)])
    group.all_reduce(t)
    return float(t[0])


@pytest.mark.parametrize("backend", ["zmq", "torch"])
def test_fork_launches_in_a_row_all_finish(backend):
    """start_method="fork" copies the caller: the ranks are forked before the launcher's TCPStore server thread
    exists (a rank forked while that thread held a torch lock used to block forever in its own TCPStore). Ten
    launches of 4 forked ranks in a row each finish, with the right sum."""
    t0 = time.monotonic()
    for _ in range(10):
        assert collectives.launch(store_sum, 4, backend=backend, timeout=30, start_method="fork") == [6.0] * 4
    assert time.monotonic() - t0 < 120


def _endpoints_and_sum(group):
    t = torch.ones(3)
    group.all_reduce(t)
    return [e.split(":")[0] for e in group.tr.endpoints], float(t[0])


def test_a_long_temp_dir_falls_back_to_tcp_loopback(tmp_path, monkeypatch):
    """A socket path is at most ~107 bytes: under a long TMPDIR the ranks bind tcp loopback only (no ipc socket,
    no failing bind) and the group works. The length is picked so that multiprocessing's own forkserver socket
    (TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX) still fits but a rank's (TMPDIR/pslab-job-XXXXXXXX/pslab-XXXXXXXX/r0)
    does not."""
    want = 74
    if len(str(tmp_path)) > want - 2:
        pytest.skip("the test's temp dir is already too long to build the exact length")
    long = tmp_path / ("d" * (want - len(str(tmp_path)) - 1))
    long.mkdir(parents=True)
    assert len(str(long)) == want
    monkeypatch.setenv("TMPDIR", str(long))
    monkeypatch.setattr(tempfile, "tempdir", str(long))     # this process' cached choice too
    out = collectives.launch(_endpoints_and_sum, 2, "zmq", timeout=60)
    assert [s for _, s in out] == [2.0, 2.0]
    assert all(kinds == ["tcp"] for kinds, _ in out), out


def test_only_forking_chooses_what_the_forkserver_preloads():
    """A process has one forkserver, and the first context to start it fixes what every later child inherits: a
    test (or module) with a preload list of its own, run first in a pytest worker, left every later rank of that
    worker importing torch._dynamo itself (~1.5 s of CPU each). So only `forkserver_context` sets one."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    me = Path(__file__).resolve()
    hits = [str(p.relative_to(root)) for d in ("collectives", "ps", "parallelism", "experiments", "tests")
            for p in (root / d).rglob("*.py") if p != me and "set_forkserver_preload" in p.read_text()]
    assert hits == ["collectives/forking.py"], hits
