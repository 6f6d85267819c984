"""Real multi-process runs (forked workers, ZeroMQ on 127.0.0.1): every strategy consumes exactly the same batches,
and BSP — all-reduce (zmq and torch backends, one flat all-reduce or bucketed and overlapped with backward) or the parameter
server (1 or 2 shards) — reproduces the local large-batch reference."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from pslab.experiments.errors import ConfigError
from pslab.experiments.results.rundir import read_jsonl
from pslab.experiments.runner import execute
from tests.experiments.conftest import small_config

STRATEGIES = ["local", "allreduce", "allreduce[torch]", "allreduce[overlap]", "ps-bsp", "ps-bsp[2 shards]", "ps-ssp:1", "ps-asp"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("real")
    out = {}
    for s in STRATEGIES:
        o = ["train.strategy=" + s.split("[")[0]]
        if "[torch]" in s:
            o.append("train.backend=torch")
        if "[overlap]" in s:
            o.append("parallel.overlap=true")
        if "[2 shards]" in s:
            o.append("train.shards=2")
        rd = execute(small_config(*o), root, label=s, quiet=True)
        out[s] = (rd, read_jsonl(rd.metrics_path), json.loads((rd.path / "summary.json").read_text()))
    return out


def test_every_strategy_consumed_exactly_the_same_batches(runs):
    """The multiset of (worker, step, batch digest) is identical for local, all-reduce and every PS mode."""
    ref = Counter((u["worker"], u["step"], u["batch"]) for u in runs["local"][1])
    assert len(ref) == 3 * 12
    for s in STRATEGIES:
        got = Counter((u["worker"], u["step"], u["batch"]) for u in runs[s][1])
        assert got == ref, s


@pytest.mark.parametrize("s", ["allreduce", "allreduce[torch]", "allreduce[overlap]", "ps-bsp",
                               "ps-bsp[2 shards]"])
def test_bsp_matches_the_local_large_batch_reference(runs, s):
    """Per-(worker, step) losses and the final test accuracy of BSP equal the local reference's (float32
    summation order differs, hence the tolerance)."""
    ref = {(u["worker"], u["step"]): u["loss"] for u in runs["local"][1]}
    got = {(u["worker"], u["step"]): u["loss"] for u in runs[s][1]}
    assert got.keys() == ref.keys()
    assert max(abs(got[k] - ref[k]) for k in ref) < 1e-4
    assert runs[s][2]["final_test_acc"] == pytest.approx(runs["local"][2]["final_test_acc"], abs=1e-6)


def test_measurements_are_recorded(runs):
    """PS runs record staleness for every update (0 under BSP, <= (K-1)(2s+1) = 6 versions under Ho's SSP(1) with
    K = 3), pull waits and bytes; the all-reduce run records the bytes its group counted."""
    for s, bound in (("ps-bsp", 0), ("ps-ssp:1", 6), ("ps-asp", None)):
        ups = runs[s][1]
        taus = [u["staleness"] for u in ups]
        assert None not in taus, s
        if bound is not None:
            assert max(taus) <= bound
        assert all(u["bytes_sent"] > 0 and u["bytes_recv"] > 0 and u["wait_s"] >= 0 for u in ups)
    assert all(u["bytes_sent"] > 0 for u in runs["allreduce"][1])
    assert runs["ps-asp"][2]["updates"] == 36 and runs["ps-asp"][2]["final_test_acc"] is not None


def test_recorded_staleness_matches_the_shards_own_statistics(runs):
    """The per-update staleness reassembled from push acks has the same mean and max as the shard's own
    StalenessStats, and the shard's gate-wait total is recorded (0 under ASP)."""
    for s in ("ps-ssp:1", "ps-asp", "ps-bsp"):
        ups, summary = runs[s][1], runs[s][2]
        taus = [u["staleness"] for u in ups]
        assert summary["shard_staleness_mean"] == pytest.approx(sum(taus) / len(taus))
        assert summary["shard_staleness_max"] == max(taus)
    assert runs["ps-asp"][2]["gate_wait_s_total"] == 0.0


# worker 2 at 20x the 10 ms step: 190 ms slower a step than the others, so on a loaded machine too it is the one a
# backup clock leaves out (at 4x, 30 ms, scheduling beside the hog once made worker 0 the slowest of a clock)
STRAGGLER = 'stragglers.factors={"2" = 20.0}'


def test_backup_workers_drop_the_stragglers_late_gradients(tmp_path):
    """ps-bsp-backup:1 with 3 workers and a 4x straggler: each clock proceeds on the first 2 gradients; the
    straggler's late ones are recorded as dropped (no staleness: never applied), the shard counts the same drops,
    and every applied update has staleness 0."""
    cfg = small_config("train.strategy=ps-bsp-backup:1", "train.base_step_s=0.01", STRAGGLER)
    rd = execute(cfg, tmp_path, label="backup", quiet=True)
    ups = read_jsonl(rd.metrics_path)
    summary = json.loads((rd.path / "summary.json").read_text())
    dropped = [u for u in ups if u.get("dropped")]
    assert dropped and all(u["worker"] == 2 and u["staleness"] is None for u in dropped)
    assert summary["dropped"] == len(dropped) == summary["shard_dropped"]
    assert all(u["staleness"] == 0 for u in ups if not u.get("dropped"))
    assert summary["final_test_acc"] is not None


def test_backup_abort_gives_up_committed_gradients_before_pushing(tmp_path):
    """The same run with train.backup_abort: the straggler learns during its padding that its clock is committed
    and pushes nothing for it, so its steps are recorded as dropped but (almost) none reaches the shard as a late
    push; every applied update still has staleness 0. Without abort every dropped step is a late push (above)."""
    cfg = small_config("train.strategy=ps-bsp-backup:1", "train.base_step_s=0.01", STRAGGLER,
                       "train.backup_abort=true")
    rd = execute(cfg, tmp_path, label="abort", quiet=True)
    ups = read_jsonl(rd.metrics_path)
    summary = json.loads((rd.path / "summary.json").read_text())
    dropped = [u for u in ups if u.get("dropped")]
    assert dropped and all(u["worker"] == 2 and u["staleness"] is None for u in dropped)
    assert summary["shard_dropped"] < len(dropped) / 2        # aborted before the push, not dropped on arrival
    assert all(u["staleness"] == 0 for u in ups if not u.get("dropped"))


def test_backup_abort_needs_backup_workers():
    with pytest.raises(ConfigError, match="train.backup_abort applies to backup workers"):
        small_config("train.strategy=ps-bsp", "train.backup_abort=true").validate()
