"""Bad `[parallel]` values: one line on stderr naming the key and the fix, exit 1, before any process starts —
a test per rule (config.py checks what needs no model, strategies/build.py:check_layout the rest)."""

from __future__ import annotations

import pytest

from pslab.experiments.cli import main

TF = ["--set", "workload.name=text-transformer"]


@pytest.mark.parametrize("sets, fragment", [
    (["parallel.tp=0"], "parallel.tp must be a positive integer"),
    (["parallel.pp=-1"], "parallel.pp must be a positive integer"),
    (["parallel.micro_batches=0"], "parallel.micro_batches must be a positive integer"),
    (["parallel.schedule=zigzag"], "parallel.schedule must be one of gpipe, 1f1b"),
    (["parallel.zero=4", "train.strategy=allreduce"], "parallel.zero must be 0, 1, 2 or 3"),
    (["parallel.zero=1"], "use train.strategy = allreduce"),
    (["parallel.zero=3", "train.strategy=allreduce", "parallel.pp=2"], "with pp use zero = 1 or 2"),
    (["parallel.zero=2", "train.strategy=allreduce", "parallel.pp=2", "parallel.tp=2", "parallel.sp=true"],
     "with them use zero = 1"),
    (["parallel.overlap=true"], "needs train.strategy = allreduce"),
    (["parallel.overlap=true", "train.strategy=allreduce", "parallel.tp=2", "parallel.pp=2"],
     "not with zero or tp > 1"),
    (["train.strategy=ps-ssp:1", "train.workers=1", "parallel.tp=2", "parallel.pp=3"],
     "leaves a stage without an attention or MLP"),
    (["parallel.pp=2", "parallel.micro_batches=64"], "exceeds the 32 examples a pipeline gets"),
    (["parallel.pp=2", "parallel.ep=2", "parallel.micro_batches=8", "train.strategy=allreduce",
      "workload.name=text-moe", "workload.batch_size=8"], "exceeds the 4 examples a pipeline gets (workload.batch_size = 8 / ep = 2)"),
    (["parallel.pp=3", "parallel.ep=2", "parallel.micro_batches=2", "train.strategy=ps-bsp", "workload.name=text-moe",
      "workload.batch_size=8", "train.workers=1"], "leaves a stage without an MoE layer"),
    (["parallel.virtual_stages=0"], "parallel.virtual_stages must be a positive integer"),
    (["parallel.stage_ms=5"], "parallel.stage_ms = 5 pads pipeline stages: it needs parallel.pp > 1"),
    (["parallel.stage_ms=-1", "parallel.pp=2"], "parallel.stage_ms must be a number of milliseconds in 0..10000"),
    (["parallel.virtual_stages=2"], "it needs parallel.pp > 1 and parallel.schedule"),
    (["parallel.virtual_stages=2", "parallel.pp=2", "parallel.schedule=gpipe"], "interleaves the stages of 1F1B"),
    (["parallel.virtual_stages=2", "parallel.pp=2", "parallel.micro_batches=3"], "must be a multiple of 2"),
    (["parallel.virtual_stages=3", "parallel.pp=2"], "use virtual_stages <= 2"),
    (["train.strategy=local", "parallel.tp=2"], "strategy local is one process"),
    (["parallel.tp=2", "simulate.enabled=true"], "the simulator models data parallelism only"),
    (["parallel.tp=3"], "must divide the attention heads (4)"),
    (["parallel.tp=2", "workload.name=digits-mlp"], "Attention and MLP blocks (as text-transformer does)"),
    (["parallel.pp=5"], "exceeds the 4 layers of text-transformer"),
    (["parallel.pp=2", "train.strategy=ps-bsp-backup:1"], "ps-bsp-backup picks"),
    (["train.strategy=ps-bsp-backup:1", "train.shards=2", "train.workers=3"], "use train.shards = 1"),
    (["train.engine=data"], "replaced by the [parallel] section"),
    (["parallel.tp=two"], "parallel.tp must be an integer"),
    (["parallel.nope=1"], "unknown key parallel.nope"),
    # sequence, context and expert parallelism
    (["parallel.sp=true"], "it needs parallel.tp > 1"),
    (["parallel.sp=yes"], "parallel.sp must be true or false"),
    (["parallel.cp=0"], "parallel.cp must be a positive integer"),
    (["parallel.cp=2", "parallel.ep=2", "train.strategy=allreduce", "workload.name=text-moe"],
     "an MoE layer routes whole sequences"),
    (["parallel.cp=3", "train.strategy=allreduce"], "choose cp in [2, 4, 8"),
    (["parallel.cp=2", "train.strategy=allreduce", "workload.name=digits-mlp"], "has no attention"),
    (["parallel.cp=2", "train.strategy=allreduce", "parallel.overlap=true"],
     "overlap applies to the data and pipeline engines"),
    (["parallel.tp=4", "parallel.sp=true", "workload.seq_len=30"], "choose tp in [2]"),
    (["parallel.tp=2", "parallel.sp=true", "workload.seq_len=31"], "no tp > 1 divides both"),
    (["workload.name=text-moe", "workload.experts=1000"], "at most 256 experts"),
    (["parallel.ep=2", "train.strategy=allreduce"], "has none: use workload.name = text-moe"),
    (["parallel.ep=2", "parallel.zero=3", "train.strategy=allreduce", "workload.name=text-moe"],
     "with zero = 3: ZeRO 2-3 reduce-scatter each gradient inside backward"),
    (["parallel.ep=2", "parallel.tp=2", "train.strategy=ps-bsp", "workload.name=text-moe"],
     "with tp = 2 needs train.strategy = allreduce"),
    (["parallel.ep=3", "train.strategy=allreduce", "workload.name=text-moe", "workload.batch_size=6"],
     "must divide workload.experts = 4"),
    (["parallel.ep=2", "train.strategy=allreduce", "workload.name=text-moe", "workload.batch_size=7"],
     "must be divisible by it"),
    (["parallel.zero=1", "train.strategy=allreduce", "workload.name=text-moe"],
     "runs data, tensor, pipeline or expert parallel (parallel.tp, pp, ep; zero = 1 with them)"),
    (["parallel.tp=2", "parallel.sp=true", "workload.name=text-moe"], "would route each tp rank's sequence shard"),
    (["workload.experts=8"], "applies to the mixture-of-experts workload only"),
    (["workload.name=text-moe", "workload.top_k=3"], "workload.top_k must be 1 or 2"),
    (["workload.name=text-moe", "workload.capacity_factor=0"], "capacity_factor must be a finite number > 0"),
    (["workload.name=text-moe", "workload.aux_weight=-1"], "aux_weight must be a finite number >= 0"),
    (["workload.name=text-moe", "workload.experts=0"], "workload.experts must be a positive integer"),
    (["workload.seq_len=64", "workload.name=digits-mlp"], "workload.seq_len sets a language model's context"),
    (["workload.seq_len=-2"], "workload.seq_len must be an integer in 1..4096"),
    (["workload.seq_len=100000"], "workload.seq_len must be an integer in 1..4096"),
])
def test_bad_parallel_value_is_one_line_and_exit_1(tmp_path, capsys, sets, fragment):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[train]\nstrategy = "ps-asp"\nworkers = 2\n')
    argv = ["run", str(cfg), "--out", str(tmp_path / "runs"), "-q"] + TF
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pslab: error:") and fragment in err[0], err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # nothing started


