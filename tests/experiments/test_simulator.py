"""The discrete-event simulator around the real ps.ShardState: deterministic, scales to 64 workers, and shows the
textbook effects (BSP capped by the straggler, ASP not; ASP staleness ~ K - 1; SSP bounded; BSP = local)."""

from __future__ import annotations

import numpy as np
import pytest

from pslab.experiments.results.rundir import read_jsonl
from pslab.experiments.results.records import steady_throughput
from pslab.experiments.runner import execute
from tests.experiments.conftest import small_config


def _sim(tmp_path, *overrides, label="sim"):
    cfg = small_config(*overrides)
    rd = execute(cfg, tmp_path, label=label, simulate=True, quiet=True)
    return rd, read_jsonl(rd.metrics_path)


def test_same_seed_gives_identical_metrics_files(tmp_path):
    """Two simulations of the same config (with random delays and transient slowdowns) write byte-identical
    metrics and eval files; a different seed does not."""
    o = ("train.strategy=ps-ssp:1", "stragglers.delay=exponential", "stragglers.delay_mean_s=0.004",
         "stragglers.transient_prob=0.2", "stragglers.transient_factor=3.0")
    a, _ = _sim(tmp_path / "a", *o)
    b, _ = _sim(tmp_path / "b", *o)
    c, _ = _sim(tmp_path / "c", *o, "workload.seed=1")
    assert a.metrics_path.read_bytes() == b.metrics_path.read_bytes()
    assert a.eval_path.read_bytes() == b.eval_path.read_bytes()
    assert a.metrics_path.read_bytes() != c.metrics_path.read_bytes()


def test_64_workers_asp_staleness_grows_to_k_minus_1(tmp_path):
    """64 simulated workers run on this machine; with K balanced ASP workers the mean staleness after the first
    round is K - 1 (within 5%), and it grows with K."""
    means = {}
    for K in (4, 16, 64):
        _, ups = _sim(tmp_path / str(K), "train.strategy=ps-asp", f"train.workers={K}", "train.steps=4",
                      "train.eval_every=1000")
        assert len(ups) == 4 * K
        taus = [u["staleness"] for u in ups if u["step"] >= 1]
        means[K] = float(np.mean(taus))
        assert means[K] == pytest.approx(K - 1, rel=0.05)
    assert means[4] < means[16] < means[64]


def test_straggler_caps_bsp_throughput_but_not_asp(tmp_path):
    """One worker 4x slower: BSP's steady throughput drops to ~1/4, ASP keeps > 70% of its throughput."""
    thr = {}
    for strat in ("ps-bsp", "ps-asp"):
        for strag in (False, True):
            o = [f"train.strategy={strat}", "train.workers=4", "train.steps=20"]
            if strag:
                o.append('stragglers.factors={"3" = 4.0}')
            _, ups = _sim(tmp_path / f"{strat}{strag}", *o)
            thr[strat, strag] = steady_throughput(ups)
    assert thr["ps-bsp", True] / thr["ps-bsp", False] == pytest.approx(0.25, rel=0.2)
    assert thr["ps-asp", True] / thr["ps-asp", False] > 0.7


def test_ssp_staleness_is_bounded_and_bsp_is_zero(tmp_path):
    """With a straggler: under ps-ssp-agg:s (one version per clock) no update is more than s versions stale; under
    Ho's ps-ssp:s (one version per gradient) no more than (K - 1)(2s + 1), and more than s occurs; under BSP every
    update has tau = 0."""
    K = 3
    for s in (1, 3):
        for kind, bound in (("ps-ssp-agg", s), ("ps-ssp", (K - 1) * (2 * s + 1))):
            _, ups = _sim(tmp_path / f"{kind}{s}", f"train.strategy={kind}:{s}", 'stragglers.factors={"0" = 3.0}')
            taus = [u["staleness"] for u in ups if u["staleness"] is not None]
            assert taus and max(taus) <= bound and max(taus) > 0, (kind, s, max(taus))
            if kind == "ps-ssp":
                assert max(taus) > s
    _, ups = _sim(tmp_path / "bsp", "train.strategy=ps-bsp", 'stragglers.factors={"0" = 3.0}')
    assert {u["staleness"] for u in ups} == {0}


