"""Two hosts for real: two network namespaces joined by a veth pair (10.77.N.1 <-> 10.77.N.2), one `pslab run`
process in each (RANK 0 and 1, as torchrun/SLURM would start them), PSLAB_BIND_HOST set to each "host's" address and
the job's secret and CURVE keys from `pslab secret` (the tutorial's recipe, §5). Every byte between the ranks
crosses the veth link encrypted: a ring all-reduce run and a parameter-server run (shards on host A, a worker on
each host) finish with every worker's updates.

Needs root and iproute2 (`ip netns`); skipped elsewhere. The namespaces are this test's own and are deleted after.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from pslab.experiments.results.rundir import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
STEPS = 10
MODEL_BYTES = 4810 * 4          # digits-mlp: 64-64-10 float32


def tx_bytes(ns: str, dev: str) -> int:
    out = subprocess.run(["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{dev}/statistics/tx_bytes"],
                         check=True, capture_output=True, text=True, timeout=30)
    return int(out.stdout)


def _sh(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    tag = uuid.uuid4().hex[:6]
    net = random.randint(0, 250)
    names, made = [f"pslab-a-{tag}", f"pslab-b-{tag}"], []
    try:
        for ns in names:
            _sh("ip", "netns", "add", ns)
            made.append(ns)
        _sh("ip", "link", "add", f"pva{tag}", "type", "veth", "peer", "name", f"pvb{tag}")
        out = []
        for i, (ns, dev) in enumerate(zip(names, (f"pva{tag}", f"pvb{tag}"))):
            addr = f"10.77.{net}.{i + 1}"
            _sh("ip", "link", "set", dev, "netns", ns)
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            out.append((ns, addr, dev))
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        pytest.skip(f"cannot make network namespaces here: {e}")
    yield out
    for ns in made:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def job_environment(folder: Path) -> dict[str, str]:
    """The tutorial's recipe: `pslab secret DIR` once, then export the variables it prints."""
    r = subprocess.run([sys.executable, "-m", "pslab", "secret", str(folder)], capture_output=True, text=True,
                       timeout=60, check=True)
    lines = [ln.removeprefix("export ").split("=", 1) for ln in r.stdout.splitlines() if ln.startswith("export ")]
    assert {k for k, _ in lines} == {"PSLAB_JOB_SECRET_FILE", "PSLAB_CURVE_KEYS"}, r.stdout
    return dict(lines)


def run_on_two_hosts(hosts, tmp_path: Path, strategy: str, label: str) -> Path:
    job = job_environment(tmp_path / "job")
    cfg = tmp_path / f"{label}.toml"
    cfg.write_text(f'[workload]\nname = "digits-mlp"\n[train]\nstrategy = "{strategy}"\nworkers = 2\n'
                   f'steps = {STEPS}\neval_every = 1000\ntimeout_s = 60\n')
    port = random.randint(20000, 60000)   # inside the namespaces nothing else listens
    procs = []
    for rank, (ns, addr, _) in enumerate(hosts):
        env = dict(os.environ, **job, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR=hosts[0][1],
                   MASTER_PORT=str(port), PSLAB_BIND_HOST=addr, PYTHONPATH=str(ROOT))
        procs.append(subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "pslab", "run",
                                       str(cfg), "--out", str(tmp_path / "runs"), "--label", label, "-q"],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))
    errs = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=100)
            errs.append(err)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(e[-2000:] for e in errs)
    return tmp_path / "runs" / label


@pytest.mark.parametrize("strategy", ["allreduce", "ps-asp"])
def test_a_run_across_two_hosts(hosts, tmp_path, strategy):
    """Rank 0 on host A, rank 1 on host B, CURVE on every socket: both workers' steps are recorded, the summary is
    written by rank 0, and host B's link carried at least its gradients (it would carry only the rendezvous if the
    ranks had taken each other for one host -- same hostname, same filesystem -- and talked through ipc sockets and
    shared memory; the network namespace in the host identity tells them apart)."""
    ns_b, _, dev_b = hosts[1]
    before = tx_bytes(ns_b, dev_b)
    run = run_on_two_hosts(hosts, tmp_path, strategy, strategy.replace(":", "_"))
    sent = tx_bytes(ns_b, dev_b) - before
    assert sent > 0.9 * STEPS * MODEL_BYTES, sent
    ups = read_jsonl(run / "metrics.jsonl")
    assert sorted((u["worker"], u["step"]) for u in ups) == [(w, t) for w in range(2) for t in range(STEPS)]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["role"] == "torchrun" and summary["updates"] == 2 * STEPS
    if strategy == "ps-asp":
        assert all(u["staleness"] is not None for u in ups)
