"""`pslab server` and `pslab bench ps` entry points: bad input is one clear line; the server runs and exits on its
idle timeout; the benchmark runs end to end on a tiny model and prints the pslab / torch-rpc ratio."""

from __future__ import annotations

import subprocess
import sys

import pytest

from experiments.cli import main as cli_main


def test_server_bad_policy_is_one_line(capsys):
    rc = cli_main(["server", "--workers", "2", "--policy", "ssp:many"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err.count("\n") == 0 and "unknown consistency policy" in err


def test_server_runs_and_exits_on_idle_timeout():
    p = subprocess.run([sys.executable, "-m", "experiments.cli", "server", "--workers", "1", "--policy", "ssp:1",
                        "--optimizer", "adam:lr=0.001", "--idle-timeout", "0.5"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "serving 1 workers on tcp://127.0.0.1:" in p.stdout and "[ssp:1, adam:lr=0.001]" in p.stdout


@pytest.mark.timeout(150)
def test_bench_ps_smoke(capsys):
    from experiments.bench.ps import main
    rc = main(["--params", "2000", "--workers", "1", "--shards", "1", "--updates", "3", "--reps", "1"])
    out = capsys.readouterr().out
    assert rc == 0
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
