"""`pslab run` through the engines: every `[parallel]` layout that makes sense, under ring all-reduce and under the
parameter server, on the text-transformer workload — one training loop for all of them.

Parity: BSP (allreduce, ps-bsp) with any engine equals `local` (one process, the unsplit model, the K workers'
gradients averaged) on the same batches: per-(worker, step) losses to float32 summation-order tolerance and the
final test accuracy; ps-asp with one worker equals local with one worker. Every run writes metrics, a summary and
bytes per step by kind, and each kind's measured bytes agree with its formula."""

from __future__ import annotations

import json

import pytest

from pslab.experiments.results.rundir import read_jsonl
from pslab.experiments.runner import execute
from tests.experiments.conftest import small_config

pytestmark = pytest.mark.long       # the `runs` fixture: 45 runs, ~80 s beside CI's busy loops (queued early)

TF = ["workload.name=text-transformer", "workload.batch_size=8", "train.steps=4", "train.eval_every=4",
      "train.lr=0.05", "train.optimizer=momentum"]

# label -> (strategy, workers = dp degree, [parallel] overrides, the kinds of bytes it must report)
LAYOUTS = {
    "allreduce dp=2 overlap": ("allreduce", 2, ["parallel.overlap=true"], {"dp gradient sync"}),
    "allreduce tp=2": ("allreduce", 1, ["parallel.tp=2"], {"tp activations"}),
    "allreduce pp=2 1f1b m4": ("allreduce", 1, ["parallel.pp=2", "parallel.micro_batches=4"], {"pp boundaries"}),
    "allreduce pp=2 gpipe ckpt": ("allreduce", 1, ["parallel.pp=2", "parallel.schedule=gpipe",
                                                   "parallel.activation_checkpointing=true"], {"pp boundaries"}),
    "allreduce zero=1": ("allreduce", 2, ["parallel.zero=1"], {"zero RS + AG"}),
    "allreduce zero=2": ("allreduce", 2, ["parallel.zero=2"], {"zero RS + AG"}),
    "allreduce zero=3": ("allreduce", 2, ["parallel.zero=3", "train.optimizer=adam", "train.lr=0.01"],
                         {"zero RS + AG"}),
    "allreduce dp=2 ckpt": ("allreduce", 2, ["parallel.activation_checkpointing=true"], {"dp gradient sync"}),
    "allreduce dp=2 x tp=2": ("allreduce", 2, ["parallel.tp=2"], {"dp gradient sync", "tp activations"}),
    "allreduce dp=2 x pp=2": ("allreduce", 2, ["parallel.pp=2"], {"dp gradient sync", "pp boundaries"}),
    "ps-bsp dp=2": ("ps-bsp", 2, [], {"ps push + pull"}),
    "ps-bsp tp=2": ("ps-bsp", 1, ["parallel.tp=2"], {"ps push + pull", "tp activations"}),
    "ps-bsp pp=2": ("ps-bsp", 1, ["parallel.pp=2"], {"ps push + pull", "pp boundaries"}),
    "ps-bsp dp=2 ckpt": ("ps-bsp", 2, ["parallel.activation_checkpointing=true"], {"ps push + pull"}),
    "ps-bsp dp=2 x tp=2": ("ps-bsp", 2, ["parallel.tp=2"], {"ps push + pull", "tp activations"}),
    "ps-bsp dp=2 x pp=2 2 shards": ("ps-bsp", 2, ["parallel.pp=2", "train.shards=2"],
                                    {"ps push + pull", "pp boundaries"}),
    "ps-asp 1 worker": ("ps-asp", 1, [], {"ps push + pull"}),
    "allreduce tp=2 sp": ("allreduce", 1, ["parallel.tp=2", "parallel.sp=true"], {"tp activations"}),
    "allreduce dp=2 x tp=2 sp": ("allreduce", 2, ["parallel.tp=2", "parallel.sp=true"],
                                 {"dp gradient sync", "tp activations"}),
    "ps-bsp dp=2 x tp=2 sp": ("ps-bsp", 2, ["parallel.tp=2", "parallel.sp=true"], {"ps push + pull", "tp activations"}),
    # composed (3D): every stage split over tp, the cuts between same-tp ranks
    "allreduce dp=2 x tp=2 x pp=2": ("allreduce", 2, ["parallel.tp=2", "parallel.pp=2", "parallel.micro_batches=2"],
                                     {"dp gradient sync", "tp activations", "pp boundaries"}),
    "allreduce dp=2 x tp=2 sp x pp=2 torch": ("allreduce", 2, ["parallel.tp=2", "parallel.sp=true", "parallel.pp=2",
                                                               "train.backend=torch"],
                                              {"dp gradient sync", "tp activations", "pp boundaries"}),
    "allreduce tp=2 sp x pp=2 ckpt": ("allreduce", 1, ["parallel.tp=2", "parallel.sp=true", "parallel.pp=2",
                                                       "parallel.activation_checkpointing=true"],
                                      {"tp activations", "pp boundaries"}),
    "ps-bsp tp=2 x pp=2": ("ps-bsp", 1, ["parallel.tp=2", "parallel.pp=2"],
                           {"ps push + pull", "tp activations", "pp boundaries"}),
    "allreduce dp=2 x tp=2 x pp=2 zero=1": ("allreduce", 2, ["parallel.tp=2", "parallel.pp=2", "parallel.zero=1"],
                                            {"zero RS + AG", "tp activations", "pp boundaries"}),
    "allreduce dp=2 x pp=2 overlap": ("allreduce", 2, ["parallel.pp=2", "parallel.overlap=true"],
                                      {"dp gradient sync", "pp boundaries"}),
    "allreduce dp=3 x pp=2 v2 overlap": ("allreduce", 3, ["parallel.pp=2", "parallel.virtual_stages=2",
                                                           "parallel.overlap=true"],
                                         {"dp gradient sync", "pp boundaries"}),
    "allreduce tp=2 sp x pp=2 v2 torch": ("allreduce", 1, ["parallel.tp=2", "parallel.sp=true", "parallel.pp=2",
                                                            "parallel.virtual_stages=2", "train.backend=torch"],
                                          {"tp activations", "pp boundaries"}),
    "ps-bsp pp=2 v2": ("ps-bsp", 1, ["parallel.pp=2", "parallel.virtual_stages=2"], {"ps push + pull", "pp boundaries"}),
    # ZeRO 2-3 over each tp rank's shards (2D: FSDP + TP)
    "allreduce dp=2 x tp=2 zero=3": ("allreduce", 2, ["parallel.tp=2", "parallel.zero=3"],   # (Adam with eps 1e-8
                                     {"zero RS + AG", "tp activations"}),   # turns the key biases' 1e-10 noise into steps)
    "allreduce dp=2 x tp=2 zero=2 torch": ("allreduce", 2, ["parallel.tp=2", "parallel.zero=2", "train.backend=torch"],
                                           {"zero RS + AG", "tp activations"}),
    # ... and with sequence parallelism: the replicated tensors' partial gradients summed over tp, then reduced
    "allreduce dp=2 x tp=2 sp zero=2": ("allreduce", 2, ["parallel.tp=2", "parallel.sp=true", "parallel.zero=2"],
                                        {"zero RS + AG", "tp activations"}),
    "allreduce dp=2 x tp=2 sp zero=3 torch": ("allreduce", 2, ["parallel.tp=2", "parallel.sp=true", "parallel.zero=3",
                                                               "train.backend=torch"],
                                              {"zero RS + AG", "tp activations"}),
    # ZeRO-2 in a pipeline: each micro-batch's gradients reduce-scattered over dp as its backward ends
    "allreduce dp=2 x pp=2 zero=2 m4": ("allreduce", 2, ["parallel.pp=2", "parallel.zero=2", "parallel.micro_batches=4"],
                                        {"zero RS + AG", "pp boundaries"}),
    "allreduce dp=2 x tp=2 x pp=2 zero=2 v2 torch": ("allreduce", 2, ["parallel.tp=2", "parallel.pp=2",
                                                                       "parallel.zero=2", "parallel.virtual_stages=2",
                                                                       "train.backend=torch"],
                                                     {"zero RS + AG", "tp activations", "pp boundaries"}),
    # ZeRO 1-3 with activation checkpointing: the hooks fire in the recomputed blocks' backward (ZeRO-3: the
    # recompute's gather serves the backward, 2 gathers a unit as without checkpointing)
    "allreduce dp=2 x tp=2 sp zero=3 ckpt": ("allreduce", 2, ["parallel.tp=2", "parallel.sp=true", "parallel.zero=3",
                                                              "parallel.activation_checkpointing=true"],
                                             {"zero RS + AG", "tp activations"}),
    "allreduce zero=1 ckpt": ("allreduce", 2, ["parallel.zero=1", "parallel.activation_checkpointing=true"],
                              {"zero RS + AG"}),
    "allreduce dp=2 x tp=2 zero=2 ckpt torch": ("allreduce", 2, ["parallel.tp=2", "parallel.zero=2", "train.backend=torch",
                                                                 "parallel.activation_checkpointing=true"],
                                                {"zero RS + AG", "tp activations"}),
    # the distributed optimizer (ZeRO-1) on a cp replica: each cp rank chunks its slots over its dp group
    "allreduce dp=2 x cp=2 zero=1": ("allreduce", 2, ["parallel.cp=2", "parallel.zero=1"],
                                     {"zero RS + AG", "cp ring + grads"}),
    # ZeRO 2-3 on cp replicas: every gradient averaged over cp after backward, then reduce-scattered over dp
    "allreduce dp=2 x cp=2 zero=2": ("allreduce", 2, ["parallel.cp=2", "parallel.zero=2"],
                                     {"zero RS + AG", "cp ring + grads"}),
    "allreduce dp=2 x cp=2 zero=3 torch": ("allreduce", 2, ["parallel.cp=2", "parallel.zero=3", "train.backend=torch"],
                                           {"zero RS + AG", "cp ring + grads"}),
    # tp x cp with sequence parallelism: LayerNorm regions on S/(C·T) tokens, the ring on the gathered S/C
    "allreduce tp=2 sp x cp=2": ("allreduce", 1, ["parallel.tp=2", "parallel.sp=true", "parallel.cp=2"],
                                 {"tp activations", "cp ring + grads"}),
    "allreduce tp=2 sp x pp=2 x cp=2 torch": ("allreduce", 1, ["parallel.tp=2", "parallel.sp=true", "parallel.pp=2",
                                                                "parallel.cp=2", "parallel.micro_batches=2",
                                                                "train.backend=torch"],
                                              {"tp activations", "pp boundaries", "cp ring + grads"}),
    "allreduce dp=2 x tp=2 sp x cp=2 zero=2": ("allreduce", 2, ["parallel.tp=2", "parallel.sp=true", "parallel.cp=2",
                                                                 "parallel.zero=2"],
                                               {"zero RS + AG", "tp activations", "cp ring + grads"}),
    # cp under the parameter server: cp rank 0 pushes the cp-averaged gradient, then broadcasts what it read
    "ps-bsp dp=2 x cp=2": ("ps-bsp", 2, ["parallel.cp=2"], {"ps push + pull", "cp ring + grads"}),
    "ps-bsp tp=2 x cp=2": ("ps-bsp", 1, ["parallel.tp=2", "parallel.cp=2"],
                           {"ps push + pull", "tp activations", "cp ring + grads"}),
    "ps-bsp pp=2 x cp=2": ("ps-bsp", 1, ["parallel.pp=2", "parallel.cp=2"],
                           {"ps push + pull", "pp boundaries", "cp ring + grads"}),
    "allreduce cp=2": ("allreduce", 1, ["parallel.tp=1", "parallel.cp=2"], {"cp ring + grads"}),
    "allreduce dp=2 x cp=2 torch": ("allreduce", 2, ["parallel.cp=2", "train.backend=torch"],
                                    {"dp gradient sync", "cp ring + grads"}),
    "allreduce pp=2 x cp=2 v2": ("allreduce", 1, ["parallel.pp=2", "parallel.cp=2", "parallel.virtual_stages=2"],
                                 {"pp boundaries", "cp ring + grads"}),
    "allreduce tp=2 x pp=2 x cp=2": ("allreduce", 1, ["parallel.tp=2", "parallel.pp=2", "parallel.cp=2",
                                                              "parallel.micro_batches=2"],
                                      {"tp activations", "pp boundaries", "cp ring + grads"}),
    "allreduce tp=2 x cp=2": ("allreduce", 1, ["parallel.tp=2", "parallel.cp=2"], {"tp activations", "cp ring + grads"}),
    "allreduce dp=2 x tp=2 x cp=2 ckpt": ("allreduce", 2, ["parallel.tp=2", "parallel.cp=2",
                                                            "parallel.activation_checkpointing=true"],
                                          {"dp gradient sync", "tp activations", "cp ring + grads"}),
}


