"""The real parameter server drives the parallelism engines' replicas (`experiments.strategies.ps.PSSyncStrategy`):
data parallel and pipeline parallel under PS-BSP match single-process training; each pipeline stage's shards hold
only that stage's parameters; PS-ASP records the exact staleness of every push."""

from __future__ import annotations

import pytest
import torch

from pslab import collectives
from pslab import ps
from pslab.experiments.strategies.ps import PSStrategyError, PSSyncStrategy, slot_group
from pslab.parallelism.data import DataParallelEngine
from pslab.parallelism.engine import train_step
from pslab.parallelism.mesh import DeviceMesh
from pslab.parallelism.pipeline import PipelineEngine

from tests.parallelism.par_helpers import MLP_FACTORY, STEPS, assert_close, dp_shard, mlp_batches, plain, reference

LR = 0.1
SERVER_OPT = {"sgd": f"sgd:lr={LR}", "momentum": f"momentum:lr={LR},momentum=0.9"}
LOCAL_OPT = {"sgd": lambda p: torch.optim.SGD(p, lr=LR),
             "momentum": lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9)}
TIMEOUT = 60


def _ps_worker(group, mesh_shape, engine_kind, addresses, ordered):
    """Train STEPS steps through the PS; `ordered`: dp rank 0 steps, then dp rank 1 (a fixed ASP interleaving)."""
    torch.set_num_threads(1)
    mesh = DeviceMesh(group, **mesh_shape)
    engine = DataParallelEngine() if engine_kind == "dp" else PipelineEngine("1f1b", micro_batches=2)
    replica = engine.build(MLP_FACTORY, mesh)
    strategy = PSSyncStrategy(addresses[slot_group(mesh)], timeout=TIMEOUT)
    dp_rank, dp_size = mesh.coord("dp"), mesh.size("dp")
    losses = []
    try:
        strategy.attach(replica)
        group.barrier()
        for x, y in mlp_batches():
            xb, yb = dp_shard(x, dp_rank, dp_size), dp_shard(y, dp_rank, dp_size)
            if not ordered:
                losses.append(train_step(replica, strategy, xb, yb))
                continue
            for turn in range(dp_size):
                if turn == dp_rank:
                    losses.append(train_step(replica, strategy, xb, yb))
                group.barrier()
        stats = strategy.shard_stats()
        return plain({"losses": losses, "coords": mesh.coords, "history": [vars(h) for h in strategy.history],
                      "slots": {s.name: s.param.detach().clone() for s in replica.slots()}, "stats": stats})
    finally:
        strategy.close()


def _run(mesh_shape, engine_kind, policy, opt, shards_per_group=1, ordered=False):
    dp, pp = mesh_shape.get("dp", 1), mesh_shape.get("pp", 1)
    servers = _servers(pp, dp, policy, SERVER_OPT[opt], shards_per_group)
    with servers:
        out = collectives.launch(_ps_worker, dp * pp, backend="zmq", timeout=TIMEOUT, secret=servers.secret,
                                 args=(mesh_shape, engine_kind, servers.group_addresses, ordered))
        held = [_shard_contents(addrs, {n: w.shape for r in out if r["coords"]["pp"] == g for n, w in
                                        r["slots"].items()}) for g, addrs in enumerate(servers.group_addresses)]
    return out, held


def _servers(groups, workers, policy, optimizer, shards=1):
    return ps.start_servers(shards, workers, policy, optimizer, groups=groups, start_method="fork",
                            request_timeout=TIMEOUT, idle_timeout=TIMEOUT)


def _shard_contents(addresses, shapes):
    """What a slot group's shards hold, read by a fresh client: {name: final value}, names from the shards' keys."""
    with ps.connect(addresses, worker=0, params=shapes, timeout=TIMEOUT) as client:
        key_to_name = {sl.key: sl.name for sl in client.partition.slices}
        names = {key_to_name.get(k, k) for meta, _ in client.registration for k in meta["keys"]}
        values = client.pull().result(TIMEOUT).params
    assert names == set(shapes), f"shards hold {sorted(names)}, the stage has {sorted(shapes)}"
    return values


