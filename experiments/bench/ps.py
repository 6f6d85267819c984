"""`pslab bench ps`: push+pull throughput of pslab's parameter server against the torch.distributed.rpc
parameter-server pattern of PyTorch's tutorials, on the same ~1M-parameter model, in the same run.

One "update" = a worker sends one gradient for every parameter and gets the fresh weights back:
  pslab  client.push(grads) and client.pull() issued together (both in flight), ASP, server-side SGD, 1 or 2 shards;
  rpc    rpc_sync(ps, update_and_fetch_model, grads): the PS applies SGD under a lock and returns the parameters
         (the pattern of "Implementing Batch RPC Processing Using Asynchronous Executions", without batching, and
         returning the parameter tensors rather than the pickled module).
No compute: gradients are fixed random tensors, so the figure is the PS's transport + apply cost. Each worker is a
process with torch.set_num_threads(1); each configuration runs `--reps` timed windows of `--updates` updates per
worker after a warm-up, and reports the median. updates/s counts all workers; MB/s = updates/s x 2 x model bytes.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import sys
import time
from typing import Any

import numpy as np


def model_shapes(params: int) -> dict[str, tuple[int, ...]]:
    """A two-layer MLP with about `params` parameters: d x d + d + d x 10 + 10."""
    d = max(8, int((params - 10) ** 0.5) - 6)
    return {"fc1.weight": (d, d), "fc1.bias": (d,), "fc2.weight": (10, d), "fc2.bias": (10,)}


def _tensors(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) * 0.01 for k, s in shapes.items()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------- pslab
def _pslab_worker(rank: int, addresses: list[str], shapes: dict, updates: int, reps: int, barrier: Any,
                  out: Any) -> None:
    import torch
    torch.set_num_threads(1)
    from ps.client import connect
    grads = _tensors(shapes, 100 + rank)
    try:
        with connect(addresses, rank, shapes, timeout=60) as c:
            if rank == 0:
                c.init(_tensors(shapes, 0)).result(60)
            c.pull().result(60)

            def update() -> None:
                fp = c.push(grads)
                fl = c.pull()
                fp.result(60)
                fl.result(60)
            for _ in range(3):
                update()
            for r in range(reps):
                barrier.wait(120)
                t0 = time.monotonic()
                for _ in range(updates):
                    update()
                out.put((rank, r, t0, time.monotonic()))
    except BaseException as e:
        out.put((rank, -1, repr(e), 0.0))
        raise


def bench_pslab(workers: int, shards: int, shapes: dict, updates: int, reps: int, transport: str) -> list[float]:
    from ps.server import start_servers
    ctx = mp.get_context("spawn")
    with start_servers(shards, workers, "asp", "sgd:lr=0.001", transport=transport, idle_timeout=120) as servers:
        return _run_workers(ctx, _pslab_worker, workers, (servers.addresses, shapes, updates, reps), updates, reps)


# ---------------------------------------------------------------------------------------------- torch rpc
class ParameterServer:
    """The tutorial's PS object: a model and an optimizer behind a lock; workers call update_and_fetch_model."""

    def __init__(self, shapes: dict) -> None:
        import threading

        import torch
        self.params = [torch.from_numpy(v) for v in _tensors(shapes, 0).values()]
        self.optimizer = torch.optim.SGD(self.params, lr=0.001)
        self.lock = threading.Lock()

    @staticmethod
    def update_and_fetch_model(ps_rref: Any, grads: list) -> list:
        self = ps_rref.local_value()
        with self.lock:
            for p, g in zip(self.params, grads):
                p.grad = g
            self.optimizer.step()
            return [p.detach().clone() for p in self.params]


def _rpc_run_worker(ps_rref: Any, rank: int, shapes: dict, updates: int, reps: int) -> list:
    import torch
    import torch.distributed.rpc as rpc
    grads = [torch.from_numpy(v) for v in _tensors(shapes, 100 + rank).values()]
    owner = ps_rref.owner()

    def update() -> None:
        rpc.rpc_sync(owner, ParameterServer.update_and_fetch_model, args=(ps_rref, grads))
    for _ in range(3):
        update()
    return [update, grads]  # not used remotely; placeholder to keep the signature simple


def _rpc_window(ps_rref: Any, rank: int, shapes: dict, updates: int) -> tuple[float, float]:
    import torch
    import torch.distributed.rpc as rpc
    grads = [torch.from_numpy(v) for v in _tensors(shapes, 100 + rank).values()]
    owner = ps_rref.owner()
    for _ in range(2):
        rpc.rpc_sync(owner, ParameterServer.update_and_fetch_model, args=(ps_rref, grads))
    t0 = time.monotonic()
    for _ in range(updates):
        rpc.rpc_sync(owner, ParameterServer.update_and_fetch_model, args=(ps_rref, grads))
    return t0, time.monotonic()


