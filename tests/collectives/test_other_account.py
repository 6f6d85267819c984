"""Another local account cannot reach a job: run as root, a child process that drops to uid `nobody` tries what an
attacker on the same host would -- connect to a rank's ipc socket, open its shared-memory segments, read the job's
rendezvous store and the secret in a rank's environment -- and is refused every time (0700 directories, 0600
segments, owner-only /proc/<pid>/environ); over tcp it reaches the socket but not the job (test_hostile.py's
strangers: refused at the PLAIN handshake). Skipped unless the tests run as root (they need to change uid)."""

from __future__ import annotations

import os
import pwd
import socket

import pytest
import torch

from pslab import collectives
from pslab.collectives import shm

from .hostile import endpoints

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a probe as another account"),
              pytest.mark.exclusive]    # lists /dev/shm: alone under pytest -n (tests/conftest.py)


def _as_nobody(probes: dict[str, tuple]) -> dict[str, str]:
    """Fork, drop to uid/gid nobody, run each probe; {name: "refused" | "OPEN"} read back through a pipe."""
    nobody = pwd.getpwnam("nobody")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                        # the child: only system calls, then _exit
        out = []
        try:
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            for name, (kind, path) in probes.items():
                try:
                    if kind == "unix":
                        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                        s.settimeout(2)
                        s.connect(path)
                        s.close()
                    elif kind == "dir":
                        os.listdir(path)
                    else:
                        os.close(os.open(path, os.O_RDONLY))
                    out.append(f"{name}=OPEN")
                except OSError:
                    out.append(f"{name}=refused")
        finally:
            os.write(w, ";".join(out).encode())
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 4096):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return dict(x.split("=") for x in data.decode().split(";") if x)


def probe_job(group: collectives.ProcessGroup) -> dict[str, str] | None:
    group.all_reduce(torch.ones(1 << 20))               # 4 MiB through shared memory, as a run does
    result = None
    if group.rank == 0:
        # a receiver unlinks a segment's name once it has mapped it; a segment between creation and mapping is
        # what an attacker could try to open: make one as the transport does (collectives.shm.Outbox)
        box = shm.Outbox("0123456789ab", 0, 1)
        box.reserve(1 << 20)
        ipc = endpoints(group, 1)["ipc"][len("ipc://"):]
        segments = [n for n in os.listdir("/dev/shm") if n.startswith("pslab-0123456789ab-")]
        store_dir = os.environ["PSLAB_CLEANUP_DIR"]
        probes = {"ipc socket": ("unix", ipc), "job directory": ("dir", store_dir),
                  "rank environment": ("file", f"/proc/{os.getpid()}/environ")}
        probes.update({f"segment {n}": ("file", f"/dev/shm/{n}") for n in segments[:4]})
        result = {"probes": _as_nobody(probes), "segments": len(segments)}
        box.close()
    group.barrier()
    return result


def test_another_account_cannot_reach_the_job():
    res = collectives.launch(probe_job, 2, timeout=60)[0]
    assert res["segments"] > 0, "no segment to probe: the test would prove nothing"
    assert res["probes"] and set(res["probes"].values()) == {"refused"}, res["probes"]


def test_the_probe_can_see_an_open_file():
    """Control: the same probe reports OPEN for a world-readable file (so 'refused' above means refused)."""
    import tempfile
    fd, path = tempfile.mkstemp(prefix="probe-", dir="/tmp")
    try:
        os.close(fd)
        os.chmod(path, 0o644)
        assert _as_nobody({"file": ("file", path)}) == {"file": "OPEN"}
    finally:
        os.unlink(path)
