"""A PS worker stuck behind an SSP gate: the shard's flight record names the straggler the read waits for, and
`diagnose` quotes it (collectives/flight.py contexts, ps/parking.py gate_waits)."""

from __future__ import annotations

import numpy as np
import pytest

from pslab.collectives import flight
from pslab.collectives.diagnose import diagnose_dir
from pslab.ps import connect, start_servers
from pslab.ps.errors import GateTimeoutError

SHAPES = {"w": (4, 3)}


def test_a_read_parked_at_the_ssp_gate_names_its_straggler(tmp_path, monkeypatch):
    monkeypatch.setenv(flight.ENV_DIR, str(tmp_path))          # the shard process inherits it
    with start_servers(1, 2, "ssp:1", "sgd:lr=0.1", request_timeout=2.0, start_method="fork") as servers:
        fast, slow = (connect(servers.addresses, w, SHAPES, timeout=30, secret=servers.secret) for w in (0, 1))
        try:
            fast.init({"w": np.zeros((4, 3), np.float32)}).result(30)
            slow.pull().result(30)                              # the straggler reads once and then stops
            g = {"w": np.ones((4, 3), np.float32)}
            for _ in range(2):                                  # clocks 0 and 1 pushed: 2 ahead of worker 1
                fast.push(g).result(30)
            with pytest.raises(GateTimeoutError, match=r"waiting for \[1\]"):
                fast.pull().result(30)                          # clock 2 > 0 + s: parked, then refused at 2 s
        finally:
            fast.close()
            slow.close()
    mine = [e for e in flight.RECORDER.snapshot("test")["entries"] if e["op"].startswith("ps.")]
    assert [e["op"] for e in mine][-3:] == ["ps.push", "ps.push", "ps.pull"] and mine[-1]["state"] == "failed"
    text = "\n".join(diagnose_dir(str(tmp_path)).problems)
    assert ("shard0: worker 0's read at clock 2 has been parked at shard 0's ssp:1 gate" in text
            and "waiting for worker 1 at clock 0" in text), text