def _rpc_proc(rank: int, world: int, port: int, shapes: dict, updates: int, reps: int, out: Any) -> None:
    import torch
    torch.set_num_threads(1)
    import torch.distributed.rpc as rpc
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=120,
                                           num_worker_threads=8)
    name = "ps" if rank == 0 else f"worker{rank}"
    try:
        rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=opts)
        if rank == 0:
            ps_rref = rpc.RRef(ParameterServer(shapes))
            for r in range(reps):   # every window starts all workers together and waits for all of them
                futs = [rpc.rpc_async(f"worker{w}", _rpc_window, args=(ps_rref, w, shapes, updates))
                        for w in range(1, world)]
                for w, f in zip(range(1, world), futs):
                    t0, t1 = f.wait()
                    out.put((w - 1, r, t0, t1))
        rpc.shutdown()
    except BaseException as e:
        out.put((rank, -1, repr(e), 0.0))
        raise


def bench_rpc(workers: int, shapes: dict, updates: int, reps: int) -> list[float]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rpc_proc, args=(r, workers + 1, port, shapes, updates, reps, out), daemon=True)
             for r in range(workers + 1)]
    return _collect(procs, out, workers, updates, reps)


# ---------------------------------------------------------------------------------------------- common
def _run_workers(ctx: Any, target: Any, workers: int, args: tuple, updates: int, reps: int) -> list[float]:
    out = ctx.Queue()
    barrier = ctx.Barrier(workers)
    addresses, shapes, updates, reps = args
    procs = [ctx.Process(target=target, args=(w, addresses, shapes, updates, reps, barrier, out), daemon=True)
             for w in range(workers)]
    return _collect(procs, out, workers, updates, reps)


def _collect(procs: list, out: Any, workers: int, updates: int, reps: int, timeout: float = 300) -> list[float]:
    for p in procs:
        p.start()
    rows: dict[int, list[tuple[float, float]]] = {}
    deadline = time.monotonic() + timeout
    try:
        for _ in range(workers * reps):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"benchmark did not finish within {timeout:g}s")
            rank, r, t0, t1 = out.get(timeout=left)
            if r < 0:
                raise RuntimeError(f"benchmark worker {rank} failed: {t0}")
            rows.setdefault(r, []).append((t0, t1))
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    rates = []
    for r in sorted(rows):
        t0 = min(a for a, _ in rows[r])
        t1 = max(b for _, b in rows[r])
        rates.append(workers * updates / (t1 - t0))
    return rates


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pslab bench ps", description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=1_000_000, help="model size in parameters (default: 1M)")
    ap.add_argument("--workers", default="1,2,4", help="comma-separated worker counts (default: 1,2,4)")
    ap.add_argument("--shards", default="1,2", help="comma-separated pslab shard counts (default: 1,2)")
    ap.add_argument("--updates", type=int, default=40, help="updates per worker per timed window (default: 40)")
    ap.add_argument("--reps", type=int, default=5, help="timed windows per configuration; median reported")
    ap.add_argument("--transport", choices=("tcp", "ipc"), default="tcp", help="pslab transport (default: tcp)")
    ap.add_argument("--no-rpc", action="store_true", help="skip the torch.distributed.rpc peer")
    a = ap.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    shapes = model_shapes(a.params)
    n = sum(int(np.prod(s)) for s in shapes.values())
    mb = 2 * 4 * n / 1e6
    workers = [int(x) for x in a.workers.split(",")]
    shards = [int(x) for x in a.shards.split(",")]
    print(f"pslab bench ps: {n:,} float32 parameters ({4 * n / 1e6:.1f} MB), async (ASP), SGD on the server, "
          f"{a.updates} updates/worker x {a.reps} windows, median; transport {a.transport}")
    print(f"{'system':<22}{'workers':>8}{'updates/s':>12}{'MB/s':>10}{'min..max upd/s':>20}")
    results: dict[tuple[str, int], float] = {}

    def row(label: str, w: int, rates: list[float]) -> None:
        med = statistics.median(rates)
        results[(label, w)] = med
        print(f"{label:<22}{w:>8}{med:>12.1f}{med * mb:>10.0f}{min(rates):>12.1f}..{max(rates):<8.1f}", flush=True)
    for w in workers:
        for s in shards:
            row(f"pslab ({s} shard{'s' if s > 1 else ''})", w, bench_pslab(w, s, shapes, a.updates, a.reps,
                                                                          a.transport))
        if not a.no_rpc:
            row("torch.distributed.rpc", w, bench_rpc(w, shapes, a.updates, a.reps))
    if not a.no_rpc:
        print("ratio pslab / torch-rpc (updates/s, same model, same run):")
        for w in workers:
            parts = [f"{s} shard{'s' if s > 1 else ''}: "
                     f"{results[(f'pslab ({s} shard' + ('s' if s > 1 else '') + ')', w)] / results[('torch.distributed.rpc', w)]:.2f}x"
                     for s in shards]
            print(f"  {w} worker{'s' if w > 1 else ''}: " + ", ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
