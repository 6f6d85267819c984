"""The wire codec: one message = one msgpack header frame + one raw frame per tensor. No pickle.

    frame 0   msgpack map {"v": PROTOCOL_VERSION, "op": str, "seq": int, "src": int, "meta": map,
                           "t": [[name, dtype, [d0, d1, ...]], ...]}
    frame i   the raw bytes of tensor i-1 (C order), len == prod(shape) * itemsize(dtype)

Sending is zero-copy: `encode` returns the arrays' own buffers, to be sent with `send_multipart(..., copy=False)`.
Receiving is zero-copy: `decode` wraps each frame with `np.frombuffer` (or `torch.frombuffer`); the arrays are
read-only views of the frames. bfloat16 has no numpy dtype, so bfloat16 tensors always decode to torch tensors.

Every field is checked against `WireLimits` before it is used; anything wrong raises `WireError` saying what.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import msgpack
import numpy as np
import torch

from .errors import WireError

PROTOCOL_VERSION = 1

# wire dtype name -> (numpy dtype or None, torch dtype, itemsize)
_DTYPES: dict[str, tuple[Any, torch.dtype, int]] = {
    "float16": (np.float16, torch.float16, 2),
    "bfloat16": (None, torch.bfloat16, 2),
    "float32": (np.float32, torch.float32, 4),
    "float64": (np.float64, torch.float64, 8),
    "int8": (np.int8, torch.int8, 1),
    "int16": (np.int16, torch.int16, 2),
    "int32": (np.int32, torch.int32, 4),
    "int64": (np.int64, torch.int64, 8),
    "uint8": (np.uint8, torch.uint8, 1),
    "bool": (np.bool_, torch.bool, 1),
}
_TORCH_TO_WIRE = {v[1]: k for k, v in _DTYPES.items()}
_NUMPY_TO_WIRE = {np.dtype(v[0]): k for k, v in _DTYPES.items() if v[0] is not None}
WIRE_DTYPES: tuple[str, ...] = tuple(_DTYPES)

Tensor = Union[np.ndarray, torch.Tensor]
Frame = Union[bytes, memoryview, np.ndarray, Any]


@dataclass(frozen=True)
class WireLimits:
    """Upper bounds a received message must respect (defaults suit a LAN research cluster)."""

    max_header_bytes: int = 1 << 20
    max_op_len: int = 64
    max_name_len: int = 256
    max_tensors: int = 4096
    max_ndim: int = 8
    max_tensor_bytes: int = 1 << 33
    max_message_bytes: int = 1 << 34
    allowed_ops: frozenset[str] | None = None


DEFAULT_LIMITS = WireLimits()


@dataclass
class Message:
    """A decoded message: who sent which op, its sequence number, free-form metadata and named tensors."""

    op: str
    seq: int = 0
    src: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, Tensor] = field(default_factory=dict)


def wire_dtype(t: Tensor) -> str:
    """The wire name of an array's or tensor's dtype; raises WireError for dtypes the wire does not carry."""
    try:
        return _TORCH_TO_WIRE[t.dtype] if isinstance(t, torch.Tensor) else _NUMPY_TO_WIRE[np.dtype(t.dtype)]
    except KeyError:
        raise WireError(f"dtype {t.dtype} is not supported on the wire; use one of {', '.join(WIRE_DTYPES)}") from None


def tensor_buffer(t: Tensor) -> memoryview:
    """A zero-copy, byte-addressed view of a contiguous CPU array/tensor (copies only if non-contiguous)."""
    if isinstance(t, torch.Tensor):
        if t.device.type != "cpu":
            raise WireError(f"tensor on {t.device} cannot be sent as a frame; move it to CPU first")
        t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.view(torch.int16)
        elif t.dtype == torch.bool:
            t = t.view(torch.uint8)
        a = t.numpy()
    else:
        a = np.ascontiguousarray(t)
    return memoryview(a.reshape(-1).view(np.uint8))


def encode(op: str, tensors: Mapping[str, Tensor] | Sequence[Tensor] | None = None, *, seq: int = 0, src: int = 0,
           meta: Mapping[str, Any] | None = None) -> list[Frame]:
    """Frames of one message; send them with `socket.send_multipart(frames, copy=False)` for zero-copy."""
    if tensors is None:
        items: list[tuple[str, Tensor]] = []
    elif isinstance(tensors, Mapping):
        items = list(tensors.items())
    else:
        items = [(str(i), t) for i, t in enumerate(tensors)]
    descs = []
    frames: list[Frame] = [b""]
    for name, t in items:
        descs.append([name, wire_dtype(t), list(t.shape)])
        frames.append(tensor_buffer(t))
    header = {"v": PROTOCOL_VERSION, "op": op, "seq": int(seq), "src": int(src), "meta": dict(meta or {}), "t": descs}
    frames[0] = msgpack.packb(header, use_bin_type=True)
    return frames


def frame_payload(frames: Sequence[Any]) -> int:
    """Bytes of the tensor frames of an encoded message (all frames but the header)."""
    return sum(_as_bytes_view(f).nbytes for f in frames[1:])


def _as_bytes_view(frame: Any) -> memoryview:
    if isinstance(frame, (bytes, bytearray, memoryview)):
        return memoryview(frame)
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    if buf is not None:
        return buf
    raise WireError(f"frame of type {type(frame).__name__} is not a byte buffer")


def decode_header(frame0: Any, limits: WireLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Parse and validate frame 0 alone (cheap: lets a receiver route or reject before touching tensor frames)."""
    raw = _as_bytes_view(frame0)
    if raw.nbytes > limits.max_header_bytes:
        raise WireError(f"header of {raw.nbytes} bytes exceeds the limit of {limits.max_header_bytes}")
    try:
        h = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types
        raise WireError(f"header is not valid msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(h, dict):
        raise WireError(f"header must be a map, got {type(h).__name__}")
    if h.get("v") != PROTOCOL_VERSION:
        raise WireError(f"protocol version {h.get('v')!r} is not supported (this peer speaks {PROTOCOL_VERSION})")
    op = h.get("op")
    if not isinstance(op, str) or not 0 < len(op) <= limits.max_op_len:
        raise WireError(f"op must be a non-empty string of at most {limits.max_op_len} chars, got {op!r:.80}")
    if limits.allowed_ops is not None and op not in limits.allowed_ops:
        raise WireError(f"unknown op {op!r}; expected one of {sorted(limits.allowed_ops)}")
    for key in ("seq", "src"):
        if not isinstance(h.get(key), int) or isinstance(h.get(key), bool):
            raise WireError(f"header field {key!r} must be an integer, got {h.get(key)!r:.80}")
    if not isinstance(h.get("meta"), dict):
        raise WireError("header field 'meta' must be a map")
    descs = h.get("t")
    if not isinstance(descs, list) or len(descs) > limits.max_tensors:
        raise WireError(f"header field 't' must be a list of at most {limits.max_tensors} tensor descriptors")
    total = 0
    for i, d in enumerate(descs):
        if not (isinstance(d, list) and len(d) == 3):
            raise WireError(f"tensor descriptor {i} must be [name, dtype, shape], got {d!r:.80}")
        name, dtype, shape = d
        if not isinstance(name, str) or len(name) > limits.max_name_len:
            raise WireError(f"tensor {i}: name must be a string of at most {limits.max_name_len} chars")
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise WireError(f"tensor {name!r}: unknown dtype {dtype!r:.40}; expected one of {', '.join(WIRE_DTYPES)}")
        if not isinstance(shape, list) or len(shape) > limits.max_ndim:
            raise WireError(f"tensor {name!r}: shape must be a list of at most {limits.max_ndim} dims")
        if not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 1 << 48 for s in shape):
            raise WireError(f"tensor {name!r}: shape {shape!r:.80} must hold non-negative integers")
        nbytes = math.prod(shape) * _DTYPES[dtype][2]
        if nbytes > limits.max_tensor_bytes:
            raise WireError(f"tensor {name!r}: {nbytes} bytes exceeds the per-tensor limit {limits.max_tensor_bytes}")
        total += nbytes
    if total > limits.max_message_bytes:
        raise WireError(f"message of {total} bytes exceeds the limit {limits.max_message_bytes}")
    return h