def _overrides(strategy: str, workers: int, extra: list[str]) -> list[str]:
    return TF + [f"train.strategy={strategy}", f"train.workers={workers}"] + extra


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("engines")
    out = {}
    for label, (strategy, workers, extra, _) in LAYOUTS.items():
        rd = execute(small_config(*_overrides(strategy, workers, extra)), root, label=label, quiet=True)
        out[label] = (read_jsonl(rd.metrics_path), json.loads((rd.path / "summary.json").read_text()))
    for label in {"local K=1", "local K=2", "local K=2 adam", "local K=3"}:
        workers = int(label.split("K=")[1][0])
        extra = ["train.optimizer=adam", "train.lr=0.01"] if "adam" in label else []
        rd = execute(small_config(*_overrides("local", workers, extra)), root, label=label, quiet=True)
        out[label] = (read_jsonl(rd.metrics_path), json.loads((rd.path / "summary.json").read_text()))
    return out


def _reference(label: str) -> str:
    strategy, workers, extra, _ = LAYOUTS[label]
    return f"local K={workers}" + (" adam" if "train.optimizer=adam" in extra else "")


@pytest.mark.parametrize("label", list(LAYOUTS))
def test_every_layout_equals_the_single_process_reference(runs, label):
    """Same (worker, step) rows and losses as local within 2e-6, and the same final test accuracy."""
    ups, summary = runs[label]
    ref_ups, ref_summary = runs[_reference(label)]
    got = {(u["worker"], u["step"]): u["loss"] for u in ups}
    ref = {(u["worker"], u["step"]): u["loss"] for u in ref_ups}
    assert got.keys() == ref.keys(), label
    assert max(abs(got[k] - ref[k]) for k in ref) < 2e-6, label
    assert summary["final_test_acc"] == pytest.approx(ref_summary["final_test_acc"], abs=1e-6), label
    assert summary["final_test_acc"] is not None and summary["updates"] == len(ref)


