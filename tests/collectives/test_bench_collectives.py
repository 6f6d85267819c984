"""`pslab bench collectives` end to end on a tiny size: every op's row for both backends, and no third-party
warnings on file descriptor 2 (its rank processes share it; torch 2.13 deprecates all_gather_into_tensor)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.timeout(180)
def test_bench_collectives_smoke_prints_no_warnings(capfd):
    from pslab.experiments.bench.collectives import main
    rc = main(["--world", "2", "--sizes", "4K", "--reps", "1", "--budget", "0.02", "--json", "-"])
    out, err = capfd.readouterr()
    assert rc == 0
    assert "Warning" not in err, err
    rows = json.loads(out[out.index("{"):])["rows"]
    assert {r["op"] for r in rows} >= {"all_reduce", "all_gather", "reduce_scatter"}
    for r in rows:
        assert r["zmq_s"] > 0 and r["gloo_s"] > 0 and r["busbw_ratio"] > 0, r


def test_peers_are_validated_and_a_missing_mpi_names_the_extra(monkeypatch):
    import importlib.util

    from pslab.experiments.bench import collectives as bench
    with pytest.raises(SystemExit, match="--peers takes a comma-separated list of gloo, mpi"):
        bench.main(["--peers", "gloo,nccl"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mpi4py" else real(name, *a))
    with pytest.raises(SystemExit, match=r"needs mpi4py and MPICH: pip install -e '\.\[bench\]'"):
        bench.main(["--world", "2", "--peers", "gloo,mpi"])


@pytest.mark.timeout(180)
@pytest.mark.skipif(__import__("importlib").util.find_spec("mpi4py") is None,
                    reason="the MPI peer is an optional extra (pip install -e '.[bench]')")
def test_mpi_peer_runs_in_the_same_processes(capfd):
    from pslab.experiments.bench.collectives import main
    rc = main(["--world", "2", "--ops", "all_reduce", "reduce_scatter", "--sizes", "4K", "40004", "--reps", "2",
               "--budget", "0.02", "--peers", "gloo,mpi", "--json", "-"])
    out, err = capfd.readouterr()
    assert rc == 0 and "Warning" not in err, err
    rows = json.loads(out[out.index("{"):])["rows"]
    assert len(rows) == 4
    for r in rows:
        assert r["zmq_s"] > 0 and r["gloo_s"] > 0 and r["mpi_s"] > 0
        assert r["vs_mpi"] == pytest.approx(r["mpi_s"] / r["zmq_s"])
