"""Interrupts, from a terminal and from a kernel: Ctrl-C or SIGTERM to `pslab run`, SIGINT to a process that called
`pslab.run` -- every process stops, nothing is left behind (no process of the session, no ipc directory, no
shared-memory segment), and what was written so far is kept.

They run under the load harness (tests/conftest.py: under_load), so under pytest -n never beside a shared test, but
beside each other: each judges only its own run's segments (the jobs its processes held or noted while it ran), not
another test's killed shard's bell that waits for its supervisor's sweep; they live in their own file so that the
queue's under_load turns are not held up by a long shared test of the same file (the API's notebook run and the
CLI's torchrun runs, 10-13 s each beside two busy loops, sat between them)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pslab
from tests.experiments.conftest import as_from_a_terminal, own_traces, session_processes, traces
from tests.leftovers import JobWatch, descendants, jobs_held, jobs_noted

PSLAB = [sys.executable, "-m", "pslab"]
ROOT = Path(__file__).resolve().parents[2]


# ---- `pslab run` in a terminal ------------------------------------------------------------------------------------
@pytest.mark.under_load
@pytest.mark.parametrize("how, strategy", [("ctrl-c", "ps-asp"), ("kill", "ps-asp"), ("ctrl-c", "allreduce")])
def test_interrupt_stops_every_process_and_keeps_metrics(tmp_path, how, strategy):
    """During a run, SIGINT to the whole process group (a terminal's Ctrl-C) or SIGTERM to pslab alone
    (`kill PID`): pslab exits promptly with the one line "pslab: interrupted" (no rank or shard traceback), no
    process of its session survives, no ipc directory or shared-memory segment is left behind, and the metrics
    written so far are merged into metrics.jsonl."""
    private = tmp_path / "tmp"          # the run's own temp dir: other jobs on this host do not count
    private.mkdir()
    before = traces(private)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[workload]\nname = "digits-logreg"\n[train]\nstrategy = "{strategy}"\nworkers = 3\n'
                   'steps = 100000\nbase_step_s = 0.01\ntimeout_s = 60\n')
    p = subprocess.Popen(PSLAB + ["run", str(cfg), "--out", str(tmp_path / "runs"), "-q"], cwd=ROOT,
                         start_new_session=True, preexec_fn=as_from_a_terminal, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, TMPDIR=str(private)))
    watch = JobWatch(private, lambda: session_processes(p.pid))    # the run's shared-memory jobs, while it runs
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            watch.look()
            parts = list((tmp_path / "runs").glob("*/metrics.w*.jsonl"))
            if parts and all(q.stat().st_size > 0 for q in parts) and len(parts) == 3:
                break
            time.sleep(0.2)
        else:
            pytest.fail("workers did not start")
        time.sleep(0.5)
        assert watch.look(), "the run made no shared-memory segment: the leftover check would prove nothing"
        if how == "ctrl-c":
            os.killpg(p.pid, signal.SIGINT)
        else:
            os.kill(p.pid, signal.SIGTERM)
        _, err = p.communicate(timeout=30)
        deadline = time.monotonic() + 10                # (the last ones are being reaped)
        while session_processes(p.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert session_processes(p.pid) == []
        assert p.returncode != 0 and err.strip().splitlines() == ["pslab: interrupted"], err[-2000:]
        assert own_traces(private, watch.jobs) - before == set()
        run = next((tmp_path / "runs").iterdir())
        assert (run / "metrics.jsonl").stat().st_size > 0 and not (run / "summary.json").exists()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        for pid in session_processes(p.pid):
            os.kill(pid, signal.SIGKILL)


# ---- pslab.run in a kernel ----------------------------------------------------------------------------------------
def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for p in pids:
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        if stat[stat.rfind(")") + 2] != "Z":
            alive.add(p)
    return alive


INTERRUPTED = """
import sys
import pslab
try:
    pslab.run({"workload": {"name": "digits-logreg"}, "train": {"strategy": sys.argv[2], "workers": 3,
               "steps": 100000, "base_step_s": 0.01, "timeout_s": 60}}, out=sys.argv[1], progress=False)
except KeyboardInterrupt:
    print("KeyboardInterrupt")
    sys.exit(3)
"""


@pytest.mark.under_load
@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy", ["ps-asp", "allreduce"])
def test_an_interrupt_stops_the_run_and_leaves_nothing(tmp_path, strategy):
    """SIGINT to the calling process alone (a kernel's stop button): KeyboardInterrupt comes out of pslab.run,
    every rank and shard it started is gone, no temp directory or segment of this run is left, the run directory
    says interrupted and keeps its metrics."""
    private = tmp_path / "tmp"
    private.mkdir()
    before = traces(private)
    p = subprocess.Popen([sys.executable, "-c", INTERRUPTED, str(tmp_path / "runs"), strategy], cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, TMPDIR=str(private)),
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    started: set[int] = set()
    watch = JobWatch(private, lambda: started | {p.pid})
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and p.poll() is None:
            started |= descendants(p.pid)
            watch.look()
            parts = list((tmp_path / "runs").glob("*/metrics.w*.jsonl"))
            if len(parts) == 3 and all(q.stat().st_size > 0 for q in parts):
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the workers did not start: {p.communicate(timeout=30)}")
        started |= descendants(p.pid)
        assert watch.look(), "the run made no shared-memory segment: the leftover check would prove nothing"
        os.kill(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 3 and out.strip() == "KeyboardInterrupt", (out, err[-3000:])
        deadline = time.monotonic() + 10                       # the forkserver reaps its last children
        while _alive(started) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert started and _alive(started) == set(), _alive(started)
        left = [q.name for q in private.iterdir() if not q.name.startswith("torchinductor_")]   # (torch's cache)
        assert left == [] and own_traces(private, watch.jobs) - before == set()
        (run,) = (tmp_path / "runs").iterdir()
        env = json.loads((run / "env.json").read_text())
        assert env.get("interrupted") and (run / "metrics.jsonl").stat().st_size > 0
        assert pslab.load(run).interrupted and len(pslab.load(run).metrics) > 0
    finally:
        if p.poll() is None:
            p.kill()
        for pid in _alive(started | descendants(p.pid)):
            os.kill(pid, signal.SIGKILL)


def test_the_leftover_check_counts_this_runs_segments_not_another_tests(tmp_path):
    """`own_traces` counts a segment of a job the run's processes held or noted, and not one of another job (under
    pytest -n, another test's killed shard's bell); `jobs_held` reads the job off an open segment, `jobs_noted`
    off a cleanup directory's note."""
    import uuid
    mine, theirs, noted = (uuid.uuid4().hex[:12] for _ in range(3))
    paths = [Path(f"/dev/shm/pslab-{j}-s0-bell") for j in (mine, theirs, noted)]
    (tmp_path / "pslab-job-x").mkdir()
    (tmp_path / "pslab-job-x" / f"shm-{noted}").write_text("")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1], 'w'); "
                               "print('ok', flush=True); time.sleep(60)", str(paths[0])], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "ok"
        for q in paths[1:]:
            q.write_text("")
        jobs = jobs_held([holder.pid]) | jobs_noted(tmp_path)
        assert jobs == {mine, noted}
        assert own_traces(tmp_path, jobs) == {f"shm:{paths[0].name}", f"shm:{paths[2].name}",
                                              str(tmp_path / "pslab-job-x")}
    finally:
        holder.kill()
        holder.wait(10)
        holder.stdout.close()
        for q in paths:
            q.unlink(missing_ok=True)