def _mean_losses(out):
    """The global loss per step: the mean of the dp ranks' losses (equal shard sizes)."""
    per_rank = torch.tensor([r["losses"] for r in out], dtype=torch.float64)
    return per_rank.mean(0).tolist()


def test_dp_under_ps_bsp_matches_large_batch_sgd():
    """dp=2 under PS-BSP (2 shards, server-side SGD): per-step losses and final weights on every rank and on the
    shards equal single-process SGD on the concatenated batch (BSP's averaged gradient is the large-batch gradient);
    every clock's update has staleness 0 and each shard applied exactly STEPS versions."""
    ref_losses, ref_w = reference(MLP_FACTORY, mlp_batches(), opt=LOCAL_OPT["sgd"])
    out, held = _run({"dp": 2}, "dp", "bsp", "sgd", shards_per_group=2)
    assert_close(_mean_losses(out), ref_losses, "losses")
    for r in out + [{"slots": held[0]}]:
        assert set(r["slots"]) == set(ref_w)
        for n, w in r["slots"].items():
            assert_close(w, ref_w[n], n)
    for r in out:
        assert [h["clock"] for h in r["history"]] == list(range(STEPS))
        for st in r["stats"]:
            assert st["version"] == STEPS and st["clocks"] == [STEPS, STEPS]
            assert st["stats"]["count"] == 2 * STEPS and st["stats"]["max"] == 0


@pytest.mark.parametrize("mesh_shape", [{"pp": 2}, {"dp": 2, "pp": 2}], ids=["pp2", "dp2xpp2"])
def test_pipeline_under_ps_bsp_matches_single_process(mesh_shape):
    """A 1F1B pipeline (and dp x pp) under PS-BSP with one shard set per stage and server-side momentum SGD gives
    the single-process per-step losses and final weights; each stage's shards hold exactly that stage's
    parameters (the stages partition the model) with the reference values, and count only their own D workers."""
    ref_losses, ref_w = reference(MLP_FACTORY, mlp_batches(), opt=LOCAL_OPT["momentum"])
    out, held = _run(mesh_shape, "pp", "bsp", "momentum")
    dp = mesh_shape.get("dp", 1)
    last_stage = [r for r in out if r["coords"]["pp"] == 1]
    assert_close(_mean_losses(last_stage), ref_losses, "losses")
    for r in out:
        stage_names = set(held[r["coords"]["pp"]])
        assert set(r["slots"]) == stage_names
        for n, w in r["slots"].items():
            assert_close(w, ref_w[n], n)
        assert all(st["clocks"] == [STEPS] * dp and st["version"] == STEPS for st in r["stats"])
    assert held[0].keys().isdisjoint(held[1].keys()) and held[0].keys() | held[1].keys() == set(ref_w)
    for values in held:
        for n, w in values.items():
            assert_close(w, ref_w[n], f"shard value {n}")


def _asp_replay(batches):
    """Single-process replay of the ordered ASP run: worker 0 then worker 1 each step, each computing its gradient
    on the weights of its own last pull and applying it at once (SGD); returns per-worker losses, the weights each
    worker pulled last, and the final weights."""
    model = MLP_FACTORY()
    w = {n: p.detach().clone() for n, p in model.named_parameters()}
    read = [dict(w), dict(w)]
    losses: list[list[float]] = [[], []]
    for x, y in batches:
        for k in range(2):
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(read[k][n])
            model.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(dp_shard(x, k, 2)), dp_shard(y, k, 2))
            loss.backward()
            w = {n: w[n] - LR * p.grad for n, p in model.named_parameters()}
            read[k] = dict(w)
            losses[k].append(float(loss.detach()))
    return losses, read, w