GLOO_HEADER = 48       # gloo's header on every message; at most 12(N−1) messages per op (an all-reduce's)


def assert_counted_equals_formula(v: dict, gloo: bool, n_max: int, what: object) -> None:
    """zmq: the counted bytes equal the formula (float rounding only: the pipeline's one-off shape headers are
    spread over the run's steps). torch: the kernel's count on gloo's connections is the formula's payload plus
    gloo's framing, 48 B a message, at most 12(N−1) messages for each op the backend counted (sends_per_step)."""
    m, f = v["measured_per_step"], v["model_per_step"]
    if not gloo:
        assert f == pytest.approx(m, rel=1e-9), what
    else:
        assert f <= m <= f + v["sends_per_step"] * 12 * (n_max - 1) * GLOO_HEADER, (what, m, f, v["sends_per_step"])


def _n_max(workers: int, extra: list[str]) -> int:
    sizes = [workers] + [int(e.split("=")[1]) for e in extra if e.split("=")[0] in
                         ("parallel.tp", "parallel.pp", "parallel.cp", "parallel.ep")]
    return max(sizes)


@pytest.mark.parametrize("label", list(LAYOUTS))
def test_every_layout_reports_bytes_by_kind_next_to_the_formula(runs, label):
    """The summary has the layout's kinds of communication; each measured (counted) figure equals its formula, on
    gloo up to its message framing."""
    _, summary = runs[label]
    kinds = {k: v for k, v in summary["bytes_by_kind"].items() if v["measured_per_step"] > 0}
    assert set(kinds) == LAYOUTS[label][3], label
    _, workers, extra, _ = LAYOUTS[label]
    for kind, v in kinds.items():
        assert_counted_equals_formula(v, "train.backend=torch" in extra, _n_max(workers, extra), (label, kind))
        assert v["formula"]


