"""`pslab bench ps`: push+pull throughput of pslab's parameter server against the torch.distributed.rpc
parameter-server pattern of PyTorch's tutorials, on the same ~1M-parameter model, in the same run.

One "update" = a worker sends one gradient for every parameter and gets the fresh weights back:
  pslab  client.push_pull(grads, copy=False): one request per shard that applies the gradient and answers with the
         new weights. The client is on the shards' host, so payloads go through shared memory and nothing is copied
         on the worker: the gradient lies in the push segment (`grad_buffers`, where a training loop would let
         backward write it) and the weights arrive as read-only views of the shard's reply segment (valid until
         the next pull; a training loop copies them into its model, as it would copy rpc's tensors). The shard
         reads the gradient in place and makes one copy of the weights. ASP, server-side SGD, 1 or 2 shards;
  rpc    rpc_sync(ps, update_and_fetch_model, grads): the PS applies SGD under a lock and returns the parameters
         (the pattern of "Implementing Batch RPC Processing Using Asynchronous Executions", without batching, and
         returning the parameter tensors rather than the pickled module);
  ray    (--peers rpc,ray) Ray's actor PS, the Ray docs' pattern (experiments/bench/ray_ps.py): a worker actor calls
         ray.get(ps.update_and_fetch.remote(grads)) and copies the weights into its model buffers.
No compute: gradients are fixed random tensors, so the figure is the PS's transport + apply cost. Each worker is a
process with torch.set_num_threads(1). For one worker count, every system (pslab with each shard count, torch rpc)
is started once and stopped (SIGSTOP) outside its own timed windows -- idle torch-rpc processes busy-poll and would
otherwise eat the CPU of the system being timed; the windows of the systems alternate round by round (order
reversed every other round), so a load change on a shared machine hits all of them alike. Reported: the median
updates/s over `--reps` windows of `--updates` updates per worker (all workers counted; MB/s = updates/s x 2 x
model bytes), and the median over rounds of the per-round pslab / peer ratio. Ray's processes are not stopped
between windows (see RaySystem).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import statistics
import sys
import time
import warnings
from typing import Any

import numpy as np

from pslab.experiments.bench import free_port


def model_shapes(params: int) -> dict[str, tuple[int, ...]]:
    """A two-layer MLP with about `params` parameters: d x d + d + d x 10 + 10."""
    d = max(8, int((params - 10) ** 0.5) - 6)
    return {"fc1.weight": (d, d), "fc1.bias": (d,), "fc2.weight": (10, d), "fc2.bias": (10,)}


def _tensors(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(np.float32) * 0.01 for k, s in shapes.items()}


# ---------------------------------------------------------------------------------------------- pslab
def _pslab_worker(rank: int, addresses: list[str], shapes: dict, updates: int, reps: int, barrier: Any,
                  out: Any, secret: str | None = None) -> None:
    import torch
    torch.set_num_threads(1)
    from pslab.ps.client import connect
    try:
        with connect(addresses, rank, shapes, timeout=120, secret=secret) as c:
            if rank == 0:
                c.init(_tensors(shapes, 0)).result(120)
            c.pull().result(120)
            grads = c.grad_buffers()           # the push segment itself (same host): pushing copies nothing
            for k, v in _tensors(shapes, 100 + rank).items():
                grads[k][...] = v

            def update() -> None:
                c.push_pull(grads, copy=False).result(120)   # weights arrive as views of the reply segment
            for _ in range(3):
                update()
            for r in range(reps):
                barrier.wait(600)              # the parent opens each window
                t0 = time.monotonic()
                for _ in range(updates):
                    update()
                out.put((rank, r, t0, time.monotonic()))
    except BaseException as e:
        out.put((rank, -1, repr(e), 0.0))
        raise


class _Processes:
    """K timed worker processes reporting (rank, window, t0, t1) on a queue; the parent opens each window through a
    barrier of `parties`. Subclasses start the processes (and whatever serves them)."""

    label = ""

    def __init__(self, workers: int, updates: int, parties: int) -> None:
        ctx = mp.get_context("spawn")
        self.ctx, self.workers, self.updates = ctx, workers, updates
        self.out, self.barrier = ctx.Queue(), ctx.Barrier(parties)
        self.procs: list[Any] = []

    def _start(self, target: Any, argsets: list[tuple]) -> None:
        self.procs = [self.ctx.Process(target=target, args=a, daemon=True) for a in argsets]
        for p in self.procs:
            p.start()

    def window(self, r: int) -> float:
        self.barrier.wait(600)
        return _collect(self.out, r, self.workers, self.updates)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self) -> None:
        _signal(self.pids(), signal.SIGCONT)
        _stop(self.procs)


class PslabSystem(_Processes):
    """Shard servers + K worker processes, idle between windows."""

    def __init__(self, workers: int, shards: int, shapes: dict, updates: int, reps: int, transport: str) -> None:
        from pslab.ps import start_servers
        super().__init__(workers, updates, workers + 1)
        self.label = f"pslab ({shards} shard{'s' if shards > 1 else ''})"
        self.servers = start_servers(shards, workers, "asp", "sgd:lr=0.001", transport=transport, idle_timeout=900)
        self._start(_pslab_worker, [(w, self.servers.addresses, shapes, updates, reps, self.barrier, self.out,
                                     self.servers.secret) for w in range(workers)])

    def pids(self) -> list[int]:
        return super().pids() + [p.pid for p in self.servers.processes if p is not None]

    def stop(self) -> None:
        super().stop()
        self.servers.stop()


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


def _rpc_window(ps_rref: Any, rank: int, shapes: dict, updates: int, warmup: int) -> tuple[float, float]:
    import torch
    import torch.distributed.rpc as rpc
    grads = [torch.from_numpy(v) for v in _tensors(shapes, 100 + rank).values()]
    owner = ps_rref.owner()
    for _ in range(warmup):
        rpc.rpc_sync(owner, ParameterServer.update_and_fetch_model, args=(ps_rref, grads))
    t0 = time.monotonic()
    for _ in range(updates):
        rpc.rpc_sync(owner, ParameterServer.update_and_fetch_model, args=(ps_rref, grads))
    return t0, time.monotonic()


def _rpc_proc(rank: int, world: int, port: int, shapes: dict, updates: int, reps: int, barrier: Any,
              out: Any) -> None:
    import torch
    torch.set_num_threads(1)
    import torch.distributed.rpc as rpc
    # torch's own rpc.shutdown() calls a gloo collective the deprecated way and warns about it (torch 2.x,
    # distributed_c10d._get_object_coll_device); the peer is torch's code, not ours: silence exactly that warning
    warnings.filterwarnings("ignore", message="You are using a Backend .* as a ProcessGroup", category=UserWarning)
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=600,
                                           num_worker_threads=8)
    name = "ps" if rank == 0 else f"worker{rank}"
    try:
        rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=opts)
        if rank == 0:
            ps_rref = rpc.RRef(ParameterServer(shapes))
            for w in range(1, world):      # warm-up, outside the timed windows
                rpc.rpc_sync(f"worker{w}", _rpc_window, args=(ps_rref, w, shapes, 0, 3))
            for r in range(reps):          # the parent opens each window; all workers start together
                barrier.wait(600)
                futs = [rpc.rpc_async(f"worker{w}", _rpc_window, args=(ps_rref, w, shapes, updates, 0))
                        for w in range(1, world)]
                for w, f in zip(range(1, world), futs):
                    t0, t1 = f.wait()
                    out.put((w - 1, r, t0, t1))
        rpc.shutdown()
    except BaseException as e:
        out.put((rank, -1, repr(e), 0.0))
        raise


class RpcSystem(_Processes):
    """torch.distributed.rpc: one PS process + K worker processes (TensorPipe), idle between windows."""

    label = "torch.distributed.rpc"

    def __init__(self, workers: int, shapes: dict, updates: int, reps: int) -> None:
        super().__init__(workers, updates, 2)
        port = free_port()
        self._start(_rpc_proc, [(r, workers + 1, port, shapes, updates, reps, self.barrier, self.out)
                                for r in range(workers + 1)])


class RaySystem:
    """Ray's actor PS (experiments/bench/ray_ps.py), same model and windows. Its processes are not stopped between
    windows: idle Ray actors block instead of spinning, and a stopped raylet would fail Ray's health checks."""

    label = "ray (actor PS)"

    def __init__(self, workers: int, shapes: dict, updates: int, reps: int) -> None:
        from pslab.experiments.bench.ray_ps import RayPS
        self.updates = updates
        self.ps = RayPS(shapes, workers)

    def pids(self) -> list[int]:
        return []

    def window(self, r: int) -> float:
        return self.ps.window(self.updates)

    def stop(self) -> None:
        self.ps.close()


