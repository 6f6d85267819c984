"""`pslab bench engines` (experiments/bench/engines.py) as a smoke test: every row runs on both pslab backends
beside its PyTorch peer and reports step times, ratios and bytes (no speed is asserted: tests never time), pslab's
zmq bytes equal to the row's formula (`model_bytes`); the peer's bytes are the kernel's count of its gloo sockets;
bad input is argparse's one usage line."""

from __future__ import annotations

import json

import pytest

from pslab.experiments.bench.engines import ROWS, main, peak_rss


def test_every_row_runs_beside_its_peer_and_reports(capsys):
    # (one warm-up step: the pipeline's one-off shape header is not in the counted step)
    assert main(["--world", "2", "--steps", "1", "--warmup", "1", "--reps", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["row"] for r in rows] == list(ROWS) and all(r["world"] == 2 for r in rows)
    for r in rows:
        for backend in ("zmq", "torch"):
            assert r[f"pslab_{backend}_ms"] > 0 and r[f"peer_{backend}_ms"] > 0 and r[f"ratio_{backend}"] > 0
        assert r["pslab_bytes_per_step"] > 0 and r["pslab_torch_bytes_per_step"] > 0, r
        assert r["pslab_bytes_per_step"] == r["model_bytes_per_step"], r     # zmq's count: the formula, to the byte
        assert r["pslab_bytes_per_step"] <= r["pslab_torch_bytes_per_step"], r   # (gloo adds its headers)
        assert r["peer_bytes_per_step"] is not None and r["peer_bytes_per_step"] > 0, r
        for key in ("pslab_zmq_peak_bytes", "pslab_torch_peak_bytes", "peer_peak_bytes"):   # (each at least holds
            assert r[key] > 0, (key, r)                                                       # its model)
    dp = rows[0]                      # an all-reduce of the same gradients: the same payload on both sides, plus
    assert dp["peer_bytes_per_step"] >= dp["pslab_bytes_per_step"]     # gloo's 48 B headers


@pytest.mark.parametrize("argv, fragment", [
    (["--rows", "moe"], "unknown row(s) moe"),
    (["--world", "1"], "--world takes 2..8 ranks"),
    (["--world", "8", "--rows", "1f1b"], "at most 4"),
])
def test_bad_input_is_one_usage_error(capsys, argv, fragment):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and fragment in capsys.readouterr().err


def test_peak_rss_sees_what_a_block_touched_and_not_what_came_before():
    """A block that fills 40 MB grows the resident set by about that much at its peak, even though the tensor is
    freed inside it; the next block starts from what is live (the heap trimmed, the high-water mark reset)."""
    import torch
    with peak_rss() as m:
        t = torch.ones(10_000_000)          # 40 MB, touched
        del t
    assert 38e6 <= m[0] <= 80e6, m
    with peak_rss() as m:
        pass
    assert m[0] < 8e6, m