@pytest.mark.parametrize("label", list(LAYOUTS))
def test_every_layout_reports_peak_activations(runs, label):
    """The summary's peak saved activations per rank (ActivationMeter over the first steps) equal the formula
    (experiments/results/memory.py) to the byte wherever one is given; pipeline, ZeRO and checkpointing: measured."""
    act = runs[label][1]["activations"]
    assert act and act["measured_peak_bytes"] > 0 and all(b > 0 for b in act["per_rank"]), label
    if act["model_bytes"] is not None:
        assert act["model_bytes"] == act["measured_peak_bytes"], (label, act)
    else:
        assert any(k in label for k in ("pp=", "zero", "ckpt")), (label, act)


@pytest.mark.parametrize("label", [k for k, v in LAYOUTS.items() if "parallel.pp=2" in v[2]])
def test_pipeline_runs_report_their_bubble_next_to_the_formula(runs, label):
    """A pipeline run's summary has the stages' measured idle share (a fraction of their step time, from the
    executor's spans) next to (p−1)/(v·m+p−1) for its own p, m and v; a run without a pipeline has none."""
    extra = LAYOUTS[label][2]
    v = 2 if "parallel.virtual_stages=2" in extra else 1
    m = next((int(e.split("=")[1]) for e in extra if e.startswith("parallel.micro_batches=")), 4)
    pipe = runs[label][1]["pipeline"]
    assert (pipe["stages"], pipe["micro_batches"], pipe["virtual_stages"]) == (2, m, v)
    assert pipe["bubble_formula"] == pytest.approx(1 / (v * m + 1), rel=1e-12)
    assert 0.0 < pipe["bubble_measured"] < 1.0
    assert "pipeline" not in runs["allreduce tp=2"][1]


