"""The wire codec: round trips for every dtype, zero-copy both ways, and a specific WireError for each malformation."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

from pslab.collectives import wire
from pslab.collectives.errors import WireError

NUMPY_DTYPES = [np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8, np.bool_]


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("shape", [(0,), (1,), (3, 5), (2, 0, 4), ()])
def test_numpy_round_trip(dtype, shape):
    """Every numpy dtype and shape (empty, scalar, 3-D) survives encode -> decode bit for bit."""
    rng = np.random.default_rng(0)
    a = (rng.standard_normal(shape) * 100).astype(dtype)
    msg = wire.decode(wire.encode("op", {"a": a}, seq=7, src=3, meta={"x": 1}))
    assert (msg.op, msg.seq, msg.src, msg.meta) == ("op", 7, 3, {"x": 1})
    out = msg.tensors["a"]
    assert out.dtype == a.dtype and out.shape == a.shape
    assert np.array_equal(out, a)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.bool])
def test_torch_round_trip(dtype):
    """CPU torch tensors, bfloat16 included, decode back to equal torch tensors."""
    t = (torch.randn(4, 6) * 10).to(dtype)
    out = wire.decode(wire.encode("op", [t]), as_torch=True).tensors["0"]
    assert out.dtype == dtype and torch.equal(out, t)
    if dtype == torch.bfloat16:  # no numpy bfloat16: always a torch tensor
        assert isinstance(wire.decode(wire.encode("op", [t])).tensors["0"], torch.Tensor)


def test_zero_copy_both_ways():
    """encode hands out the array's own memory; decode's arrays are views over the received frames."""
    a = np.arange(1000, dtype=np.float32)
    frames = wire.encode("op", [a])
    assert np.shares_memory(np.frombuffer(frames[1], dtype=np.float32), a)
    t = torch.arange(10, dtype=torch.float64)
    frames_t = wire.encode("op", [t])
    assert np.shares_memory(np.frombuffer(frames_t[1], dtype=np.float64), t.numpy())
    received = bytearray(frames[1])
    out = wire.decode([frames[0], received]).tensors["0"]
    assert np.shares_memory(out, np.frombuffer(received, dtype=np.uint8))


def _header(**over):
    h = {"v": wire.PROTOCOL_VERSION, "op": "x", "seq": 0, "src": 0, "meta": {}, "t": [["a", "float32", [2]]]}
    h.update(over)
    return msgpack.packb(h)


GOOD_DATA = np.zeros(2, np.float32).tobytes()


@pytest.mark.parametrize("frames, fragment", [
    ([], "empty message"),
    ([b"\xc1\xff\x00garbage"], "not valid msgpack"),
    ([msgpack.packb([1, 2, 3])], "must be a map"),
    ([_header(v=99), GOOD_DATA], "protocol version 99"),
    ([_header(op=""), GOOD_DATA], "op must be"),
    ([_header(op="x" * 1000), GOOD_DATA], "op must be"),
    ([_header(seq="1"), GOOD_DATA], "'seq' must be an integer"),
    ([_header(t=[["a", "complex128", [2]]]), GOOD_DATA], "unknown dtype"),
    ([_header(t=[["a", "float32", [-2]]]), GOOD_DATA], "non-negative"),
    ([_header(t=[["a", "float32", [1] * 20]]), GOOD_DATA], "at most 8 dims"),
    ([_header(t=[["a", "float32"]]), GOOD_DATA], "must be [name, dtype, shape]"),
    ([_header(), GOOD_DATA[:5]], "frame has 5 bytes"),
    ([_header(), GOOD_DATA, GOOD_DATA], "2 tensor frames arrived"),
    ([_header()], "0 tensor frames arrived"),
    ([_header(t=[["a", "float32", [1 << 40]]]), GOOD_DATA], "exceeds the per-tensor limit"),
    ([_header(meta=[1]), GOOD_DATA], "'meta' must be a map"),
    ([_header(t=[["a", "float32", [1]], ["a", "float32", [1]]]), b"\0" * 4, b"\0" * 4], "appears twice"),
])
def test_malformed_messages_raise_wire_error(frames, fragment):
    """Each kind of malformation raises WireError with a message naming what was wrong."""
    with pytest.raises(WireError) as e:
        wire.decode(frames)
    assert fragment in str(e.value)


def test_limits_header_size_and_unknown_op():
    """Oversized headers and ops outside an allow-list are refused before use."""
    limits = wire.WireLimits(max_header_bytes=64, allowed_ops=frozenset({"push"}))
    with pytest.raises(WireError, match="exceeds the limit of 64"):
        wire.decode(wire.encode("push", meta={"pad": "x" * 100}), limits)
    with pytest.raises(WireError, match="unknown op 'pull'"):
        wire.decode(wire.encode("pull"), limits)
    assert wire.decode(wire.encode("push"), limits).op == "push"


def test_random_bytes_never_escape_as_other_errors():
    """Thousands of random frame lists only ever raise WireError (never a crash of another type)."""
    rng = np.random.default_rng(1)
    for i in range(3000):
        nframes = int(rng.integers(1, 4))
        frames = [rng.bytes(int(rng.integers(0, 64))) for _ in range(nframes)]
        if i % 3 == 0:  # valid msgpack prefix with random fields, the interesting case
            frames[0] = msgpack.packb({"v": 1, "op": "x", "seq": int(rng.integers(-5, 5)), "src": 0, "meta": {},
                                       "t": [["a", str(rng.choice(["float32", "int8", "zz"])),
                                              [int(rng.integers(-1, 9))]]]})
        try:
            wire.decode(frames)
        except WireError:
            pass


def test_unsupported_dtype_on_encode():
    """Sending an array of a dtype the wire does not carry fails with the list of supported dtypes."""
    with pytest.raises(WireError, match="not supported on the wire"):
        wire.encode("x", [np.zeros(2, np.complex64)])
