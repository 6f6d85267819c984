"""Validating an engine snapshot read from a file (snapshot.py writes them): its meta against the schema, every
tensor's shape against its piece's selection (whole, flat [a, b), index (dim, idx), index_flat), the optimizer
state against the piece -- before anything is used. No pickle: meta is JSON-able data, tensors come from a tensor
file (collectives/tensorfile.py)."""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from .engine import EngineError

FORMAT = 1


class SnapshotError(EngineError):
    """A snapshot (or checkpoint shard) does not fit this replica: another model or optimizer, or malformed."""


def _fail(where: str, what: str) -> SnapshotError:
    return SnapshotError(f"{where}: {what}")


def check_snapshot(tensors: Mapping[str, torch.Tensor], meta: Any, where: str = "snapshot") -> list[dict[str, Any]]:
    """Validate (tensors, meta) against the schema `capture` writes; returns its pieces, each with "tensors":
    {"param", "index"?, "opt/<key>"...}. Every shape is checked against its selection before anything is used."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("pieces"), list):
        raise _fail(where, f"not an engine snapshot of format {FORMAT} (meta must hold format and pieces)")
    out = []
    for k, p in enumerate(meta["pieces"]):
        w = f"{where} piece {k}"
        if not isinstance(p, dict) or not isinstance(p.get("name"), str) or not isinstance(p.get("sel"), dict):
            raise _fail(w, "must be a map with name, shape, sel, sliced, scalar")
        shape = p.get("shape")
        if not (isinstance(shape, list) and len(shape) <= 8 and all(isinstance(s, int) and not isinstance(s, bool)
                                                                     and s >= 0 for s in shape)):
            raise _fail(w, f"shape of {p['name']} must be a list of at most 8 integers >= 0")
        param = tensors.get(f"{k}/param")
        if param is None or not param.is_floating_point():
            raise _fail(w, f"tensor {k}/param of {p['name']} is missing or not floating point")
        got = {"param": param}
        sel, numel = p["sel"], math.prod(shape)
        if sel.get("kind") == "whole" and len(sel) == 1:
            want = list(shape)
        elif sel.get("kind") == "flat" and set(sel) == {"kind", "start", "stop"}:
            a, b = sel["start"], sel["stop"]
            if not (isinstance(a, int) and isinstance(b, int) and 0 <= a <= b <= numel):
                raise _fail(w, f"flat range [{a!r:.20}, {b!r:.20}) is not inside the {numel} elements of {p['name']}")
            want = [b - a]
        elif (sel.get("kind") == "index" and set(sel) == {"kind", "dim"}) or \
                (sel.get("kind") == "index_flat" and set(sel) == {"kind", "dim", "start", "stop"}):
            dim, idx = sel["dim"], tensors.get(f"{k}/index")
            if not (isinstance(dim, int) and 0 <= dim < len(shape)) or idx is None or idx.dtype != torch.int64 \
                    or idx.dim() != 1 or (idx.numel() and not (0 <= int(idx.min()) and int(idx.max()) < shape[dim])):
                raise _fail(w, f"index selection of {p['name']} must be a dim and int64 indices inside the shape")
            want = list(shape)
            want[dim] = idx.numel()
            got["index"] = idx
            if sel["kind"] == "index_flat":
                a, b, n = sel["start"], sel["stop"], math.prod(want)
                if not (isinstance(a, int) and isinstance(b, int) and 0 <= a <= b <= n):
                    raise _fail(w, f"flat range [{a!r:.20}, {b!r:.20}) is not inside the {n} elements of "
                                   f"{p['name']}'s tp piece")
                want = [b - a]
        else:
            raise _fail(w, f"unknown selection {sel!r:.60}")
        if list(param.shape) != want:
            raise _fail(w, f"{p['name']} holds a {list(param.shape)} piece, its selection needs {want}")
        sliced, scalar = p.get("sliced"), p.get("scalar")
        if not (isinstance(sliced, list) and all(isinstance(s, str) for s in sliced) and isinstance(scalar, list)
                and all(isinstance(s, list) and len(s) == 2 and isinstance(s[0], str)
                        and s[1] in ("tensor", "int", "float") for s in scalar)):
            raise _fail(w, "sliced must list state keys and scalar [key, tensor|int|float] pairs")
        for key in sliced:
            v = tensors.get(f"{k}/opt/{key}")
            if v is None or list(v.shape) != want:
                raise _fail(w, f"optimizer state {key!r} of {p['name']} is missing or not shaped like its piece")
            got[f"opt/{key}"] = v
        for key, _ in scalar:
            v = tensors.get(f"{k}/opt/{key}")
            if v is None or v.numel() != 1:
                raise _fail(w, f"optimizer scalar {key!r} of {p['name']} is missing or not one number")
            got[f"opt/{key}"] = v
        out.append({**p, "tensors": got})
    return out
