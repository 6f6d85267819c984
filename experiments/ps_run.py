"""The parameter-server strategies as real processes: one `ps` shard server per shard (ZeroMQ on 127.0.0.1),
K worker processes (`collectives.launch`, used for the start barrier), each looping

    pull (waits at the shard's consistency gate) -> compute on batch(w, clock) -> push (ack carries staleness)

Worker w records wait_s = time blocked in pull (gate wait + transfer) and bytes = tensor payload pushed + pulled.
Staleness: under ASP each push's ack carries its own tau. Under BSP/SSP/backup-BSP a push may be buffered until its
clock completes, and its tau arrives in the ack of whichever push completed the clock. Every worker therefore logs
all (worker, tau) pairs it sees with the shard version; `fill_staleness` replays them in version order and assigns
each worker's taus to its pushes in clock order.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

from experiments.config import RunConfig
from experiments.errors import ExperimentError
from experiments.metrics import JsonlWriter, RunDir, read_jsonl
from experiments.psbridge import optimizer_string, policy_string
from experiments.worker_common import WorkerContext
from experiments.workloads import get_params, set_params


def _server_child(cfg: Any, conn: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us; a Ctrl-C must not leave a half-dead loop
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    from ps import serve
    try:
        serve(cfg, ready=lambda addr: conn.send(("ok", addr)))
    except Exception as e:  # e.g. address in use
        conn.send(("error", f"{type(e).__name__}: {e}"))


class Servers:
    """Shard server processes (forked: they start in milliseconds); always stopped on exit."""

    def __init__(self, cfg: RunConfig, start_method: str, bind_host: str = "127.0.0.1",
                 curve_keys_dir: str | None = None):
        from ps import ServerConfig
        self.procs: list[Any] = []
        self.addresses: list[str] = []
        ctx = mp.get_context(start_method)
        try:
            for i in range(cfg.train.shards):
                sc = ServerConfig(bind=f"tcp://{bind_host}:0", shard_id=i, num_workers=cfg.train.workers,
                                  curve_keys_dir=curve_keys_dir,
                                  policy=policy_string(cfg.strategy), optimizer=optimizer_string(cfg.train),
                                  request_timeout=cfg.train.timeout_s, idle_timeout=cfg.train.timeout_s)
                parent, child = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_server_child, args=(sc, child), daemon=True, name=f"pslab-shard-{i}")
                p.start()
                child.close()
                self.procs.append(p)
                if not parent.poll(60):
                    raise ExperimentError(f"shard server {i} did not start within 60 s")
                status, info = parent.recv()
                if status != "ok":
                    raise ExperimentError(f"shard server {i} failed to start: {info}")
                self.addresses.append(info)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(3)
            if p.is_alive():
                p.kill()
                p.join(3)

    def __enter__(self) -> "Servers":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def ps_worker(group: Any, cfg_dict: dict[str, Any], run_path: str, addresses: list[str],
              curve_keys_dir: str | None = None) -> dict[str, Any]:
    import ps
    ctx = WorkerContext(cfg_dict, run_path, group.rank)
    cfg, rank = ctx.cfg, ctx.rank
    K, steps = cfg.train.workers, cfg.train.steps
    init = get_params(ctx.model)
    client = ps.connect(addresses, worker=rank, params=init, timeout=cfg.train.timeout_s,
                        curve_keys_dir=curve_keys_dir)
    taus = JsonlWriter(ctx.rundir.part_path("tau", rank))
    try:
        if rank == 0:
            client.init(init).result(cfg.train.timeout_s)
        ctx.maybe_evaluate(-1, 0)
        group.barrier()
        ctx.start_clock()
        done = 0
        while client.clocks[0] < steps:
            tw = time.perf_counter()
            pr = client.pull(copy=False).result(cfg.train.timeout_s)    # views: set_params copies them
            wait = time.perf_counter() - tw
            clock = pr.clocks[0]
            if clock >= steps:  # backup-BSP moved this worker past the last clock
                break
            set_params(ctx.model, pr.params)
            loss, grads, digest = ctx.compute(clock)
            acks = client.push(grads).result(cfg.train.timeout_s)
            a0 = acks[0]
            if a0["staleness"]:
                taus.write({"version": a0["version"], "pairs": a0["staleness"]})
            ctx.record(worker=rank, step=clock, clock=clock + 1, time_s=ctx.now(), loss=loss, staleness=None,
                       bytes_sent=sum(g.nbytes for g in grads.values()),
                       bytes_recv=sum(p.nbytes for p in pr.params.values()), wait_s=wait, batch=digest,
                       **({"dropped": True} if a0["status"] == "dropped" else {}))
            ctx.maybe_evaluate(done * K, (done + 1) * K)
            done += 1
        group.barrier()  # everyone has pushed everything
        if rank == 0:
            final = client.pull().result(cfg.train.timeout_s)
            set_params(ctx.model, final.params)
            ctx.maybe_evaluate(0, K * steps, final=True)
            stats = client.stats().result(cfg.train.timeout_s)
            group.barrier()
            return {"rank": rank, "shard_stats": stats}
        group.barrier()
        return {"rank": rank}
    finally:
        taus.close()
        client.close()
        ctx.close()


def fill_staleness(rd: RunDir) -> None:
    """Assign the logged (worker, tau) pairs to the workers' pushes (see module docstring)."""
    import json
    events = [e for p in sorted(rd.path.glob("tau.w*.jsonl")) for e in read_jsonl(p)]
    events.sort(key=lambda e: e["version"])
    per_worker: dict[int, list[int]] = {}
    for e in events:
        for w, tau in e["pairs"]:
            per_worker.setdefault(int(w), []).append(int(tau))
    ups = read_jsonl(rd.metrics_path)
    order = sorted((u for u in ups if not u.get("dropped")), key=lambda u: (u["worker"], u["step"]))
    pos: dict[int, int] = {}
    for u in order:
        w = u["worker"]
        i = pos.get(w, 0)
        if i < len(per_worker.get(w, [])):
            u["staleness"] = per_worker[w][i]
        pos[w] = i + 1
    with open(rd.metrics_path, "w") as f:
        for u in ups:
            f.write(json.dumps(u, separators=(",", ":")) + "\n")
    for p in rd.path.glob("tau.w*.jsonl"):
        p.unlink()


