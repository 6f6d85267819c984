"""The simulator's timing-only mode (same records as training mode on the same schedule, no loss), stopping at a
target accuracy, steady-window staleness, the analytic staleness laws and the per-worker histogram plot."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pslab.experiments.cli import main
from pslab.experiments.errors import ConfigError
from pslab.experiments.results.records import UpdateRecord, steady_window_end
from pslab.experiments.results.report import write_report
from pslab.experiments.results.rundir import RunDir, read_jsonl
from pslab.experiments.runner import execute
from pslab.experiments.sim import laws
from pslab.experiments.sim.timing import record_line
from tests.experiments.conftest import small_config

STRAGGLER = 'stragglers.factors={"2" = 3.0}'


def _run(tmp_path, name, *overrides):
    rd = execute(small_config(*overrides), tmp_path / name, label=name, simulate=True, quiet=True)
    return read_jsonl(rd.metrics_path), json.loads((rd.path / "summary.json").read_text()), rd


def _strip(records):
    return [{k: v for k, v in r.items() if k not in ("loss", "batch")} for r in records]


@pytest.mark.parametrize("strategy, extra", [
    ("ps-asp", ()), ("ps-bsp", ()), ("ps-ssp:2", ()), ("ps-ssp-agg:2", ()), ("ps-bsp-backup:1", ()),
    ("ps-bsp-backup:1", ("train.backup_abort=true",)), ("allreduce", ()),
    ("ps-ssp:1", ("stragglers.delay=exponential", "stragglers.delay_mean_s=0.004", "stragglers.transient_prob=0.2",
                  "stragglers.transient_factor=3.0")),
])
def test_timing_only_gives_the_training_modes_records(tmp_path, strategy, extra):
    """On the same schedule (4 workers, one 3x straggler, 2 shards), the timing-only simulation writes the same
    per-update records as the training simulation -- worker, step, time, staleness, bytes, wait, dropped, in the same
    order -- with loss and batch null, and the same throughput, staleness summary and shard statistics."""
    o = (f"train.strategy={strategy}", "train.workers=4", "train.shards=2", STRAGGLER, *extra)
    train, s_train, _ = _run(tmp_path, "train", *o)
    timing, s_timing, _ = _run(tmp_path, "timing", *o, "simulate.timing_only=true")
    assert len(timing) == len(train) > 0
    assert _strip(timing) == _strip(train)
    assert all(r["loss"] is None and r["batch"] is None for r in timing)
    assert all(r["loss"] is not None for r in train)
    for k in ("updates_per_s", "updates_per_s_total", "staleness_mean", "staleness_mean_steady", "staleness_max",
              "wait_s_total", "dropped", "bytes_per_worker", "time_s"):
        assert s_timing[k] == s_train[k], k
    assert s_timing.get("shard_stats") == s_train.get("shard_stats")
    assert s_timing["timing_only"] and s_timing["final_train_loss"] is None and s_timing["final_test_acc"] is None
    if strategy == "ps-bsp-backup:1":
        assert any(r.get("dropped") for r in timing)


def test_backup_abort_gives_up_in_flight_gradients(tmp_path):
    """Simulated ps-bsp-backup:1, 3x straggler: by default the straggler's late gradients reach the shards and are
    dropped there; with backup_abort it gives each one up when its clock commits -- the shards drop nothing, its
    steps are recorded as dropped with no bytes sent, and it starts its next read at once (not 3x later)."""
    o = ("train.strategy=ps-bsp-backup:1", "train.workers=4", STRAGGLER)
    plain, s_plain, _ = _run(tmp_path, "plain", *o)
    abort, s_abort, _ = _run(tmp_path, "abort", *o, "train.backup_abort=true")
    shard_drops = lambda s: sum(sum(int(v) for v in (x.get("dropped") or {}).values()) for x in s["shard_stats"])  # noqa: E731
    assert shard_drops(s_plain) > 0 and shard_drops(s_abort) == 0
    aborted = [r for r in abort if r.get("dropped")]
    assert aborted and all(r["worker"] == 2 and r["bytes_sent"] == 0 and r["staleness"] is None for r in aborted)
    assert all(r["staleness"] == 0 for r in abort if not r.get("dropped"))


def test_record_line_is_what_the_json_writer_writes():
    """The timing loop's hand-formatted line equals json.dumps of the UpdateRecord, applied and dropped."""
    for tau, dropped, t, wait in ((3, False, 0.1 + 0.2, 0.0), (None, True, 12.0, 1e-7), (0, False, 0.0, 3.25)):
        rec = UpdateRecord(2, 7, 8, t, None, tau, 1234, 5678, wait, None, dropped)
        assert record_line(2, 7, t, tau, 1234, 5678, wait, dropped) == \
            json.dumps(rec.to_json(), separators=(",", ":")) + "\n"