def test_activation_memory_falls_with_sp_and_cp(runs):
    """Per rank: tp + sp < tp < one whole model, and cp = 2 keeps half of the whole model's activations (+ the loss)."""
    peak = {k: runs[k][1]["activations"]["measured_peak_bytes"] for k in
            ("allreduce dp=2 overlap", "allreduce tp=2", "allreduce tp=2 sp", "allreduce cp=2")}
    assert peak["allreduce tp=2 sp"] < peak["allreduce tp=2"] < peak["allreduce dp=2 overlap"]
    assert peak["allreduce cp=2"] == (peak["allreduce dp=2 overlap"] - 4) // 2 + 4


def test_ps_runs_record_staleness_from_the_shards(runs):
    """ps-bsp: every update has staleness 0 (the shard's series covers every record)."""
    for label in ("ps-bsp dp=2", "ps-bsp dp=2 x tp=2", "ps-bsp dp=2 x pp=2 2 shards"):
        assert {u["staleness"] for u in runs[label][0]} == {0}, label


ACCEPTANCE = {
    "allreduce tp=2": ["train.strategy=allreduce", "train.workers=1", "parallel.tp=2"],
    "allreduce pp=2 m4 1f1b": ["train.strategy=allreduce", "train.workers=1", "parallel.pp=2",
                               "parallel.micro_batches=4", "parallel.schedule=1f1b"],
    "allreduce zero=3": ["train.strategy=allreduce", "train.workers=2", "parallel.zero=3"],
    "allreduce dp=2 x tp=2": ["train.strategy=allreduce", "train.workers=2", "parallel.tp=2"],
    "ps-asp pp=2": ["train.strategy=ps-asp", "train.workers=2", "parallel.pp=2"],
    "ps-ssp:2 dp=2 x tp=2": ["train.strategy=ps-ssp:2", "train.workers=2", "parallel.tp=2"],
    "allreduce tp=2 sp": ["train.strategy=allreduce", "train.workers=1", "parallel.tp=2", "parallel.sp=true"],
    "allreduce cp=2 S=48": ["train.strategy=allreduce", "train.workers=1", "parallel.cp=2", "workload.seq_len=48"],
}


