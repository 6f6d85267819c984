"""Sharded engine checkpoints (`parallelism.snapshot`, `parallelism.state_io`): save per rank, commit by manifest,
load onto the same layout (bitwise) or another one (re-cut: ZeRO-3 dp 4 -> 2, tp 2 -> 1 and 1 -> 2), and reject
a corrupt or foreign checkpoint.

Batches here are a function of (worker, step, K) and drawn partly from the global torch RNG (the noise added to x),
so a resumed run continues bitwise only if the data position *and* the RNG state were restored."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from pslab import collectives
from pslab.collectives.tensorfile import read_tensor_file, write_tensor_file
from pslab.parallelism.data import DataParallelEngine
from pslab.parallelism.engine import AllReduceStrategy
from pslab.parallelism.export import gather_full_state
from pslab.parallelism.mesh import DeviceMesh
from pslab.parallelism.models import lm_loss
from pslab.parallelism.pipeline import PipelineEngine
from pslab.parallelism.snapshot import SnapshotError, capture, restore_into
from pslab.parallelism.state_io import CheckpointMismatchError, committed_steps, load, save
from pslab.parallelism.tensor import TensorParallelEngine
from pslab.parallelism.zero import ZeroEngine, ZeroStrategy
from tests.parallelism.par_helpers import MLP_FACTORY, TF_FACTORY, assert_close, plain

DIGEST = "d" * 64
BASE_LR = 0.01
TIMEOUT = 120


def _adam(k: int):
    """Adam at the linear lr rule for k workers (the lr a resumed run takes from its own config)."""
    return lambda ps: torch.optim.Adam(ps, lr=BASE_LR * k)


def _momentum(ps):
    return torch.optim.SGD(ps, lr=0.05, momentum=0.9)


def _mlp_batch(w: int, t: int, k: int, noise: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * k + 10 * t + w)
    x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
    if noise:                         # the global RNG: only a restored RNG state reproduces it
        x = x + 0.01 * torch.randn(8, 8)
    return x, y


def _tf_batch(w: int, t: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + 100 * t + w)
    return torch.randint(0, 16, (4, 6), generator=g), torch.randint(0, 16, (4, 6), generator=g)


def _train(mesh, replica, strategy, start: int, stop: int, k: int, batch=_mlp_batch, **kw) -> None:
    w = mesh.coord("dp")
    for t in range(start, stop):
        x, y = batch(w, t, k, **kw)
        replica.forward_backward(x, y)
        strategy.step(replica)


# ---- workers (module level: collectives.launch starts them in child processes) ------------------------------------

def _zero_worker(group, root: str, stage: int, start: int, stop: int, save_at: int | None):
    mesh = DeviceMesh(group, dp=group.world_size)
    k = group.world_size
    replica = ZeroEngine(stage, _adam(k)).build(MLP_FACTORY, mesh)
    strategy = ZeroStrategy()
    strategy.attach(replica)
    loaded = load(root, replica, strategy, mesh, DIGEST)
    at_load = gather_full_state(replica, mesh)
    _train(mesh, replica, strategy, loaded.step if loaded else start, stop, k)
    if save_at is not None:
        save(root, save_at, replica, strategy, mesh, DIGEST)
    final = gather_full_state(replica, mesh)
    replica.close()
    return plain({"loaded": loaded.step if loaded else None, "at_load": at_load, "final": final})


def _dp_worker(group, root: str, stop: int, save_every: int, noise: bool):
    mesh = DeviceMesh(group, dp=group.world_size)
    replica = DataParallelEngine().build(MLP_FACTORY, mesh)
    strategy = AllReduceStrategy(_momentum)
    strategy.attach(replica)
    loaded = load(root, replica, strategy, mesh, DIGEST) if root else None
    step = loaded.step if loaded else 0
    while step < stop:
        _train(mesh, replica, strategy, step, step + 1, group.world_size, noise=noise)
        step += 1
        if root and save_every and step % save_every == 0:
            save(root, step, replica, strategy, mesh, DIGEST)
    return plain({"loaded": loaded.step if loaded else None, "rejected": loaded.rejected if loaded else [],
                  "state": gather_full_state(replica, mesh), "rng": torch.rand(3)})


def _tp_worker(group, root: str, tp: int, start: int, stop: int, save_at: int | None):
    mesh = DeviceMesh(group, tp=tp)
    engine = TensorParallelEngine(loss_fn=lm_loss) if tp > 1 else DataParallelEngine(loss_fn=lm_loss)
    replica = engine.build(TF_FACTORY, mesh)
    strategy = AllReduceStrategy(_momentum)   # (not Adam: attention's k bias has a zero gradient up to rounding,
                                              # which Adam would scale up to lr-sized, layout-dependent steps)
    strategy.attach(replica)
    loaded = load(root, replica, strategy, mesh, DIGEST)
    at_load = gather_full_state(replica, mesh)
    _train(mesh, replica, strategy, loaded.step if loaded else start, stop, 1, batch=_tf_batch)
    if save_at is not None:
        save(root, save_at, replica, strategy, mesh, DIGEST)
    return plain({"loaded": loaded.step if loaded else None, "at_load": at_load,
                  "final": gather_full_state(replica, mesh)})


def _pp_worker(group, root: str, pp: int, stop: int, save_at: int | None):
    mesh = DeviceMesh(group, pp=pp)
    engine = PipelineEngine(micro_batches=2) if pp > 1 else DataParallelEngine()
    replica = engine.build(MLP_FACTORY, mesh)
    strategy = AllReduceStrategy(_momentum)
    strategy.attach(replica)
    loaded = load(root, replica, strategy, mesh, DIGEST)
    at_load = gather_full_state(replica, mesh)
    _train(mesh, replica, strategy, loaded.step if loaded else 0, stop, 1)
    if save_at is not None:
        save(root, save_at, replica, strategy, mesh, DIGEST)
    return plain({"loaded": loaded.step if loaded else None, "at_load": at_load,
                  "final": gather_full_state(replica, mesh)})


def _load_worker(group, root: str, digest: str):
    """Load into a 1-rank DP replica; return what was loaded and the warnings logged."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("pslab.parallelism.state_io").addHandler(handler)
    mesh = DeviceMesh(group)
    replica = DataParallelEngine().build(MLP_FACTORY, mesh)
    strategy = AllReduceStrategy(_momentum)
    strategy.attach(replica)
    try:
        loaded = load(root, replica, strategy, mesh, digest)
    except (SnapshotError, CheckpointMismatchError) as e:
        return {"error": type(e).__name__, "message": str(e), "warnings": records}
    return {"step": loaded.step, "rejected": loaded.rejected, "warnings": records}


