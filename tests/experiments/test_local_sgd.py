"""Local SGD and DiLoCo (parallelism/local_sgd.py) through the one training loop.

Exact: local-sgd:1 with plain SGD is all-reduce BSP (rel 1e-6: parameter averaging after equal steps = gradient
averaging, to rounding); diloco:H with outer SGD lr 1, momentum 0 is local-sgd:H (also with a momentum inner
optimizer, whose state stays per worker in both). The bytes measured equal ⌈n/H⌉/n of an all-reduce of the
parameters per step; the records' staleness is the local step since the last average; evaluation reads the
global model; the outer Nesterov step is the paper's formula; what does not run with them yet is one line."""

from __future__ import annotations

import json

import pytest
import torch

from pslab.experiments.errors import ConfigError
from pslab.experiments.results.rundir import read_jsonl
from pslab.experiments.runner import execute
from tests.experiments.conftest import small_config

OUTER_IS_AVERAGE = ["outer.optimizer=sgd", "outer.lr=1.0", "outer.momentum=0.0"]


def _run(root, strategy: str, *extra: str) -> tuple[list[dict], dict]:
    rd = execute(small_config(f"train.strategy={strategy}", "train.steps=10", *extra), root, label=strategy,
                 quiet=True)
    return read_jsonl(rd.metrics_path), json.loads((rd.path / "summary.json").read_text())


def _losses(recs: list[dict]) -> dict[tuple[int, int], float]:
    return {(r["worker"], r["step"]): r["loss"] for r in recs}


def _close(a: dict, b: dict, rel: float = 1e-6) -> float:
    assert a.keys() == b.keys()
    worst = max(abs(a[k] - b[k]) / max(abs(b[k]), 1e-12) for k in a)
    assert worst < rel, worst
    return worst


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("local_sgd")
    return {
        "allreduce": _run(root, "allreduce"),
        "local-sgd:1": _run(root, "local-sgd:1"),
        "local-sgd:4": _run(root, "local-sgd:4"),
        "diloco:4 (outer = average)": _run(root, "diloco:4", *OUTER_IS_AVERAGE),
        "local-sgd:4 momentum": _run(root, "local-sgd:4", "train.optimizer=momentum"),
        "diloco:4 momentum (outer = average)": _run(root, "diloco:4", "train.optimizer=momentum", *OUTER_IS_AVERAGE),
        "diloco:4": _run(root, "diloco:4"),
    }


def test_local_sgd_1_with_sgd_is_allreduce(runs):
    (a, sa), (b, sb) = runs["allreduce"], runs["local-sgd:1"]
    _close(_losses(b), _losses(a))
    assert sb["final_test_loss"] == pytest.approx(sa["final_test_loss"], rel=1e-6)


@pytest.mark.parametrize("inner", ["", " momentum"])
def test_diloco_with_the_outer_step_an_average_is_local_sgd(runs, inner):
    (a, sa), (b, sb) = runs[f"local-sgd:4{inner}"], runs[f"diloco:4{inner} (outer = average)"]
    _close(_losses(b), _losses(a))
    assert sb["final_test_loss"] == pytest.approx(sa["final_test_loss"], rel=1e-6)


def test_the_paper_outer_step_moves_off_the_average(runs):
    """DiLoCo's default outer step (Nesterov 0.9, lr 0.7) is not the average: the runs part after the first
    average (step 4), and agree before it."""
    a, b = _losses(runs["local-sgd:4"][0]), _losses(runs["diloco:4"][0])
    assert all(a[k] == b[k] for k in a if k[1] < 4)
    assert any(abs(a[k] - b[k]) > 1e-4 for k in a if k[1] >= 4)


def test_staleness_is_the_local_step_since_the_last_average(runs):
    for name, H in (("local-sgd:1", 1), ("local-sgd:4", 4), ("diloco:4", 4)):
        recs = runs[name][0]
        assert {(r["step"], r["staleness"]) for r in recs} == {(t, t % H) for t in range(10)}, name
    assert {r["staleness"] for r in runs["allreduce"][0]} == {0}


