"""Start N local processes for a function, wired into one group; the first failure ends them all.

    results = launch(work, world_size=4, backend="zmq", args=(...), timeout=60)   # one result per rank

Children are forked from a forkserver that has imported torch once (start_method="forkserver", the default),
so a launch costs a fork, not a fresh interpreter. Nothing of the job listens beyond loopback, and nothing is
reachable by another account: the rendezvous store is a `torch.distributed.FileStore` in a fresh 0700 temp
directory (no network listener; removed at the end), the ranks bind ipc sockets in their own 0700 directories and
tcp on 127.0.0.1 only (gloo, for backend="torch", on the loopback interface unless GLOO_SOCKET_IFNAME says
otherwise), and every zmq connection authenticates with a per-job secret (`secret=`, else the caller's
PSLAB_JOB_SECRET, else a fresh `auth.new_job_secret()`) that reaches the children through their process
arguments, never through the store; each child also exports it
as PSLAB_JOB_SECRET, so what `fn` starts (a PS client) can prove it belongs to the job. Each child sets
`torch.set_num_threads(1)` and the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK), builds the group and calls
`fn(group, *args)`. Results come back through a multiprocessing queue between these trusted local processes only.
If any rank raises, the others are killed and `LaunchError` carries that rank's traceback; if the whole launch
outlives `timeout`, every child is killed and `LaunchError` says which ranks were still running and where: each
hung rank's Python stacks (faulthandler, asked for with SIGUSR1) are appended to the message.
With `return_exceptions=True` a failed or killed rank yields a `RankFailure` instead and the others run on.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from . import cleanup
from .auth import ENV_SECRET, job_secret, new_job_secret
from .errors import LaunchError


@dataclass
class RankFailure:
    """What a rank left behind when it failed: its exception type and traceback, or the signal that killed it."""

    rank: int
    error: str
    traceback: str = ""
    exitcode: int | None = None


STOPPED = 128 + signal.SIGTERM      # a rank's exit code when the launcher stopped it


def _stopped(signum: int, frame: Any) -> None:
    """SIGTERM from the launcher: unwind quietly (finally blocks close the group, its ipc dir and segments)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(STOPPED)


def _child(rank: int, world_size: int, store_path: str, backend: str, fn: Callable, args: tuple, q: Any,
           options: dict, release: Any) -> None:
    # Ctrl-C reaches the whole process group; the launcher (the parent) owns it and stops the ranks with SIGTERM,
    # so a Ctrl-C prints one line from the parent, not a traceback per rank
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _stopped)
    import torch
    torch.set_num_threads(1)
    stacks = open(options.pop("stacks_path"), "w")            # launch() asks a hung rank for its stacks
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    secret = options.pop("secret")
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       ENV_SECRET: secret, cleanup.ENV: os.path.dirname(store_path)})
    if os.path.isdir("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")     # gloo (backend="torch") on loopback too
    group = None
    try:
        import torch.distributed as dist
        from .init import init_process_group
        gt = options.pop("group_timeout")
        launch_timeout = options.pop("launch_timeout")
        store = dist.FileStore(store_path, -1)
        store.set_timeout(timedelta(seconds=gt))
        group = init_process_group(backend, rank=rank, world_size=world_size, store=store, timeout=gt,
                                   secret=secret, **options)
        result = fn(group, *args)
        q.put((rank, "ok", result, ""))
        # torch tensors in `result` travel as shared storage that the parent maps from this process:
        # stay alive until the parent has taken every result
        release.wait(launch_timeout)
    except BaseException as e:  # report everything, including KeyboardInterrupt, then exit non-zero
        if isinstance(e, SystemExit) and e.code == STOPPED:
            raise                        # the launcher is stopping us: nothing to report
        q.put((rank, "err", f"{type(e).__name__}: {e}", traceback.format_exc()))
        raise SystemExit(1)
    finally:
        if group is not None:
            try:
                group.destroy()
            except Exception:
                pass


