"""The failure report (experiments/results/faults.py) on a hand-written run directory in the schema real runs write
(events.jsonl + metrics.jsonl + eval.jsonl), `pslab report` on it, and `pslab compare --preset failure --simulate`
end to end on a small config."""

from __future__ import annotations

import json

import pytest

from pslab.experiments.cli import main
from pslab.experiments.config import to_toml
from pslab.experiments.errors import ConfigError, ExperimentError
from pslab.experiments.results.faults import failure_summary, failures, throughput_series, validate_events
from pslab.experiments.results.report import summary_table, write_report
from pslab.experiments.results.rundir import RunDir, write_jsonl
from pslab.experiments.studies.compare import parse_failure
from tests.experiments.conftest import small_config

pytestmark = pytest.mark.timeout(300)

EVENTS = [   # a real ps-asp run's failure as the supervisor would write it: kill worker 3 at 2.0 s, a stop that is a pause
    {"time_s": 1.0, "event": "inject", "who": "worker:1", "how": "SIGSTOP", "generation": 0, "world_size": 4,
     "step": 10},
    {"time_s": 2.0, "event": "inject", "who": "worker:3", "how": "SIGKILL", "generation": 0, "world_size": 4,
     "step": 20},
    {"time_s": 2.8, "event": "detect", "who": "worker:3", "how": "exit code -9", "generation": 0, "world_size": 4,
     "detect_s": 0.8},
    {"time_s": 4.0, "event": "recover", "who": "worker:3", "how": "continue", "generation": 1, "world_size": 3,
     "lost_steps": 2},
]


def _write_run(root, name, strategy="ps-asp", events=None, rate_gap=(2.0, 4.0)):
    """A run directory by hand: 4 workers, one update every 0.1 s each, none between rate_gap (the stall)."""
    cfg = small_config(f"train.strategy={strategy}", "train.workers=4")
    d = root / name
    d.mkdir(parents=True)
    (d / "config.toml").write_text(to_toml(cfg.to_dict()))
    ups, t, step = [], 0.0, 0
    while t < 6.0:
        t = round(t + 0.1, 6)
        if rate_gap[0] <= t < rate_gap[1]:
            continue
        for w in range(3 if (events and t >= rate_gap[0]) else 4):
            ups.append({"worker": w, "step": step, "clock": step + 1, "time_s": t, "loss": 2.0 / (1 + t),
                        "staleness": 0, "bytes_sent": 0, "bytes_recv": 0, "wait_s": 0.0, "batch": None})
        step += 1
    write_jsonl(d / "metrics.jsonl", ups)
    acc = 0.80 if events else 0.85
    write_jsonl(d / "eval.jsonl", [{"updates": 0, "time_s": 0.0, "test_loss": 2.3, "test_acc": 0.1},
                                   {"updates": len(ups), "time_s": 6.0, "test_loss": 0.5, "test_acc": acc}])
    if events is not None:
        write_jsonl(d / "events.jsonl", events)
    (d / "summary.json").write_text(json.dumps({"label": name, "workers": 4, "final_test_acc": acc,
                                                "simulated": False, "updates": len(ups)}))
    return d


def test_failures_pair_the_events_of_each_target():
    fs = failures(validate_events(EVENTS))
    assert [f["who"] for f in fs] == ["worker:1", "worker:3"]
    pause, kill = fs
    assert pause["detect_s"] is None and pause["t_recover"] is None
    assert kill["detect_s"] == 0.8 and kill["recover_s"] == pytest.approx(1.2) and kill["lost_steps"] == 2
    assert kill["world_size"] == 3


@pytest.mark.parametrize("bad, message", [
    ({"time_s": 1.0, "event": "explode", "who": "worker:1"}, "event 'explode' is not one of"),
    ({"time_s": -1.0, "event": "inject", "who": "worker:1"}, "time_s must be"),
    ({"time_s": 1.0, "event": "inject", "who": "worker:1", "colour": "red"}, "unknown field 'colour'"),
    ({"time_s": 1.0, "event": "inject", "who": 3}, "who must name"),
    ({"time_s": 1.0, "event": "recover", "who": "worker:1", "lost_steps": -2}, "lost_steps must be"),
])
def test_a_malformed_event_is_refused_naming_its_line(bad, message):
    with pytest.raises(ExperimentError, match=f"line 2: {message}"):
        validate_events([EVENTS[0], bad])


def test_throughput_series_measures_the_rate_and_the_stall():
    ups = [{"time_s": 0.1 * i, "staleness": 0} for i in range(1, 101) if not 40 <= i < 60]
    grid, rate, window = throughput_series(ups)
    assert window == pytest.approx(0.5)
    steady = (grid > 1.0) & (grid < 3.5)
    assert rate[steady] == pytest.approx(10.0, abs=2.1)                # one update per 0.1 s
    stall = (grid > 4.6) & (grid < 5.9)
    assert stall.any() and (rate[stall] == 0).all()