def _snapshot_worker(group):
    """capture -> train on -> restore_into: the state is back bitwise, and training from it repeats bitwise."""
    mesh = DeviceMesh(group, dp=group.world_size)
    replica = ZeroEngine(3, _adam(2)).build(MLP_FACTORY, mesh)
    strategy = ZeroStrategy()
    strategy.attach(replica)
    _train(mesh, replica, strategy, 0, 2, 2, noise=True)
    tensors, meta = capture(replica, strategy)
    _train(mesh, replica, strategy, 2, 4, 2, noise=True)
    first = gather_full_state(replica, mesh)
    restore_into(replica, strategy, tensors, meta)
    _train(mesh, replica, strategy, 2, 4, 2, noise=True)
    again = gather_full_state(replica, mesh)
    replica.close()
    return plain({"first": first, "again": again, "pieces": len(meta["pieces"])})


# ---- reference ----------------------------------------------------------------------------------------------------

def _reference(schedule: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
    """One process, the whole model: for each (steps, K) segment, Adam at lr = BASE_LR * K (state carried over,
    the lr set anew), each step on the mean loss of the K workers' batches -- what a run that changes its world size
    at a checkpoint must compute."""
    torch.manual_seed(0)
    model = MLP_FACTORY()
    opt = torch.optim.Adam(model.parameters(), lr=BASE_LR)
    t = 0
    for steps, k in schedule:
        for g in opt.param_groups:
            g["lr"] = BASE_LR * k
        for _ in range(steps):
            loss = sum(torch.nn.functional.cross_entropy(model(x), y)
                       for x, y in (_mlp_batch(w, t, k) for w in range(k))) / k
            opt.zero_grad()
            loss.backward()
            opt.step()
            t += 1
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---- tests ---------------------------------------------------------------------------------------------------------

def test_zero3_dp4_checkpoint_resumes_at_dp2(tmp_path):
    """ZeRO-3 at dp=4 for 3 steps, checkpointed; resumed at dp=2 (shards and Adam moments re-partitioned) for 3 more.
    At load the dp=2 model equals the dp=4 model bitwise; after training it matches the single-process reference
    (3 steps of 4 workers' batches at lr x 4, then 3 steps of 2 workers' batches at lr x 2) to float32 tolerance."""
    root = str(tmp_path / "ck")
    first = collectives.launch(_zero_worker, 4, args=(root, 3, 0, 3, 3), timeout=TIMEOUT)
    assert [s for s, _ in committed_steps(root)] == [3]
    assert len(list((tmp_path / "ck" / "step-00000003").glob("rank-*.pslab"))) == 4
    second = collectives.launch(_zero_worker, 2, args=(root, 3, 0, 6, None), timeout=TIMEOUT)
    assert second[0]["loaded"] == 3
    for n, v in first[0]["final"].items():
        assert (second[0]["at_load"][n] == v).all(), f"{n} changed in the dp 4 -> 2 re-cut"
    ref = _reference([(3, 4), (3, 2)])
    for n, v in ref.items():
        assert_close(second[0]["final"][n], v, f"ZeRO-3 dp 4 -> 2, {n}")
    wrong = _reference([(6, 4)])             # the run that did not change its size is measurably elsewhere
    assert any(not torch.allclose(torch.as_tensor(second[0]["final"][n]), v, rtol=1e-4, atol=1e-5)
               for n, v in wrong.items())


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_stage_dp2_checkpoint_resumes_at_dp1(tmp_path, stage):
    """ZeRO-1/2 store only the owned chunks; a dp=1 resume reassembles them (and the flat Adam moments)."""
    root = str(tmp_path / "ck")
    first = collectives.launch(_zero_worker, 2, args=(root, stage, 0, 2, 2), timeout=TIMEOUT)
    second = collectives.launch(_zero_worker, 1, args=(root, stage, 0, 4, None), timeout=TIMEOUT)
    for n, v in first[0]["final"].items():
        assert (second[0]["at_load"][n] == v).all()
    for n, v in _reference([(2, 2), (2, 1)]).items():
        assert_close(second[0]["final"][n], v, f"ZeRO-{stage} dp 2 -> 1, {n}")


def test_dp_resume_same_size_is_bitwise(tmp_path):
    """Data parallel, momentum SGD, noise from the global RNG: 6 steps straight == 3 steps, checkpoint, a fresh
    launch resuming for 3 more -- parameters and the RNG stream after them, bitwise."""
    straight = collectives.launch(_dp_worker, 2, args=("", 6, 0, True), timeout=TIMEOUT)
    root = str(tmp_path / "ck")
    collectives.launch(_dp_worker, 2, args=(root, 3, 3, True), timeout=TIMEOUT)
    resumed = collectives.launch(_dp_worker, 2, args=(root, 6, 3, True), timeout=TIMEOUT)
    assert resumed[0]["loaded"] == 3
    for n, v in straight[0]["state"].items():
        assert (resumed[0]["state"][n] == v).all(), f"{n} differs from the uninterrupted run"
    assert (resumed[1]["rng"] == straight[1]["rng"]).all()
    assert [s for s, _ in committed_steps(root)] == [6, 3]


def test_tp2_to_tp1_and_back(tmp_path):
    """tp=2 (Megatron column/row slices) for 2 steps, checkpointed; a tp=1 run loads exactly the gathered full model,
    trains 1 step (momentum buffers re-cut) like the tp=2 run does, checkpoints; a tp=2 run loads that bitwise."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    tp2 = collectives.launch(_tp_worker, 2, args=(a, 2, 0, 2, 2), timeout=TIMEOUT)
    straight = collectives.launch(_tp_worker, 2, args=(str(tmp_path / "none"), 2, 0, 3, None), timeout=TIMEOUT)
    tp1 = collectives.launch(_tp_worker, 1, args=(a, 1, 0, 3, 3), timeout=TIMEOUT)
    assert tp1[0]["loaded"] == 2 and straight[0]["loaded"] is None
    for n, v in tp2[0]["final"].items():
        assert (tp1[0]["at_load"][n] == v).all(), f"{n}: tp 2 -> 1 is not the gathered full model"
        assert_close(tp1[0]["final"][n], straight[0]["final"][n], f"step 3 at tp=1 after the re-cut vs tp=2, {n}")
    shutil.copytree(Path(a) / "step-00000003", Path(b) / "step-00000003")
    back = collectives.launch(_tp_worker, 2, args=(b, 2, 0, 3, None), timeout=TIMEOUT)
    assert back[0]["loaded"] == 3
    for n, v in tp1[0]["final"].items():
        assert (back[0]["at_load"][n] == v).all(), f"{n}: tp 1 -> 2 changed the model"


def test_pipeline_stages_recut(tmp_path):
    """pp=2 (each stage's rank stores its own layers) -> one rank holding all layers, and that -> pp=2 again:
    the model is the same bitwise, and a step after the re-cut matches the uninterrupted pp=2 run."""
    a = str(tmp_path / "a")
    pp2 = collectives.launch(_pp_worker, 2, args=(a, 2, 2, 2), timeout=TIMEOUT)
    straight = collectives.launch(_pp_worker, 2, args=(str(tmp_path / "none"), 2, 3, None), timeout=TIMEOUT)
    one = collectives.launch(_pp_worker, 1, args=(a, 1, 3, 3), timeout=TIMEOUT)
    back = collectives.launch(_pp_worker, 2, args=(a, 2, 3, None), timeout=TIMEOUT)
    assert one[0]["loaded"] == 2 and back[0]["loaded"] == 3
    for n, v in pp2[0]["final"].items():
        assert (one[0]["at_load"][n] == v).all(), f"{n}: pp 2 -> 1 changed the model"
        assert_close(one[0]["final"][n], straight[0]["final"][n], f"step 3 after pp 2 -> 1, {n}")
        assert (back[0]["at_load"][n] == one[0]["final"][n]).all(), f"{n}: pp 1 -> 2 changed the model"


def test_corrupt_shard_falls_back_with_a_warning(tmp_path):
    root = tmp_path / "ck"
    collectives.launch(_dp_worker, 1, args=(str(root), 4, 2, False), timeout=TIMEOUT)
    assert [s for s, _ in committed_steps(root)] == [4, 2]
    shard = root / "step-00000004" / "rank-00000.pslab"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    out = collectives.launch(_load_worker, 1, args=(str(root), DIGEST), timeout=TIMEOUT)[0]
    assert out["step"] == 2
    assert "step-00000004" in out["rejected"][0][0] and "checksum" in out["rejected"][0][1]
    assert any("rejected checkpoint" in w for w in out["warnings"])
    assert any("older checkpoint" in w for w in out["warnings"])
    (root / "step-00000002" / "rank-00000.pslab").unlink()           # missing: nothing valid is left
    out = collectives.launch(_load_worker, 1, args=(str(root), DIGEST), timeout=TIMEOUT)[0]
    assert out["error"] == "SnapshotError" and "missing" in out["message"]


def test_foreign_manifest_and_wrong_shapes_are_refused(tmp_path):
    root = tmp_path / "ck"
    collectives.launch(_dp_worker, 1, args=(str(root), 2, 2, False), timeout=TIMEOUT)
    out = collectives.launch(_load_worker, 1, args=(str(root), "e" * 64), timeout=TIMEOUT)[0]
    assert out["error"] == "CheckpointMismatchError" and "another config" in out["message"]
    assert "\n" not in out["message"]
    # a shard that verifies (checksums rewritten) but holds a tensor of another shape
    d = root / "step-00000002"
    tensors, meta = read_tensor_file(d / "rank-00000.pslab")
    tensors["0/param"] = torch.zeros(3, 3)
    write_tensor_file(d / "rank-00000.pslab", tensors, meta)
    m = json.loads((d / "manifest.json").read_text())
    m["files"][0]["sha256"] = hashlib.sha256((d / "rank-00000.pslab").read_bytes()).hexdigest()
    (d / "manifest.json").write_text(json.dumps(m))
    out = collectives.launch(_load_worker, 1, args=(str(root), DIGEST), timeout=TIMEOUT)[0]
    assert out["error"] == "SnapshotError" and "piece" in out["message"]


def test_capture_restore_into_is_bitwise():
    out = collectives.launch(_snapshot_worker, 2, timeout=TIMEOUT)
    assert out[0]["pieces"] > 0
    for n, v in out[0]["first"].items():
        assert (out[0]["again"][n] == v).all(), f"{n}: training from restore_into differs"
