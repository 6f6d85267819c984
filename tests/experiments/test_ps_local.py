"""ps-local:H and ps-diloco:H (experiments/strategies/ps_local.py, sim/ps_local.py): Local SGD and DiLoCo through the
shards, asynchronous. Exact where it can be: one worker is Local SGD; under the shards' BSP gate with the shard's
SGD at lr 1 the K pushes of a round are one average, so the run is local-sgd:H's to float rounding. Measured: the
bytes on the wire equal ⌈n/H⌉/n · 2S, every local step carries its push's staleness in outer steps, and the
simulator's arithmetic and staleness are the strategy's."""

from __future__ import annotations

import json

import pytest

from pslab.experiments.errors import ConfigError
from pslab.experiments.results.records import assign_staleness
from pslab.experiments.results.rundir import read_jsonl
from pslab.experiments.runner import execute
from pslab.experiments.strategies import spec as spec_module
from tests.experiments.conftest import small_config


def _losses(rd) -> dict:
    return {(r["worker"], r["step"]): r["loss"] for r in read_jsonl(rd.metrics_path)}


def _final(rd) -> float:
    return json.loads((rd.path / "summary.json").read_text())["final_test_loss"]


def _close(a: dict, b: dict, rel: float) -> bool:
    return a.keys() == b.keys() and max(abs(a[k] - b[k]) / abs(b[k]) for k in b) < rel


def test_one_worker_through_the_shards_is_local_sgd(tmp_path):
    """K = 1: the shard applies all of Δ (SGD, lr 1/K = 1), so θ after each push is the worker's own θ: the run is
    local-sgd:3's (and ps-diloco with outer sgd, lr 1, momentum 0 is ps-local), to float rounding."""
    base = ("train.workers=1", "train.steps=10", "train.eval_every=5")
    ref = execute(small_config("train.strategy=local-sgd:3", *base), tmp_path, label="ref", quiet=True)
    for extra in (["train.strategy=ps-local:3"],
                  ["train.strategy=ps-diloco:3", "outer.optimizer=sgd", "outer.lr=1", "outer.momentum=0"]):
        rd = execute(small_config(*extra, *base), tmp_path, label=extra[0].split("=")[1], quiet=True)
        assert _close(_losses(rd), _losses(ref), 1e-5), extra
        assert _final(rd) == pytest.approx(_final(ref), rel=1e-5)


def test_under_the_bsp_gate_the_pushes_of_a_round_are_local_sgds_average(tmp_path, monkeypatch):
    """The same workers against shards that wait for all K pushes of a clock and apply their mean at lr 1:
    θ − (1/K) Σ Δ_i = (1/K) Σ θ_i, Local SGD's average. Every record's loss equals local-sgd:3's (rel 1e-5): the
    worker side (local steps, Δ, reading θ back, evaluation of the shards' θ) is exact; asynchrony is the only
    difference of the real ps-local."""
    from pslab.ps.optim import OptimizerSpec
    base = ("train.workers=3", "train.steps=10", "train.eval_every=6")
    ref = execute(small_config("train.strategy=local-sgd:3", *base), tmp_path, label="ref", quiet=True)
    monkeypatch.setattr(spec_module.Strategy, "policy", property(lambda self: "bsp"))
    monkeypatch.setattr(spec_module, "shard_optimizer_spec", lambda cfg: OptimizerSpec(name="sgd", lr=1.0))
    rd = execute(small_config("train.strategy=ps-local:3", *base), tmp_path, label="gated", quiet=True)
    assert _close(_losses(rd), _losses(ref), 1e-5)
    assert _final(rd) == pytest.approx(_final(ref), rel=1e-5)


@pytest.fixture(scope="module")
def diloco(tmp_path_factory):
    root = tmp_path_factory.mktemp("ps-diloco")
    rd = execute(small_config("train.strategy=ps-diloco:4", "train.steps=10"), root, label="ps-diloco", quiet=True)
    return rd, read_jsonl(rd.metrics_path), json.loads((rd.path / "summary.json").read_text())


