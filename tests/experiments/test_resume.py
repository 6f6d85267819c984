"""`pslab run --resume RUN_DIR` and the loop's engine checkpoints (`experiments/strategies/resume.py`), end to end:
real ranks through the runner and the CLI, small step counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pslab.collectives.tensorfile import read_tensor_file
from pslab.experiments.config import load_config
from pslab.experiments.errors import ConfigError
from pslab.experiments.results.rundir import RunDir, read_jsonl
from pslab.experiments.runner import execute
from pslab.experiments.strategies.resume import resume_config
from pslab.parallelism.state_io import committed_steps
from tests.experiments.conftest import small_config

DP = ["workload.name=digits-mlp", "train.strategy=allreduce", "train.workers=2", "train.optimizer=momentum",
      "train.lr=0.05", "train.eval_every=4", "faults.checkpoint_every=3"]
ZERO = ["workload.name=digits-mlp", "train.strategy=allreduce", "train.workers=2", "train.optimizer=adam",
        "train.lr=0.01", "parallel.zero=3", "train.eval_every=4", "faults.checkpoint_every=2"]
TF = ["workload.name=text-transformer", "workload.batch_size=8", "train.strategy=allreduce", "train.workers=1",
      "train.optimizer=momentum", "train.lr=0.05", "train.eval_every=4", "faults.checkpoint_every=2"]
# (faults.on_failure = abort: these runs test checkpoints, not the elastic rollback)
DP, ZERO, TF = ([*c, "faults.on_failure=abort"] for c in (DP, ZERO, TF))


def _params(run: Path, step: int) -> dict[str, torch.Tensor]:
    """Rank 0's parameter pieces of a committed step, by name (data parallel: the whole model)."""
    tensors, meta = read_tensor_file(run / "checkpoints" / f"step-{step:08d}" / "rank-00000.pslab")
    return {p["name"]: tensors[f"{k}/param"] for k, p in enumerate(meta["pieces"])}


def test_resume_at_another_layout_zero3_to_data_parallel(tmp_path):
    """2 workers under ZeRO-3 (Adam) for 2 steps, resumed with --set parallel.zero=0 (the data-parallel engine: the
    flat parameter and Adam shards reassembled into whole tensors): its first loss (step 2: the same weights, the
    same batches) equals the uninterrupted ZeRO-3 run's step-2 loss to float32 tolerance, and it trains on."""
    straight = execute(small_config(*ZERO, "train.steps=4"), tmp_path, label="z3", quiet=True)
    first = execute(small_config(*ZERO, "train.steps=2"), tmp_path, label="z3-first", quiet=True)
    cfg = resume_config(first.path, ["parallel.zero=0", "train.steps=4"])
    execute(cfg, quiet=True, resume=RunDir(first.path))
    ref = {(u["worker"], u["step"]): u["loss"] for u in read_jsonl(straight.metrics_path)}
    got = {(u["worker"], u["step"]): u["loss"] for u in read_jsonl(first.metrics_path)}
    assert sorted(got) == sorted(ref)
    for w in range(2):
        assert got[(w, 1)] == ref[(w, 1)]
        assert got[(w, 2)] == pytest.approx(ref[(w, 2)], rel=1e-5)
        assert got[(w, 3)] == pytest.approx(ref[(w, 3)], rel=1e-5)     # after a step on the restored Adam state
    assert json.loads((first.path / "summary.json").read_text())["parallel"] == "data"


def test_zero3_dp4_resumed_at_dp2_matches_local(tmp_path):
    """ZeRO-3 with 4 workers for 3 steps, `--resume --set train.workers=2` for 3 more: every loss matches `local`
    (one process, whole tensors) doing the same -- 4 workers' batches at lr x 4, then 2 workers' (the training set
    re-split in 2) at lr x 2 -- to float32 tolerance; the evaluations count 3 x 4 + 3 x 2 = 18 updates."""
    runs = {}
    for name, extra in (("zero", ["parallel.zero=3"]), ("local", ["train.strategy=local", "parallel.zero=0"])):
        cfg = [*ZERO, *extra, "train.workers=4", "train.steps=3", "faults.checkpoint_every=3"]
        run = execute(small_config(*cfg), tmp_path, label=name, quiet=True)
        execute(resume_config(run.path, ["train.workers=2", "train.steps=6"]), quiet=True, resume=RunDir(run.path))
        runs[name] = run
    key = lambda run: {(u["worker"], u["step"]): u["loss"] for u in read_jsonl(run.metrics_path)}
    zero, local = key(runs["zero"]), key(runs["local"])
    assert sorted(zero) == sorted(local) == sorted([(w, t) for w in range(4) for t in range(3)]
                                                    + [(w, t) for w in range(2) for t in range(3, 6)])
    for k, loss in local.items():
        assert zero[k] == pytest.approx(loss, rel=1e-5), k
    ev = read_jsonl(runs["zero"].eval_path)
    assert [e["updates"] for e in ev] == sorted({e["updates"] for e in ev}) and ev[-1]["updates"] == 18