def _hung_stacks(procs: dict[int, Any], stacks_dir: str) -> str:
    """Ask hung ranks for every thread's Python stack (faulthandler on SIGUSR1) and return them as text."""
    for p in procs.values():
        if p.is_alive() and p.pid is not None:
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except OSError:
                pass
    time.sleep(0.5)
    out = []
    for r in procs:
        try:
            text = open(os.path.join(stacks_dir, f"rank{r}.txt")).read().strip()
        except OSError:
            text = ""
        out.append(f"--- stacks of rank {r} ---\n{text or '(none: the rank did not answer)'}")
    return "\n".join(out)


def launch(fn: Callable[..., Any], world_size: int, backend: str = "zmq", args: tuple = (), timeout: float = 60.0,
           *, group_timeout: float | None = None, return_exceptions: bool = False, start_method: str = "forkserver",
           secret: str | None = None, **group_options: Any) -> list[Any]:
    """Run `fn(group, *args)` in `world_size` local processes; return the per-rank results in rank order.

    fn must be importable by the children (a module-level function). `group_timeout` bounds every single wait
    inside a collective (default: `timeout`); `timeout` bounds the whole launch. `secret`: the job's secret (default:
    this process's PSLAB_JOB_SECRET / _FILE if set, else a fresh one). What the ranks leave behind -- ipc
    directories, shared-memory segments, even of a killed rank -- is swept when the launch ends (cleanup.py)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":  # one server imports torch once; each rank is then a cheap fork of it
        ctx.set_forkserver_preload(["torch", "torch.optim", "torch._dynamo", "numpy", "zmq", "collectives.init",
                                    "collectives.zmq_group"])
    q = ctx.Queue()
    options = dict(group_options, group_timeout=group_timeout or timeout,
                   secret=secret or job_secret() or new_job_secret())
    release = ctx.Event()
    job_dir = cleanup.make_dir("pslab-job-")   # 0700: the store, the stacks, the ranks' ipc dirs + shm notes
    store_path = os.path.join(job_dir, "store")
    procs = [ctx.Process(target=_child, args=(r, world_size, store_path, backend, fn, args, q,
                                              dict(options, launch_timeout=timeout,
                                                   stacks_path=os.path.join(job_dir, f"rank{r}.txt")), release),
                         daemon=True, name=f"pslab-rank{r}") for r in range(world_size)]
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.start()
        while len(results) < world_size:
            try:
                rank, status, value, tb = q.get(timeout=0.05)
            except queue.Empty:
                for r, p in enumerate(procs):  # a rank that died without reporting (SIGKILL, segfault)
                    if r not in results and p.exitcode is not None and p.exitcode != 0 and q.empty():
                        time.sleep(0.05)
                        if not q.empty():
                            break
                        fail = RankFailure(r, f"process exited with code {p.exitcode}", exitcode=p.exitcode)
                        if not return_exceptions:
                            raise LaunchError(f"rank {r} died with exit code {p.exitcode} before reporting a result")
                        results[r] = fail
                if time.monotonic() > deadline:
                    running = [r for r in range(world_size) if r not in results]
                    stacks = _hung_stacks({r: procs[r] for r in running}, job_dir)
                    raise LaunchError(f"launch timed out after {timeout:g}s; ranks {running} had not finished\n"
                                      f"{stacks}")
                continue
            if status == "ok":
                results[rank] = value
            elif return_exceptions:
                results[rank] = RankFailure(rank, value, tb, procs[rank].exitcode)
            else:
                raise LaunchError(f"rank {rank} failed: {value}\n--- traceback of rank {rank} ---\n{tb}")
        release.set()
        for p in procs:
            p.join(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
    finally:
        release.set()
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            if p.pid is None:                  # never started
                continue
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join(timeout=2)
        q.close()
        cleanup.sweep(job_dir)                 # also what killed ranks could not remove (collectives/cleanup.py)
    return [results[r] for r in range(world_size)]
