"""A shard killed (SIGKILL) in the middle of a dp=2 PS-BSP run of real engine replicas (`PSSyncStrategy`): the
launcher's supervisor hook calls `ServerGroup.check` in the parent, the shard comes back from its checkpoint on the
same address, each rank's strategy resyncs and rewinds to the restored clock (the loop's `take_rewind`), and the
run ends with the weights of single-process large-batch SGD; the strategy reports the restart."""

from __future__ import annotations

import functools
import os
import signal
from typing import Any

import pytest
import torch

from pslab import collectives
from pslab import ps
from pslab.experiments.strategies.ps import PSSyncStrategy
from pslab.parallelism.data import DataParallelEngine
from pslab.parallelism.engine import train_step
from pslab.parallelism.mesh import DeviceMesh
from pslab.parallelism.models import lm_loss, tiny_transformer

from tests.parallelism.par_helpers import MLP_FACTORY, assert_close, dp_shard, mlp_batches, plain, reference

LR, STEPS, K, KILL_AT = 0.1, 12, 3, 7
TIMEOUT = 60
CP_FACTORY = functools.partial(tiny_transformer, vocab=16, d=16, heads=4, layers=2, seq=8)   # S = 8: 2·cp chunks


def _cp_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 16, (8, 8), generator=g), torch.randint(0, 16, (8, 8), generator=g))
            for _ in range(STEPS)]


def _worker(group: Any, addresses: list[str], shard_pid: int, cp: int = 1) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = DeviceMesh(group, dp=2, cp=cp)
    if cp > 1:         # context parallel: cp rank 0 talks to the shard, cp rank 1 mirrors it (its rewind too)
        from pslab.parallelism.context import ContextParallelEngine
        replica = ContextParallelEngine(loss_fn=lm_loss).build(CP_FACTORY, mesh)
        batches = _cp_batches()
    else:
        replica = DataParallelEngine().build(MLP_FACTORY, mesh)
        batches = mlp_batches(STEPS)
    strategy = PSSyncStrategy(addresses, timeout=TIMEOUT, mirror_group=mesh.group("cp") if cp > 1 else None)
    rewinds = []
    try:
        strategy.attach(replica)
        group.barrier()
        step, killed = 0, False
        for _ in range(3 * STEPS):                      # bounded: a step advances or is redone once
            if step >= STEPS:
                break
            if step == KILL_AT and group.rank == 0 and not killed:
                killed = True
                os.kill(shard_pid, signal.SIGKILL)
            x, y = batches[step]
            train_step(replica, strategy, dp_shard(x, mesh.coord("dp"), 2), dp_shard(y, mesh.coord("dp"), 2))
            nxt = max(step + 1, strategy.clock)          # loop.py phase 5
            rewind = strategy.take_rewind()
            if rewind is not None:
                rewinds.append((step, rewind))
                nxt = rewind
            step = nxt
        group.barrier()
        strategy.refresh(replica)
        return plain({"slots": {s.name: s.param.detach().clone() for s in replica.slots()},
                      "restarts": strategy.restarts, "rewinds": rewinds,
                      "statuses": [h.status for h in strategy.history], "clock": strategy.clock,
                      "mirror": strategy.mirror})
    finally:
        strategy.close(replica)


class ShardWatch:
    """The launcher's supervisor hook: every tick, ServerGroup.check (in the parent, no thread)."""

    heartbeat_s, detect_s, elastic = 0.5, 60.0, False     # the ranks' own hang detection is not tested here
    shard_detect_s = 3.0

    def __init__(self, servers: Any) -> None:
        self.servers, self.events = servers, []

    def started(self, job: Any) -> None:
        pass

    def failed(self, job: Any, rank: int, how: str, hung: bool) -> bool:
        return False

    def message(self, job: Any, rank: int, payload: Any) -> None:
        pass

    def tick(self, job: Any) -> None:
        self.events += self.servers.check(self.shard_detect_s)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("cp", [1, 2])
def test_a_killed_shard_under_ps_bsp_is_survived_by_the_engine_run(tmp_path, cp):
    """(cp = 2: dp 2 x cp 2 of the tiny transformer; the cp ranks > 0 hold no client and take the weights, the
    clock and the rewind from their cp rank 0, so they redo the same clocks.)"""
    if cp > 1:
        ref_losses, ref_w = reference(CP_FACTORY, _cp_batches(), opt=lambda p: torch.optim.SGD(p, lr=LR),
                                      loss_fn=lm_loss)
    else:
        ref_losses, ref_w = reference(MLP_FACTORY, mlp_batches(STEPS), opt=lambda p: torch.optim.SGD(p, lr=LR))
    with ps.start_servers(1, 2, "bsp", f"sgd:lr={LR}", start_method="fork", checkpoint_dir=str(tmp_path),
                          checkpoint_every=K, request_timeout=TIMEOUT, idle_timeout=TIMEOUT) as servers:
        watch = ShardWatch(servers)
        out = collectives.launch(_worker, 2 * cp, backend="zmq", timeout=200, secret=servers.secret,
                                 supervisor=watch, args=(servers.addresses, servers.processes[0].pid, cp))
        assert [e["event"] for e in watch.events] == ["detect", "shard_restart"], watch.events
        restart = watch.events[1]
        assert restart["how"].startswith("from ") and 0 <= restart["lost_updates"] <= K
    for r in out:
        assert r["clock"] == STEPS
        assert r["rewinds"] and r["rewinds"][0][1] == restart["restored_version"]
        if r["mirror"]:
            assert r["restarts"] == [] and r["statuses"].count(["dropped"]) == 1
        else:
            assert [x["shard"] for x in r["restarts"]] == [0] and r["restarts"][0]["lost_updates"] <= K
            assert r["statuses"].count(["lost"]) == 1
        for n, w in r["slots"].items():                # the redone clocks: as if nothing had failed
            assert_close(w, ref_w[n], n)
