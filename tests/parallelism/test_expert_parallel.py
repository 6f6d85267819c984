"""Expert parallelism (parallelism/expert.py) against the single-process MoE: layer parity (with and without
dropping), all-to-all bytes, dp x ep training, export and snapshots."""

from __future__ import annotations

import functools

import pytest
import torch

from pslab import collectives
from pslab.parallelism.comm import Comm
from pslab.parallelism.engine import AllReduceStrategy, EngineError
from pslab.parallelism.expert import ExpertParallelEngine, ExpertParallelMoE, all_to_all_bytes_per_step
from pslab.parallelism.export import gather_full_state
from pslab.parallelism.mesh import DeviceMesh
from pslab.parallelism.models import lm_loss, tiny_moe_transformer
from pslab.parallelism.moe import MoE, capacity, moe_aux_loss, moe_layers
from pslab.parallelism import state_io
from pslab.parallelism.snapshot import capture, restore_into

from tests.parallelism.par_helpers import (GLOO_HEADER, adam_attention, assert_close, plain, run_training, sgd,
                                          tf_batches)

B, S, D, E = 8, 4, 8, 4          # layer tests: global batch of B samples of S tokens of width D, E experts
STEPS = 3


def _layer(k: int, cf: float, groups: int, gs: int | None = None):
    """The seeded MoE layer and its input / output weights (identical on every rank and in the reference)."""
    torch.manual_seed(0)
    layer = MoE(D, E, top_k=k, capacity_factor=cf, groups=groups, aux_weight=0.1, group_samples=gs)
    g = torch.Generator().manual_seed(1)
    return layer, torch.randn(B, S, D, generator=g), torch.randn(B, S, D, generator=g)


