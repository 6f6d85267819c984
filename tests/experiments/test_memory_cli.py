"""`pslab memory`: the article's example, JSON, the plot, one-line errors, and --measure (the real engines, 1-8
local processes per layout) on every layout it runs by default: equal to the model to the byte, but for Adam's step
counters (4 B per tensor) and the MoE's routing-dependent activations (measured only), as docs/tutorial.md §6 says."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys

import pytest

from pslab.experiments.cli import main
from pslab.experiments.commands.memory import MEASURE, _config
from pslab.experiments.workloads import get_workload


def test_article_example_and_fit_table(capsys):
    assert main(["memory", "--params", "70e9"]) == 0
    out = capsys.readouterr().out
    assert "16 B/param" in out and "1.12 TB" in out
    assert "80 GB" in out and "141 GB" in out
    assert "zero3 dp=64 tp=1 pp=1" in out and "Rajbhandari" in out


def test_json_parses_and_fits(capsys):
    assert main(["memory", "--params", "7.5e9", "--dp", "64", "--zero", "3", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["total_bytes"] == pytest.approx(1.875e9)
    assert d["state_bytes_per_param"] == 16
    assert {t["term"] for t in d["terms"]} == {"params", "grads", "optimizer"}
    fits = {r["layout"]: r for r in d["fits"]}
    one = fits["zero0 dp=1 tp=1 pp=1"]                  # 120 GB: only the 141 GB GPU holds it
    assert one["bytes"] == pytest.approx(120e9) and one["fits_141GB"] and not one["fits_80GB"]
    assert fits["zero3 dp=64 tp=1 pp=1"]["fits_80GB"]
    mine = d["fits"][0]                                 # the asked-for layout comes first, with the same total
    assert mine["layout"] == "yours: dp=64 zero3" and mine["bytes"] == pytest.approx(d["total_bytes"])


def test_shape_with_activations_and_plot(tmp_path, capsys):
    png = tmp_path / "mem.png"
    assert main(["memory", "--layers", "96", "--hidden", "12288", "--heads", "96", "--seq", "2048", "--vocab",
                 "51200", "--tp", "8", "--pp", "8", "--sp", "--recompute", "selective", "--json",
                 "--plot", str(png)]) == 0
    d = json.loads(capsys.readouterr().out)
    act = [t for t in d["terms"] if t["term"] == "activations"][0]
    assert act["bytes"] == pytest.approx(96 * 2048 * 12288 * 34 / 8) and "Korthikanti" in act["source"]
    assert png.stat().st_size > 1000


def test_interleaving_holds_p_plus_p_minus_1_over_v_micro_batches_on_the_first_stage(capsys):
    """--virtual-stages 2, pp = 4, m = 8: stage 0 holds 4 + 3/2 = 5.5 stage-micro-batches of activations (1F1B: 4)."""
    shape = ["--layers", "32", "--hidden", "1024", "--heads", "16", "--seq", "512", "--vocab", "1000", "--pp", "4",
             "--micro-batches", "8", "--json"]
    acts = []
    for v in ("1", "2"):
        assert main(["memory", *shape, "--virtual-stages", v]) == 0
        d = json.loads(capsys.readouterr().out)
        acts.append([t for t in d["terms"] if t["term"] == "activations"][0])
    assert "× 4 micro-batches in flight" in acts[0]["formula"] and "× 5.5 micro-batches in flight" in acts[1]["formula"]
    assert acts[1]["bytes"] == pytest.approx(acts[0]["bytes"] * 5.5 / 4, rel=1e-12)


@pytest.mark.parametrize("argv, fragment", [
    (["--params", "-3"], "--params must be > 0"),
    (["--zero", "4"], "--zero must be 0, 1, 2 or 3"),
    (["--layers", "4"], "needs all of"),
    (["--precision", "fp8"], "unknown precision"),
    (["--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "8", "--vocab", "16", "--tp", "3"], "divide"),
    (["--measure", "--configs", "dp=9"], "unknown --configs"),
    (["--measure", "--attention-seqs", "12"], "--attention-seqs takes two or more"),
    (["--virtual-stages", "2"], "--virtual-stages > 1 interleaves 1F1B"),
    (["--pp", "4", "--micro-batches", "6", "--virtual-stages", "2"], "must be a multiple of 4"),
])
def test_bad_input_is_one_line_exit_1(argv, fragment, capsys):
    assert main(["memory", *argv]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0]


def test_bad_input_from_the_shell_has_no_traceback():
    r = subprocess.run([sys.executable, "-m", "pslab", "memory", "--dp", "0"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == ["pslab: error: --dp must be >= 1, got 0"]


def test_help_has_examples(capsys):
    with pytest.raises(SystemExit) as e:
        main(["memory", "--help"])
    assert e.value.code == 0
    assert "pslab memory --params 70e9" in capsys.readouterr().out


# ---- --measure: every layout it runs by default, measured against the model --------------------------------

@pytest.fixture(scope="module")
def measured():
    """`pslab memory --measure --json` with its default --configs (all of MEASURE, 1-8 processes each, ~20 s):
    {label: [row of rank 0, rank 1, ...]}."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["memory", "--measure", "--json"]) == 0
    d = json.loads(out.getvalue())
    assert "ActivationMeter" in d["meters"]
    by: dict[str, list] = {}
    for r in d["rows"]:
        by.setdefault(r["config"], []).append(r)
    return by


def _tensors(label: str) -> int:
    """Parameter tensors of the whole model of a configuration, the experts' divided by ep (an ep rank holds E/ep
    of them): Adam keeps one 4-byte step counter per tensor a rank holds."""
    cfg = _config(label)
    wl = get_workload(cfg.workload.name, 1, cfg.workload.batch_size, cfg.workload.seed, **cfg.workload.overrides())
    names = [n for n, _ in wl.make_model().named_parameters()]
    experts = sum(".experts." in n for n in names)
    assert experts % cfg.parallel.ep == 0
    return len(names) - experts + experts // cfg.parallel.ep