def test_asp_staleness_follows_the_geometric_law_with_exponential_times(tmp_path):
    """ASP, K = 8, purely exponential compute times: the pooled steady-window staleness is Geometric(1/K) (total
    variation < 0.03 over 8 x 1500 updates) with mean K - 1 (within 3 %); constant times are not (a negative
    control: every update then has tau = K - 1)."""
    K = 8
    o = ("train.strategy=ps-asp", f"train.workers={K}", "train.steps=1500", "simulate.timing_only=true",
         "simulate.compute_s=0", "simulate.latency_intra_s=0")
    def pmf(*extra):
        ups, _, _ = _run(tmp_path, f"e{len(extra)}", *o, *extra)
        t_end = steady_window_end(ups)
        taus = np.array([u["staleness"] for u in ups if u["time_s"] <= t_end and u["step"] >= 1])
        return taus, np.bincount(taus, minlength=200)[:200] / len(taus)
    taus, h = pmf("stragglers.delay=exponential", "stragglers.delay_mean_s=0.01")
    assert taus.mean() == pytest.approx(K - 1, rel=0.03)
    assert 0.5 * np.abs(h - laws.geometric_pmf(K, 199)).sum() < 0.03
    taus, h = pmf("simulate.compute_s=0.01")
    assert 0.5 * np.abs(h - laws.geometric_pmf(K, 199)).sum() > 0.5


def test_straggler_spike_and_steady_window(tmp_path):
    """ASP, K = 4, worker 3 four times slower: its staleness is the spike c(K - 1) = 12, the fast workers average
    K - 2 + 1/c; the steady-window mean ((3 x 4 x 2.25 + 12) / 13 = 3.0) leaves out the tail where the straggler
    runs alone at tau = 0 and so exceeds the whole-run mean."""
    ups, s, _ = _run(tmp_path, "s", "train.strategy=ps-asp", "train.workers=4", "train.steps=200",
                     'stragglers.factors={"3" = 4.0}', "simulate.timing_only=true")
    t_end = steady_window_end(ups)
    steady = [u for u in ups if u["time_s"] <= t_end and u["step"] >= 2]
    slow = [u["staleness"] for u in steady if u["worker"] == 3]
    fast = [u["staleness"] for u in steady if u["worker"] != 3]
    assert np.median(slow) == laws.straggler_spike(4, 4.0) == 12
    assert np.mean(fast) == pytest.approx(laws.fast_worker_mean(4, 4.0), abs=0.05)
    assert s["staleness_mean_steady"] == pytest.approx(3.0, abs=0.05)
    assert s["staleness_mean"] < s["staleness_mean_steady"] - 0.3


def test_laws_and_bounds():
    """Geometric(1/K) sums to 1 with mean K - 1; the bounds per strategy; overlays pick the right law."""
    p = laws.geometric_pmf(8, 2000)
    assert p.sum() == pytest.approx(1.0) and (np.arange(2001) * p).sum() == pytest.approx(7.0)
    assert [laws.staleness_bound(s, 4) for s in ("ps-asp", "ps-bsp", "ps-ssp:2", "ps-ssp-agg:2")] == [None, 0, 15, 2]
    cfg = {"train": {"strategy": "ps-asp", "workers": 4}, "stragglers": {"factors": {"3": 4.0}}, "simulate": {}}
    assert laws.overlay(cfg, 3, 20).mean == 12 and laws.overlay(cfg, 0, 20).mean == 2.25
    exp = {"train": {"strategy": "ps-asp", "workers": 4}, "simulate": {"compute_s": 0.0},
           "stragglers": {"delay": "exponential", "delay_mean_s": 0.01}}
    assert laws.overlay(exp, 0, 5).pmf is not None and laws.overlay(cfg, 0, 5).pmf is None


