"""train.compress in real runs (allreduce, forked workers over 127.0.0.1): topk:1.0 and PowerSGD at full rank
train exactly as the uncompressed all-reduce (rel 1e-6); the bytes measured on the wire equal the formula for
top-k, sign and PowerSGD; turning error feedback off changes the run; what compression does not run with yet is
one line. On the parameter server's push (ps-*): ps-bsp with one shard and top-k trains as the all-reduce with
top-k (the same selection, the same mean), the simulator as the real run, and the push's bytes equal the formula.
(The compressors' arithmetic: tests/parallelism/test_compress.py and tests/ps/test_compression.py.)"""

from __future__ import annotations

import json

import pytest

from pslab.experiments.errors import ConfigError
from pslab.experiments.results.rundir import read_jsonl
from pslab.experiments.runner import execute
from tests.experiments.conftest import small_config


def _run(root, label: str, *extra: str) -> tuple[dict, dict]:
    rd = execute(small_config("train.strategy=allreduce", "train.steps=8", *extra), root, label=label, quiet=True)
    recs = read_jsonl(rd.metrics_path)
    return {(r["worker"], r["step"]): r["loss"] for r in recs}, json.loads((rd.path / "summary.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compress")
    out = {"none": _run(root, "none")}
    for c in ("topk:1.0", "powersgd:10", "topk:0.05", "sign", "powersgd:2"):   # digits-logreg: a 10 x 64 weight
        out[c] = _run(root, c, f"train.compress={c}")
    out["topk:0.05 no-ef"] = _run(root, "topk:0.05 no-ef", "train.compress=topk:0.05", "train.error_feedback=false")
    return out


@pytest.mark.parametrize("c", ["topk:1.0", "powersgd:10"])
def test_full_compression_trains_as_the_all_reduce(runs, c):
    (a, sa), (b, sb) = runs["none"], runs[c]
    assert a.keys() == b.keys()
    assert max(abs(a[k] - b[k]) / abs(a[k]) for k in a) < 1e-6
    assert sb["final_test_loss"] == pytest.approx(sa["final_test_loss"], rel=1e-6)


@pytest.mark.parametrize("c", ["topk:1.0", "topk:0.05", "sign", "powersgd:2", "powersgd:10"])
def test_bytes_on_the_wire_equal_the_formula(runs, c):
    k = runs[c][1]["bytes_by_kind"]["dp gradient sync"]
    assert k["measured_per_step"] > 0 and k["model_per_step"] == pytest.approx(k["measured_per_step"], rel=1e-9), k
    plain = runs["none"][1]["bytes_by_kind"]["dp gradient sync"]["measured_per_step"]
    if c in ("topk:0.05", "sign", "powersgd:2"):
        assert k["measured_per_step"] < plain / 2, (c, k["measured_per_step"], plain)


def test_lossy_compression_and_error_feedback_change_the_run(runs):
    a, ef, no_ef = runs["none"][0], runs["topk:0.05"][0], runs["topk:0.05 no-ef"][0]
    assert all(a[k] == pytest.approx(ef[k], rel=1e-6) for k in a if k[1] == 0)    # the first step's loss: same
    assert any(abs(a[k] - ef[k]) > 1e-4 for k in a) and any(abs(ef[k] - no_ef[k]) > 1e-4 for k in a)


@pytest.mark.parametrize("extra, fragment", [
    (["train.compress=zip"], "train.compress must be none, topk:<fraction>, sign or powersgd:<rank>"),
    (["train.compress=topk:0.1", "train.strategy=ps-local:4"], "or a per-step parameter-server strategy"),
    (["train.compress=topk:0.1", "train.strategy=local-sgd:4"], "or a per-step parameter-server strategy"),
    (["train.compress=powersgd:2", "train.strategy=ps-asp"], "PowerSGD all-reduces its low-rank factors"),
    (["train.compress=sign", "train.strategy=ps-asp", "simulate.timing_only=true", "simulate.enabled=true"],
     "which a timing-only simulation does not compute"),
    (["train.compress=sign", "train.strategy=allreduce", "parallel.zero=1"], "runs on plain data parallelism"),
    (["train.compress=sign", "train.strategy=allreduce", "simulate.timing_only=true", "simulate.enabled=true"],
     "which a timing-only simulation does not compute"),
    (["train.error_feedback=false", "train.strategy=allreduce"], "applies to a compressor"),
    (["train.compress=topk:0.1", "train.strategy=allreduce", 'faults.events=[{kill="worker:1", at_step=5}]'],
     "does not carry yet"),
])
def test_what_compression_does_not_run_with_is_one_line(extra, fragment):
    with pytest.raises(ConfigError) as e:
        small_config(*extra)
    assert fragment in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("c", ["topk:0.05", "sign", "powersgd:2", "topk:0.05 no-ef"])
def test_the_simulator_trains_as_the_real_run(runs, tmp_path, c):
    """--simulate runs the same compressors (one per worker, its own residual) on the same gradients: every
    record's loss and the final test loss equal the real run's (rel 1e-5: the sums' order differs); the bytes per
    rank of top-k and sign are the real all-gather's, (K − 1) x the compressed payload."""
    kind = c.split()[0]
    extra = [f"train.compress={kind}"] + (["train.error_feedback=false"] if "no-ef" in c else [])
    rd = execute(small_config("train.strategy=allreduce", "train.steps=8", *extra), tmp_path, label="sim",
                 quiet=True, simulate=True)
    recs = read_jsonl(rd.metrics_path)
    sim = {(r["worker"], r["step"]): r["loss"] for r in recs}
    real, summary = runs[c]
    assert sim.keys() == real.keys()
    assert max(abs(sim[k] - real[k]) / abs(real[k]) for k in real) < 1e-5
    final = json.loads((rd.path / "summary.json").read_text())["final_test_loss"]
    assert final == pytest.approx(summary["final_test_loss"], rel=1e-5)
    if kind in ("topk:0.05", "sign"):
        K = 3
        per_rank = summary["bytes_by_kind"]["dp gradient sync"]["measured_per_step"] / K
        assert all(r["bytes_sent"] == pytest.approx(per_rank, rel=1e-12) for r in recs), (recs[0], per_rank)


# ---- the parameter server's push (ps/compression.py) ---------------------------------------------------------------

def _ps_run(root, label: str, strategy: str, compress: str, *extra: str, simulate: bool = False) -> tuple[dict, dict]:
    rd = execute(small_config(f"train.strategy={strategy}", "train.steps=8", f"train.compress={compress}", *extra),
                 root, label=label, quiet=True, simulate=simulate)
    recs = read_jsonl(rd.metrics_path)
    return {(r["worker"], r["step"]): r["loss"] for r in recs}, json.loads((rd.path / "summary.json").read_text())


def test_ps_bsp_with_top_k_trains_as_the_all_reduce_with_top_k(runs, tmp_path):
    """One shard: a worker's top-k over the shard's flat gradient is its top-k over the whole gradient, and BSP's
    mean of the K decoded pushes is the all-reduce's mean of the K all-gathered ones (rel 1e-5: the sums' order);
    the simulator gives the real run's records."""
    ar, sa = runs["topk:0.05"]
    ps_bsp, sp = _ps_run(tmp_path, "ps", "ps-bsp", "topk:0.05", "train.shards=1")
    sim, ss = _ps_run(tmp_path, "sim", "ps-bsp", "topk:0.05", "train.shards=1", simulate=True)
    assert ar.keys() == ps_bsp.keys() == sim.keys()
    assert max(abs(ps_bsp[k] - ar[k]) / abs(ar[k]) for k in ar) < 1e-5
    assert max(abs(sim[k] - ps_bsp[k]) / abs(ps_bsp[k]) for k in ar) < 1e-5
    assert sp["final_test_loss"] == pytest.approx(sa["final_test_loss"], rel=1e-5)
    assert ss["final_test_loss"] == pytest.approx(sp["final_test_loss"], rel=1e-5)


@pytest.mark.parametrize("compress", ["topk:0.05", "sign"])
def test_ps_push_bytes_on_the_wire_equal_the_formula(tmp_path, compress):
    """Two shards (the weight split across them): each push's measured bytes are Σ_s of the compressed payload,
    the reads whole S; both equal the formula, and the push is several times smaller than the whole gradient."""
    _, s = _ps_run(tmp_path, compress, "ps-asp", compress, "train.shards=2")
    k = s["bytes_by_kind"]["ps push + pull"]
    assert k["measured_per_step"] > 0 and k["model_per_step"] == pytest.approx(k["measured_per_step"], rel=1e-9), k
    _, plain = _ps_run(tmp_path, "plain", "ps-asp", "none", "train.shards=2")
    whole = plain["bytes_by_kind"]["ps push + pull"]["measured_per_step"]
    assert k["measured_per_step"] < 0.6 * whole, (k["measured_per_step"], whole)     # push small, read whole
