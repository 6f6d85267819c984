"""Traced runs: `pslab run --trace` leaves per-process timelines, `pslab trace` merges them into a valid Chrome trace
(the schema Perfetto and chrome://tracing read) and measures the bubble and the overlap from it."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from pslab.experiments.config import load_config
from pslab.experiments.errors import ConfigError
from pslab.experiments.results.timeline import TraceError, merge
from pslab.experiments.runner import execute

CONFIGS = Path(__file__).resolve().parents[2] / "experiments" / "configs"


def _run(tmp_path: Path, config: str, *sets: str) -> Path:
    cfg = load_config(str(CONFIGS / config), ["trace.enabled=true", *sets])
    return execute(cfg, tmp_path, quiet=True).path


def check_chrome_trace(obj: dict) -> dict[str, int]:
    """The schema: required keys, X events nest on each (pid, tid), every flow and async pair has both ends,
    one named track per process. Returns counts per phase."""
    assert isinstance(obj, dict) and isinstance(obj["traceEvents"], list)
    counts: dict[str, int] = defaultdict(int)
    named, used = set(), set()
    spans: dict[tuple, list[tuple[float, float, str]]] = defaultdict(list)
    flows: dict[object, set[str]] = defaultdict(set)
    pairs: dict[object, list[str]] = defaultdict(list)
    for e in obj["traceEvents"]:
        assert {"ph", "name", "pid", "tid"} <= set(e), e
        counts[e["ph"]] += 1
        if e["ph"] == "M":
            if e["name"] == "process_name":
                assert e["args"]["name"] and e["pid"] not in named, e
                named.add(e["pid"])
            continue
        assert isinstance(e["ts"], (int, float)) and e["ts"] > 0, e
        used.add(e["pid"])
        if e["ph"] == "X":
            assert e["dur"] >= 0 and "cat" in e and isinstance(e["args"], dict), e
            spans[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e["name"]))
        elif e["ph"] in ("s", "f"):
            flows[e["id"]].add(e["ph"])
        elif e["ph"] in ("b", "e"):
            pairs[(e["pid"], e["id"])].append(e["ph"])
        else:
            raise AssertionError(f"unexpected phase {e['ph']!r}")
    assert used <= named, f"tracks without a name: {used - named}"
    assert all(v == {"s", "f"} for v in flows.values()), "a flow without both ends"
    assert all(v == ["b", "e"] for v in pairs.values()), "an async pair without both ends"
    eps = 2.0                                                       # µs of rounding
    for key, evs in spans.items():                                  # nesting: a stack of open spans
        stack: list[tuple[float, float, str]] = []
        for a, b, name in sorted(evs, key=lambda x: (x[0], -x[1])):
            while stack and a >= stack[-1][1] - eps:
                stack.pop()
            assert not stack or b <= stack[-1][1] + eps, f"{key}: {name} [{a}, {b}] crosses {stack[-1]}"
            stack.append((a, b, name))
    return dict(counts)


def test_a_dp2_pp2_run_gives_a_valid_trace_with_p2p_flows_and_its_bubble(tmp_path):
    run = _run(tmp_path, "transformer_tp.toml", "parallel.tp=1", "parallel.pp=2", "train.steps=4")
    path, analysis = merge(run)
    obj = json.loads(path.read_text())
    counts = check_chrome_trace(obj)
    assert counts["s"] == counts["f"] > 0                           # sends to receives
    names = {e["args"]["name"] for e in obj["traceEvents"] if e["name"] == "process_name"}
    assert names == {"rank 0 · dp0 pp0", "rank 1 · dp0 pp1", "rank 2 · dp1 pp0", "rank 3 · dp1 pp1"}
    ops = {e["name"] for e in obj["traceEvents"] if e["ph"] == "X"}
    assert {"F", "B", "recv", "all_reduce", "forward+backward", "sync + update"} <= ops, ops
    assert analysis["bubble"]["p"] == 2 and 0 < analysis["bubble"]["measured"] < 1
    assert all(r["compute_s"] > 0 and r["comm_s"] > 0 for r in analysis["processes"])


def test_a_ps_run_with_a_straggler_shows_padding_gate_waits_and_push_flows(tmp_path):
    run = _run(tmp_path, "compare_default.toml", "train.strategy=ps-ssp:1", "train.steps=12",
               "stragglers.factors={\"1\" = 4.0}", "train.base_step_s=0.01")
    path, analysis = merge(run)
    obj = json.loads(path.read_text())
    counts = check_chrome_trace(obj)
    names = {e["args"]["name"] for e in obj["traceEvents"] if e["name"] == "process_name"}
    assert "PS shard 0" in names and counts["s"] > 0                # push_pull -> the shard's apply
    by = {r["who"]: r for r in analysis["processes"]}
    assert by["rank 1 · dp1"]["pad_s"] > 0 and by["PS shard 0"]["wait_s"] > 0   # the straggler pads, others park
    assert set(analysis["gate_wait_by_worker"]) <= {"0", "1", "2", "3"} and analysis["gate_wait_by_worker"]


def test_bubble_from_the_trace_follows_the_formula(tmp_path):
    """pp = 4, m = 8, 1F1B, stage times padded to 40 ms forward / 80 ms backward: the measured bubble is the
    formula's (p-1)/(m+p-1) = 27 % plus what the messages add -- not less, and not far more."""
    run = _run(tmp_path, "transformer_tp.toml", "parallel.tp=1", "parallel.pp=4", "train.workers=1",
               "parallel.micro_batches=8", "parallel.stage_ms=40", "train.steps=3")
    b = merge(run)[1]["bubble"]
    assert b["formula"] == pytest.approx(3 / 11)
    assert b["formula"] - 0.03 < b["measured"] < b["formula"] + 0.15, b


def test_trace_refuses_what_it_cannot_do(tmp_path):
    cfg = load_config(str(CONFIGS / "compare_default.toml"), ["trace.enabled=true"])
    with pytest.raises(ConfigError, match="simulated run has none"):
        execute(cfg, tmp_path, simulate=True, quiet=True)
    with pytest.raises(TraceError, match="run it with --trace"):
        merge(tmp_path)
    with pytest.raises(TraceError, match="no such directory"):
        merge(tmp_path / "nope")
    out = subprocess.run([sys.executable, "-m", "pslab", "trace", str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1 and out.stderr.startswith("pslab: error:") and "Traceback" not in out.stderr


def test_a_hang_the_supervisor_finds_ends_the_run_with_the_flight_verdict(tmp_path):
    """Worker 1 (ranks 2, 3 of dp 2 x tp 2) stopped mid-run under on_failure = abort: the run's one-line error
    names the rank the supervisor found hung and what each group waits for (collectives/diagnose.py)."""
    cfg = load_config(str(CONFIGS / "transformer_tp.toml"),
                      ["train.steps=200", "faults.on_failure=abort",
                       'faults.events=[{stop="worker:1", at_step=5, for_s=30}]'])
    with pytest.raises(Exception, match=r"hung: .*diagnosis: .*missing rank [23] in collective all_reduce #") as e:
        execute(cfg, tmp_path, quiet=True)
    first = str(e.value).splitlines()[0]                     # the one line a user sees
    assert "diagnosis:" in first and ("dp group [" in first or "tp group [" in first), first
    run = next(p for p in tmp_path.iterdir() if p.is_dir())
    out = subprocess.run([sys.executable, "-m", "pslab", "diagnose", str(run)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1 and "problem: " in out.stdout and "group [" in out.stdout, out.stdout
