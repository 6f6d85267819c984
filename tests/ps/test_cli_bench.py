"""`pslab server` and `pslab bench ps` entry points: bad input is one clear line; the server runs and exits on its
idle timeout; the benchmark runs end to end on a tiny model and prints the pslab / torch-rpc ratio."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pslab.experiments.cli import main as cli_main


def test_server_bad_policy_is_one_line(capsys):
    rc = cli_main(["server", "--workers", "2", "--policy", "ssp:many"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err.count("\n") == 0 and "unknown consistency policy" in err


def test_server_runs_and_exits_on_idle_timeout():
    p = subprocess.run([sys.executable, "-m", "pslab", "server", "--workers", "1", "--policy", "ssp:1",
                        "--optimizer", "adam:lr=0.001", "--idle-timeout", "0.5"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "serving 1 workers on tcp://127.0.0.1:" in p.stdout and "[ssp:1, adam:lr=0.001]" in p.stdout


@pytest.mark.timeout(150)
def test_bench_ps_smoke(capfd):
    """... and its processes (torch rpc's included) print no third-party warnings: capfd reads file descriptor 2,
    which the child processes share."""
    from pslab.experiments.bench.ps import main
    rc = main(["--params", "2000", "--workers", "1", "--shards", "1", "--updates", "3", "--reps", "1"])
    out, err = capfd.readouterr()
    assert rc == 0
    assert "Warning" not in err, err
    assert "pslab (1 shard)" in out and "torch.distributed.rpc" in out and "1 worker: 1 shard:" in out


@pytest.mark.parametrize("args, fragment", [
    (["--bind", "tcp://127.0.0.1:99999"], "needs a port 0..65535"),
    (["--bind", "ipc:///no/such/dir/shard"], "directory of the ipc path does not exist"),
    (["--bind", "tcp://127.0.0.1:1;0.0.0.0:5555"], "exposes the shard beyond this host"),
    (["--optimizer", "momentum:momentum=-5"], "momentum must be in [0, 1)"),
    (["--optimizer", "adam:betas=0.9"], "betas must be two numbers"),
    (["--optimizer", "sgd:lr=inf"], "learning rate must be a finite number"),
    (["--request-timeout", "-1"], "request_timeout and idle_timeout are seconds >= 0"),
    (["--bind", "PORT_IN_USE"], "Address already in use"),
])
def test_server_bad_values_are_one_line(capsys, args, fragment):
    import socket
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    args = [f"tcp://127.0.0.1:{taken.getsockname()[1]}" if a == "PORT_IN_USE" else a for a in args]
    try:
        rc = cli_main(["server", "--workers", "1", *args])
    finally:
        taken.close()
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err.count("\n") == 0 and fragment in err, err


@pytest.mark.timeout(90)
def test_server_without_a_secret_makes_one_and_prints_where(tmp_path):
    """No --secret-file and no PSLAB_JOB_SECRET: the server writes a new secret into a 0600 file in a fresh 0700
    directory, names it once in its start-up line, admits a client that reads it, and removes it on exit."""
    import os
    import re
    import stat

    from pslab.ps.admin import connect_admin
    env = {k: v for k, v in os.environ.items() if not k.startswith("PSLAB_JOB_SECRET")}
    p = subprocess.Popen([sys.executable, "-m", "pslab", "server", "--workers", "1", "--idle-timeout", "3"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = p.stdout.readline()
        m = re.search(r"on (tcp://\S+) .*job secret: (\S+) \(new; workers: PSLAB_JOB_SECRET_FILE=(\S+)\)", line)
        assert m and m.group(2) == m.group(3), line
        addr, path = m.group(1), m.group(2)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        secret = open(path).read().strip()
        with connect_admin([addr], secret=secret, timeout=10) as admin:
            assert admin.ping().result(10)[0]["shard"] == 0
        assert p.wait(30) == 0
        assert not os.path.exists(os.path.dirname(path))
    finally:
        p.kill()
        p.wait()
        p.stdout.close()
        p.stderr.close()


def test_server_secret_file_is_created_checked_and_bad_ones_are_one_line(tmp_path, capsys):
    import os
    import stat
    path = tmp_path / "job.secret"
    rc = cli_main(["server", "--workers", "1", "--idle-timeout", "0.2", "--secret-file", str(path)])
    out = capsys.readouterr().out
    assert rc == 0 and f"job secret: {path} (new)" in out
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and len(path.read_text().strip()) == 64
    rc = cli_main(["server", "--workers", "1", "--idle-timeout", "0.2", "--secret-file", str(path)])
    assert rc == 0 and f"job secret: {path}\n" in capsys.readouterr().out + "\n"
    os.chmod(path, 0o644)
    short = tmp_path / "short.secret"
    short.write_text("abc\n")
    os.chmod(short, 0o600)
    for bad, fragment in [(path, "must be a regular file of mode 0600"), (short, "at least 32 printable"),
                          (tmp_path / "no" / "dir", "cannot create it")]:
        rc = cli_main(["server", "--workers", "1", "--secret-file", str(bad)])
        err = capsys.readouterr().err.strip()
        assert rc == 1 and err.count("\n") == 0 and fragment in err, err


def test_bench_ps_peers_are_validated(capsys):
    from pslab.experiments.bench.ps import main
    with pytest.raises(SystemExit, match="--peers takes a comma-separated list of rpc, ray or none"):
        main(["--peers", "rpc,mpi"])


@pytest.mark.timeout(240)
@pytest.mark.skipif(__import__("importlib").util.find_spec("ray") is None,
                    reason="the Ray peer is an optional extra (pip install -e '.[bench]')")
def test_bench_ps_ray_peer(capfd):
    """Ray's actor PS in the same run, its ratio printed, and no warnings from Ray on fd 2."""
    from pslab.experiments.bench.ps import main
    rc = main(["--params", "2000", "--workers", "1", "--shards", "1", "--updates", "3", "--reps", "1",
               "--peers", "ray"])
    out, err = capfd.readouterr()
    assert rc == 0 and "ray (actor PS)" in out and "ratio pslab / ray" in out
    assert "torch.distributed.rpc" not in out
    assert "Warning" not in err, err