def test_bytes_on_the_wire_are_one_push_and_one_read_per_period(diloco):
    """⌈10/4⌉ = 3 pushes of Δ and reads of θ per worker over 10 steps: measured = formula (rel 1e-9); the records
    carry S sent and S received on each push step, 0 between."""
    _, recs, summary = diloco
    k = summary["bytes_by_kind"]["ps push + pull"]
    assert k["measured_per_step"] > 0 and k["model_per_step"] == pytest.approx(k["measured_per_step"], rel=1e-9), k
    for w in range(3):
        sent = [r["bytes_sent"] for r in sorted(recs, key=lambda r: r["step"]) if r["worker"] == w]
        assert [s > 0 for s in sent] == [False, False, False, True] * 2 + [False, True]


def test_every_local_step_carries_its_pushs_staleness(diloco):
    """τ in outer steps: the pushes the shard applied between the worker's read and its push, the same for the H
    records of a period; with 3 workers each of the others pushed about once in between."""
    _, recs, summary = diloco
    for w in range(3):
        taus = [r["staleness"] for r in sorted(recs, key=lambda r: r["step"]) if r["worker"] == w]
        assert all(isinstance(t, int) and t >= 0 for t in taus), taus
        assert len(set(taus[0:4])) == len(set(taus[4:8])) == len(set(taus[8:10])) == 1, taus
    assert 0 < summary["staleness_mean"] <= 4


def test_assign_staleness_gives_each_period_its_push():
    recs = [{"worker": 0, "step": s} for s in range(5)]
    assign_staleness(recs, [[0.0, 0, 2, 1], [0.0, 0, 1, 3]], period=3)
    assert [r["staleness"] for r in recs] == [2, 2, 2, 1, 1]


def test_the_simulator_runs_the_same_arithmetic(tmp_path):
    """One worker: the simulated losses equal the real run's (rel 1e-5). Four workers in lockstep: the first
    pushes see 0, 1, 2, 3 (the order they arrive in), then every push sees the other three (τ = K − 1), and
    timing-only gives the same staleness."""
    base = ("train.workers=1", "train.steps=10", "train.eval_every=5")
    real = execute(small_config("train.strategy=ps-local:3", *base), tmp_path, label="real", quiet=True)
    sim = execute(small_config("train.strategy=ps-local:3", *base), tmp_path, label="sim", quiet=True,
                  simulate=True)
    assert _close(_losses(sim), _losses(real), 1e-5)
    four = ("train.strategy=ps-diloco:2", "train.workers=4", "train.steps=6")
    runs = [read_jsonl(execute(small_config(*four, *extra), tmp_path, label=f"sim{i}", quiet=True,
                               simulate=True).metrics_path)
            for i, extra in enumerate([(), ("simulate.timing_only=true",)])]
    for recs in runs:
        first = sorted(r["staleness"] for r in recs if r["step"] == 0)
        assert first == [0, 1, 2, 3]
        assert {r["staleness"] for r in recs if r["step"] >= 2} == {3}
    assert [(r["worker"], r["step"], r["staleness"]) for r in runs[0]] == \
        [(r["worker"], r["step"], r["staleness"]) for r in runs[1]]


@pytest.mark.parametrize("extra, fragment", [
    (["train.strategy=ps-local"], "needs a period H"),
    (["train.strategy=ps-diloco:0"], "must be >= 1"),
    (["train.strategy=ps-local:4", "faults.checkpoint_every=2"], "keeps per-worker parameters"),
    (["train.strategy=ps-local:4", "faults.shard_checkpoint_every=2"], "keeps per-worker parameters"),
    (["train.strategy=ps-local:4", "workload.name=text-transformer", "parallel.tp=2"], "plain data parallelism"),
])
def test_what_ps_local_does_not_run_with_is_one_line(extra, fragment):
    with pytest.raises(ConfigError) as e:
        small_config(*extra)
    assert fragment in str(e.value) and "\n" not in str(e.value)