@pytest.mark.parametrize("strategy", ["ps-asp", "allreduce"])
def test_target_accuracy_stops_the_simulation(tmp_path, strategy):
    """train.target_acc: the run stops at the first evaluation reaching it (fewer updates than planned) and the
    summary says when; an unreachable target runs to the end and reports None."""
    o = (f"train.strategy={strategy}", "train.steps=60", "train.eval_every=6", "train.lr=0.2")
    ups, s, rd = _run(tmp_path, "hit", *o, "train.target_acc=0.8")
    evals = read_jsonl(rd.eval_path)
    assert evals[-1]["test_acc"] >= 0.8 and all(e["test_acc"] < 0.8 for e in evals[:-1])
    assert s["time_to_target_s"] == evals[-1]["time_s"] and s["updates_to_target"] == evals[-1]["updates"]
    assert s["stopped_at_target"] and len(ups) < 3 * 60
    ups, s, _ = _run(tmp_path, "miss", *o, "train.target_acc=1.0")
    assert len(ups) == 3 * 60 and s["time_to_target_s"] is None and s["updates_to_target"] is None


@pytest.mark.parametrize("override, fragment", [
    ("train.target_acc=1.5", "train.target_acc must be a test accuracy in (0, 1]"),
    ("train.target_acc=0", "train.target_acc must be"),
    ("train.target_acc=high", "train.target_acc must be"),
    ("train.target_acc=true", "train.target_acc must be"),
    ("simulate.timing_only=yes", "simulate.timing_only must be true or false"),
])
def test_bad_values_are_config_errors(override, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace("[", r"\[")):
        small_config(override)


def test_timing_only_conflicts_are_one_line(tmp_path, capsys):
    """A target accuracy needs trained weights; timing_only without the simulator is refused; both one line."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('[train]\nstrategy = "ps-asp"\n[simulate]\ntiming_only = true\n')
    for argv, fragment in ((["run", str(cfg), "--set", "train.target_acc=0.9"], "needs trained weights"),):
        assert main(argv) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and fragment in err[0], err
    with pytest.raises(ConfigError, match="mode of the simulator"):
        execute(small_config("simulate.timing_only=true"), tmp_path, simulate=False, quiet=True)


def test_cli_timing_only_run_and_its_report(tmp_path, capsys):
    """`pslab run --timing-only` (in --help) simulates without gradients; its report says timing-only, has no loss
    or accuracy plot, and draws the per-worker staleness histograms."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('[workload]\nname = "digits-logreg"\n[train]\nstrategy = "ps-asp"\nworkers = 4\nsteps = 30\n'
                   '[stragglers]\nfactors = {"3" = 4.0}\n')
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert "--timing-only" in capsys.readouterr().out
    assert main(["run", str(cfg), "--timing-only", "-q", "--out", str(tmp_path / "runs")]) == 0
    assert "staleness mean" in capsys.readouterr().out
    (path,) = (tmp_path / "runs").iterdir()
    run = RunDir(path).load()
    assert run["summary"]["timing_only"] and "timing-only" in run["summary"]["label"]
    assert run["config"]["simulate"]["timing_only"] is True and not run["evals"]
    report = write_report([run], tmp_path / "rep")
    text = report.read_text()
    assert "Timing-only simulation" in text and "staleness_per_worker.png" in text
    assert not (tmp_path / "rep" / "test_accuracy.png").exists()
    assert not (tmp_path / "rep" / "loss_vs_time.png").exists()
    assert (tmp_path / "rep" / "staleness_per_worker.png").stat().st_size > 0


def test_bench_sim_smoke(capsys):
    """`pslab bench sim` runs, prints both rates and their ratio, and finds the records identical."""
    from pslab.experiments.bench.sim import main as bench
    assert bench(["--workers", "8", "--steps", "20", "--peer-steps", "2", "--reps", "1",
                  "--workload", "digits-logreg"]) == 0
    out = capsys.readouterr().out
    assert "timing-only" in out and "training" in out and "identical" in out and ": yes" in out