def test_dp_under_ps_asp_records_exact_staleness():
    """dp=2 under PS-ASP, with worker 0 stepping before worker 1 each step: the run completes, every push is
    applied at once with staleness tau = (shard version) - (version read) -- worker 0: 0 then 1s, worker 1: all 1s
    -- recorded both in the strategy's per-step history and in the shard's histogram, and losses and final weights
    equal a single-process replay of that stale-gradient interleaving."""
    out, held = _run({"dp": 2}, "dp", "asp", "sgd", ordered=True)
    expected = {0: [0] + [1] * (STEPS - 1), 1: [1] * STEPS}
    for r in out:
        w = r["coords"]["dp"]
        assert [h["status"] for h in r["history"]] == [["applied"]] * STEPS
        got = [[[tuple(pair) for pair in shard] for shard in h["staleness"]] for h in r["history"]]
        assert got == [[[(w, t)]] for t in expected[w]]
        summary = r["stats"][0]["stats"]
        assert summary["count"] == 2 * STEPS
        for k, taus in expected.items():
            hist = {int(t): c for t, c in summary["per_worker"][str(k)]["histogram"].items()}
            assert hist == {t: taus.count(t) for t in set(taus)}
    ref_losses, ref_read, ref_w = _asp_replay(mlp_batches())
    for r in out:
        k = r["coords"]["dp"]
        assert_close(r["losses"], ref_losses[k], "losses")
        for n, w in r["slots"].items():
            assert_close(w, ref_read[k][n], n)
    for n, w in held[0].items():
        assert_close(w, ref_w[n], f"shard value {n}")


def _mismatch_worker(group, addresses):
    torch.set_num_threads(1)
    replica = DataParallelEngine().build(MLP_FACTORY, DeviceMesh(group, dp=2))
    strategy = PSSyncStrategy(addresses, timeout=TIMEOUT)
    try:
        strategy.attach(replica)
    except PSStrategyError as e:
        return str(e)
    finally:
        strategy.close()
    return None


def test_attach_rejects_shards_sized_for_another_dp_group():
    """Shards started for 1 worker cannot serve a dp=2 group: attach raises PSStrategyError saying to start one
    shard set per slot group with num_workers = dp size (instead of hanging at the BSP gate or mis-averaging)."""
    with _servers(1, 1, "bsp", SERVER_OPT["sgd"]) as servers:
        out = collectives.launch(_mismatch_worker, 2, backend="zmq", timeout=TIMEOUT, secret=servers.secret,
                                 args=(servers.group_addresses[0],))
    assert all(msg is not None and "num_workers = dp size" in msg for msg in out), out


def _tp_worker(group, addresses, steps):
    from pslab.parallelism.models import lm_loss
    from pslab.parallelism.tensor import TensorParallelEngine
    from tests.parallelism.par_helpers import TF_FACTORY, tf_batches
    torch.set_num_threads(1)
    mesh = DeviceMesh(group, dp=2, tp=2)
    replica = TensorParallelEngine(loss_fn=lm_loss).build(TF_FACTORY, mesh)
    strategy = PSSyncStrategy(addresses[slot_group(mesh)], timeout=TIMEOUT, shared_group=mesh.group("tp"))
    try:
        strategy.attach(replica)
        for x, y in tf_batches(steps):
            xb, yb = dp_shard(x, mesh.coord("dp"), 2), dp_shard(y, mesh.coord("dp"), 2)
            train_step(replica, strategy, xb, yb)
        strategy.refresh(replica)
        return plain({"coords": mesh.coords, "replicated": {s.name: s.param.detach().clone()
                                                            for s in replica.slots() if "#tp" not in s.name}})
    finally:
        strategy.close(replica)


@pytest.mark.timeout(90)
def test_tp_ranks_of_a_worker_share_one_copy_of_the_replicated_tensors_under_asp():
    """dp=2 x tp=2 under PS-ASP: the two workers' pushes race, yet the two tp ranks of each worker always hold the
    same LayerNorm / embedding / bias values (tp rank 0's shard set owns them and broadcasts), bit for bit."""
    with _servers(2, 2, "asp", SERVER_OPT["sgd"]) as servers:
        out = collectives.launch(_tp_worker, 4, backend="zmq", timeout=TIMEOUT, secret=servers.secret,
                                 args=(servers.group_addresses, 12))
    for d in (0, 1):
        a, b = [r["replicated"] for r in out if r["coords"]["dp"] == d]
        assert a.keys() == b.keys() and len(a) > 4
        for n in a:
            assert (a[n] == b[n]).all(), n
