"""Shard checkpoints: one self-describing file per checkpoint, written atomically, verified by checksum. No pickle.

File layout (little-endian):

    b"PSLABCK1"  | u64 header length H | msgpack header (H bytes) | tensor payload
    header = {"format": 1, "meta": <ShardState metadata>, "tensors": [[name, dtype, shape, offset, nbytes], ...],
              "payload_bytes": int, "sha256": hex digest of the payload}

Writing: temp file in the same directory -> write -> flush + fsync -> rename over the final name -> fsync the
directory; a crash leaves either the old set of checkpoints or the new one, never a torn file under a final name.
Files are named ckpt-<version:012d>.pslab; `latest_checkpoint` returns the newest file that verifies, and
`load_checkpoint` raises `CheckpointError` naming what is wrong with a corrupt one.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path
from typing import Any, Mapping

import msgpack
import numpy as np
import torch

from .errors import CheckpointError

MAGIC = b"PSLABCK1"
FORMAT = 1
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
        descs, meta, digest, nbytes = header["tensors"], header["meta"], header["sha256"], header["payload_bytes"]
    except Exception as e:
        raise CheckpointError(f"checkpoint {p} has a corrupt header ({type(e).__name__}: {e})") from None
    if header.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {p} has format {header.get('format')!r}; this pslab reads {FORMAT}")
    payload = memoryview(data)[16 + hlen:]
    if payload.nbytes != nbytes:
        raise CheckpointError(f"checkpoint {p} is truncated: {payload.nbytes} payload bytes, expected {nbytes}")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise CheckpointError(f"checkpoint {p} fails its sha256 checksum: the file is corrupt; "
                              "remove it to resume from an older checkpoint")
    tensors: dict[str, torch.Tensor] = {}
    for name, dtype, shape, off, n in descs:
        raw = bytearray(payload[off:off + n])
        t = torch.frombuffer(raw, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        tensors[name] = t.view(_DTYPES[dtype]).reshape(shape) if n else torch.empty(shape, dtype=_DTYPES[dtype])
    return tensors, meta


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Checkpoint files in `directory`, newest (highest version) first."""
    d = Path(directory)
    return sorted(d.glob("ckpt-*.pslab"), reverse=True) if d.is_dir() else []


def latest_checkpoint(directory: str | os.PathLike) -> tuple[Path, dict[str, torch.Tensor], dict[str, Any]] | None:
    """The newest checkpoint that verifies, or None if there is none; corrupt newer files are reported via
    `rejected` in the returned meta (as '_rejected': [[path, reason], ...])."""
    rejected = []
    for p in list_checkpoints(directory):
        try:
            tensors, meta = load_checkpoint(p)
        except CheckpointError as e:
            rejected.append([str(p), str(e)])
            continue
        meta["_rejected"] = rejected
        return p, tensors, meta
    if rejected:
        raise CheckpointError(f"no valid checkpoint in {directory}: " + "; ".join(r for _, r in rejected))
    return None
