"""Compressed pushes: a worker sends a shard fewer bytes than its gradient (`connect(..., compress="topk:0.01")`).

The all-reduce's compressors (parallelism/compress.py) all-gather every worker's compressed gradient; over a
parameter server each worker sends its own compressed gradient to the shards, which decode it and step with it as
with any push. With error feedback (on by default) a worker keeps, per shard, the residual e of what it did not
send and adds it to its next gradient:

    M = g + e,   send C(M),   e ← M − C(M)          so   Σ_t C(M_t) + e_T = Σ_t g_t   (delayed, never lost)

The residual moves only when the shard acknowledged the push: a refused push (non-finite, oversize, or refused at
admission: a connection not registered as that worker) leaves the worker's residual, like its clock, where it
was. Forms, per shard (the shard's n elements in its key order, as the client's partition lays them out):

    topk:ρ   the k = ⌈ρ·n⌉ largest |M| over the shard's whole flat gradient (with one shard: the worker's whole
             gradient, the same selection as the all-reduce's topk): tensors "topk.i" (k int32 indices, strictly
             increasing) and "topk.v" (k values, the parameters' dtype)              8·k B per shard (float32)
    sign     EF-signSGD per key (Karimireddy et al. 2019), n_key the key's elements: C(M) = (‖M‖₁/n_key)·(±1),
             one bit per coordinate (+1 for M ≥ 0): a uint8 tensor of ⌈n_key/8⌉ bytes per key and "sign.scale",
             one scale per key in key order                        Σ_keys (⌈n_key/8⌉ + 4) B per shard (float32)

PowerSGD is not offered here: its factors P and Q are all-reduced across the workers (the low rank is shared),
which a parameter server's independent pushes do not do.

Decoding is validation first (`decode`): the key list must be exactly the shard's keys, every tensor its expected
dtype and length, indices in range and strictly increasing, scales non-negative; anything else is a
ProtocolError or ShapeError and changes nothing. Non-finite values decode as such and the shard refuses them as
any non-finite push; the client checks before encoding too, since a NaN the top-k does not select would hide in
the residual.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from .errors import ConfigError, ProtocolError, ShapeError

FORMS = ("topk", "sign")
_FORM = re.compile(r"^(none|sign|topk:(?P<rho>[0-9.eE+-]+)|powersgd:\d+)$")


@dataclass(frozen=True)
class Form:
    """A push compressor: `kind` "topk" (with `rho`) or "sign"."""
    kind: str
    rho: float = 1.0

    def k(self, n: int) -> int:
        """How many coordinates top-k keeps of n: ⌈ρ·n⌉, at least 1, at most n."""
        return max(1, min(n, math.ceil(self.rho * n)))

    def payload_bytes(self, sizes: Sequence[int], itemsize: int = 4) -> int:
        """Bytes of one push to a shard holding keys of `sizes` elements (the module docstring's formulas)."""
        if self.kind == "topk":
            return self.k(sum(sizes)) * (4 + itemsize)
        return sum(math.ceil(n / 8) + itemsize for n in sizes)

    def __str__(self) -> str:
        return f"topk:{self.rho:g}" if self.kind == "topk" else self.kind


def parse(text: str | None) -> Form | None:
    """"none"/None -> None; "topk:ρ" (0 < ρ ≤ 1) or "sign" -> a Form; anything else ConfigError, one line."""
    if text is None:
        return None
    s = str(text).strip().lower()
    m = _FORM.match(s)
    if m is None:
        raise ConfigError(f"a push's compress must be none, topk:<fraction> or sign, got {text!r}")
    if s == "none":
        return None
    if s.startswith("powersgd"):
        raise ConfigError(f"compress {text!r}: PowerSGD all-reduces its low-rank factors across the workers, which "
                          "a parameter server's pushes do not do; push with topk:<fraction> or sign instead")
    if s == "sign":
        return Form("sign")
    try:
        rho = float(m["rho"])
    except ValueError:
        rho = -1.0
    if not 0 < rho <= 1:
        raise ConfigError(f"compress topk:<fraction> keeps that fraction of the coordinates, in (0, 1]; got {text!r}")
    return Form("topk", rho)


class PushCompressor:
    """One worker's encoder with its residuals (one per shard): `encode` proposes, `commit` keeps."""

    def __init__(self, form: Form, error_feedback: bool = True) -> None:
        self.form = form
        self.error_feedback = error_feedback
        self.residual: dict[int, dict[str, np.ndarray]] = {}

    def encode(self, shard: int, pieces: Mapping[str, np.ndarray]) -> tuple[dict[str, Any], dict[str, np.ndarray],
                                                                             dict[str, np.ndarray]]:
        """(meta, tensors, the residual after this push) for one shard's gradient pieces (flat, in key order)."""
        old = self.residual.get(shard)
        m = {k: (g + old[k] if old is not None and self.error_feedback else np.array(g, copy=True))
             for k, g in pieces.items()}
        keys = list(m)
        if self.form.kind == "topk":
            dtypes = {a.dtype for a in m.values()}
            if len(dtypes) != 1:
                raise ConfigError(f"topk over a shard needs one dtype for all its tensors; shard {shard} holds "
                                  f"{sorted(map(str, dtypes))}")
            flat = np.concatenate([a.reshape(-1) for a in m.values()]) if m else np.zeros(0, np.float32)
            k = self.form.k(flat.size)
            idx = np.sort(np.argpartition(np.abs(flat), flat.size - k)[flat.size - k:]) if k < flat.size \
                else np.arange(flat.size)
            idx = idx.astype(np.int32)
            vals = flat[idx]
            tensors = {"topk.i": idx, "topk.v": vals}
            sent = np.zeros_like(flat)
            sent[idx] = vals
            rest, off = {}, 0
            for key in keys:
                n = m[key].size
                rest[key] = m[key] - sent[off:off + n]
                off += n
        else:
            tensors, scales, rest = {}, [], {}
            for key in keys:
                a = m[key].reshape(-1)
                scale = np.abs(a).sum(dtype=a.dtype) / max(a.size, 1)
                tensors[key] = np.packbits(a >= 0, bitorder="little")
                scales.append(scale)
                rest[key] = a - _signs(tensors[key], a.size, a.dtype) * scale
            dt = m[keys[0]].dtype if keys else np.float32
            tensors["sign.scale"] = np.asarray(scales, dtype=dt)
        return {"compress": self.form.kind, "keys": keys}, tensors, rest

    def commit(self, shard: int, residual: dict[str, np.ndarray]) -> None:
        """The shard acknowledged the push encoded with this residual: keep it (error feedback only)."""
        if self.error_feedback:
            self.residual[shard] = residual


def _signs(packed: np.ndarray, n: int, dtype: Any) -> np.ndarray:
    """±1 (as `dtype`) of n coordinates from little-endian packed bits (1: ≥ 0)."""
    return np.unpackbits(packed, count=n, bitorder="little").astype(dtype) * 2 - 1


def decode(meta: Mapping[str, Any], tensors: Mapping[str, Any],
           layout: Mapping[str, tuple[int, np.dtype]]) -> dict[str, np.ndarray]:
    """The dense flat gradients of a compressed push, validated against the shard's `layout` {key: (numel,
    dtype)} (its keys in order); ProtocolError / ShapeError, one line, for anything malformed."""
    kind = meta.get("compress")
    if kind not in FORMS:
        raise ProtocolError(f"push compress must be one of {', '.join(FORMS)}, got {kind!r}")
    keys = meta.get("keys")
    if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)) or sorted(keys) != sorted(layout) \
            or len(set(keys)) != len(keys):
        raise ProtocolError(f"a compressed push must list this shard's keys once each; got {str(keys)[:80]}")
    arrays = {name: _array(name, t) for name, t in tensors.items()}
    sizes = [layout[k][0] for k in keys]
    if kind == "topk":
        if set(arrays) != {"topk.i", "topk.v"}:
            raise ProtocolError(f"a topk push carries exactly topk.i and topk.v, got {sorted(arrays)[:6]}")
        idx, vals = arrays["topk.i"], arrays["topk.v"]
        dts = {layout[k][1] for k in keys}
        n = sum(sizes)
        if idx.dtype != np.int32 or idx.ndim != 1 or vals.ndim != 1 or len(dts) != 1 or vals.dtype != dts.pop():
            raise ShapeError(f"topk push: indices must be int32 and values the parameters' dtype, both 1-D; got "
                             f"{idx.dtype}{list(idx.shape)}, {vals.dtype}{list(vals.shape)}")
        if idx.size != vals.size or not 1 <= idx.size <= n:
            raise ShapeError(f"topk push: {idx.size} indices and {vals.size} values for {n} coordinates")
        if idx[0] < 0 or idx[-1] >= n or (idx.size > 1 and not (np.diff(idx) > 0).all()):
            raise ProtocolError(f"topk push: indices must be strictly increasing within [0, {n})")
        flat = np.zeros(n, dtype=vals.dtype)
        flat[idx] = vals
        out, off = {}, 0
        for k, size in zip(keys, sizes):
            out[k] = flat[off:off + size]
            off += size
        return out
    if set(arrays) != set(keys) | {"sign.scale"}:
        raise ProtocolError(f"a sign push carries one packed tensor per key and sign.scale, got {sorted(arrays)[:6]}")
    scales = arrays["sign.scale"]
    out = {}
    for j, (k, size) in enumerate(zip(keys, sizes)):
        dt = layout[k][1]
        if scales.dtype != dt or scales.shape != (len(keys),):
            raise ShapeError(f"sign push: sign.scale must hold {len(keys)} values of {dt}, got "
                             f"{scales.dtype}{list(scales.shape)}")
        packed = arrays[k]
        if packed.dtype != np.uint8 or packed.shape != (math.ceil(size / 8),):
            raise ShapeError(f"sign push: {k!r} must be {math.ceil(size / 8)} uint8 bytes, got "
                             f"{packed.dtype}{list(packed.shape)}")
        if scales[j] < 0:                   # (NaN / Inf decode as such: the shard refuses or skips them)
            raise ProtocolError(f"sign push: the scale of {k!r} must be >= 0, got {float(scales[j])!r}")
        out[k] = _signs(packed, size, dt) * scales[j]
    return out


def _array(name: str, t: Any) -> np.ndarray:
    """A received tensor as a numpy array (the wire hands torch tensors or arrays)."""
    try:
        return t.numpy() if hasattr(t, "numpy") else np.asarray(t)
    except (TypeError, RuntimeError) as e:
        raise ShapeError(f"compressed push tensor {name!r} cannot be read as an array: {e}") from None