def test_composed_layouts_the_table_admits():
    """What the refusals no longer cover loads: 3D with sp, checkpointing and overlap-free ZeRO-1, ZeRO-3 with
    checkpointing, and ps-* 3D."""
    from pslab.experiments.config import load_config
    from pslab.experiments.strategies.build import check_layout
    from pslab.experiments.workloads import get_workload
    for sets in (["train.strategy=allreduce", "parallel.tp=2", "parallel.pp=2", "parallel.sp=true",
                  "parallel.activation_checkpointing=true"],
                 ["train.strategy=allreduce", "parallel.pp=2", "parallel.zero=1",
                  "parallel.activation_checkpointing=true"],
                 ["train.strategy=allreduce", "parallel.pp=2", "parallel.overlap=true"],
                 ["train.strategy=allreduce", "parallel.pp=2", "parallel.virtual_stages=2", "parallel.tp=2",
                  "parallel.sp=true"],
                 ["train.strategy=allreduce", "parallel.tp=2", "parallel.cp=2", "parallel.activation_checkpointing=true"],
                 ["train.strategy=allreduce", "train.workers=2", "parallel.zero=3",
                  "parallel.activation_checkpointing=true"],
                 ["train.strategy=ps-ssp:1", "parallel.tp=2", "parallel.pp=2"]):
        cfg = load_config(None, ["workload.name=text-transformer"] + sets)
        w = cfg.workload
        check_layout(cfg, get_workload(w.name, cfg.train.workers, w.batch_size, w.seed, **w.overrides()))


def test_stage_ms_pads_the_pipeline_engine():
    """parallel.stage_ms = 60 hands the pipeline engine equal stage times of 60 ms forward and 120 ms backward (the
    formula's setting, as `pslab schedule --run` pads); the run's label says so."""
    from pslab.experiments.config import load_config
    from pslab.experiments.strategies.build import make_engine
    from pslab.experiments.workloads import get_workload
    cfg = load_config(None, ["workload.name=text-transformer", "train.strategy=allreduce", "parallel.pp=2",
                             "parallel.stage_ms=60"])
    w = cfg.workload
    engine = make_engine(cfg, get_workload(w.name, cfg.train.workers, w.batch_size, w.seed, **w.overrides()))
    assert engine.kw["stage_time"] == (0.06, 0.12)
    assert cfg.parallel.describe() == "pp=2/1f1b/m4/60ms"
