"""`pslab bench collectives --profile`: where one zmq call's time goes on rank 0 (wait / zmq / copy / reduce /
python), per op and size, printed under the table; and `--no-shm-channel`, the before-and-after switch."""

from __future__ import annotations

import json

import pytest

from pslab.experiments.bench import collectives as bench


def test_profile_kinds_classify_cprofile_entries():
    """The classifier puts each kind of cProfile entry where the docstring says."""
    k = bench._kind
    assert k(("~", 0, "<built-in method posix.sched_yield>")) == "wait"
    assert k(("/x/collectives/shm_channel.py", 10, "until")) == "wait"
    assert k(("/x/site-packages/zmq/sugar/poll.py", 1, "poll")) == "wait"
    assert k(("/x/site-packages/zmq/sugar/socket.py", 1, "send_multipart")) == "zmq"
    assert k(("~", 0, "<method 'copy_' of 'torch._C.TensorBase' objects>")) == "copy"
    assert k(("~", 0, "<method 'add_' of 'torch._C.TensorBase' objects>")) == "reduce"
    assert k(("~", 0, "<built-in method add of type object at 0x1>")) == "reduce"
    assert k(("/x/collectives/zmq_group.py", 1, "all_reduce")) == "python"      # not "zmq": our module
    assert k(("~", 0, "<built-in method builtins.sum>")) == "python"


@pytest.mark.timeout(180)
def test_profile_rows_and_printout(capfd):
    """--profile adds rank 0's µs per call in every kind to each row (JSON) and prints the breakdown table;
    the channel path waits (or spins) instead of calling ZeroMQ at 4 KiB, the --no-shm-channel run calls ZeroMQ."""
    rc = bench.main(["--world", "2", "--ops", "all_reduce", "broadcast", "--sizes", "4K", "--reps", "1",
                     "--budget", "0.02", "--profile", "--json", "-"])
    out, err = capfd.readouterr()
    assert rc == 0 and "Warning" not in err, err
    rows = json.loads(out[out.index("{"):])["rows"]
    assert [r["op"] for r in rows] == ["all_reduce", "broadcast"]
    for r in rows:
        p = r["profile_us"]
        assert set(p) == set(bench.PROFILE_KINDS) and all(v >= 0 for v in p.values()) and sum(p.values()) > 0
        assert p["zmq"] < 0.05 * sum(p.values()), p          # no ZeroMQ message on the same-host latency path
    rc = bench.main(["--world", "2", "--ops", "all_reduce", "--sizes", "4K", "--reps", "1", "--budget", "0.02",
                     "--profile", "--no-shm-channel"])
    out, _ = capfd.readouterr()
    assert rc == 0
    assert "where one zmq call's time goes on rank 0" in out
    line = next(ln for ln in out.splitlines()[::-1] if ln.startswith("all_reduce"))   # the profile table's row
    assert len(line.split()) == 3 + 2 + 2 * len(bench.PROFILE_KINDS) + 1, line
