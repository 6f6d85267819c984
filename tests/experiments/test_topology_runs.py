"""`[topology]` in real runs: the ranks of `pslab run` on emulated hosts (collectives/topology.py).

What must hold, each against a reference that is not the code under test:
- the config refuses what it cannot emulate, in one line naming the fix;
- the bytes per link class (counted by each rank's transport) add up to the bytes per kind (counted by each
  process group), step for step, and land where the placement says: for dp 2 x tp 2 on 2 hosts x 2, packed puts
  the tp pairs {0,1}, {2,3} inside a host (tp bytes intra, dp bytes inter), spread puts them across (the reverse);
- plain data parallelism over 2 x 2 (packed) takes the hierarchical all-reduce: 2(H-1)/H · S/L per rank across;
- the emulation moves time only: a run's losses equal those of the same run without a topology, bit for bit;
- `step_time_s` is the median over steps after the first 2 of the slowest worker's step (hand-computed records).
Never an assertion on wall time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pslab.collectives import hierarchical as hier
from pslab.experiments.config import load_config
from pslab.experiments.errors import ConfigError
from pslab.experiments.results.records import step_time
from pslab.experiments.results.rundir import read_jsonl
from pslab.experiments.runner import execute

CONFIG = Path(__file__).resolve().parents[2] / "experiments" / "configs" / "topology_tp.toml"
SHORT = ["train.steps=5", "train.timeout_s=60"]
NO_TOPOLOGY = ["topology.hosts=0", "topology.gpus_per_host=0"]
DP4 = ["parallel.tp=1", "train.workers=4"]


def _cfg(*overrides: str):
    return load_config(CONFIG, SHORT + list(overrides))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("topology")
    out = {}
    for label, extra in {"packed": ["faults.checkpoint_every=5"], "spread": ["topology.placement=spread"],
                         "none": NO_TOPOLOGY, "dp4 packed": DP4}.items():
        rd = execute(_cfg(*extra), root, label=label, quiet=True)
        out[label] = (rd, read_jsonl(rd.metrics_path), json.loads((rd.path / "summary.json").read_text()))
    return out


# ---- refusals --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, words", [
    (["topology.hosts=2", "topology.gpus_per_host=1"],
     r"2 x 1 = 2 ranks, but the run has 4 \(train.workers 2 x model-parallel degree 2\)"),
    (["train.workers=1"], r"2 x 2 = 4 ranks, but the run has 2"),
    (["train.backend=torch"], "zmq backend only"),
    (["train.strategy=ps-bsp", "topology.shard_host=2"], "shard_host must be one of the emulated hosts 0..1"),
    (["topology.shard_host=1"], "it needs train.strategy = ps-\\*, not allreduce"),
    (NO_TOPOLOGY + ["train.strategy=ps-bsp", "topology.shard_host=1"], "shard_host = 1 needs topology.hosts >= 1"),
    (["train.strategy=local", "parallel.tp=1", "faults.on_failure=auto"], "one process"),
    (["topology.placement=round-robin"], "'round-robin' names round-robin, not an axis: it must be packed, spread"),
    (["topology.placement=tp"], r"'tp' leaves out dp: .* every axis this run splits \(dp, tp\) once"),
    (["topology.inter_bandwidth_GBps=-1"], "inter_bandwidth_GBps must be a finite number >= 0"),
    (["topology.gpus_per_host=0"], "needs topology.gpus_per_host >= 1"),
    (["topology.hosts=0"], "gpus_per_host = 2 needs topology.hosts >= 1"),
    (["topology.speed=3"], "unknown key topology.speed"),
    (DP4 + ["faults.on_failure=auto"], "set faults.on_failure = abort"),
    (["simulate.enabled=true", "parallel.tp=1", "train.workers=4"], r"the simulator's network is \[simulate\]'s"),
])
def test_config_refusals_are_one_line(overrides, words):
    with pytest.raises(ConfigError, match=words) as e:
        _cfg(*overrides)
    assert "\n" not in str(e.value)


def test_set_topology_like_any_section():
    cfg = load_config(None, ["workload.name=text-transformer", "train.strategy=allreduce", "train.workers=2",
                             "faults.on_failure=abort", "topology.hosts=2", "topology.gpus_per_host=1",
                             "topology.inter_latency_us=500", "topology.inter_bandwidth_GBps=0.1"])
    t = cfg.topology.build()
    assert (t.hosts, t.per_host, t.placement) == (2, 1, "packed")
    assert t.inter_latency_s == pytest.approx(5e-4) and t.inter_bandwidth_Bps == pytest.approx(1e8)
    assert t.intra_bandwidth_Bps == float("inf")                    # 0 GB/s: unlimited
    assert load_config(None, []).topology.build() is None


# ---- step_time_s -----------------------------------------------------------------------------------------------
def test_step_time_is_median_of_slowest_worker_after_two_steps():
    # worker 0 ends its steps at 1, 2, 3.5, 4.0, 6.0 s; worker 1 at 1.5, 2, 3, 4.5, 5.0 s
    times = {0: [1.0, 2.0, 3.5, 4.0, 6.0], 1: [1.5, 2.0, 3.0, 4.5, 5.0]}
    ups = [{"worker": w, "step": k, "time_s": t} for w, ts in times.items() for k, t in enumerate(ts)]
    # steps 2, 3, 4 last (1.5, 0.5, 2.0) and (1.0, 1.5, 0.5): the slowest 1.5, 1.5, 2.0 -> median 1.5
    assert step_time(ups) == 1.5
    assert step_time(ups[:2] + ups[5:7]) is None                      # only warm-up steps
    assert step_time(ups, warmup=0) == 1.5                            # (1.5, 1.0, 1.5, 1.5, 2.0)


# ---- runs ------------------------------------------------------------------------------------------------------
def _kinds(summary) -> dict[str, float]:
    return {k: v["measured_per_step"] for k, v in summary["bytes_by_kind"].items()}


@pytest.mark.parametrize("label", ["packed", "spread", "dp4 packed"])
def test_link_bytes_add_up_to_the_kinds(runs, label):
    """Both count the payload of every message of the training steps, one per transport, one per group."""
    links = runs[label][2]["link_bytes_per_step"]
    kinds = _kinds(runs[label][2])
    assert links["intra"] > 0 and links["inter"] > 0
    assert links["intra"] + links["inter"] == pytest.approx(sum(kinds.values()), rel=1e-12), (links, kinds)


def test_placement_decides_which_link_each_kind_crosses(runs):
    packed, spread = runs["packed"][2], runs["spread"][2]
    kp, ks = _kinds(packed), _kinds(spread)
    assert kp == ks                                                   # the same bytes, other links
    assert packed["link_bytes_per_step"] == {"intra": kp["tp activations"], "inter": kp["dp gradient sync"]}
    assert spread["link_bytes_per_step"] == {"intra": ks["dp gradient sync"], "inter": ks["tp activations"]}


def test_data_parallel_over_two_hosts_is_hierarchical(runs):
    """dp = 4 on 2 x 2 packed: the gradient all-reduce (one flat buffer of the model's P parameters) crosses hosts
    with 2(H-1)/H · S/L per rank (exact_inter_bytes, written out in tests/collectives/test_topology.py)."""
    from pslab.experiments.workloads import get_workload
    cfg = _cfg(*DP4)
    wl = get_workload(cfg.workload.name, 4, cfg.workload.batch_size, cfg.workload.seed)
    numel = sum(p.numel() for p in wl.make_model().parameters())
    links = runs["dp4 packed"][2]["link_bytes_per_step"]
    steps = cfg.train.steps
    # + once, in the first step: the barrier after making the host-local and cross-host sub-groups (1 byte from
    # each rank to each peer; 2 of its 3 peers are on the other host)
    want = steps * sum(hier.exact_inter_bytes(numel, 4, 2, 2, "hierarchical")) + 4 * 2
    assert links["inter"] * steps == pytest.approx(want, abs=1e-6)
    assert links["intra"] + links["inter"] == pytest.approx(runs["dp4 packed"][2]["bytes_by_kind"]
                                                            ["dp gradient sync"]["measured_per_step"])


def test_topology_moves_time_only(runs):
    """Same (worker, step) losses, bit for bit, and the same final accuracy as the run without a topology (the
    same algorithms run: the dp and tp groups are pairs, below hierarchical all-reduce's 4 ranks)."""
    def losses(label):
        return {(u["worker"], u["step"]): u["loss"] for u in runs[label][1]}
    assert losses("packed") == losses("none") == losses("spread")
    assert runs["packed"][2]["final_test_acc"] == runs["none"][2]["final_test_acc"]
    assert "link_bytes_per_step" not in runs["none"][2]
    for label in runs:
        assert runs[label][2]["step_time_s"] > 0, label


def test_pslab_run_prints_the_link_bytes(runs, capsys):
    from pslab.experiments.commands.run import _report
    _report(runs["spread"][0])
    line = next(s for s in capsys.readouterr().out.splitlines() if "links (" in s)
    assert "2x2 spread" in line and "intra" in line and "inter" in line and "step time" in line


def test_resume_may_change_the_topology(runs):
    """The links are not part of a checkpoint's state (not in resume.FIXED): a run resumes at another placement."""
    from pslab.experiments.strategies.resume import resume_config
    cfg = resume_config(runs["packed"][0].path, ["topology.placement=spread", "train.steps=7"])
    assert cfg.topology.placement == "spread"


def test_3d_placement_keeps_tp_and_pp_inside_a_host(tmp_path):
    """experiments/configs/3d.toml, dp 2 x tp 2 x pp 2 on 2 hosts x 4: packed puts worker 0's four ranks (both stages,
    both tp ranks) on host 0, so only the dp gradient sync crosses hosts; spread puts every tp pair and nothing else
    across (pp pairs r, r+2 and dp pairs r, r+4 share a host); the axis order "tp,dp,pp" fills a host with tp, then
    dp, so each pipeline stage has its own host and only the pp boundaries cross (Megatron's placement). Counted per
    message by each rank's transport."""
    three_d = CONFIG.with_name("3d.toml")
    out = {}
    for placement in ("packed", "spread", "tp,dp,pp"):
        rd = execute(load_config(three_d, SHORT + [f"topology.placement={placement}"]), tmp_path, label=placement,
                     quiet=True)
        out[placement] = json.loads((rd.path / "summary.json").read_text())
    kp, ks = _kinds(out["packed"]), _kinds(out["spread"])
    assert kp == ks and set(kp) == {"dp gradient sync", "tp activations", "pp boundaries"}
    assert out["packed"]["link_bytes_per_step"] == pytest.approx(
        {"intra": kp["tp activations"] + kp["pp boundaries"], "inter": kp["dp gradient sync"]}, rel=1e-12)
    assert out["spread"]["link_bytes_per_step"] == pytest.approx(
        {"intra": ks["dp gradient sync"] + ks["pp boundaries"], "inter": ks["tp activations"]}, rel=1e-12)
    ko = _kinds(out["tp,dp,pp"])
    assert out["tp,dp,pp"]["link_bytes_per_step"] == pytest.approx(
        {"intra": ko["dp gradient sync"] + ko["tp activations"], "inter": ko["pp boundaries"]}, rel=1e-12)


# ---- the parameter server on emulated hosts -----------------------------------------------------------------------
PS = ["parallel.tp=1", "train.strategy=ps-bsp", "train.workers=2", "topology.hosts=2", "topology.gpus_per_host=1",
      "topology.inter_latency_us=20000", "topology.intra_latency_us=0"]


@pytest.mark.timeout(240)
def test_ps_shards_live_on_a_host_and_each_rank_crosses_its_link(tmp_path):
    """ps-bsp, dp 2 on 2 hosts x 1, the shards on host 0 (then host 1): rank 0's push and read cross the intra link,
    rank 1's the inter link (each 2·S per step: push + pull, as the client counts them), the other way round with
    the shards on host 1; the losses equal the run without a topology bit for bit (the emulation moves time only);
    and under BSP every step waits for the worker across the 20 ms link at least twice (its push, the read): a lower
    bound on the step time, which a loaded machine only raises."""
    out = {}
    for label, extra in {"host0": [], "host1": ["topology.shard_host=1"], "none": NO_TOPOLOGY}.items():
        rd = execute(_cfg(*PS, *extra), tmp_path, label=label, quiet=True)
        out[label] = ({(u["worker"], u["step"]): u["loss"] for u in read_jsonl(rd.metrics_path)},
                      json.loads((rd.path / "summary.json").read_text()))
    per_step = out["none"][1]["bytes_by_kind"]["ps push + pull"]["measured_per_step"]     # Σ_r 2·S_r
    for label, (losses, s) in out.items():
        assert losses == out["none"][0], label
        if label == "none":
            continue
        links = s["link_bytes_per_step"]
        assert links["intra"] == pytest.approx(per_step / 2, rel=1e-9) and links["inter"] == links["intra"], links
        assert s["step_time_s"] >= 2 * 0.020, s["step_time_s"]
