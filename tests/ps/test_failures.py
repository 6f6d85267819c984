"""Issue 9, shard side: a shard killed (SIGKILL), stopped (SIGTERM) or hung (SIGSTOP) under BSP is detected by
`ServerGroup.check`, restarted from its checkpoint on the same address, the workers resync and finish, and the
result equals (bitwise) a run without the failure; failing and unwritable checkpoint directories are reported; the
versioned membership releases gates blocked by a dead worker and re-admits a replacement. Real shard processes
(fork), worker threads with real clients; every test leaves no shard process and none of its /dev/shm segments."""

from __future__ import annotations

import ast
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pslab.ps.admin import connect_admin
from pslab.ps import shm_path
from pslab.ps.checkpoint import list_checkpoints, load_checkpoint
from pslab.ps.client import connect
from pslab.ps.errors import (CheckpointWarning, ConfigError, MembershipError, NotAMemberError, NotRegisteredError,
                       ShardLostError)
from pslab.ps.processes import start_servers
from pslab.ps.shard import ShardState
from tests.detectlog import detected
from tests.leftovers import held, job_of, segments

from .test_processes import shard_children

pytestmark = pytest.mark.under_load        # beside a CPU hog, as CI runs it (tests/conftest.py)

LR = 0.1
PARAMS = {"w": np.linspace(-1, 1, 64, dtype=np.float32), "b": np.arange(8, dtype=np.float32)}


def grads(w: int, clock: int) -> dict[str, np.ndarray]:
    """Worker w's gradient at `clock`: depends on both, so a redone or skipped clock shows in the result."""
    return {k: np.full(v.shape, 0.01 * (w + 1) + 0.001 * clock, np.float32) for k, v in PARAMS.items()}


def reference(workers: int, clocks: int) -> dict[str, np.ndarray]:
    """The parameters after `clocks` BSP clocks without any failure (the sans-IO shard, same sums in same order)."""
    st = ShardState({k: v.copy() for k, v in PARAMS.items()}, f"sgd:lr={LR}", "bsp", workers)
    for c in range(clocks):
        for w in range(workers):
            st.push(w, c, st.version, grads(w, c))
    return {k: t.numpy().reshape(PARAMS[k].shape).copy() for k, t in st.params.items()}


def shm_jobs(servers: Any, clients: list[Any]) -> set[str]:
    """The /dev/shm job ids this test's shards (every incarnation so far) and clients created segments under."""
    jobs = {link.job for c in clients for link in c._links}
    for row in servers._sweeps:
        for d in row:
            if d and os.path.isdir(d):
                jobs |= {n[4:] for n in os.listdir(d) if n.startswith("shm-")}
    return jobs


def leftover_segments(jobs: set[str]) -> list[str]:
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return []
    return [n for n in names if any(n.startswith(f"pslab-{j}-") for j in jobs)]