def test_measure_runs_every_default_layout_on_every_rank(measured):
    assert list(measured) == list(MEASURE)                      # the default --configs: every layout, in order
    for label, rows in measured.items():
        cfg = _config(label)
        assert [r["rank"] for r in rows] == list(range(cfg.train.workers * cfg.parallel.model_parallel)), label


@pytest.mark.parametrize("label", list(MEASURE))
def test_measure_equals_the_model_to_the_byte(measured, label):
    """Per rank, as docs/tutorial.md §6 states: parameters, gradients and saved activations equal the model to the
    byte; the optimizer state too, but for Adam's step counters, 4 B per tensor the rank holds (over a pipeline's
    stages: 4 B per tensor of the model); the MoE's activations depend on the routing: measured only (no model)."""
    rows = measured[label]
    for r in rows:
        m, f = r["measured"], r["model"]
        for kind in ("params", "grads", "optimizer", "activations"):
            assert m[kind] > 0, (label, r["rank"], kind)
        for kind in ("params", "grads"):
            assert m[kind] == f[kind], (label, r["rank"], kind, m[kind], f[kind])
        if "ep=2" in label:                                      # text-moe: the routing decides
            assert f["activations"] is None and r["ratio"]["activations"] is None
        else:
            assert m["activations"] == f["activations"], (label, r["rank"], m["activations"], f["activations"])
        extra = m["optimizer"] - f["optimizer"]
        assert extra > 0 and extra % 4 == 0, (label, r["rank"], m["optimizer"], f["optimizer"])
    counters = _tensors(label) * 4
    by_rest: dict[tuple, int] = {}                               # the ranks of one pipeline: sum over its stages
    for r in rows:
        rest = tuple(sorted((k, v) for k, v in r["coords"].items() if k != "pp"))
        by_rest[rest] = by_rest.get(rest, 0) + r["measured"]["optimizer"] - r["model"]["optimizer"]
    assert set(by_rest.values()) == {counters}, (label, by_rest, counters)


def test_measure_relations_between_layouts(measured):
    """Independently of the model: an unsplit rank holds 4 B per parameter of the model (fp32), ZeRO-3 half of it
    over dp = 2, ZeRO-2 half the gradients, ZeRO-1 (and 2, 3) half of Adam's 8 B per parameter; tp = 2 x pp = 2's
    stages hold as much as pp = 2's split over tp, and ZeRO-1 over dp = 2 halves its optimizer state per stage."""
    cfg = _config("dp=2")
    wl = get_workload(cfg.workload.name, 1, cfg.workload.batch_size, cfg.workload.seed, **cfg.workload.overrides())
    psi = sum(q.numel() for q in wl.make_model().parameters())
    counters = 4 * _tensors("dp=2")
    for label in ("dp=2", "dp=2 zero1", "dp=2 zero2", "ckpt", "cp=2"):
        assert {r["measured"]["params"] for r in measured[label]} == {4 * psi}, label
    assert {r["measured"]["params"] for r in measured["dp=2 zero3"]} == {2 * psi}
    assert {r["measured"]["grads"] for r in measured["dp=2 zero2"]} == {2 * psi}
    assert {r["measured"]["optimizer"] for r in measured["dp=2"]} == {8 * psi + counters}
    for label in ("dp=2 zero1", "dp=2 zero2", "dp=2 zero3"):
        assert {r["measured"]["optimizer"] for r in measured[label]} == {4 * psi + counters}, label
    pp2 = [r["measured"]["params"] for r in measured["pp=2"]]
    assert sum(pp2) == 4 * psi
    plain = {r["coords"]["pp"]: r["model"]["optimizer"] for r in measured["tp=2 pp=2"]}
    for r in measured["dp=2 tp=2 pp=2 zero1"]:
        assert r["model"]["optimizer"] * 2 == plain[r["coords"]["pp"]]
    # interleaving and cp keep each pipeline stage's parameters (the same blocks' bytes), cp halves its activations
    for label in ("pp=2 v2", "pp=2 cp=2"):
        assert sorted({r["measured"]["params"] for r in measured[label]}) == sorted(set(pp2)), label
    assert all(r["measured"]["activations"] < measured["pp=2"][r["coords"]["pp"]]["measured"]["activations"]
               for r in measured["pp=2 cp=2"])
    # SP and CP cut the saved activations (tp = 2: sbh(16 + 48/t) + ... -> sbh(8 + 56/t) + ...; cp: s/C)
    act = {label: measured[label][0]["measured"]["activations"] for label in ("dp=2", "tp=2", "tp=2 sp", "cp=2")}
    assert act["tp=2 sp"] < act["tp=2"] < act["dp=2"] and act["cp=2"] == (act["dp=2"] - 4) // 2 + 4


def test_attention_rows_naive_is_quadratic_and_flash_linear_to_the_byte():
    from pslab.parallelism.ring_attention import measure_attention_memory
    rows = measure_attention_memory([64, 128, 256], batch=1, d=32, heads=8)
    for r in rows:
        assert r["naive"] == r["naive_model"] and r["flash"] == r["flash_model"] and r["max_diff"] < 1e-5
    a, b = rows[0], rows[-1]
    probs = lambda r: r["naive"] - r["flash"]           # noqa: E731  B·H·(S² − S)·4: the probabilities kept
    assert probs(b) / probs(a) == pytest.approx((256 ** 2 - 256) / (64 ** 2 - 64))
    assert b["flash"] / a["flash"] == pytest.approx(4.0)
