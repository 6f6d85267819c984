"""The flight recorder and `diagnose`: deliberately broken programs on both backends, and the verdict each gets.

Each program runs under `collectives.launch` with short collective timeouts, so a hang fails in seconds; every
rank's record lands in tmp_path (flight.py), and `diagnose_dir` must name what went wrong."""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest
import torch

from pslab import collectives
from pslab.collectives import flight, flight_wrap
from pslab.collectives.diagnose import FlightRecordError, diagnose_dir

BACKENDS = ("zmq", "torch")


def _skips(group: collectives.ProcessGroup) -> int:         # rank 1 skips the second all_reduce and ends
    t = np.ones(16, np.float32)
    group.all_reduce(t)
    if group.rank == 0:
        group.all_reduce(t)
    return 0


def _other_op(group: collectives.ProcessGroup) -> None:     # rank 1 broadcasts where rank 0 all-reduces
    t = np.ones(16, np.float32)
    group.all_reduce(t)
    if group.rank == 0:
        group.all_reduce(t)
    else:
        group.broadcast(t, 0)


def _other_size(group: collectives.ProcessGroup) -> None:
    group.all_reduce(np.ones(16 + 8 * group.rank, np.float32))


def _other_dtype(group: collectives.ProcessGroup) -> None:
    group.all_reduce(np.ones(16, np.float32 if group.rank == 0 else np.float64))


def _recv_without_send(group: collectives.ProcessGroup) -> None:
    t = np.ones(16, np.float32)
    if group.rank == 0:
        group.send(t, 1)                   # the first message arrives ...
    else:
        group.recv(t, 0)
        group.recv(t, 0)                   # ... the second is never sent


CASES = {
    "skip": (_skips, [r"missing rank 1 in collective all_reduce #1 \(16 x float32\) that rank 0 waits in",
                      r"rank 1 last called all_reduce #0 .* finished"]),
    "op": (_other_op, [r"collective type mismatch at collective #1: rank 0 all_reduce #1 .*, rank 1 broadcast #1"]),
    "size": (_other_size, [r"size mismatch at collective #0: rank 0 all_reduce #0 \(16 x float32\), "
                           r"rank 1 all_reduce #0 \(24 x float32\)"]),
    "dtype": (_other_dtype, [r"dtype mismatch at collective #0: rank 0 .*float32\), rank 1 .*float64\)"]),
    "p2p": (_recv_without_send, [r"rank 1 waits in recv #1 \(16 x float32\) from rank 0, which never sent it: "
                                 r"rank 0 sent 1 message\(s\) to rank 1"]),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_diagnose_names_what_went_wrong(case: str, backend: str, tmp_path) -> None:
    fn, expected = CASES[case]
    t0 = time.monotonic()
    out = collectives.launch(fn, 2, backend=backend, timeout=60, group_timeout=3, flight_dir=str(tmp_path),
                             return_exceptions=True)
    assert any(isinstance(r, collectives.launcher.RankFailure) for r in out), out   # the program did fail
    assert time.monotonic() - t0 < 45                         # a hang fails in seconds, not at the launch timeout
    d = diagnose_dir(str(tmp_path))
    text = "\n".join(d.problems)
    import re
    for pattern in expected:
        assert re.search(pattern, text), f"{pattern!r} not in:\n{text}"
    assert len(d.problems) == 1, text                          # one verdict, not a cascade


def _killed_mid_call(group: collectives.ProcessGroup) -> None:
    t = np.ones(16, np.float32)
    group.all_reduce(t)
    if group.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)                   # no record written: only its ring file is left
    group.all_reduce(t)


def test_a_killed_rank_still_leaves_its_calls(tmp_path) -> None:
    with pytest.raises(collectives.LaunchError):
        collectives.launch(_killed_mid_call, 2, timeout=60, group_timeout=3, flight_dir=str(tmp_path))
    assert not (tmp_path / "flight-rank1.json").exists() and (tmp_path / "flight-rank1.ring").exists()
    text = "\n".join(diagnose_dir(str(tmp_path)).problems)
    assert "missing rank 1 in collective all_reduce #1" in text and "wrote no record of its own" in text, text


def _timed_out(group: collectives.ProcessGroup) -> None:
    if group.rank == 0:
        group.barrier()
    time.sleep(60)


def test_a_timed_out_launch_prints_the_verdict() -> None:
    with pytest.raises(collectives.LaunchError, match=r"diagnosis: .*missing rank 1 in collective barrier #0"):
        collectives.launch(_timed_out, 2, timeout=6, group_timeout=30)


def _clean(group: collectives.ProcessGroup) -> float:
    t = np.ones(8, np.float32)
    for _ in range(5):
        group.all_reduce(t)
    if group.rank == 0:
        group.send(t, 1)
    else:
        group.recv(t, 0)
    return float(t[0])