class Workers:
    """BSP worker threads: push_pull every clock until clock `steps` on the shard; on a lost shard resync, read at
    the restored clock (recorded) and go on from there (the loop's rewind)."""

    def __init__(self, addresses: list[str], n: int, steps: int, timeout: float = 20.0) -> None:
        self.steps, self.timeout = steps, timeout
        self.out: dict[int, Any] = {}
        self.after_restart: dict[int, tuple[dict[str, np.ndarray], int, dict | None]] = {}
        self.clients = [connect(addresses, w, PARAMS, timeout=timeout) for w in range(n)]
        self.clients[0].init(PARAMS).result(timeout)
        self.threads = [threading.Thread(target=self._run, args=(w,), daemon=True) for w in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, w: int) -> None:
        c = self.clients[w]
        try:
            c.pull().result(self.timeout)
            lost = 0
            for _ in range(4 * self.steps):           # bounded: each step either advances or is redone
                if c.clocks[0] >= self.steps:
                    break
                try:
                    c.push_pull(grads(w, c.clocks[0])).result(self.timeout)
                except (ShardLostError, NotRegisteredError):
                    lost += 1
                    for _ in range(3):                 # a slot group's survivors may go down while we resync
                        try:
                            c.resync()
                            r = c.pull().result(self.timeout)  # at the restored clock, before any push
                            break
                        except (ShardLostError, NotRegisteredError):
                            continue
                    self.after_restart[w] = ({k: v.copy() for k, v in r.params.items()}, r.versions[0],
                                             c.last_restart)
            self.out[w] = {"clock": c.clocks[0], "lost_steps": lost}
        except BaseException as e:                    # reported by the test
            self.out[w] = e

    def alive(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def close(self) -> None:
        for t in self.threads:
            t.join(30)
        for c in self.clients:
            c.close()


def supervise(servers: Any, workers: Workers, detect_s: float, inject: Any, limit_s: float = 60.0
              ) -> tuple[list[dict], dict[str, float]]:
    """The supervisor's poll loop: inject the fault once `inject(servers)` says so, call check() every 10 ms."""
    events: list[dict] = []
    times: dict[str, float] = {}
    end = time.monotonic() + limit_s
    while workers.alive() and time.monotonic() < end:
        if "inject" not in times and inject(servers):
            times["inject"] = time.monotonic()
        found = servers.check(detect_s)
        if found and "detect" not in times:
            times["detect"] = time.monotonic()
        for ev in found:               # read the restored file now: keep=2 rotates it away 2k updates later
            if ev["event"] == "shard_restart" and ev["checkpoint"]:
                ev["_file"] = load_checkpoint(ev["checkpoint"])
        events += found
        time.sleep(0.01)
    return events, times


def finish(servers: Any, workers: Workers, jobs: set[str]) -> None:
    workers.close()
    servers.stop()
    assert not shard_children()
    assert not leftover_segments(jobs), "shared-memory segments left behind"


def check_bitwise_restart(workers: Workers, restarts: list[dict], n: int) -> None:
    """Every worker read exactly the checkpoints the shards restored, bitwise (= the failure-free run at that
    version)."""
    assert sorted(workers.after_restart) == list(range(n))
    piece = {sl.key: sl for sl in workers.clients[0].partition.slices}     # shard key -> (name, start, stop)
    for restart in restarts:
        tensors, meta = restart["_file"]
        assert meta["version"] == restart["restored_version"]
        ref = reference(n, restart["restored_version"])
        keys = [k.split("\x00", 1)[1] for k in tensors if k.startswith("param\x00")]
        assert keys
        for k in keys:
            sl, held = piece[k], tensors[f"param\x00{k}"].numpy()
            np.testing.assert_array_equal(ref[sl.name].reshape(-1)[sl.start:sl.stop], held)
            for params, _, _ in workers.after_restart.values():
                np.testing.assert_array_equal(params[sl.name].reshape(-1)[sl.start:sl.stop], held)
    for _, version, last in workers.after_restart.values():
        assert version == restarts[0]["restored_version"] == last["restored_version"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport,shards", [("ipc", 1), ("tcp", 1), ("ipc", 2)])
def test_kill9_shard_under_bsp_is_restarted_and_the_run_completes_exactly(tmp_path, transport, shards):
    """One shard: it alone restarts. Two shards: the slot group restarts together from its common restore point."""
    k, steps, n = 4, 24, 2
    servers = start_servers(shards, num_workers=n, policy="bsp", optimizer=f"sgd:lr={LR}", start_method="fork",
                            transport=transport, checkpoint_dir=str(tmp_path), checkpoint_every=k, idle_timeout=60)
    addresses = list(servers.addresses)
    workers = Workers(servers.addresses, n, steps)
    try:
        events, times = supervise(servers, workers, 3.0, lambda s: s.heartbeat(0)[1] >= 2 * k + 2 and
                                  os.kill(s.processes[0].pid, signal.SIGKILL) is None)
        assert [e["event"] for e in events] == ["detect"] + ["shard_restart"] * shards, events
        detect, *restarts = events
        restart = restarts[0]
        assert detect["who"] == "shard:0" and detect["how"] == "SIGKILL" and detect["time_s"] is None
        detected(detect["who"], times["detect"] - times["inject"], 5.0)
        assert times["detect"] - times["inject"] < 5.0, times         # faults.detect_s's ceiling, under load too
        assert [r["who"] for r in restarts] == [f"shard:{i}" for i in range(shards)]
        assert servers.addresses == addresses                                      # the same addresses
        assert {r["restored_version"] for r in restarts} == {restart["restored_version"]}   # one common clock
        assert restart["restored_version"] % k == 0
        for r in restarts:        # a survivor may be one clock ahead of the dead shard: k + 1 at most there
            assert 0 <= r["lost_updates"] <= k + (r is not restart)
            assert r["lost_updates"] == r["version_before"] - r["restored_version"]
        assert all(not isinstance(o, BaseException) for o in workers.out.values()), workers.out
        assert [o["clock"] for o in workers.out.values()] == [steps] * n
        assert all(o["lost_steps"] == 1 for o in workers.out.values())
        check_bitwise_restart(workers, restarts, n)
        for c in workers.clients:          # each client saw the restart; its lost figure is a lower bound
            assert [r["shard"] for r in c.restarts] == list(range(shards))
            assert c.restarts[0]["lost_updates"] <= restart["lost_updates"]
        final = workers.clients[0].pull().result(20)
        assert final.versions == [steps] * shards   # the lost clocks were redone: as many updates as without it
        for name, v in reference(n, steps).items():
            np.testing.assert_array_equal(final.params[name], v)
        print(f"\n[{transport}, {shards} shard(s)] kill -9: detected and restarted "
              f"{times['detect'] - times['inject']:.3f} s after the kill (beat age {detect['detect_s']} s, restart "
              f"{restart['restart_s']} s), lost {restart['lost_updates']} "
              f"of k={k} (restored version {restart['restored_version']})")
    finally:
        finish(servers, workers, shm_jobs(servers, workers.clients))


@pytest.mark.timeout(120)
def test_sigterm_to_a_shard_writes_a_final_checkpoint_and_loses_nothing(tmp_path):
    steps, n = 20, 2
    servers = start_servers(1, num_workers=n, policy="bsp", optimizer=f"sgd:lr={LR}", start_method="fork",
                            transport="ipc", checkpoint_dir=str(tmp_path), checkpoint_every=1000, idle_timeout=60)
    workers = Workers(servers.addresses, n, steps)
    try:
        events, _ = supervise(servers, workers, 3.0, lambda s: s.heartbeat(0)[1] >= 7 and
                              os.kill(s.processes[0].pid, signal.SIGTERM) is None)
        assert [e["event"] for e in events] == ["detect", "shard_restart"], events
        detect, restart = events
        assert detect["how"] == "exit code 0"          # a clean exit is still a failure during a run
        assert restart["lost_updates"] == 0 and restart["restored_version"] == restart["version_before"] >= 7
        assert restart["checkpoint"] and [int(p.name[5:-6]) for p in list_checkpoints(tmp_path / "shard-0")] == [
            restart["restored_version"], 0]        # only the final one, and the one written at init
        assert all(not isinstance(o, BaseException) for o in workers.out.values()), workers.out
        final = workers.clients[0].pull().result(20)
        assert final.versions == [steps]
        for name, v in reference(n, steps).items():
            np.testing.assert_array_equal(final.params[name], v)
    finally:
        finish(servers, workers, shm_jobs(servers, workers.clients))


@pytest.mark.timeout(120)
def test_a_hung_shard_is_detected_within_detect_s_killed_and_restarted(tmp_path):
    detect_s, steps, n = 1.0, 16, 2
    servers = start_servers(1, num_workers=n, policy="bsp", optimizer=f"sgd:lr={LR}", start_method="fork",
                            transport="tcp", checkpoint_dir=str(tmp_path), checkpoint_every=2, idle_timeout=60)
    workers = Workers(servers.addresses, n, steps)
    pid = servers.processes[0].pid
    try:
        events, times = supervise(servers, workers, detect_s, lambda s: s.heartbeat(0)[1] >= 5 and
                                  os.kill(s.processes[0].pid, signal.SIGSTOP) is None)
        assert [e["event"] for e in events] == ["detect", "shard_restart"], events
        detect, restart = events
        assert detect["how"].startswith("no heartbeat for ") and detect["detect_s"] >= detect_s   # (rounded to ms)
        took = times["detect"] - times["inject"]
        detected("shard:0", took, detect_s + 1.0)
        assert took < detect_s + 1.0, f"hung shard detected after {took:.2f} s (bound {detect_s} s + a beat)"
        assert servers.processes[0].pid != pid and 0 <= restart["lost_updates"] <= 2
        assert all(not isinstance(o, BaseException) for o in workers.out.values()), workers.out
        check_bitwise_restart(workers, [restart], n)
        final = workers.clients[0].pull().result(20)
        for name, v in reference(n, steps).items():
            np.testing.assert_array_equal(final.params[name], v)
        print(f"\nSIGSTOP: detected {took:.3f} s after the stop (detect_s={detect_s}), "
              f"restart {restart['restart_s']} s")
    finally:
        finish(servers, workers, shm_jobs(servers, workers.clients))


@pytest.mark.timeout(60)
def test_check_names_shards_of_slot_groups_and_can_only_report(tmp_path):
    """With several slot groups a shard is "g<g>-shard:<i>"; restart=False only reports (at every call while it is
    dead); healthy shards give no event; check(restart=True) then brings it back on its address."""
    with start_servers(1, num_workers=1, groups=2, start_method="fork", transport="ipc", idle_timeout=60) as servers:
        assert servers.check(2.0) == []
        address = servers.group_addresses[1][0]
        servers.kill(0, signal.SIGKILL, group=1)
        for _ in range(2):
            (ev,) = servers.check(2.0, restart=False)
            assert ev["event"] == "detect" and ev["who"] == "g1-shard:0" and ev["how"] == "SIGKILL"
        detect, restart = servers.check(2.0)
        assert restart["event"] == "shard_restart" and restart["how"] == "empty (no checkpoint)"
        assert servers.alive(0, group=1) and servers.group_addresses[1][0] == address and servers.check(2.0) == []
        with pytest.raises(ConfigError, match="detect_s must be > 0"):
            servers.check(0)
    assert not shard_children()


@pytest.mark.timeout(60)
def test_a_restarted_shard_gets_the_membership_again(tmp_path):
    """set_members after the shard's last checkpoint: a restart from that checkpoint would wait for the dead worker
    again; ServerGroup re-sends the membership it set, so the restored shard's gate still ignores worker 2."""
    servers = start_servers(1, num_workers=3, policy="bsp", optimizer=f"sgd:lr={LR}", start_method="fork",
                            transport="ipc", checkpoint_dir=str(tmp_path), checkpoint_every=1, idle_timeout=60)
    try:
        with servers.admin(params=PARAMS) as admin:
            admin.init(PARAMS).result(20)
            admin.checkpoint().result(20)                       # membership version 0 in this checkpoint
        assert servers.set_members([0, 1], 1)[0]["members"] == [0, 1]
        servers.kill(0)
        detect, restart = servers.check(2.0)
        assert restart["restored_version"] == 0 and restart["membership"] == 1
        with servers.admin() as admin:
            stats = admin.stats().result(20)[0]
        assert stats["members"] == [0, 1] and stats["membership_version"] == 1
    finally:
        servers.stop()
    assert not shard_children()


@pytest.mark.timeout(60)
def test_a_failing_periodic_checkpoint_is_reported_and_then_recovers(tmp_path):
    servers = start_servers(1, num_workers=1, policy="asp", optimizer=f"sgd:lr={LR}", start_method="fork",
                            transport="ipc", checkpoint_dir=str(tmp_path), checkpoint_every=2, idle_timeout=60)
    d = tmp_path / "shard-0"
    try:
        with connect(servers.addresses, 0, PARAMS, timeout=20) as c:
            c.init(PARAMS).result(20)
            shutil.rmtree(d)
            d.write_text("not a directory")            # root passes permission checks: make mkdir fail instead
            c.push(grads(0, 0)).result(20)             # version 1: no checkpoint due
            assert c.checkpoint_errors == [None]
            with pytest.warns(CheckpointWarning, match="checkpoint at version 2 .* failed"):
                acks = c.push(grads(0, 1)).result(20)  # version 2: due, fails; the push is applied
            assert acks[0]["status"] == "applied" and acks[0]["version"] == 2
            assert "failed" in acks[0]["checkpoint_error"]
            assert c.checkpoint_errors[0] and "last good one is " in c.checkpoint_errors[0]
            assert c.checkpoint_errors[0].endswith("ckpt-000000000000.pslab")   # the one written at init
            with servers.admin() as admin:
                stats = admin.stats().result(20)[0]
            assert stats["counters"]["checkpoint_failures"] == 1 and stats["checkpoint_error"]
            assert "checkpoint_error" in c.push(grads(0, 2)).result(20)[0]   # v3: still reported, not retried
            d.unlink()
            assert "checkpoint_error" not in c.push(grads(0, 3)).result(20)[0]   # v4: retried, succeeds
            assert c.checkpoint_errors == [None] and [p.name for p in list_checkpoints(d)] == [
                "ckpt-000000000004.pslab"]
    finally:
        servers.stop()
    assert not shard_children()


@pytest.mark.timeout(60)
def test_an_unwritable_checkpoint_directory_is_refused_at_start_up(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    bad = str(blocker / "ckpt")
    with pytest.raises(ConfigError, match="checkpoint_dir .* is not a writable directory"):
        start_servers(1, num_workers=1, start_method="fork", checkpoint_dir=bad)
    assert not shard_children()
    from pslab.experiments.cli import main
    assert main(["server", "--workers", "1", "--checkpoint-dir", bad]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a writable directory" in err[0]


@contextlib.contextmanager
def _pslab_server(*args: str):
    """`pslab server ARGS` in a subprocess (stdout, stderr piped), always reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from pslab.experiments.cli import main; "
                             "sys.exit(main(sys.argv[1:]))", "server", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.timeout(90)
def test_pslab_server_writes_a_final_checkpoint_on_sigterm_and_sigint(tmp_path, job_secret_env):
    """Two servers side by side (one per signal: their start-ups overlap), 3 updates each, then the signal."""
    sigs = ((signal.SIGTERM, 143), (signal.SIGINT, 130))
    with contextlib.ExitStack() as stack:
        procs = [stack.enter_context(_pslab_server("--bind", f"ipc://{tmp_path}/{sig.name}.sock", "--workers", "1",
                                                   "--checkpoint-dir", str(tmp_path / sig.name),
                                                   "--checkpoint-every", "1000", "--idle-timeout", "60"))
                 for sig, _ in sigs]
        for (sig, code), proc in zip(sigs, procs):
            sock = f"ipc://{tmp_path}/{sig.name}.sock"
            assert "serving 1 workers" in proc.stdout.readline()
            with connect([sock], 0, PARAMS, timeout=20) as c:
                c.init(PARAMS).result(20)
                for i in range(3):
                    c.push(grads(0, i)).result(20)
            proc.send_signal(sig)
        for (sig, code), proc in zip(sigs, procs):
            assert proc.wait(30) == code
            assert "final checkpoint" in proc.stderr.read()
    for sig, _ in sigs:
        tensors, meta = load_checkpoint(list_checkpoints(tmp_path / sig.name)[0])   # (newest first; [-1]: init's)
        assert meta["version"] == 3                     # 3 of 3 updates kept (issue 9: 137 of 137 were lost)


@pytest.mark.timeout(90)
@pytest.mark.skipif(not shm_path.shm.available(), reason="/dev/shm is not writable here")
def test_a_killed_pslab_server_leaves_no_fifo_or_segment(tmp_path, job_secret_env):
    """kill -9 of a stand-alone `pslab server` with a same-host client registered (its doorbell FIFO and the
    client's reply segment exist): its sweeper removes them, and nothing of its jobs stays in /dev/shm (another
    test's segments, beside it under pytest -n, are not its: tests/leftovers.py)."""
    sock = f"ipc://{tmp_path}/s.sock"
    with _pslab_server("--bind", sock, "--workers", "1", "--idle-timeout", "60") as proc:
        assert "serving 1 workers" in proc.stdout.readline()
        with connect([sock], 0, PARAMS, timeout=20) as c:
            c.init(PARAMS).result(20)
            c.push(grads(0, 0)).result(20)
            c.pull().result(20)
            names = held([proc.pid])
            ours = segments({j for n in names if (j := job_of(n))})
            assert any(n.endswith("-s0-bell") for n in names) and ours, \
                f"the server holds no FIFO or segment: the test would prove nothing ({names})"
            os.kill(proc.pid, signal.SIGKILL)
            assert proc.wait(30) == -signal.SIGKILL
        deadline = time.monotonic() + 20
        left = lambda: {n for n in os.listdir("/dev/shm") if n in ours}        # noqa: E731
        while time.monotonic() < deadline and left():
            time.sleep(0.1)
        assert not left(), sorted(left())


@pytest.mark.timeout(90)
@pytest.mark.skipif(not shm_path.shm.available(), reason="/dev/shm is not writable here")
def test_a_client_that_exits_without_close_leaves_no_fifo_or_segment(tmp_path, job_secret_env):
    """A script (no pslab supervisor to sweep after it) connects to a stand-alone server over the same-host lane,
    then dies of an exception without close(): its doorbell FIFO and lane segment go with it (atexit)."""
    sock = f"ipc://{tmp_path}/s.sock"
    script = ("import os, sys, numpy as np\nfrom pslab.ps import connect\nfrom tests.leftovers import held\n"
              "p = {'w': np.zeros(8, np.float32)}\nc = connect([sys.argv[1]], 0, p, timeout=20)\n"
              "c.init(p).result(20); c.pull().result(20)\n"
              "print(sorted(held([os.getpid()])), flush=True)\n"       # what this client holds: its own
              "raise RuntimeError('the user script fails')\n")
    with _pslab_server("--bind", sock, "--workers", "1", "--idle-timeout", "60") as proc:
        assert "serving 1 workers" in proc.stdout.readline()
        r = subprocess.run([sys.executable, "-c", script, sock], capture_output=True, text=True, timeout=60,
                           cwd=Path(__file__).resolve().parents[2])
        assert "the user script fails" in r.stderr, r.stderr[-2000:]
        had = {n for n in ast.literal_eval(r.stdout.strip().splitlines()[-1]) if "-w0-" in n or n.endswith("-w0-bell")}
        assert any(n.endswith("-w0-bell") for n in had), f"the client made no bell: the test would prove nothing {had}"
        left = had & set(os.listdir("/dev/shm"))
        assert not left, sorted(left)


# ---------------------------------------------------------------------------------------------- membership
def test_set_members_releases_a_bsp_gate_and_commits_with_the_live_workers(thread_servers):
    shm_ok = shm_path.shm.available()
    servers = thread_servers(1, num_workers=3, policy="bsp", optimizer=f"sgd:lr={LR}")
    shard = servers.servers[0]
    clients = [connect(servers.addresses, w, PARAMS, timeout=20) for w in range(3)]
    try:
        clients[0].init(PARAMS).result(20)
        for c in clients:
            c.pull().result(20)
        parked = [clients[w].push_pull(grads(w, 0)) for w in (0, 1)]      # worker 2 never pushes: it "died"
        with pytest.raises(TimeoutError):
            parked[0].result(0.5)
        assert clients[2].shm == [shm_ok] and any(link.worker == 2 for link in shard.links.values()) == shm_ok
        with connect_admin(servers.addresses, timeout=20) as admin:
            reply = admin.set_members([0, 1], 1).result(20)[0]
            assert reply["members"] == [0, 1] and reply["version"] == 1 and reply["committed"] == 1
            for f in parked:                                                # released at once
                acks, read = f.result(20)
                assert read.versions == [1]
            two = ShardState({k: v.copy() for k, v in PARAMS.items()}, f"sgd:lr={LR}", "bsp", 2)
            for w in (0, 1):                                                # the average of the K-1 live ones
                two.push(w, 0, 0, grads(w, 0))
            for k, v in read.params.items():
                np.testing.assert_array_equal(v.reshape(-1), two.params[k].numpy().reshape(-1))
            assert 2 not in shard.registered.values()                       # the dead one's registration is gone
            assert all(link.worker != 2 for link in shard.links.values())   # and its shared-memory link
            with pytest.raises(NotRegisteredError):                         # a stale member is refused
                clients[2].push(grads(2, 0)).result(20)
            assert admin.set_members([0, 1], 1).result(20)[0]["version"] == 1   # the same change again: no-op
            with pytest.raises(MembershipError, match="generations only increase"):
                admin.set_members([0], 1).result(20)
            stats = admin.stats().result(20)[0]
            assert stats["counters"]["membership_changes"] == 1
            log = stats["membership_log"][0]
            assert log["removed"] == [2] and log["gradients_per_step"] == 2
            # -- re-admission: a replacement for worker 2 registers, is refused until re-admitted, then joins at
            #    the committed clock, and the clocks commit with three again
            for f in [clients[w].push_pull(grads(w, 1)) for w in (0, 1)]:
                f.result(20)
            clients[2].close()
            clients[2] = connect(servers.addresses, 2, PARAMS, timeout=20)
            with pytest.raises(NotAMemberError, match="re-admits it"):
                clients[2].push(grads(2, 0)).result(20)
            assert admin.set_members([0, 1, 2], 2).result(20)[0]["clocks"] == [2, 2, 2]
            assert clients[2].resync() == [2]                               # the committed clock
            r = clients[2].pull().result(20)
            assert r.versions == [2] and r.clocks == [2]
            futs = [clients[w].push_pull(grads(w, 2)) for w in range(3)]
            assert [f.result(20)[1].versions for f in futs] == [[3]] * 3
    finally:
        for c in clients:
            c.close()


def test_membership_in_the_sans_io_shard_for_ssp_and_backup():
    st = ShardState({"w": np.zeros(2, np.float32)}, "sgd:lr=0.1", "ssp:1", 3)
    for _ in range(2):
        for w in (0, 1):
            st.push(w, st.clocks[w], st.version, {"w": np.ones(2, np.float32)})
    assert not st.may_read(0, 2) and st.blocking_workers(2) == [2]           # worker 2 at clock 0 holds the gate
    st.set_members([0, 1], 1)
    assert st.may_read(0, 2) and st.blocking_workers(2) == []
    with pytest.raises(NotAMemberError):
        st.may_read(2, 0)
    st.set_members([0, 1, 2], 2)
    assert st.clocks[2] == 2 == st.rejoin_clock()                           # the slowest live clock
    agg = ShardState({"w": np.zeros(2, np.float32)}, "sgd:lr=0.5", "ssp-agg:1", 3)
    for c in range(2):
        for w in (0, 1):
            agg.push(w, c, agg.version, {"w": np.full(2, w + 1.0, np.float32)})
    assert agg.version == 0 and not agg.may_read(0, 2)          # nothing commits without worker 2
    applied = agg.set_members([0, 1], 1)
    assert agg.version == 2 and agg.committed_clock == 2 and agg.may_read(0, 2)
    assert sorted(applied) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    np.testing.assert_array_equal(agg.params["w"].numpy(), np.full(2, -2 * 0.5 * 1.5, np.float32))  # mean of 1, 2
    bk = ShardState({"w": np.zeros(2, np.float32)}, "sgd:lr=0.1", "bsp-backup:1", 3)
    bk.push(0, 0, 0, {"w": np.ones(2, np.float32)})
    assert bk.version == 0
    bk.set_members([0, 2], 1)                                               # needed: 2 live - 1 backup = 1
    assert bk.version == 1 and bk.committed_clock == 1
    with pytest.raises(MembershipError, match="needs more than 1 live"):
        bk.set_members([0], 2)
    tensors, meta = bk.state_dict()                                         # membership survives a checkpoint
    back = ShardState.from_state_dict(tensors, meta)
    assert back.members == [0, 2] and back.membership_version == 1


def test_a_handshake_refused_before_the_first_request_is_still_reported(thread_servers, monkeypatch):
    """The monitor that now watches a socket for its whole life may report a refused handshake before register
    is even sent: that refusal is kept, so connect raises AuthenticationError instead of timing out."""
    from pslab.ps.client import PSClient
    from pslab.ps.errors import AuthenticationError
    servers = thread_servers(1, num_workers=1)
    real = PSClient._register

    def late(self):
        time.sleep(0.3)                          # the handshake has failed (and been noticed) by now
        self._watch()
        return real(self)
    monkeypatch.setattr(PSClient, "_register", late)
    with pytest.raises(AuthenticationError, match="refused this client's credential"):
        connect(servers.addresses, 0, PARAMS, timeout=5, secret="0" * 48)