@pytest.mark.parametrize("name", ["local-sgd:1", "local-sgd:4", "diloco:4"])
def test_bytes_are_one_parameter_all_reduce_per_period(runs, name):
    b = runs[name][1]["bytes_by_kind"]
    assert set(b) == {"dp parameter average"}, b
    k = b["dp parameter average"]
    assert k["measured_per_step"] > 0 and k["model_per_step"] == pytest.approx(k["measured_per_step"], rel=1e-9)
    H = int(name.split(":")[1])
    ar = runs["allreduce"][1]["bytes_by_kind"]["dp gradient sync"]["measured_per_step"]
    assert k["measured_per_step"] == pytest.approx(ar * (-(-10 // H)) / 10, rel=1e-9)      # ⌈10/H⌉ of 10 steps


def _simulated(root, strategy: str, *extra: str) -> tuple[list[dict], dict]:
    rd = execute(small_config(f"train.strategy={strategy}", "train.steps=10", *extra), root, label=strategy + " sim",
                 quiet=True, simulate=True)
    return read_jsonl(rd.metrics_path), json.loads((rd.path / "summary.json").read_text())


@pytest.mark.parametrize("name", ["local-sgd:4", "diloco:4"])
def test_the_simulator_takes_the_real_runs_steps(runs, tmp_path, name):
    """--simulate: the same (worker, step, batch, staleness) records and losses as the real run (rel 1e-5: the
    real ring's summation order), the same final test loss; timing-only gives the same times without losses."""
    real, real_sum = runs[name]
    sim, sim_sum = _simulated(tmp_path, name)
    key = lambda r: (r["worker"], r["step"], r["batch"], r["staleness"])      # noqa: E731
    assert sorted(map(key, sim)) == sorted(map(key, real))
    _close(_losses(sim), _losses(real), rel=1e-5)
    assert sim_sum["simulated"] and sim_sum["final_test_loss"] == pytest.approx(real_sum["final_test_loss"], rel=1e-5)
    timing, _ = _simulated(tmp_path, name, "simulate.timing_only=true")
    assert [(r["worker"], r["step"], r["time_s"], r["staleness"]) for r in timing] == \
        [(r["worker"], r["step"], r["time_s"], r["staleness"]) for r in sim]
    assert all(r["loss"] is None for r in timing)
    averages = [r for r in sim if r["step"] in (3, 7, 9)]                    # the steps that end with an average
    assert all(r["bytes_sent"] > 0 for r in averages) and all(r["bytes_sent"] == 0 for r in sim if r not in averages)


# -- the strategy alone, in one process (dp of size 1: the averaging arithmetic without a ring) -----------------
class _Dp:
    size = 1

    def all_reduce(self, t, op, site=""):
        raise AssertionError("no all-reduce over one worker")


class _Replica:
    def __init__(self, params):
        from pslab.parallelism.engine import ParamSlot
        self.dp = _Dp()
        self._slots = [ParamSlot(f"p{i}", p, 0) for i, p in enumerate(params)]

    def slots(self):
        return self._slots


def _strategy(period, total, outer=None, lr=0.5):
    from pslab.parallelism.local_sgd import PeriodicAveragingStrategy
    return PeriodicAveragingStrategy(lambda ps: torch.optim.SGD(ps, lr=lr), period, total, outer)


def test_global_view_shows_the_last_average_and_restores_the_copy():
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    rep, st = _Replica([p]), _strategy(period=3, total=10)
    st.attach(rep)
    p.grad = torch.tensor([1.0, 1.0])
    st.step(rep)                                       # a local step: no average yet
    assert torch.equal(p.detach(), torch.tensor([0.5, 1.5]))
    with st.global_view(rep):
        assert torch.equal(p.detach(), torch.tensor([1.0, 2.0]))     # the global model: the initial average
    assert torch.equal(p.detach(), torch.tensor([0.5, 1.5]))


def test_the_outer_nesterov_step_is_the_papers():
    """One outer step, D = 1: Δ = θ_outer − θ_1; Nesterov's first step moves by lr·(1 + μ)·Δ (buffer = Δ);
    the second by lr·(Δ₂ + μ·(μ·Δ + Δ₂))."""
    from pslab.parallelism.local_sgd import outer_optimizer
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
    rep = _Replica([p])
    st = _strategy(period=2, total=4, outer=outer_optimizer("nesterov", 0.7, 0.9), lr=0.1)
    st.attach(rep)
    theta, g = p.detach().clone(), torch.tensor([0.5, 0.25], dtype=torch.float64)
    for _ in range(2):
        p.grad = g.clone()
        st.step(rep)
    d1 = theta - (theta - 2 * 0.1 * g)                 # two inner SGD steps on a constant gradient
    theta1 = theta - 0.7 * (1 + 0.9) * d1
    assert torch.allclose(p.detach(), theta1, rtol=0, atol=1e-12)
    for _ in range(2):
        p.grad = g.clone()
        st.step(rep)
    d2 = theta1 - (theta1 - 2 * 0.1 * g)
    buf = 0.9 * d1 + d2
    assert torch.allclose(p.detach(), theta1 - 0.7 * (d2 + 0.9 * buf), rtol=0, atol=1e-12)
    assert st.averages == 2


@pytest.mark.parametrize("extra, fragment", [
    (["train.strategy=local-sgd"], "needs a period H (steps between averages), e.g. local-sgd:4"),
    (["train.strategy=diloco:0"], "must be >= 1"),
    (["train.strategy=diloco:4", "outer.optimizer=adam"], "outer.optimizer must be one of nesterov, sgd"),
    (["train.strategy=diloco:4", "outer.momentum=0.0"], "nesterov needs outer.momentum > 0"),
    (["train.strategy=diloco:4", "outer.lr=-1"], "outer.lr must be a finite number > 0"),
    (["train.strategy=local-sgd:4", "faults.checkpoint_every=2"], "does not save yet"),
    (["train.strategy=local-sgd:4", "faults.on_failure=shrink"], "does not save yet"),
    (["train.strategy=local-sgd:4", "parallel.zero=1"], "use train.strategy = allreduce"),
    (["train.strategy=diloco:4", "parallel.overlap=true"], "needs train.strategy = allreduce, not diloco:4"),
])
def test_what_does_not_run_yet_is_one_line(extra, fragment):
    with pytest.raises(ConfigError) as e:
        small_config(*extra)
    assert fragment in str(e.value) and "\n" not in str(e.value)