def decode(frames: Sequence[Any], limits: WireLimits = DEFAULT_LIMITS, *, as_torch: bool = False,
           header: dict[str, Any] | None = None) -> Message:
    """Validate and decode a multipart message; tensors are zero-copy read-only views of the frames.

    `header` may pass the result of an earlier `decode_header(frames[0])` to skip parsing it twice."""
    if len(frames) == 0:
        raise WireError("empty message: expected a header frame")
    h = header if header is not None else decode_header(frames[0], limits)
    descs = h["t"]
    if len(frames) != 1 + len(descs):
        raise WireError(f"header describes {len(descs)} tensors but {len(frames) - 1} tensor frames arrived")
    tensors: dict[str, Tensor] = {}
    for (name, dtype, shape), frame in zip(descs, frames[1:]):
        buf = _as_bytes_view(frame)
        np_dtype, t_dtype, itemsize = _DTYPES[dtype]
        expect = math.prod(shape) * itemsize
        if buf.nbytes != expect:
            raise WireError(f"tensor {name!r}: frame has {buf.nbytes} bytes, but {dtype}{shape} needs {expect}")
        if name in tensors:
            raise WireError(f"tensor name {name!r} appears twice")
        tensors[name] = _view(buf, np_dtype, t_dtype, shape, as_torch)
    return Message(op=h["op"], seq=h["seq"], src=h["src"], meta=h["meta"], tensors=tensors)


def _view(buf: memoryview, np_dtype: Any, t_dtype: torch.dtype, shape: list[int], as_torch: bool) -> Tensor:
    if np_dtype is not None and not as_torch:
        return np.frombuffer(buf, dtype=np_dtype).reshape(shape)
    if buf.nbytes == 0:
        return torch.empty(shape, dtype=t_dtype)
    with warnings.catch_warnings():  # frames are read-only; torch warns but the view is safe to read
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=t_dtype).reshape(shape)


def to_numpy(t: Tensor) -> np.ndarray:
    """A numpy view (no copy) of a CPU tensor or array; bfloat16 stays a torch tensor's job, so it is refused."""
    if isinstance(t, np.ndarray):
        return t
    if t.dtype == torch.bfloat16:
        raise WireError("bfloat16 has no numpy dtype; keep it as a torch tensor")
    return t.detach().numpy()