@pytest.mark.parametrize("label", list(ACCEPTANCE))
def test_pslab_run_with_parallel_settings_writes_a_full_run_dir(tmp_path, capsys, label):
    """`pslab run CONFIG --set parallel.x=...`: metrics for every (worker, step), test accuracy, a summary with
    bytes by kind; under SSP(2) no update is more than 2 + (K-1)... bounded; staleness recorded for PS runs."""
    from pslab.experiments.cli import main
    cfg = tmp_path / "c.toml"
    cfg.write_text('[workload]\nname = "text-transformer"\nbatch_size = 8\n[train]\nsteps = 4\neval_every = 4\n')
    argv = ["run", str(cfg), "--out", str(tmp_path / "runs"), "-q"]
    for s in ACCEPTANCE[label]:
        argv += ["--set", s]
    assert main(argv) == 0
    (rd,) = list((tmp_path / "runs").iterdir())
    summary = json.loads((rd / "summary.json").read_text())
    ups = read_jsonl(rd / "metrics.jsonl")
    workers = int(next(s for s in ACCEPTANCE[label] if s.startswith("train.workers")).split("=")[1])
    assert sorted((u["worker"], u["step"]) for u in ups) == [(w, t) for w in range(workers) for t in range(4)]
    assert summary["final_test_acc"] is not None and summary["bytes_by_kind"]
    assert summary["activations"]["measured_peak_bytes"] > 0
    assert (rd / "eval.jsonl").exists() and (rd / "config.toml").exists()
    if "ps-" in label:
        assert all(u["staleness"] is not None for u in ups)
    if "ssp:2" in label:
        assert max(u["staleness"] for u in ups) <= (workers - 1) * (2 * 2 + 1)    # Ho's SSP(2): (K-1)(2s+1)
    assert "run directory:" in capsys.readouterr().out


def test_compare_with_a_parallel_setting(tmp_path, capsys):
    """`pslab compare --strategies ... --set parallel.tp=2` runs every strategy on the split model (local, the
    reference, on the unsplit one) and reports them side by side."""
    from pslab.experiments.cli import main
    argv = ["compare", "--strategies", "local,allreduce,ps-bsp,ps-asp", "--no-straggler", "-q",
            "--out", str(tmp_path / "cmp"), "--set", "workload.name=text-transformer", "--set", "parallel.tp=2",
            "--set", "train.workers=2", "--set", "train.steps=4", "--set", "workload.batch_size=8",
            "--set", "train.base_step_s=0", "--set", "train.eval_every=4"]
    assert main(argv) == 0
    report = (tmp_path / "cmp" / "report.md").read_text()
    for label in ("| local |", "| allreduce[tp=2] |", "| ps-bsp[tp=2] |", "| ps-asp[tp=2] |"):
        assert label in report, label
    assert "bytes_by_kind.png" in report


def test_sparse_gradients_take_every_path(tmp_path):
    """bow-1m's embedding has sparse gradients: local (accumulated sparse), allreduce (densified for the flat
    all-reduce, and accumulated into dense buckets with overlap), ZeRO (densified before the reduce-scatter) and
    ps-bsp (accumulated into the push segment,
    only the touched rows zeroed after each push) all train the same model from the same batches."""
    base = ["workload.name=bow-1m", "workload.batch_size=8", "train.workers=2", "train.steps=5", "train.lr=0.5",
            "train.eval_every=10"]
    out = {}
    for label, extra in {"local": ["train.strategy=local"], "allreduce": ["train.strategy=allreduce"],
                         "overlap": ["train.strategy=allreduce", "parallel.overlap=true"],
                         "zero=1": ["train.strategy=allreduce", "parallel.zero=1"],
                         "zero=3": ["train.strategy=allreduce", "parallel.zero=3"],
                         "ps-bsp": ["train.strategy=ps-bsp"]}.items():
        rd = execute(small_config(*base, *extra), tmp_path, label=label, quiet=True)
        out[label] = ({(u["worker"], u["step"]): u["loss"] for u in read_jsonl(rd.metrics_path)},
                      json.loads((rd.path / "summary.json").read_text())["final_test_acc"])
    ref, ref_acc = out["local"]
    for label, (losses, acc) in out.items():
        assert losses.keys() == ref.keys() and max(abs(losses[k] - ref[k]) for k in ref) < 1e-5, label
        assert acc == pytest.approx(ref_acc, abs=1e-6), label
    assert len(set(ref.values())) > 5            # it trained: the losses move


