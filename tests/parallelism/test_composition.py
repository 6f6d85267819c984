"""Composed layouts (parallelism/compose.py): dp × tp × pp (3D), with and without sequence parallelism, plain or
interleaved 1F1B, equal a single process on the concatenated batch — every step's loss and the final full model
(rtol 1e-5) — on both backends; under sp each pipeline cut carries only the S/T sequence slice per rank."""

from __future__ import annotations

import math

import pytest

from pslab import collectives
from pslab.parallelism.export import gather_full_state
from pslab.parallelism.models import lm_loss
from pslab.parallelism.pipeline import PipelineEngine

from tests.parallelism.par_helpers import (STEPS, TF_FACTORY, adam_attention, assert_close, plain, reference, run_training,
                                          sgd, tf_batches)

pytestmark = pytest.mark.timeout(240)

CASES = {   # name: (mesh, schedule, micro-batches, sequence parallel, activation checkpointing, optimizer,
            #        overlap: the dp all-reduce from hooks in the stage's last backward, else one flat one after)
    "dp2-tp2-pp2": ({"dp": 2, "tp": 2, "pp": 2}, "1f1b", 2, False, False, "sgd", False),
    "dp2-tp2-pp2-overlap": ({"dp": 2, "tp": 2, "pp": 2}, "1f1b", 2, False, False, "sgd", True),
    "dp2-tp2-pp2-adam": ({"dp": 2, "tp": 2, "pp": 2}, "gpipe", 2, False, False, "adam", True),
    "tp2-pp2-sp": ({"tp": 2, "pp": 2}, "1f1b", 4, True, False, "adam", False),
    "dp2-tp2-pp2-sp": ({"dp": 2, "tp": 2, "pp": 2}, "1f1b", 2, True, False, "sgd", True),
    "tp2-pp2-ac": ({"tp": 2, "pp": 2}, "1f1b", 2, False, True, "sgd", False),
    # interleaved 1F1B: v = 2 chunks per stage (the 4 units [Embed, Block, Block, Head] cut 4 ways)
    "dp2-tp2-pp2-sp-v2": ({"dp": 2, "tp": 2, "pp": 2}, "1f1b", 2, True, False, "adam", True, 2),
    "tp2-pp2-ac-v2": ({"tp": 2, "pp": 2}, "1f1b", 4, False, True, "sgd", False, 2),
}
OPTS = {"sgd": sgd, "adam": adam_attention}


def _launch_against_one_process(worker, case, mesh_shape, opt, backend):
    """Run `worker` on the mesh's ranks; every rank's per-step losses must equal one process's. Returns the ranks'
    results and the single-process final weights."""
    ref_losses, ref_w = reference(TF_FACTORY, tf_batches(), opt=OPTS[opt], loss_fn=lm_loss)
    out = collectives.launch(worker, math.prod(mesh_shape.values()), backend=backend, args=(case,), timeout=200)
    for r in out:
        assert_close(r["losses"], ref_losses, f"losses of rank {r.get('coords', '?')}")
    return out, ref_w


def _case(case):
    mesh_shape, schedule, m, sp, ac, opt, overlap, *v = CASES[case]
    return mesh_shape, schedule, m, sp, ac, opt, overlap, (v[0] if v else 1)


def _worker(group, case):
    from pslab.parallelism.engine import AllReduceStrategy
    mesh_shape, schedule, m, sp, ac, opt, overlap, v = _case(case)
    engine = PipelineEngine(schedule, m, loss_fn=lm_loss, sequence_parallel=sp, checkpoint_activations=ac,
                            virtual_stages=v)
    strategy = AllReduceStrategy(OPTS[opt], overlap=overlap)
    mesh, replica, losses = run_training(group, engine, TF_FACTORY, tf_batches(), mesh_shape, strategy=strategy)
    state = gather_full_state(replica, mesh)
    replica.close()
    return plain({"losses": losses, "state": state, "coords": mesh.coords,
                  "sites": replica.log.by_site("p2p"), "dp_sites": list(replica.dp.log.by_site("all_reduce"))})


