"""`pslab secret DIR`: the job secret (0600) and CURVE keys in a 0700 folder, the variables to export printed;
what it makes is what pslab reads; an existing secret is never overwritten."""

from __future__ import annotations

import os
import stat

import pytest

from pslab.experiments.cli import main


def test_secret_makes_what_pslab_reads(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "job"
    assert main(["secret", str(folder)]) == 0
    out = capsys.readouterr().out
    env = dict(ln.removeprefix("export ").split("=", 1) for ln in out.splitlines() if ln.startswith("export "))
    assert env == {"PSLAB_JOB_SECRET_FILE": str(folder / "job_secret"), "PSLAB_CURVE_KEYS": str(folder / "keys")}
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700 and stat.S_IMODE(os.stat(folder / "keys").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(folder / "job_secret").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(folder / "keys" / "pslab.key_secret").st_mode) == 0o600
    from pslab.collectives.auth import job_secret
    monkeypatch.delenv("PSLAB_JOB_SECRET", raising=False)
    monkeypatch.setenv("PSLAB_JOB_SECRET_FILE", env["PSLAB_JOB_SECRET_FILE"])
    secret = job_secret()
    assert secret is not None and len(bytes.fromhex(secret)) == 32
    import zmq.auth
    public, private = zmq.auth.load_certificate(str(folder / "keys" / "pslab.key_secret"))
    assert len(public) == 40 and private is not None and len(private) == 40            # Z85 of 32 bytes


@pytest.mark.parametrize("setup", ["secret", "file"])
def test_secret_never_overwrites(tmp_path, capsys, setup):
    folder = tmp_path / "job"
    if setup == "secret":
        assert main(["secret", str(folder)]) == 0
        before = (folder / "job_secret").read_text()
    else:
        folder.mkdir()
        (folder / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert main(["secret", str(folder)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("pslab: error: ") and "\n" not in err
    assert ("never overwritten" in err and (folder / "job_secret").read_text() == before) if setup == "secret" \
        else "not an empty folder" in err