def _layer_worker(group, dp: int, ep: int, k: int, cf: float, groups_total: int, gs: int | None):
    """Rank (dp d, ep s) runs the EP layer on sample chunk d·ep + s of the global batch; loss (out·w).sum() + aux."""
    torch.set_num_threads(1)
    mesh = DeviceMesh(group, dp=dp, ep=ep)
    full, x, w = _layer(k, cf, groups_total // dp, gs)
    layer = ExpertParallelMoE(full, Comm(mesh.group("ep")), site="moe")
    xs = torch.tensor_split(x, dp * ep)[group.rank].clone().requires_grad_(True)
    ws = torch.tensor_split(w, dp * ep)[group.rank]
    out = layer(xs)
    ((out * ws).sum() + layer.last_aux).backward()
    return plain({"out": out.detach(), "xgrad": xs.grad, "router": layer.router.weight.grad,
                  "experts": {int(e): {n: p.grad for n, p in m.named_parameters()} for e, m in layer.experts.items()},
                  "kept": layer.last_routing.kept, "dropped": layer.last_stats["dropped"],
                  "by_kind": layer.comm.log.by_kind(wire=False), "wire": layer.comm.log.by_kind(),
                  "by_site": layer.comm.log.by_site(), "capacity": layer.last_routing.capacity,
                  "calls": layer.comm.log.calls("all_to_all")})


LAYER_CASES = [  # backend, dp, ep, top_k, capacity_factor, groups over the global batch, samples per group or None
    ("zmq", 1, 2, 2, 2.0, 2, None), ("torch", 1, 2, 1, 4.0, 4, None), ("zmq", 2, 2, 2, 2.0, 4, None),
    ("torch", 1, 4, 2, 2.0, 4, None), ("zmq", 1, 2, 2, 0.5, 2, None), ("torch", 1, 2, 1, 0.5, 4, None),
    ("zmq", 1, 4, 1, 0.75, 4, None), ("torch", 2, 2, 2, 0.5, 4, None), ("zmq", 1, 2, 2, 1.0, 8, 1),
]


@pytest.mark.parametrize("backend,dp,ep,k,cf,groups,gs", LAYER_CASES)
def test_ep_layer_equals_single_process(backend, dp, ep, k, cf, groups, gs):
    """The EP layer on dp x ep ranks equals the single-process MoE on the global batch (same groups): forward
    output, input gradient, every expert's gradients and the router gradient (rtol 1e-5), the same admitted
    assignments and dropped counts, with nothing dropped (cf·k >= E) and under dropping (cf·k < E). The
    all-to-all bytes equal the formula: 2 forward + 2 backward messages of (G/ep)·E·C·d floats."""
    ref, x, w = _layer(k, cf, groups, gs)
    x.requires_grad_(True)
    out = ref(x)
    ((out * w).sum() + dp * ep * ref.last_aux).backward()   # Σ over ranks of their aux = dp·ep · the mean
    res = collectives.launch(_layer_worker, dp * ep, backend=backend, args=(dp, ep, k, cf, groups, gs), timeout=90)
    chunks = lambda t: torch.tensor_split(t, dp * ep)                            # noqa: E731
    kept = torch.tensor_split(ref.last_routing.kept, dp * ep)                    # whole groups per rank
    for r, got in enumerate(res):
        assert_close(got["out"], chunks(out.detach())[r], f"rank {r} output")
        assert_close(got["xgrad"], chunks(x.grad)[r], f"rank {r} input grad")
        assert (torch.as_tensor(got["kept"]) == kept[r]).all(), f"rank {r} admitted assignments"
    assert_close(sum(torch.as_tensor(g["router"]) for g in res), ref.router.weight.grad, "router grad")
    for e in range(E):
        for n, p in ref.experts[e].named_parameters():
            assert_close(sum(torch.as_tensor(g["experts"][e][n]) for g in res if e in g["experts"]), p.grad,
                         f"expert {e} {n}")
    assert sorted(e for g in res for e in g["experts"]) == sorted(list(range(E)) * dp)
    dropped = sum(torch.as_tensor(g["dropped"]) for g in res)
    assert dropped.tolist() == ref.last_stats["dropped"].tolist()
    assert (dropped.sum() > 0) == (cf * k < E)
    C = capacity(B * S // groups, E, k, cf)
    for got in res:
        assert got["capacity"] == C
        want = all_to_all_bytes_per_step(groups // (dp * ep), E, C, D, ep)
        assert got["by_kind"]["all_to_all"] == want == got["by_site"]["moe"]
        if backend == "zmq":        # counted per slice sent: (ep−1)/ep of the buffer leaves the rank
            assert got["wire"]["all_to_all"] == pytest.approx(want * (ep - 1) / ep)
        else:                       # the kernel's count on gloo's connections: + 3(ep−1) headers of 48 B a call
            framing = got["calls"] * 3 * (ep - 1) * GLOO_HEADER
            assert want * (ep - 1) / ep < got["wire"]["all_to_all"] <= want * (ep - 1) / ep + framing


# ---- training: ExpertParallelEngine + AllReduceStrategy on dp x ep --------------------------------------------------

MOE_CFG = dict(vocab=16, d=16, heads=4, layers=2, seq=6, experts=4, top_k=2, capacity_factor=1.0, aux_weight=0.05)


def _factory(groups: int):
    return functools.partial(tiny_moe_transformer, **MOE_CFG, groups=groups)


def _reference(groups: int | None, steps: int = STEPS, opt=sgd):
    """Single-process training of the MoE model on the global batches: task loss + aux loss, SGD with momentum (or
    `opt`); groups None: routing groups of one sequence (the pipeline tests' model)."""
    model = (_factory(groups) if groups is not None else _pp_factory())()
    opt = opt(list(model.parameters()))
    losses = []
    for x, y in tf_batches(steps):
        loss = lm_loss(model(x), y) + moe_aux_loss(model)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    stats = {n: m.pop_stats() for n, m in moe_layers(model)}
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, stats


def _train_worker(group, mesh_shape: dict[str, int], groups: int, ckpt: str | None):
    torch.set_num_threads(1)
    strategy = AllReduceStrategy(sgd)
    mesh, replica, losses = run_training(group, ExpertParallelEngine(loss_fn=lm_loss), _factory(groups),
                                         tf_batches(STEPS), mesh_shape, strategy=strategy)
    by_kind, by_site = replica.log.by_kind(wire=False), replica.log.by_site()
    stats = replica.moe_stats(reduce=True)
    slots = replica.slots()
    experts = {s.name: bool(getattr(s.param, "_ep_expert", False)) for s in slots}
    state = gather_full_state(replica, mesh)
    if ckpt is not None:
        state_io.save(ckpt, STEPS, replica, strategy, mesh, "moe-test")
    tensors, meta = capture(replica, strategy)
    stored = [p["name"] for p in capture(replica, strategy, mesh)[1]["pieces"]]
    before = {s.name: s.param.detach().clone() for s in slots}
    momentum = {s.name: strategy.optimizer.state[s.param]["momentum_buffer"].clone() for s in slots}
    with torch.no_grad():
        for s in slots:
            s.param.add_(1.0)
            strategy.optimizer.state[s.param]["momentum_buffer"].zero_()
    restore_into(replica, strategy, tensors, meta)
    restored = all(torch.equal(s.param, before[s.name]) and
                   torch.equal(strategy.optimizer.state[s.param]["momentum_buffer"], momentum[s.name])
                   for s in slots)
    return plain({"losses": losses, "slots": before, "experts": experts, "coords": mesh.coords, "stats": stats,
                  "by_kind": by_kind, "by_site": by_site, "state": state, "stored": stored, "restored": restored})


def _resume_worker(group, mesh_shape: dict[str, int], groups: int, ckpt: str):
    """Load the dp 2 x ep 2 checkpoint into another layout and train one more step (checking on the way that a
    second forward_backward accumulates gradients)."""
    torch.set_num_threads(1)
    mesh = DeviceMesh(group, **mesh_shape)
    replica = ExpertParallelEngine(loss_fn=lm_loss).build(_factory(groups), mesh)
    strategy = AllReduceStrategy(sgd)
    strategy.attach(replica)
    loaded = state_io.load(ckpt, replica, strategy, mesh, "moe-test")
    x, y = tf_batches(STEPS + 1)[-1]
    loss = replica.forward_backward(x, y)
    once = {s.name: s.grad.clone() for s in replica.slots()}
    replica.forward_backward(x, y)             # accumulates: every gradient doubles (replicas not summed twice)
    doubled = all(torch.allclose(s.grad, 2 * once[s.name], rtol=1e-5, atol=1e-7) for s in replica.slots())
    for s in replica.slots():
        s.param.grad = once[s.name]
    strategy.step(replica)
    return plain({"step": loaded.step, "loss": loss, "slots": {s.name: s.param.detach() for s in replica.slots()},
                  "doubled": doubled})


@pytest.mark.parametrize("backend", ["zmq", "torch"])
def test_ep_training_equals_single_process(backend, tmp_path):
    """dp 2 x ep 2, AllReduceStrategy(SGD momentum), 3 steps, top-2 with cf 1.0 (some tokens dropped): per-step
    losses (task + aux) and every rank's slots equal single-process training on the global batch with the same
    groups (2 per worker = 4 in all); expert slots (marked _ep_expert, full-model names) live on their ep rank only;
    moe_stats(reduce=True) equals the reference's routed/dropped counts; all-to-all bytes equal the formula and the
    replicated gradients are summed over ep at site "ep grads"; gather_full_state gives the reference's final state;
    capture/restore_into puts weights and momentum back exactly; a checkpoint's ep rank 1 stores only
    its experts; (zmq) the state_io checkpoint loaded on ep 4 trains one more step exactly like the reference."""
    ref_losses, ref_w, ref_stats = _reference(groups=4)
    ckpt = str(tmp_path / "ckpt") if backend == "zmq" else None
    res = collectives.launch(_train_worker, 4, backend=backend, args=({"dp": 2, "ep": 2}, 2, ckpt), timeout=120)
    for r in res:
        assert_close(r["losses"], ref_losses, "losses")
        ep = r["coords"]["ep"]
        for n, p in r["slots"].items():
            assert_close(p, ref_w[n], n)
            if r["experts"][n]:
                assert int(n.split(".experts.")[1].split(".")[0]) // 2 == ep, n
        assert {n for n, is_e in r["experts"].items() if not is_e} == {n for n in ref_w if ".experts." not in n}
        assert r["restored"]
        if r["coords"]["dp"] == 1:
            assert r["stored"] == []                    # dp 0's ranks store the replica
        elif ep == 1:
            assert r["stored"] and all(".experts." in n for n in r["stored"])
        C = capacity(2 * 6, 4, 2, 1.0)
        assert r["by_kind"]["all_to_all"] == STEPS * all_to_all_bytes_per_step(1, 4, C, 16, ep=2, moe_layers=2)
        assert set(r["by_site"]) == {"1.mlp", "2.mlp", "ep grads", "grads"}
    assert set().union(*(r["slots"] for r in res)) == set(ref_w)
    for layer, st in ref_stats.items():
        for k in ("routed", "dropped"):
            got = sum(torch.as_tensor(r["stats"][layer][k]) for r in res if r["coords"]["ep"] == 0)
            assert got.tolist() == st[k].tolist(), (layer, k)
    assert sum(ref_stats["1.mlp"]["dropped"]) + sum(ref_stats["2.mlp"]["dropped"]) > 0
    assert set(res[0]["state"]) == set(ref_w) and all(r["state"] is None for r in res[1:])
    for n, p in res[0]["state"].items():
        assert_close(p, ref_w[n], f"exported {n}")
    if ckpt is not None:       # the sharded checkpoint re-cut for ep 4 (1 x 4) resumes the reference exactly
        more_losses, more_w, _ = _reference(groups=4, steps=STEPS + 1)
        out = collectives.launch(_resume_worker, 4, backend=backend, args=({"ep": 4}, 4, ckpt), timeout=120)
        for r in out:
            assert r["step"] == STEPS and r["doubled"]
            assert_close(r["loss"], more_losses[-1], "loss after resume")
            for n, p in r["slots"].items():
                assert_close(p, more_w[n], f"resumed {n}")
        assert set().union(*(r["slots"] for r in out)) == set(more_w)


class _FakeGroup:
    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.world_size = rank, size


def test_impossible_layouts_are_refused():
    """E % ep != 0 and groups % ep != 0 are EngineErrors with a one-line message saying what to change."""
    with pytest.raises(EngineError, match="4 experts cannot be split over ep = 3"):
        ExpertParallelMoE(MoE(D, 4), Comm(_FakeGroup(0, 3)))
    with pytest.raises(EngineError, match="groups = 3 is not a multiple of ep = 2"):
        ExpertParallelMoE(MoE(D, 4, groups=3), Comm(_FakeGroup(0, 2)))


# ---- MoE in a pipeline: each stage's aux loss in its own backward; experts over ep inside the stages ---------------

OPTS = {"sgd": sgd, "adam": adam_attention}


def _pp_factory():
    return functools.partial(tiny_moe_transformer, **MOE_CFG, group_samples=1)   # capacity per sequence


def _pp_worker(group, mesh_shape, v, opt):
    from pslab.parallelism.pipeline import PipelineEngine
    torch.set_num_threads(1)
    engine = PipelineEngine("1f1b", 2, loss_fn=lm_loss, virtual_stages=v)
    mesh, replica, losses = run_training(group, engine, _pp_factory(), tf_batches(STEPS), mesh_shape,
                                         strategy=AllReduceStrategy(OPTS[opt]))
    return plain({"losses": losses, "state": gather_full_state(replica, mesh), "by_site": replica.log.by_site(),
                  "coords": mesh.coords, "stats": replica.moe_stats()})


@pytest.mark.parametrize("backend,mesh_shape,v,opt", [
    ("zmq", {"pp": 2, "ep": 2}, 1, "sgd"),
    ("torch", {"dp": 2, "pp": 2}, 1, "adam"),
    ("zmq", {"dp": 2, "pp": 2, "ep": 2}, 2, "sgd"),
])
def test_moe_in_a_pipeline_matches_single_process(backend, mesh_shape, v, opt):
    """A mixture-of-experts model cut into pipeline stages (with ep: each stage's experts over its ep group, a sample
    chunk per ep rank; interleaved too): every stage adds its MoE layers' load-balancing loss of each micro-batch
    to that micro-batch's backward, so the per-step losses (task + aux, summed over the stages) and the gathered
    model equal one process's; the routed counts over all ranks equal the reference's."""
    ref_losses, ref_w, _ = _reference(None, opt=OPTS[opt])
    world = 1
    for n in mesh_shape.values():
        world *= n
    out = collectives.launch(_pp_worker, world, backend=backend, args=(mesh_shape, v, opt), timeout=150)
    for r in out:
        assert_close(r["losses"], ref_losses, f"losses {r['coords']}")
        assert ("ep grads" in r["by_site"]) == (mesh_shape.get("ep", 1) > 1)
    root = out[0]["state"]
    assert list(root) == list(ref_w)
    for n, w in ref_w.items():
        assert_close(root[n], w, n)
    routed: dict[str, int] = {}
    for r in out:
        for name, st in r["stats"].items():
            routed[name] = routed.get(name, 0) + int(torch.tensor(st["routed"]).sum())
    x, _ = tf_batches(STEPS)[0]
    tokens = STEPS * x.numel() * MOE_CFG["top_k"]                 # every token's top-k choices, every step
    assert routed == {"1.mlp": tokens, "2.mlp": tokens}
