"""`pslab bench collectives` end to end on a tiny size: every op's row for both backends, and no third-party
warnings on file descriptor 2 (its rank processes share it; torch 2.13 deprecates all_gather_into_tensor)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.timeout(180)
def test_bench_collectives_smoke_prints_no_warnings(capfd):
    from experiments.bench.collectives import main
    rc = main(["--world", "2", "--sizes", "4K", "--reps", "1", "--budget", "0.02", "--json", "-"])
    out, err = capfd.readouterr()
    assert rc == 0
    assert "Warning" not in err, err
    rows = json.loads(out[out.index("{"):])["rows"]
    assert {r["op"] for r in rows} >= {"all_reduce", "all_gather", "reduce_scatter"}
    for r in rows:
        assert r["zmq_s"] > 0 and r["gloo_s"] > 0 and r["busbw_ratio"] > 0, r
