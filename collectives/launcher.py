"""Start N local processes for a function, wired into one group; the first failure ends them all.

    results = launch(work, world_size=4, backend="zmq", args=(...), timeout=60)   # one result per rank

Children are forked from a forkserver that has imported torch once (start_method="forkserver", the default),
so a launch costs a fork, not a fresh interpreter. The parent hosts a TCPStore on 127.0.0.1 (port 0: the OS picks a free one) and each child joins it, sets
`torch.set_num_threads(1)` and the torchrun variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), builds the group
and calls `fn(group, *args)`. Results come back through a multiprocessing queue between these trusted local
processes only. If any rank raises, the others are killed and `LaunchError` carries that rank's traceback;
if the whole launch outlives `timeout`, every child is killed and `LaunchError` says which ranks were still running
and where: each hung rank's Python stacks (faulthandler, asked for with SIGUSR1) are appended to the message.
With `return_exceptions=True` a failed or killed rank yields a `RankFailure` instead and the others run on.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .errors import LaunchError


@dataclass
class RankFailure:
    """What a rank left behind when it failed: its exception type and traceback, or the signal that killed it."""

    rank: int
    error: str
    traceback: str = ""
    exitcode: int | None = None


def _child(rank: int, world_size: int, port: Any, backend: str, fn: Callable, args: tuple, q: Any,
           options: dict, release: Any) -> None:
    import torch
    torch.set_num_threads(1)
    stacks = open(options.pop("stacks_path"), "w")            # launch() asks a hung rank for its stacks
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    if not isinstance(port, int):                             # "fork": the store's port comes after the fork
        if not port.poll(options["launch_timeout"]):
            raise SystemExit(1)
        port = int(port.recv())
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    group = None
    try:
        import torch.distributed as dist
        from .init import init_process_group
        gt = options.pop("group_timeout")
        launch_timeout = options.pop("launch_timeout")
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=gt))
        group = init_process_group(backend, rank=rank, world_size=world_size, store=store, timeout=gt, **options)
        result = fn(group, *args)
        q.put((rank, "ok", result, ""))
        # torch tensors in `result` travel as shared storage that the parent maps from this process:
        # stay alive until the parent has taken every result
        release.wait(launch_timeout)
    except BaseException as e:  # report everything, including KeyboardInterrupt, then exit non-zero
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
           **group_options: Any) -> list[Any]:
    """Run `fn(group, *args)` in `world_size` local processes; return the per-rank results in rank order.

    fn must be importable by the children (a module-level function). `group_timeout` bounds every single wait
    inside a collective (default: `timeout`); `timeout` bounds the whole launch."""
    import torch.distributed as dist
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")

    def make_store() -> Any:
        return dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, timeout=timedelta(seconds=timeout),
                             wait_for_workers=False)
    # With "fork" the children are copies of this process: fork them BEFORE the store's server thread exists,
    # since a child forked while that thread holds one of torch's locks blocks forever on its own TCPStore.
    forking = start_method == "fork"
    store = None if forking else make_store()
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":  # one server imports torch once; each rank is then a cheap fork of it
        ctx.set_forkserver_preload(["torch", "torch.optim", "torch._dynamo", "numpy", "zmq", "collectives.init",
                                    "collectives.zmq_group"])
    q = ctx.Queue()
    options = dict(group_options, group_timeout=group_timeout or timeout)
    release = ctx.Event()
    stacks_dir = tempfile.mkdtemp(prefix="pslab-stacks-")
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)] if forking else []
    procs = [ctx.Process(target=_child, args=(r, world_size, pipes[r][0] if forking else store.port, backend, fn,
                                              args, q,
                                              dict(options, launch_timeout=timeout,
                                                   stacks_path=os.path.join(stacks_dir, f"rank{r}.txt")), release),
                         daemon=True, name=f"pslab-rank{r}") for r in range(world_size)]
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.start()
        if forking:
            store = make_store()
            for recv_end, send_end in pipes:
                send_end.send(store.port)
                send_end.close()
                recv_end.close()
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
                    stacks = _hung_stacks({r: procs[r] for r in running}, stacks_dir)
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
        shutil.rmtree(stacks_dir, ignore_errors=True)
        del store
    return [results[r] for r in range(world_size)]