def test_resume_at_another_layout_tp2_to_tp1(tmp_path):
    """text-transformer at tp=2 for 2 steps, resumed with --set parallel.tp=1: its first loss (step 2, the Megatron
    slices and momentum buffers joined on one rank, the same batch) equals the uninterrupted tp=2 run's step-2 loss
    to float32 tolerance, and it trains on to train.steps."""
    straight = execute(small_config(*TF, "parallel.tp=2", "train.steps=4"), tmp_path, label="tp2", quiet=True)
    first = execute(small_config(*TF, "parallel.tp=2", "train.steps=2"), tmp_path, label="tp2-first", quiet=True)
    execute(resume_config(first.path, ["parallel.tp=1", "train.steps=4"]), quiet=True, resume=RunDir(first.path))
    ref = {u["step"]: u["loss"] for u in read_jsonl(straight.metrics_path)}
    got = {u["step"]: u["loss"] for u in read_jsonl(first.metrics_path)}
    assert sorted(got) == [0, 1, 2, 3]
    assert got[1] == ref[1] and got[2] == pytest.approx(ref[2], rel=1e-5)
    assert got[3] == pytest.approx(ref[3], rel=1e-5)                   # after a step on the restored momentum
    assert json.loads((first.path / "summary.json").read_text())["parallel"] == "data"


def _resumes_continue(tmp_path, base: list[str], changes: dict[str, list[str]], name: str) -> RunDir:
    """Run `base` 4 steps straight; then, per label in `changes`, 2 steps resumed to 4 with those overrides: the
    (worker, step) rows equal the straight run's, its losses bitwise for "same" (no change), else to rel 1e-5.
    Returns the straight run."""
    straight = execute(small_config(*base, "train.steps=4"), tmp_path, label=name, quiet=True)
    ref = {(u["worker"], u["step"]): u["loss"] for u in read_jsonl(straight.metrics_path)}
    for label, change in changes.items():
        first = execute(small_config(*base, "train.steps=2"), tmp_path, label=f"{name} {label}", quiet=True)
        execute(resume_config(first.path, [*change, "train.steps=4"]), quiet=True, resume=RunDir(first.path))
        got = {(u["worker"], u["step"]): u["loss"] for u in read_jsonl(first.path / "metrics.jsonl")}
        assert sorted(got) == sorted(ref), label
        for k, v in ref.items():
            assert got[k] == (v if label == "same" else pytest.approx(v, rel=1e-5)), (label, k, got[k], v)
    return straight


def test_3d_zero1_resumed_at_another_layout(tmp_path):
    """dp 2 x tp 2 x pp 2 with the distributed optimizer (ZeRO-1, Adam: its moments in chunks of tp shards) for 2
    steps, resumed once at the same layout and once as dp 2 x tp 2 without ZeRO: both continue the uninterrupted
    run's losses (the same layout bitwise, the other to float32 tolerance), so the chunks joined back into whole
    tensors and re-cut hold every element of the parameters and of Adam's state."""
    zero3d = [*TF, "train.workers=2", "parallel.tp=2", "parallel.pp=2", "parallel.micro_batches=2", "parallel.zero=1",
              "train.optimizer=adam", "train.lr=0.01"]
    _resumes_continue(tmp_path, zero3d, {"same": [], "tp2": ["parallel.pp=1", "parallel.zero=0"]}, "3d-zero1")


def test_local_resume_is_bitwise(tmp_path):
    """`local` (one process playing 2 workers) resumed at step 2 continues exactly like the run that went on."""
    local = ["workload.name=digits-mlp", "train.strategy=local", "train.workers=2", "train.optimizer=adam",
             "train.lr=0.01", "train.eval_every=4", "faults.checkpoint_every=2"]
    straight = execute(small_config(*local, "train.steps=4"), tmp_path, label="local", quiet=True)
    first = execute(small_config(*local, "train.steps=2"), tmp_path, label="local-first", quiet=True)
    execute(resume_config(first.path, ["train.steps=4"]), quiet=True, resume=RunDir(first.path))
    key = lambda run: {(u["worker"], u["step"]): u["loss"] for u in read_jsonl(run.metrics_path)}
    assert key(first) == key(straight) and len(key(first)) == 8
    a, b = _params(straight.path, 4), _params(first.path, 4)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_resume_skips_a_corrupt_checkpoint_with_a_warning(tmp_path, caplog):
    """Checkpoints at steps 3 and 6, step 6's shard corrupted: the resume warns, starts at step 3, and the run
    directory ends with each (worker, step) once."""
    run = execute(small_config(*DP, "train.steps=6"), tmp_path, label="c", quiet=True)
    shard = run.path / "checkpoints" / "step-00000006" / "rank-00001.pslab"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x55
    shard.write_bytes(bytes(data))
    with caplog.at_level("WARNING"):
        execute(resume_config(run.path, ["train.steps=7"]), quiet=True, resume=RunDir(run.path))
    assert any("rejected checkpoint" in r.getMessage() and "step-00000006" in r.getMessage() for r in caplog.records)
    assert json.loads((run.path / "env.json").read_text())["resumed"][0]["from_step"] == 3
    ups = read_jsonl(run.metrics_path)
    assert sorted((u["worker"], u["step"]) for u in ups) == [(w, t) for w in range(2) for t in range(7)]
    assert [s for s, _ in committed_steps(run.path / "checkpoints")] == [6, 3]    # step 6 written anew