def run_ps(cfg: RunConfig, rd: RunDir) -> dict[str, Any]:
    """Run the workers against fresh shard servers; returns what the shards measured themselves (their staleness
    statistics and the time each worker's reads waited at the gate), for the summary."""
    import collectives
    from experiments.runner import START_METHOD
    results: list[Any] = []
    try:
        with Servers(cfg, START_METHOD) as servers:
            results = collectives.launch(ps_worker, world_size=cfg.train.workers, backend="zmq",
                               args=(cfg.to_dict(), str(rd.path), servers.addresses), timeout=cfg.train.timeout_s,
                               start_method=START_METHOD)
    except collectives.LaunchError as e:
        raise ExperimentError(f"{cfg.strategy} run failed: {str(e).splitlines()[0]}") from e
    finally:
        rd.merge_parts("metrics")
        fill_staleness(rd)
    return shard_summary(results)


def shard_summary(results: list[Any]) -> dict[str, Any]:
    """Summary fields from shard 0's own statistics, as rank 0's worker fetched them."""
    shard0 = ((results[0] or {}).get("shard_stats") or [{}])[0] if results else {}
    st = shard0.get("stats") or {}
    return {"shard_staleness_mean": st.get("mean"), "shard_staleness_max": st.get("max"),
            "gate_wait_s_total": sum(float(v) for v in (st.get("wait_seconds") or {}).values()),
            "shard_dropped": sum(int(v) for v in (st.get("dropped") or {}).values())}