@pytest.mark.timeout(120)
def test_a_straggler_in_a_split_model_slows_it_without_compounding(tmp_path):
    """A 3x straggler on worker 1 of a pipeline (dp=2 x pp=2): its two stage ranks pad to one deadline, so the run
    finishes (per-rank padding used to compound, each step's wait feeding the next step's padding, until timeout)."""
    cfg = small_config(*TF, "train.strategy=allreduce", "train.workers=2", "parallel.pp=2", "train.steps=24",
                       "train.base_step_s=0.005", 'stragglers.factors={"1" = 3.0}', "train.timeout_s=60")
    rd = execute(cfg, tmp_path, label="straggler pp", quiet=True)
    assert len(read_jsonl(rd.metrics_path)) == 48


MOE = ["workload.name=text-moe", "workload.batch_size=8", "train.steps=4", "train.eval_every=4", "train.lr=0.05",
       "train.optimizer=momentum", "train.workers=2"]


@pytest.mark.timeout(240)
def test_moe_expert_parallel_equals_local_and_reports_the_expert_load(tmp_path):
    """text-moe (top-2, capacity factor 0.75: tokens are dropped) with ep = 2 x dp = 2 under allreduce (zmq and gloo)
    and under ps-bsp, and cut into pipeline stages (dp x pp x ep; under ps-bsp interleaved too), each stage adding
    its MoE layers' aux loss; with tp (each expert's MLP split column/row, alone on gloo and inside ep with
    activation checkpointing) and checkpointed pipelines (the aux losses leave the checkpoint as outputs): every (worker, step) loss and the final accuracy equal `local` (one process, all experts);
    the summary reports the expert load (the same counts as local: routing per sequence does not depend on the
    split), the all-to-all bytes equal their formula, and `pslab report` draws the expert-load plot."""
    from pslab.experiments.cli import main
    extra = ["workload.top_k=2", "workload.capacity_factor=0.75"]
    runs = {}
    for label, more in {"local": ["train.strategy=local"],
                        "allreduce ep=2": ["train.strategy=allreduce", "parallel.ep=2"],
                        "allreduce ep=2 torch": ["train.strategy=allreduce", "parallel.ep=2", "train.backend=torch"],
                        "ps-bsp ep=2": ["train.strategy=ps-bsp", "parallel.ep=2"],
                        "allreduce pp=2 x ep=2": ["train.strategy=allreduce", "parallel.pp=2", "parallel.ep=2",
                                                  "parallel.micro_batches=2"],
                        "ps-bsp pp=2 x ep=2 v2": ["train.strategy=ps-bsp", "parallel.pp=2", "parallel.ep=2",
                                                  "parallel.virtual_stages=2", "parallel.micro_batches=2"],
                        "allreduce ep=2 x tp=2 ckpt": ["train.strategy=allreduce", "parallel.ep=2", "parallel.tp=2",
                                                       "parallel.activation_checkpointing=true"],
                        "allreduce tp=2 torch": ["train.strategy=allreduce", "parallel.tp=2", "train.backend=torch"],
                        "allreduce ep=2 zero=1": ["train.strategy=allreduce", "parallel.ep=2", "parallel.zero=1"],
                        "ps-bsp tp=2": ["train.strategy=ps-bsp", "parallel.tp=2"],
                        "allreduce pp=2 x ep=2 ckpt": ["train.strategy=allreduce", "parallel.pp=2", "parallel.ep=2",
                                                       "parallel.micro_batches=2",
                                                       "parallel.activation_checkpointing=true"]}.items():
        rd = execute(small_config(*MOE, *extra, *more), tmp_path, label=label, quiet=True)
        runs[label] = (rd, {(u["worker"], u["step"]): u["loss"] for u in read_jsonl(rd.metrics_path)},
                       json.loads((rd.path / "summary.json").read_text()))
    _, ref, ref_s = runs["local"]
    assert len(ref) == 8 and len(set(ref.values())) == 8
    assert ref_s["moe"]["dropped"] > 0 and ref_s["moe"]["routed"] == 2 * 2 * 2 * 4 * 8 * 32   # layers k D steps b S
    for label, (rd, losses, s) in runs.items():
        assert losses.keys() == ref.keys() and max(abs(losses[k] - ref[k]) for k in ref) < 2e-6, label
        assert s["final_test_acc"] == pytest.approx(ref_s["final_test_acc"], abs=1e-6), label
        assert s["moe"]["layers"] == ref_s["moe"]["layers"], label
        for kind, v in s["bytes_by_kind"].items():
            assert_counted_equals_formula(v, "torch" in label, 2, (label, kind))
        assert ("ep all-to-all + grads" in s["bytes_by_kind"]) == ("ep=2" in label), label
        assert ("pp boundaries" in s["bytes_by_kind"]) == ("pp=2" in label), label
        assert ("tp activations" in s["bytes_by_kind"]) == ("tp=2" in label), label
    rd = runs["allreduce ep=2"][0]
    assert main(["report", str(rd.path)]) == 0
    report = (rd.path / "report" / "report.md").read_text()
    assert "expert_load.png" in report and (rd.path / "report" / "expert_load.png").exists()