def test_report_on_a_hand_written_run_shows_the_failure_section_and_timeline(tmp_path, capsys):
    """`pslab report` on a fixture in the real runs' schema: report.md gains the failure table (detect 0.8 s,
    recover 1.2 s, lost 2, final accuracy 80 % next to the no-failure run's 85 %) and the timeline PNG."""
    _write_run(tmp_path / "runs", "a-ok")
    _write_run(tmp_path / "runs", "b-fail", events=EVENTS)
    assert main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "rep")]) == 0
    text = (tmp_path / "rep" / "report.md").read_text()
    assert "## Failures" in text and "![failure_timeline](failure_timeline.png)" in text
    row = next(line for line in text.splitlines() if line.startswith("| b-fail | worker:3"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3:9] == ["0.8", "1.2", "2 / —", "3", "80", "85"]
    assert "not detected (a pause)" in text
    assert (tmp_path / "rep" / "failure_timeline.png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "time to detect (s)" in printed and "| 2 | 0.8 | 1.2 | 2 / — | -5.00 |" in printed     # as the table


def test_runs_without_events_keep_the_old_report(tmp_path):
    runs = [RunDir(_write_run(tmp_path, "ok")).load()]
    assert "failures" not in summary_table(runs)
    text = write_report(runs, tmp_path / "rep").read_text()
    assert "## Failures" not in text and not (tmp_path / "rep" / "failure_timeline.png").exists()
    assert failure_summary(runs[0])["failures"] == 0


def test_parse_failure_accepts_pairs_and_toml():
    assert parse_failure("kill=worker:3,at_step=50") == [{"kill": "worker:3", "at_step": 50}]
    assert parse_failure("stop=worker:1, at_s=2.5, for_s=4") == [{"stop": "worker:1", "at_s": 2.5, "for_s": 4}]
    assert parse_failure('[{kill = "worker:2", at_step = 5}, {kill = "shard:0", at_s = 1.0}]') == [
        {"kill": "worker:2", "at_step": 5}, {"kill": "shard:0", "at_s": 1.0}]
    with pytest.raises(ConfigError, match="not key=value"):
        parse_failure("kill")


def test_compare_preset_failure_end_to_end_simulated(tmp_path, capsys):
    """Each strategy with and without the default failure (kill the last worker at steps/2), simulated: 4 runs,
    the failing ones with events; the report has the failure section and timeline; the table the new columns."""
    out = tmp_path / "cmp"
    assert main(["compare", "--preset", "failure", "--simulate", "-q", "--out", str(out), "--strategies",
                 "allreduce,ps-bsp", "--set", "workload.name=digits-logreg", "--set", "train.workers=3", "--set",
                 "train.steps=12", "--set", "train.eval_every=12"]) == 0
    runs = [RunDir(p.parent).load() for p in sorted((out / "runs").glob("*/config.toml"))]
    assert len(runs) == 4 and sum(1 for r in runs if r["events"]) == 2
    for r in runs:
        if r["events"]:
            assert r["events"][0] == {**r["events"][0], "event": "inject", "who": "worker:2", "step": 6}
            assert failure_summary(r)["detected"] == 1
    text = (out / "report.md").read_text()
    assert "## Failures" in text and (out / "failure_timeline.png").exists() and "kill worker:2 at step 6" in text
    printed = capsys.readouterr().out
    assert "| allreduce + kill worker:2 at step 6 (simulated) |" in printed and "acc vs no-failure" in printed


@pytest.mark.parametrize("argv, message", [
    (["compare", "--failure", "kill=worker:1,at_step=2"], "--failure applies to --preset failure"),
    (["compare", "--preset", "failure", "--simulate", "--strategies", "local"], "no worker to lose"),
    (["compare", "--preset", "failure", "--tune-lr"], "--tune-lr applies to the default comparison"),
    (["compare", "--preset", "failure", "--simulate", "--failure", "kill=worker:9,at_step=2"], "out of range"),
])
def test_compare_preset_failure_refuses_bad_input(argv, message, capsys):
    assert main(argv) == 1
    assert message in capsys.readouterr().err


def test_the_summary_row_says_unknown_losses_are_unknown():
    """A failure whose loss nobody measured (an abort) is "—" lost in the summary row, as in the Failures table, not
    "0"; measured ones are summed."""
    from pslab.experiments.results.faults import failure_summary
    abort = {"events": [{"time_s": 1.0, "event": "inject", "who": "worker:1", "how": "SIGKILL"},
                        {"time_s": 1.1, "event": "detect", "who": "worker:1", "how": "SIGKILL", "detect_s": 0.1},
                        {"time_s": 1.1, "event": "abort", "who": "worker:1", "how": "SIGKILL"}]}
    f = failure_summary(abort)
    assert f["failures"] == 1 and f["lost_steps"] is None and f["lost_updates"] is None
    shrink = {"events": [{"time_s": 1.0, "event": "detect", "who": "worker:1", "how": "SIGKILL"},
                         {"time_s": 1.2, "event": "recover", "who": "worker:1", "lost_steps": 2}]}
    assert failure_summary(shrink)["lost_steps"] == 2


def test_the_summary_names_the_busiest_process_a_shard_under_a_ps() -> None:
    from pslab.experiments.results.report import busiest
    ps = {"path": "a", "summary": {"workers": 4, "bytes_per_worker": 2e6},
          "config": {"train": {"strategy": "ps-asp", "shards": 2}}}
    ring = {"path": "b", "summary": {"workers": 4, "bytes_per_worker": 3e6}, "config": {"train": {"strategy": "allreduce"}}}
    assert busiest(ps) == "4 (a shard)" and busiest(ring) == "3 (a rank)"     # MB: 4 workers x 2 MB / 2 shards
    assert busiest({"path": "c", "summary": {"bytes_per_worker": None}, "config": {}}) == "—"
