"""Shard checkpoints: one self-describing file per checkpoint, written atomically, verified by checksum. No pickle.

File layout (little-endian):

    b"PSLABCK1"  | u64 header length H | msgpack header (H bytes) | tensor payload
    header = {"format": 1, "meta": <ShardState metadata>, "tensors": [[name, dtype, shape, offset, nbytes], ...],
              "payload_bytes": int, "sha256": hex digest of the payload}

Writing: temp file in the same directory -> write -> flush + fsync -> rename over the final name -> fsync the
directory; a crash leaves either the old set of checkpoints or the new one, never a torn file under a final name.
Files are named ckpt-<version:012d>.pslab; `latest_checkpoint` returns the newest file that verifies, and
`load_checkpoint` raises `CheckpointError` naming what is wrong with a corrupt one.

Reading trusts nothing, not even a file whose checksum holds (anyone who can write the directory can write a valid
checksum): every header field has its type checked, and every descriptor must be [name, dtype, shape, offset,
nbytes] with a unique string name, a known dtype, a shape of at most 8 non-negative ints, 0 <= offset,
offset + nbytes <= payload and prod(shape) * itemsize == nbytes -- before any byte is read or allocated.
`restore_latest` goes further, building an object from each file (ps.restore validates every meta field of a
shard's state) and falling back to the next older file while one is rejected.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import struct
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

import msgpack
import numpy as np
import torch

from .errors import CheckpointError

MAGIC = b"PSLABCK1"
FORMAT = 1
MAX_NDIM = 8
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64,
           "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8, "bool": torch.bool}


def _bytes_of(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous().reshape(-1)
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    elif t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return memoryview(t.numpy().view(np.uint8))


def save_checkpoint(directory: str | os.PathLike, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any],
                    *, keep: int = 2) -> Path:
    """Write a checkpoint of (tensors, meta) atomically into `directory`; keep the newest `keep` files."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    descs, bufs, offset = [], [], 0
    h = hashlib.sha256()
    for name, t in tensors.items():
        t = torch.as_tensor(t)
        dtype = str(t.dtype).replace("torch.", "")
        if dtype not in _DTYPES:
            raise CheckpointError(f"cannot checkpoint tensor {name!r} of dtype {dtype}")
        b = _bytes_of(t)
        descs.append([name, dtype, list(t.shape), offset, b.nbytes])
        bufs.append(b)
        h.update(b)
        offset += b.nbytes
    header = msgpack.packb({"format": FORMAT, "meta": dict(meta), "tensors": descs, "payload_bytes": offset,
                            "sha256": h.hexdigest()}, use_bin_type=True)
    final = d / f"ckpt-{int(meta.get('version', 0)):012d}.pslab"
    tmp = d / f".{final.name}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for b in bufs:
            f.write(b)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    dir_fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    for old in sorted(d.glob("ckpt-*.pslab"))[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    return final


def load_checkpoint(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read and verify one checkpoint file; raises CheckpointError (what is wrong, which file) if it is corrupt."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint {p}: {e}") from None
    if len(data) < 16 or data[:8] != MAGIC:
        raise CheckpointError(f"{p} is not a pslab checkpoint (bad magic); delete it or point to another file")
    (hlen,) = struct.unpack("<Q", data[8:16])
    if 16 + hlen > len(data):
        raise CheckpointError(f"checkpoint {p} is truncated (header runs past the end of the file)")
    try:
        header = msgpack.unpackb(data[16:16 + hlen], raw=False, strict_map_key=False)
    except Exception as e:          # msgpack raises several unrelated types
        raise CheckpointError(f"checkpoint {p} has a corrupt header ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"checkpoint {p}: the header must be a map, got {type(header).__name__}")
    if header.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {p} has format {header.get('format')!r:.40}; this pslab reads {FORMAT}")
    descs, meta, digest, nbytes = (header.get(k) for k in ("tensors", "meta", "sha256", "payload_bytes"))
    for key, value, kind in (("tensors", descs, list), ("meta", meta, dict), ("sha256", digest, str),
                             ("payload_bytes", nbytes, int)):
        if not isinstance(value, kind) or isinstance(value, bool):
            raise CheckpointError(f"checkpoint {p}: header field {key!r} must be a {kind.__name__}, got "
                                  f"{type(value).__name__}")
    payload = memoryview(data)[16 + hlen:]
    if payload.nbytes != nbytes:
        raise CheckpointError(f"checkpoint {p} is truncated: {payload.nbytes} payload bytes, expected {nbytes}")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise CheckpointError(f"checkpoint {p} fails its sha256 checksum: the file is corrupt; "
                              "remove it to resume from an older checkpoint")
    checked = [_check_descriptor(p, i, d, nbytes) for i, d in enumerate(descs)]
    if len({c[0] for c in checked}) != len(checked):
        raise CheckpointError(f"checkpoint {p}: two tensor descriptors have the same name")
    tensors: dict[str, torch.Tensor] = {}
    for name, dtype, shape, off, n in checked:
        if n == 0:
            tensors[name] = torch.empty(shape, dtype=_DTYPES[dtype])      # prod(shape) == 0: nothing allocated
            continue
        raw = bytearray(payload[off:off + n])
        tensors[name] = torch.frombuffer(raw, dtype=torch.uint8).view(_DTYPES[dtype]).reshape(shape)
    return tensors, meta


def _check_descriptor(p: Path, i: int, d: Any, payload_bytes: int) -> tuple[str, str, list[int], int, int]:
    """One tensor descriptor, every field checked against the payload (CheckpointError naming the first fault)."""
    where = f"checkpoint {p}: tensor descriptor {i}"
    if not (isinstance(d, list) and len(d) == 5):
        raise CheckpointError(f"{where} must be [name, dtype, shape, offset, nbytes], got {d!r:.80}")
    name, dtype, shape, off, n = d
    if not isinstance(name, str) or len(name) > 4096:
        raise CheckpointError(f"{where}: the name must be a string, got {type(name).__name__}")
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise CheckpointError(f"{where} ({name!r:.60}): unknown dtype {dtype!r:.40}; known: {', '.join(_DTYPES)}")
    if not (isinstance(shape, list) and len(shape) <= MAX_NDIM
            and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)):
        raise CheckpointError(f"{where} ({name!r:.60}): the shape must be a list of at most {MAX_NDIM} integers "
                              f">= 0, got {shape!r:.80}")
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (off, n)) or off < 0 or n < 0:
        raise CheckpointError(f"{where} ({name!r:.60}): offset and nbytes must be integers >= 0, got {off!r:.30} "
                              f"and {n!r:.30}")
    if off + n > payload_bytes:
        raise CheckpointError(f"{where} ({name!r:.60}): bytes [{off}, {off + n}) lie beyond the "
                              f"{payload_bytes}-byte payload")
    itemsize = torch.empty(0, dtype=_DTYPES[dtype]).element_size()
    if math.prod(shape) * itemsize != n:
        raise CheckpointError(f"{where} ({name!r:.60}): shape {shape} of {dtype} needs "
                              f"{math.prod(shape) * itemsize} bytes, the descriptor says {n}")
    return name, dtype, shape, off, n


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Checkpoint files in `directory`, newest (highest version) first."""
    d = Path(directory)
    return sorted(d.glob("ckpt-*.pslab"), reverse=True) if d.is_dir() else []


def latest_checkpoint(directory: str | os.PathLike) -> tuple[Path, dict[str, torch.Tensor], dict[str, Any]] | None:
    """The newest checkpoint that verifies, or None if there is none; corrupt newer files are reported via
    `rejected` in the returned meta (as '_rejected': [[path, reason], ...])."""
    found = restore_latest(directory, lambda p, tensors, meta: (tensors, meta))
    if found is None:
        return None
    path, (tensors, meta), rejected = found
    meta["_rejected"] = rejected
    return path, tensors, meta


T = TypeVar("T")
log = logging.getLogger("ps.checkpoint")


def restore_latest(directory: str | os.PathLike, build: Callable[[Path, dict[str, torch.Tensor], dict[str, Any]], T]
                   ) -> tuple[Path, T, list[list[str]]] | None:
    """(path, build(path, tensors, meta), rejected) for the newest file that loads and that `build` accepts (it
    raises CheckpointError to reject one); older files are tried while newer ones are rejected, each rejection
    logged and listed as [path, reason]. None if the directory holds no checkpoint; CheckpointError if it holds
    only rejected ones."""
    rejected: list[list[str]] = []
    for p in list_checkpoints(directory):
        try:
            tensors, meta = load_checkpoint(p)
            built = build(p, tensors, meta)
        except CheckpointError as e:
            log.warning("rejected checkpoint %s: %s", p, e)
            rejected.append([str(p), str(e)])
            continue
        if rejected:
            log.warning("resuming from the older checkpoint %s", p)
        return p, built, rejected
    if rejected:
        raise CheckpointError(f"no valid checkpoint in {directory}: " + "; ".join(r for _, r in rejected))
    return None