def test_the_planners_pslab_comm_model_equals_the_measured_bytes_per_kind(runs):
    """`parallelism.comm_model.step_comm(..., algorithm="pslab")` for each allreduce layout's Shape (the workload's
    layers, width, heads, context, vocabulary; the micro-batch b/m) gives the bytes per kind the engines measured,
    EXACTLY: direct exchange <= 32 KiB, the pipeline's loss broadcast and its one-off shape headers spread over the
    run's steps, SP's replicated-gradient and loss all-reduces, ZeRO's per-parameter reduce-scatters and all-gathers.
    (The gloo layouts are checked against results/bytes.py's gloo formulas above: the planner models pslab's
    algorithms.)"""
    from pslab.experiments.workloads import get_workload
    from pslab.parallelism.cluster import Cluster
    from pslab.parallelism.comm_model import bytes_by_kind, step_comm
    from pslab.parallelism.memory_model import Layout, Shape
    for label, (strategy, workers, extra, _) in LAYOUTS.items():
        if strategy != "allreduce":
            continue
        if "train.backend=torch" in extra:    # the planner models pslab's algorithms; gloo's (its reduce-scatter
            continue                          # an all-reduce, its framing): results/bytes.py, the test above
        cfg = small_config(*_overrides(strategy, workers, extra))
        p, w = cfg.parallel, cfg.workload
        wl = get_workload(w.name, workers, w.batch_size, w.seed, **w.overrides())
        x, _, _ = wl.batch(0, 0)
        m = p.micro_batches if p.pp > 1 else 1
        kw = wl.model_kwargs
        shape = Shape(layers=kw["layers"], hidden=kw["dim"], heads=kw["heads"], seq=x.shape[1],
                      vocab=wl.data.num_classes, micro_batch=x.shape[0] // m)
        layout = Layout(dp=workers, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep, zero=p.zero, sp=p.sp, micro_batches=m,
                        recompute="full" if p.activation_checkpointing else "none", schedule=p.schedule,
                        virtual_stages=p.virtual_stages)
        here = Cluster("here", layout.gpus(), 1, 1e12, 1e12)
        terms = step_comm(shape, layout, here, algorithm="pslab", act_bytes=4, grad_bytes=4, overlap=p.overlap,
                          steps=cfg.train.steps)
        measured = {k: v["measured_per_step"] for k, v in runs[label][1]["bytes_by_kind"].items()
                    if v["measured_per_step"] > 0}
        assert bytes_by_kind(terms) == measured, label