def test_a_clean_run_has_no_verdict_and_the_ring_wraps(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(flight.ENV_ENTRIES, "16")
    collectives.launch(_clean, 2, timeout=60, flight_dir=str(tmp_path))
    d = diagnose_dir(str(tmp_path))
    assert d.problems == [] and d.records == 2
    rec = json.loads((tmp_path / "flight-rank0.json").read_text())
    assert rec["reason"] == "finished" and [e["op"] for e in rec["entries"]][-2:] == ["all_reduce", "send"]
    ring = flight.read_ring(str(tmp_path / "flight-rank1.ring"))      # the ring file holds what the dump holds
    assert [(e["op"], e["seq"], e["state"]) for e in ring["entries"]] == \
        [(e["op"], e["seq"], e["state"]) for e in json.loads((tmp_path / "flight-rank1.json").read_text())["entries"]]


def test_a_record_that_is_not_one_is_refused(tmp_path) -> None:
    (tmp_path / "flight-rank0.json").write_text(json.dumps({"format": flight.FORMAT, "who": "rank0", "reason": "x",
                                                            "groups": [], "entries": [{"op": "all_reduce"}]}))
    with pytest.raises(FlightRecordError, match="an entry is not"):
        diagnose_dir(str(tmp_path))
    with pytest.raises(FlightRecordError, match="no such directory"):
        diagnose_dir(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FlightRecordError, match="no flight records"):
        diagnose_dir(str(tmp_path / "empty"))


def test_the_ring_buffer_is_bounded() -> None:
    rec = flight.Recorder(entries=16)

    class G:
        ranks, rank, backend = (0, 1), 0, "test"
    gi = rec.group_index(G())
    for i in range(100):
        rec.end(rec.begin(gi, rec.op_code("all_reduce"), 4, rec.dtype_code("float32"), -1))
    entries = rec.snapshot("test")["entries"]
    assert [e["seq"] for e in entries] == list(range(84, 100)) and {e["state"] for e in entries} == {"completed"}


class _Fake(collectives.ProcessGroup):
    """A backend whose calls do nothing: what the flight wrapper alone does (signature, entries, pauses)."""
    backend, rank, world_size, ranks, timeout = "fake", 0, 2, (5, 7), 1.0

    def all_reduce(self, tensor, op="sum", algorithm="auto"):
        self.last = (op, algorithm)
        return tensor

    def reduce_scatter(self, output, input, op="sum"):
        return output

    def all_gather(self, output, input):
        return output

    def broadcast(self, tensor, src=0):
        return tensor

    def all_to_all(self, output, input):
        return output

    def barrier(self):
        pass

    def send(self, tensor, dst, tag=0):
        self._isend(tensor, dst, tag)

    def recv(self, tensor, src, tag=0):
        return tensor

    def isend(self, tensor, dst, tag=0):
        return self._isend(tensor, dst, tag)

    def _isend(self, tensor, dst, tag=0):
        class Done:
            def wait(self, timeout=None):
                return None

            def is_completed(self):
                return True
        return Done()

    def irecv(self, tensor, src, tag=0):
        return self._isend(tensor, src, tag)

    def new_group(self, ranks):
        return None

    def destroy(self):
        pass


def test_the_wrapper_keeps_the_signature_and_records_each_call_once(monkeypatch) -> None:
    monkeypatch.setattr(flight, "RECORDER", flight.Recorder(entries=64))
    g, t = _Fake(), torch.ones(6, dtype=torch.float64)
    g.all_reduce(t, "max", algorithm="ring")
    assert g.last == ("max", "ring")
    g.all_reduce(tensor=t)
    assert g.last == ("sum", "auto")
    g.send(t, 1)                                   # one entry: send's own _isend is not a second call
    g.isend(t, dst=1).wait()
    g.barrier()
    g.broadcast(torch.ones(3, dtype=torch.int32), src=1)
    with flight.paused():                          # the bench's "noflight": calls pass unrecorded
        g.all_reduce(t)
    quiet = _Fake()
    quiet._flight_quiet = True                     # a hierarchical all-reduce's sub-group: its steps are not calls
    quiet.all_reduce(t)
    got = [(e["op"], e["seq"], e["numel"], e["dtype"], e["peer"], e["state"])
           for e in flight.RECORDER.snapshot("test")["entries"]]
    assert got == [("all_reduce", 0, 6, "float64", -1, "completed"), ("all_reduce", 1, 6, "float64", -1, "completed"),
                   ("send", 0, 6, "float64", 7, "completed"), ("isend", 1, 6, "float64", 7, "completed"),
                   ("barrier", 2, 1, "", -1, "completed"), ("broadcast", 3, 3, "int32", 7, "completed")]
    with pytest.raises(TypeError, match="named parameters"):
        flight_wrap.recorded("all_reduce", lambda self, *args: None)