@pytest.mark.parametrize("backend,case", [("zmq", "dp2-tp2-pp2"), ("torch", "dp2-tp2-pp2"),
                                          ("zmq", "dp2-tp2-pp2-overlap"), ("zmq", "dp2-tp2-pp2-adam"),
                                          ("zmq", "tp2-pp2-sp"), ("torch", "dp2-tp2-pp2-sp"), ("zmq", "tp2-pp2-ac"),
                                          ("zmq", "dp2-tp2-pp2-sp-v2"), ("torch", "tp2-pp2-ac-v2")])
def test_3d_matches_single_process(backend, case):
    """Every step's loss and the final full model equal one process on the concatenated batch; with overlap the
    dp gradients go in buckets from the last backward's hooks ("bucket k"; interleaved: each chunk's last
    backward), without in one flat all-reduce."""
    mesh_shape, schedule, m, sp, ac, opt, overlap, v = _case(case)
    out, ref_w = _launch_against_one_process(_worker, case, mesh_shape, opt, backend)
    root = out[0]["state"]
    assert root is not None and all(r["state"] is None for r in out[1:])
    assert list(root) == list(ref_w)
    for n, w in ref_w.items():
        assert_close(root[n], w, n)
    # each cut carries B/D · S · d floats per rank forward (and as many back), or the S/T slice of it under sequence
    # parallelism; interleaved, rank s sends forward from each of its virtual stages c < 2v − 1 and back from each
    # c > 0 (c = s, s + 2, …), all to the other rank
    x, _ = tf_batches()[0]
    d = TF_FACTORY().get_submodule("0").tok.embedding_dim
    seq = x.shape[1] // (mesh_shape.get("tp", 1) if sp else 1)
    want = STEPS * (x.shape[0] // mesh_shape.get("dp", 1)) * seq * d * 4
    for r in out:
        s = r["coords"]["pp"]
        site = "stage 0 -> 1" if s == 0 else "stage 1 -> 0"
        sends = sum((c < 2 * v - 1) + (c > 0) for c in range(s, 2 * v, 2))
        assert r["sites"][site] == sends * want, (r["coords"], r["sites"])
        if mesh_shape.get("dp", 1) > 1:
            assert ("bucket 0" in r["dp_sites"]) == overlap and ("grads" in r["dp_sites"]) == (not overlap), r



# ---- ZeRO-1 on a composed replica: the distributed optimizer per (pp, tp) coordinate over dp -----------------------
ZERO_CASES = {   # name: (mesh, sequence parallel, optimizer[, stage 2: reduce-scatter after each micro-batch])
    "zero1-dp2-tp2-pp2": ({"dp": 2, "tp": 2, "pp": 2}, False, "adam"),
    "zero1-dp2-tp2-sp": ({"dp": 2, "tp": 2}, True, "sgd"),
    "zero1-dp2-pp2": ({"dp": 2, "pp": 2}, False, "adam"),
    "zero2-dp2-tp2-pp2": ({"dp": 2, "tp": 2, "pp": 2}, False, "adam", 2),
    "zero2-dp2-pp2": ({"dp": 2, "pp": 2}, False, "sgd", 2),
}


def _zero_worker(group, case):
    from pslab.parallelism.distributed_optimizer import DistributedOptimizerStrategy
    from pslab.parallelism.tensor import TensorParallelEngine
    mesh_shape, sp, opt, *stage = ZERO_CASES[case]
    engine = (PipelineEngine("1f1b", 2, loss_fn=lm_loss, sequence_parallel=sp) if mesh_shape.get("pp", 1) > 1
              else TensorParallelEngine(loss_fn=lm_loss, sequence_parallel=sp))
    strategy = DistributedOptimizerStrategy(OPTS[opt], stage=stage[0] if stage else 1)
    mesh, replica, losses = run_training(group, engine, TF_FACTORY, tf_batches(), mesh_shape, strategy=strategy)
    state = gather_full_state(replica, mesh)
    numel = sum(s.param.numel() for s in replica.slots())
    kept = sum(v.numel() for st in strategy.optimizer.state.values() for v in st.values() if v.dim() > 0)
    by_kind = replica.log.by_kind(wire=False)
    # snapshots hold the chunked state: capture, take a step, restore, take the same step -> bitwise the same
    from pslab.parallelism.snapshot import capture, restore_into
    import torch
    dp_rank, dp = mesh.coord("dp"), mesh.size("dp")
    x, y = (torch.tensor_split(t, dp)[dp_rank] for t in tf_batches()[0])
    tensors, meta = capture(replica, strategy)
    stored = capture(replica, strategy, mesh)[1]["pieces"]
    rs_before = sum(r[0] == "reduce_scatter" and r[1].startswith("grad ") for r in replica.log.records)
    first = replica.forward_backward(x, y)
    freed = all(s.grad is None for s in replica.slots())      # stage 2: only the reduced chunks are left
    rs_in_backward = sum(r[0] == "reduce_scatter" and r[1].startswith("grad ") for r in replica.log.records) - rs_before
    strategy.step(replica)
    after = [s.param.detach().clone() for s in replica.slots()]
    restore_into(replica, strategy, tensors, meta)
    again = replica.forward_backward(x, y)
    strategy.step(replica)
    same = first == again and all(torch.equal(a, s.param) for a, s in zip(after, replica.slots()))
    return plain({"losses": losses, "state": state, "numel": numel, "kept": kept, "by_kind": by_kind,
                  "restore_repeats": same, "stored": [(p["name"], p["sel"]["kind"]) for p in stored],
                  "coords": mesh.coords, "freed": freed, "rs_in_backward": rs_in_backward,
                  "slots": len(replica.slots())})


@pytest.mark.parametrize("backend,case", [("zmq", "zero1-dp2-tp2-pp2"), ("torch", "zero1-dp2-tp2-sp"),
                                          ("zmq", "zero1-dp2-pp2"), ("torch", "zero2-dp2-tp2-pp2"),
                                          ("zmq", "zero2-dp2-pp2")])
def test_zero1_on_a_composed_replica_matches_single_process(backend, case):
    """The distributed optimizer (reduce-scatter the gradients over dp, update the owned chunk, all-gather) on dp x
    tp x pp equals one process, and each rank keeps optimizer state for 1/D of its slots' elements; a snapshot of it
    (chunks of tp shards: the "index_flat" selection) restores a step bitwise. Stage 2 in a pipeline reduce-scatters
    every slot's gradient after each of the m = 2 micro-batches' backward and frees the full ones."""
    mesh_shape, sp, opt, *stage = ZERO_CASES[case]
    out, ref_w = _launch_against_one_process(_zero_worker, case, mesh_shape, opt, backend)
    for n, w in ref_w.items():
        assert_close(out[0]["state"][n], w, n)
    per_state = 2 if opt == "adam" else 1                      # Adam: two moments; SGD with momentum: one buffer
    for r in out:
        assert r["kept"] == pytest.approx(per_state * r["numel"] / mesh_shape["dp"], abs=per_state * 8), r
        assert r["by_kind"]["reduce_scatter"] > 0 and r["by_kind"]["all_gather"] > 0
        assert r["restore_repeats"], r["coords"]
        assert r["freed"] == bool(stage) and r["rs_in_backward"] == (2 * r["slots"] if stage else 0), r
        # a checkpoint stores each rank's chunks only: of tp shards on every tp rank, of replicated tensors on tp 0
        kinds = {k for _, k in r["stored"]}
        assert kinds <= {"flat", "index_flat"} and r["stored"], r["stored"]
        if r["coords"]["tp"] > 0:
            assert kinds == {"index_flat"}


# ---- ZeRO 2-3 over dp x tp (2D: FSDP + TP): ZeroEngine on each tp rank's shards ------------------------------------
def _zero_tp_worker(group, case):
    import torch
    from pslab.parallelism.snapshot import capture, restore_into
    from pslab.parallelism.zero import ZeroEngine, ZeroStrategy
    stage, opt, sp, *ac = case
    mesh_shape = {"dp": 2, "tp": 2}
    engine = ZeroEngine(stage, OPTS[opt], loss_fn=lm_loss, sequence_parallel=sp, checkpoint_activations=bool(ac))
    mesh, replica, losses = run_training(group, engine, TF_FACTORY, tf_batches(), mesh_shape, strategy=ZeroStrategy())
    state = gather_full_state(replica, mesh)
    held = sum(s.param.numel() for s in replica.slots())
    tp_numel = sum(math.prod(shape) for shape in replica.shapes.values())
    dp_rank = mesh.coord("dp")
    x, y = (torch.tensor_split(t, 2)[dp_rank] for t in tf_batches()[0])
    tensors, meta = capture(replica, None)
    stored = capture(replica, None, mesh)[1]["pieces"]
    first = replica.forward_backward(x, y)
    replica.step()
    after = [s.param.detach().clone() for s in replica.slots()]
    restore_into(replica, None, tensors, meta)
    again = replica.forward_backward(x, y)
    replica.step()
    same = first == again and all(torch.equal(a, s.param) for a, s in zip(after, replica.slots()))
    replica.close()
    return plain({"losses": losses, "state": state, "held": held, "tp_numel": tp_numel, "coords": mesh.coords,
                  "restore_repeats": same, "tp_sites": replica.log.by_site("all_reduce"),
                  "deferred": [n for n, _ in replica.deferred],
                  "recomputed": sum(getattr(m, "forwards", 0) for m in replica.module.modules()), "stored": [(p["name"], p["sel"]["kind"]) for p in stored],
                  "peak": replica.peak_gathered_bytes, "unit_bytes": [u.nbytes for u in replica.units]})


@pytest.mark.parametrize("backend,stage,opt,sp,ac", [("zmq", 2, "adam", False, False), ("zmq", 3, "sgd", False, False),
                                                     ("torch", 3, "adam", False, False), ("zmq", 2, "adam", True, False),
                                                     ("torch", 3, "adam", True, False), ("zmq", 2, "adam", True, True),
                                                     ("torch", 1, "sgd", False, True)])
def test_zero2_and_zero3_over_tp_shards_match_single_process(backend, stage, opt, sp, ac):
    """ZeRO-2/3 on dp 2 x tp 2 (FSDP + TP): each tp rank's shards (and the tensors tp replicates) are chunked over
    its dp group; losses and the gathered model equal one process; a rank holds 1/D of its tp share; stage 3 never
    holds its whole share at once; a snapshot (chunks of tp shards: "index_flat") restores a step bitwise. With
    sequence parallelism the replicated tensors' partial gradients are summed over tp before they are reduce-
    scattered (their hooks wait: without the sum the model drifts from one process). With activation checkpointing
    (stages 1-2) the blocks run twice a step and the hooks fire in the recomputed backward."""
    case = (stage, opt, sp) + ((True,) if ac else ())
    out, ref_w = _launch_against_one_process(_zero_tp_worker, case, {"dp": 2, "tp": 2}, opt, backend)
    for n, w in ref_w.items():
        assert_close(out[0]["state"][n], w, n)
    full = sum(w.numel() for w in ref_w.values())
    for r in out:
        assert r["held"] == pytest.approx(r["tp_numel"] / 2, abs=len(r["unit_bytes"]) * 4), r["coords"]
        assert r["tp_numel"] < full                   # a tp rank's share, not the whole model
        assert r["restore_repeats"], r["coords"]
        kinds = {k for _, k in r["stored"]}
        assert r["stored"] and kinds <= {"flat", "index_flat"}, r["stored"]
        if r["coords"]["tp"] > 0:
            assert kinds == {"index_flat"}
        if stage == 3:
            assert 0 < r["peak"] < sum(r["unit_bytes"])
        assert (r["recomputed"] > 0) == ac, r["recomputed"]
        assert bool(r["deferred"]) == sp and ("sp replicated grads" in r["tp_sites"]) == sp, r["tp_sites"]
        if sp:
            assert any("norm" in n or "ln" in n for n in r["deferred"]), r["deferred"]