def test_resume_refusals(tmp_path):
    """One line each: an override of the workload, a run without checkpoints, checkpoint_every under ps-*."""
    run = execute(small_config(*DP, "train.steps=3"), tmp_path, label="r", quiet=True)
    with pytest.raises(ConfigError, match="workload.name") as e:
        resume_config(run.path, ["workload.name=digits-logreg", "train.steps=6"])
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="not beyond the checkpoint's step 3"):
        execute(resume_config(run.path, []), quiet=True, resume=RunDir(run.path))
    bare = execute(small_config(*DP[:-1], "train.steps=2"), tmp_path, label="bare", quiet=True)
    with pytest.raises(ConfigError, match="no committed checkpoint"):
        resume_config(bare.path, ["train.steps=4"])
    with pytest.raises(ConfigError, match="shard_checkpoint_every"):
        load_config(None, ["train.strategy=ps-asp", "faults.checkpoint_every=5"])
    moe = execute(small_config("workload.name=text-moe", "workload.batch_size=8", "train.strategy=allreduce",
                               "train.workers=2", "train.steps=2", "faults.checkpoint_every=1"),
                  tmp_path, label="moe", quiet=True)
    written = (moe.path / "config.toml").read_text()
    for change in ("workload.experts=8", "workload.capacity_factor=0.5", "workload.seq_len=16"):
        with pytest.raises(ConfigError, match=change.split("=")[0]):
            resume_config(moe.path, [change, "train.steps=4"])
    assert (moe.path / "config.toml").read_text() == written      # nothing written by a refused resume


def test_zero3_over_tp_resumed_at_another_layout(tmp_path):
    """dp 2 x tp 2 with ZeRO-3 (each tp rank's shards chunked over dp: the checkpoint holds chunks of tp shards) for
    2 steps, resumed as itself and as dp 2 x tp 2 with ZeRO-2 and as dp 2 without ZeRO or tp: every resume continues
    the uninterrupted run's losses (itself bitwise, the others to float32 tolerance)."""
    fsdp_tp = [*TF, "train.workers=2", "parallel.tp=2", "parallel.zero=3"]
    _resumes_continue(tmp_path, fsdp_tp, {"same": [], "zero2": ["parallel.zero=2"],
                                          "dp": ["parallel.tp=1", "parallel.zero=0"]}, "zero3-tp2")


def test_zero3_on_a_cp_replica_resumed(tmp_path):
    """ZeRO-3 on dp 2 x cp 2: the cp ranks of a dp group hold the same chunks, cp rank 0's are stored; a resume as
    itself continues the uninterrupted run bitwise, as ZeRO-2 and without ZeRO to float32 tolerance."""
    base = [*TF, "train.workers=2", "parallel.cp=2", "parallel.zero=3"]
    _resumes_continue(tmp_path, base, {"same": [], "zero2": ["parallel.zero=2"], "no zero": ["parallel.zero=0"]},
                      "cp-zero3")


@pytest.mark.parametrize("layout", ["cp", "ep"])
def test_zero1_on_a_cp_or_ep_replica_resumed(tmp_path, layout):
    """The distributed optimizer on dp 2 x cp 2 (the text transformer) and on dp 2 x ep 2 (text-moe): each cp / ep
    rank chunks its slots over its dp group; a checkpoint stores one copy (cp rank 0's; ep rank 0's replicas, every
    ep rank's experts), and a resume at the same layout continues the uninterrupted run bitwise, one without ZeRO
    to float32 tolerance."""
    base = ([*TF, "train.workers=2", "parallel.cp=2", "parallel.zero=1"] if layout == "cp" else
            [*TF, "workload.name=text-moe", "train.workers=2", "parallel.ep=2", "parallel.zero=1"])
    _resumes_continue(tmp_path, base, {"same": [], "no zero": ["parallel.zero=0"]}, f"{layout}-zero1")


@pytest.mark.parametrize("compress", ["topk:0.05", "powersgd:2"])
def test_a_compressed_run_resumes_bitwise_with_each_workers_residual(tmp_path, compress):
    """train.compress keeps a residual per worker (and PowerSGD its warm-start Q): each rank's own goes into its
    checkpoint file and comes back on resume, so the resumed run's losses equal the straight run's bitwise (without
    the residuals the step after the resume differs: tests/parallelism/test_compress.py checks it matters)."""
    straight = _resumes_continue(tmp_path, [*DP, "faults.checkpoint_every=2", f"train.compress={compress}"],
                                 {"same": []}, compress)
    ck = committed_steps(straight.path / "checkpoints")
    _, meta = read_tensor_file(ck[0][1] / "rank-00001.pslab")
    assert "residual/0" in meta["local"], meta["local"]