PEERS = {"rpc": RpcSystem, "ray": RaySystem}


# ---------------------------------------------------------------------------------------------- common
def _collect(out: Any, r: int, workers: int, updates: int, timeout: float = 600) -> float:
    """Wait for every worker's (t0, t1) of window r; updates/s over the union of their intervals."""
    rows = []
    deadline = time.monotonic() + timeout
    while len(rows) < workers:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"benchmark window {r} did not finish within {timeout:g}s")
        rank, rr, t0, t1 = out.get(timeout=left)
        if rr < 0:
            raise RuntimeError(f"benchmark worker {rank} failed: {t0}")
        if rr != r:
            raise RuntimeError(f"benchmark worker {rank} reported window {rr} during window {r}")
        rows.append((t0, t1))
    return workers * updates / (max(b for _, b in rows) - min(a for a, _ in rows))


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _stop(procs: list) -> None:
    for p in procs:
        p.join(10)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pslab bench ps", description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=1_000_000, help="model size in parameters (default: 1M)")
    ap.add_argument("--workers", default="1,2,4", help="comma-separated worker counts (default: 1,2,4)")
    ap.add_argument("--shards", default="1,2", help="comma-separated pslab shard counts (default: 1,2)")
    ap.add_argument("--updates", type=int, default=400,
                    help="updates per worker per timed window (default: 400; shorter windows are noisier)")
    ap.add_argument("--reps", type=int, default=5, help="timed windows per configuration; median reported")
    ap.add_argument("--transport", choices=("tcp", "ipc"), default="tcp", help="pslab transport (default: tcp)")
    ap.add_argument("--peers", default="rpc",
                    help="comma-separated peers in the same run: rpc (torch.distributed.rpc), ray (Ray's actor PS; "
                         "pip install -e '.[bench]'), or none (default: rpc)")
    ap.add_argument("--no-rpc", action="store_true", help="the same as --peers none")
    a = ap.parse_args(argv)
    peers = [] if a.no_rpc else [x.strip() for x in a.peers.split(",") if x.strip() and x.strip() != "none"]
    if any(x not in PEERS for x in peers):
        raise SystemExit(f"pslab bench ps: --peers takes a comma-separated list of {', '.join(PEERS)} or none, "
                         f"got {a.peers!r}")
    if "ray" in peers:
        import importlib.util
        if importlib.util.find_spec("ray") is None:
            raise SystemExit("pslab bench ps: the ray peer needs Ray: pip install -e '.[bench]'")
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
    ratios: dict[tuple[str, int, int], float] = {}
    shard_ratios: dict[tuple[int, int], float] = {}
    for w in workers:
        systems: list[Any] = []
        try:   # all systems of this worker count stay up; their windows alternate, so load drifts hit all alike
            for sh in shards:
                systems.append(PslabSystem(w, sh, shapes, a.updates, a.reps, a.transport))
            for peer in peers:
                systems.append(PEERS[peer](w, shapes, a.updates, a.reps))
            rates: dict[str, list[float]] = {sys_.label: [] for sys_ in systems}
            for sys_ in systems:      # a system runs only during its own windows (idle torch-rpc processes spin)
                _signal(sys_.pids(), signal.SIGSTOP)
            for r in range(a.reps):
                order = systems if r % 2 == 0 else systems[::-1]
                for sys_ in order:
                    _signal(sys_.pids(), signal.SIGCONT)
                    rates[sys_.label].append(sys_.window(r))
                    _signal(sys_.pids(), signal.SIGSTOP)
        finally:
            for sys_ in systems:
                sys_.stop()
        for label, rr in rates.items():
            med = statistics.median(rr)
            results[(label, w)] = med
            print(f"{label:<22}{w:>8}{med:>12.1f}{med * mb:>10.0f}{min(rr):>12.1f}..{max(rr):<8.1f}", flush=True)
        for peer in peers:
            for sh in shards:
                label = f"pslab ({sh} shard{'s' if sh > 1 else ''})"
                per_round = [x / y for x, y in zip(rates[label], rates[PEERS[peer].label])]
                ratios[(peer, w, sh)] = statistics.median(per_round)
        if len(shards) > 1:       # more shards against the first count, round by round (same load)
            first = rates[f"pslab ({shards[0]} shard{'s' if shards[0] > 1 else ''})"]
            for sh in shards[1:]:
                per_round = [x / y for x, y in zip(rates[f"pslab ({sh} shard{'s' if sh > 1 else ''})"], first)]
                shard_ratios[(w, sh)] = statistics.median(per_round)
    for peer in peers:
        name = {"rpc": "torch-rpc", "ray": "ray"}[peer]
        print(f"ratio pslab / {name} updates/s (median over rounds of the per-round ratio; same model, same run):")
        for w in workers:
            print(f"  {w} worker{'s' if w > 1 else ''}: " + ", ".join(
                f"{sh} shard{'s' if sh > 1 else ''}: {ratios[(peer, w, sh)]:.2f}x" for sh in shards))
    if shard_ratios:
        print(f"ratio pslab N shards / {shards[0]} shard{'s' if shards[0] > 1 else ''} updates/s (median over rounds "
              "of the per-round ratio; same run):")
        for w in workers:
            print(f"  {w} worker{'s' if w > 1 else ''}: " + ", ".join(
                f"{sh} shard{'s' if sh > 1 else ''}: {shard_ratios[(w, sh)]:.2f}x" for sh in shards[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