def test_simulated_bsp_follows_the_local_reference(tmp_path):
    """The simulated ps-bsp (real ShardState + ps optimizer) gives the same per-(worker, step) losses as the
    single-process large-batch reference, for SGD and Adam."""
    for opt in ("sgd", "adam"):
        _, sim = _sim(tmp_path / f"s{opt}", "train.strategy=ps-bsp", f"train.optimizer={opt}", "train.lr=0.05")
        cfg = small_config("train.strategy=local", f"train.optimizer={opt}", "train.lr=0.05")
        loc = read_jsonl(execute(cfg, tmp_path / f"l{opt}", quiet=True).metrics_path)
        a = {(u["worker"], u["step"]): u["loss"] for u in sim}
        b = {(u["worker"], u["step"]): u["loss"] for u in loc}
        assert a.keys() == b.keys()
        assert max(abs(a[k] - b[k]) for k in a) < 1e-5


def test_simulated_allreduce_follows_local_and_is_capped_by_the_straggler(tmp_path):
    """Simulated ring all-reduce: same losses as the local reference; with a 4x straggler its virtual time grows ~4x
    (everyone waits for the slowest), and each rank moves 2(N-1)/N of the gradient bytes per step."""
    _, ar = _sim(tmp_path / "a", "train.strategy=allreduce")
    loc = read_jsonl(execute(small_config("train.strategy=local"), tmp_path / "l", quiet=True).metrics_path)
    ref = {(u["worker"], u["step"]): u["loss"] for u in loc}
    assert max(abs(u["loss"] - ref[u["worker"], u["step"]]) for u in ar) < 1e-5
    _, slow = _sim(tmp_path / "s", "train.strategy=allreduce", 'stragglers.factors={"1" = 4.0}')
    assert max(u["time_s"] for u in slow) / max(u["time_s"] for u in ar) == pytest.approx(4.0, rel=0.1)
    model_bytes = (64 * 10 + 10) * 4
    assert ar[0]["bytes_sent"] == round(2 * 2 / 3 * model_bytes)


def test_optimizer_options_pass_through_to_the_ps(tmp_path):
    """DC-ASGD and staleness-aware lr reach the shard's optimizer: under ASP (tau > 0) each changes the
    trajectory; with one worker (tau = 0 always) staleness-aware lr changes nothing."""
    def losses(*o):
        _, ups = _sim(tmp_path / str(abs(hash(o))), *o)
        return [u["loss"] for u in ups]
    plain = losses("train.strategy=ps-asp")
    assert losses("train.strategy=ps-asp", "train.dc_asgd=true", "train.dc_lambda=0.5") != plain
    assert losses("train.strategy=ps-asp", "train.staleness_lr=true") != plain
    one = ("train.strategy=ps-asp", "train.workers=1")
    assert losses(*one, "train.staleness_lr=true") == losses(*one)


def test_backup_workers_drop_the_stragglers_gradients(tmp_path):
    """ps-bsp-backup:1 with one 4x-slow worker: dropped pushes come from the straggler, and the run keeps
    (most of) the throughput BSP loses."""
    o = ("train.workers=4", "train.steps=16", 'stragglers.factors={"2" = 4.0}')
    _, ups = _sim(tmp_path / "b", "train.strategy=ps-bsp-backup:1", *o)
    dropped = [u for u in ups if u.get("dropped")]
    assert dropped and {u["worker"] for u in dropped} == {2}
    _, bsp = _sim(tmp_path / "p", "train.strategy=ps-bsp", *o)
    assert steady_throughput(ups) > 2 * steady_throughput(bsp)


@pytest.mark.parametrize("name", ["mnist-cnn", "text-transformer"])
def test_other_workloads_run_in_the_simulator(tmp_path, name):
    """The MNIST CNN and the tiny transformer LM train through the PS in the simulator and record test accuracy."""
    rd, ups = _sim(tmp_path, "train.strategy=ps-ssp:1", f"workload.name={name}", "train.workers=2",
                   "train.steps=3", "train.eval_every=6", "workload.batch_size=8")
    assert len(ups) == 6 and all(np.isfinite(u["loss"]) for u in ups)
    assert read_jsonl(rd.eval_path)[-1]["test_acc"] >= 0.0
