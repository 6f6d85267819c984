"""Crafted checkpoints: files whose checksum holds (the payload is untouched, only the header is rewritten) but
whose descriptors or metadata lie. Each family is a one-line CheckpointError from the loader, and a shard starting
on the directory falls back to the previous valid checkpoint (logged, and named by restored_from)."""

from __future__ import annotations

import logging
import struct

import msgpack
import numpy as np
import pytest

from pslab.ps.checkpoint import MAGIC, load_checkpoint, save_checkpoint
from pslab.ps.errors import CheckpointError
from pslab.ps.restore import load_state
from pslab.ps.server import ServerConfig, ShardServer
from pslab.ps.shard import ShardState

INIT = {"w": np.arange(24, dtype=np.float32).reshape(6, 4), "b": np.ones(4, np.float32)}
CONFIG = dict(num_workers=2, policy="asp", optimizer="momentum:lr=0.1")


def _state(steps: int) -> ShardState:
    st = ShardState(INIT, CONFIG["optimizer"], CONFIG["policy"], num_workers=2)
    for i in range(steps):
        w = i % 2
        st.push(w, st.clocks[w], st.version, {k: np.full(v.shape, 0.5, np.float32) for k, v in INIT.items()})
    return st


def craft(path, change) -> None:
    """Rewrite the header of the checkpoint at `path` with change(header); the payload (and so the checksum)
    stays exactly as written."""
    data = path.read_bytes()
    (hlen,) = struct.unpack("<Q", data[8:16])
    header = msgpack.unpackb(data[16:16 + hlen], raw=False, strict_map_key=False)
    change(header)
    new = msgpack.packb(header, use_bin_type=True)
    path.write_bytes(MAGIC + struct.pack("<Q", len(new)) + new + data[16 + hlen:])


def _desc(header, name="param\x00w"):
    return next(d for d in header["tensors"] if d[0] == name)


def _arity(h):
    h["tensors"][0] = h["tensors"][0][:4]


def _dtype(h):
    _desc(h)[1] = "float33"


def _shape_bytes(h):
    _desc(h)[2] = [7, 4]                       # 28 floats claimed, 24 floats' bytes


def _offset(h):
    _desc(h)[3] = -16


def _huge(h):
    d = _desc(h, "param\x00b")
    d[2], d[4] = [1 << 40], 0                  # 2^40 floats (4 TB) in 0 bytes


def _clocks(h):
    h["meta"]["clocks"] = h["meta"]["clocks"][:1]


DESCRIPTOR_FAMILIES = [
    ("arity", _arity, r"descriptor 0 must be \[name, dtype, shape, offset, nbytes\]"),
    ("dtype", _dtype, "unknown dtype 'float33'"),
    ("shape-bytes", _shape_bytes, r"shape \[7, 4\] of float32 needs 112 bytes, the descriptor says 96"),
    ("negative-offset", _offset, "offset and nbytes must be integers >= 0"),
    ("huge-shape-no-bytes", _huge, "needs 4398046511104 bytes, the descriptor says 0"),
]
META_FAMILIES = [
    ("version-string", lambda h: h["meta"].__setitem__("version", "6"), "version must be an integer"),
    ("version-list", lambda h: h["meta"].__setitem__("version", [6]), "version must be an integer"),
    ("clocks-not-a-list", lambda h: h["meta"].__setitem__("clocks", "6,6"), "clocks must be a list"),
    ("clock-float", lambda h: h["meta"]["clocks"].__setitem__(0, 2.5), r"clocks\[0\] must be an integer"),
    ("shapes-list", lambda h: h["meta"].__setitem__("shapes", [[6, 4]]), "shapes must be a map"),
    ("shape-wrong-size", lambda h: h["meta"]["shapes"].__setitem__("w", [5, 4]), "has 24 elements, its shape says 20"),
    ("optimizer-none", lambda h: h["meta"].__setitem__("optimizer", None), "optimizer must be a map"),
    ("optimizer-spec", lambda h: h["meta"]["optimizer"]["spec"].__setitem__("lr", "fast"), "optimizer.spec"),
    ("pending-map", lambda h: h["meta"].__setitem__("pending", {"0": 1}), "pending must be a list"),
    ("pending-worker", lambda h: h["meta"].__setitem__("pending", [[3, 9, 0]]), r"pending\[0\] worker"),
    ("backups-missing-tensor", lambda h: h["meta"].__setitem__("backups", [1]), "tensor 'bak/1/w' is missing"),
    ("stats-list", lambda h: h["meta"].__setitem__("stats", []), "stats must be a map"),
    ("num-workers-bool", lambda h: h["meta"].__setitem__("num_workers", True), "num_workers must be an integer"),
    ("policy-unknown", lambda h: h["meta"].__setitem__("policy", "hogwild"), "policy"),
    ("meta-not-a-map", lambda h: h.__setitem__("meta", [1, 2]), "header field 'meta' must be a dict"),
]


@pytest.fixture
def two_checkpoints(tmp_path):
    """An older valid checkpoint (version 3) and a newer one (version 6) to be crafted."""
    old = save_checkpoint(tmp_path, *_state(3).state_dict())
    new = save_checkpoint(tmp_path, *_state(6).state_dict())
    return tmp_path, old, new


def _falls_back(directory, old, new, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="pslab.ps.checkpoint"):
        server = ShardServer(ServerConfig(checkpoint_dir=str(directory), **CONFIG))
    assert server.restored_from == str(old) and server.state.version == 3
    assert [p for p, _ in server.rejected_checkpoints] == [str(new)]
    assert any("rejected checkpoint" in r.message and str(new) in r.message for r in caplog.records)
    assert any("resuming from the older checkpoint" in r.message and str(old) in r.message for r in caplog.records)
    server._close()


@pytest.mark.parametrize("family, change, message", DESCRIPTOR_FAMILIES, ids=[f[0] for f in DESCRIPTOR_FAMILIES])
def test_crafted_descriptor_is_a_checkpoint_error_and_the_older_file_is_used(two_checkpoints, caplog, family,
                                                                             change, message):
    directory, old, new = two_checkpoints
    craft(new, change)
    with pytest.raises(CheckpointError, match=message) as err:
        load_checkpoint(new)
    assert "\n" not in str(err.value) and str(new) in str(err.value)
    _falls_back(directory, old, new, caplog)


@pytest.mark.parametrize("family, change, message", META_FAMILIES + [("clocks-short", _clocks,
                         "clocks holds 1 clocks for 2 workers")], ids=[f[0] for f in META_FAMILIES] + ["clocks-short"])
def test_crafted_meta_is_a_checkpoint_error_and_the_older_file_is_used(two_checkpoints, caplog, family, change,
                                                                       message):
    directory, old, new = two_checkpoints
    craft(new, change)
    with pytest.raises(CheckpointError, match=message) as err:
        load_state(new)
    assert "\n" not in str(err.value) and str(new) in str(err.value)
    _falls_back(directory, old, new, caplog)
