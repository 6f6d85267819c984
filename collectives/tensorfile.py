"""The tensor file: one self-describing file of named tensors + a metadata map, written atomically, checksummed.
No pickle. (Moved here from `ps.checkpoint`, which keeps its names and behaviour on top of it, so that the
parallelism engines' checkpoints use the very same format: `collectives` is the layer both may import.)

File layout (little-endian):

    b"PSLABCK1"  | u64 header length H | msgpack header (H bytes) | tensor payload
    header = {"format": 1, "meta": <map>, "tensors": [[name, dtype, shape, offset, nbytes], ...],
              "payload_bytes": int, "sha256": hex digest of the payload}

Writing: temp file in the same directory -> write -> flush + fsync -> rename over the final name -> fsync the
directory; a crash leaves either the old file or the new one, never a torn file under a final name.

Reading trusts nothing, not even a file whose checksum holds (anyone who can write the directory can write a valid
checksum): every header field has its type checked, and every descriptor must be [name, dtype, shape, offset,
nbytes] with a unique string name, a known dtype, a shape of at most 8 non-negative ints, 0 <= offset,
offset + nbytes <= payload and prod(shape) * itemsize == nbytes -- before any byte is read or allocated.
What the meta map means is the caller's to check.
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
from pathlib import Path
from typing import Any, Mapping

import msgpack
import numpy as np
import torch

from .errors import CollectivesError

MAGIC = b"PSLABCK1"
FORMAT = 1
MAX_NDIM = 8
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64,
          "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8, "bool": torch.bool}


class TensorFileError(CollectivesError, ValueError):
    """A tensor file cannot be written, or is unreadable, corrupt or malformed; the message names the file and why."""


def _bytes_of(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous().reshape(-1)
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    elif t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return memoryview(t.numpy().view(np.uint8))


def fsync_dir(d: str | os.PathLike) -> None:
    """Make a rename in directory `d` durable."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_tensor_file(path: str | os.PathLike, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> str:
    """Write (tensors, meta) to `path` atomically (temp file + rename + directory fsync); returns the payload's
    sha256 hex digest (the one recorded in the header)."""
    final = Path(path)
    descs, bufs, offset = [], [], 0
    h = hashlib.sha256()
    for name, t in tensors.items():
        t = torch.as_tensor(t)
        dtype = str(t.dtype).replace("torch.", "")
        if dtype not in DTYPES:
            raise TensorFileError(f"cannot checkpoint tensor {name!r} of dtype {dtype}")
        b = _bytes_of(t)
        descs.append([name, dtype, list(t.shape), offset, b.nbytes])
        bufs.append(b)
        h.update(b)
        offset += b.nbytes
    digest = h.hexdigest()
    header = msgpack.packb({"format": FORMAT, "meta": dict(meta), "tensors": descs, "payload_bytes": offset,
                            "sha256": digest}, use_bin_type=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for b in bufs:
                f.write(b)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(final.parent)
    return digest


def read_tensor_file(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read and verify one tensor file; raises TensorFileError (what is wrong, which file) if it is corrupt."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise TensorFileError(f"cannot read checkpoint {p}: {e}") from None
    if len(data) < 16 or data[:8] != MAGIC:
        raise TensorFileError(f"{p} is not a pslab checkpoint (bad magic); delete it or point to another file")
    (hlen,) = struct.unpack("<Q", data[8:16])
    if 16 + hlen > len(data):
        raise TensorFileError(f"checkpoint {p} is truncated (header runs past the end of the file)")
    try:
        header = msgpack.unpackb(data[16:16 + hlen], raw=False, strict_map_key=False)
    except Exception as e:          # msgpack raises several unrelated types
        raise TensorFileError(f"checkpoint {p} has a corrupt header ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise TensorFileError(f"checkpoint {p}: the header must be a map, got {type(header).__name__}")
    if header.get("format") != FORMAT:
        raise TensorFileError(f"checkpoint {p} has format {header.get('format')!r:.40}; this pslab reads {FORMAT}")
    descs, meta, digest, nbytes = (header.get(k) for k in ("tensors", "meta", "sha256", "payload_bytes"))
    for key, value, kind in (("tensors", descs, list), ("meta", meta, dict), ("sha256", digest, str),
                             ("payload_bytes", nbytes, int)):
        if not isinstance(value, kind) or isinstance(value, bool):
            raise TensorFileError(f"checkpoint {p}: header field {key!r} must be a {kind.__name__}, got "
                                  f"{type(value).__name__}")
    payload = memoryview(data)[16 + hlen:]
    if payload.nbytes != nbytes:
        raise TensorFileError(f"checkpoint {p} is truncated: {payload.nbytes} payload bytes, expected {nbytes}")
    if hashlib.sha256(payload).hexdigest() != digest:
        raise TensorFileError(f"checkpoint {p} fails its sha256 checksum: the file is corrupt; "
                              "remove it to resume from an older checkpoint")
    checked = [_check_descriptor(p, i, d, nbytes) for i, d in enumerate(descs)]
    if len({c[0] for c in checked}) != len(checked):
        raise TensorFileError(f"checkpoint {p}: two tensor descriptors have the same name")
    tensors: dict[str, torch.Tensor] = {}
    for name, dtype, shape, off, n in checked:
        if n == 0:
            tensors[name] = torch.empty(shape, dtype=DTYPES[dtype])      # prod(shape) == 0: nothing allocated
            continue
        raw = bytearray(payload[off:off + n])
        tensors[name] = torch.frombuffer(raw, dtype=torch.uint8).view(DTYPES[dtype]).reshape(shape)
    return tensors, meta


def _check_descriptor(p: Path, i: int, d: Any, payload_bytes: int) -> tuple[str, str, list[int], int, int]:
    """One tensor descriptor, every field checked against the payload (TensorFileError naming the first fault)."""
    where = f"checkpoint {p}: tensor descriptor {i}"
    if not (isinstance(d, list) and len(d) == 5):
        raise TensorFileError(f"{where} must be [name, dtype, shape, offset, nbytes], got {d!r:.80}")
    name, dtype, shape, off, n = d
    if not isinstance(name, str) or len(name) > 4096:
        raise TensorFileError(f"{where}: the name must be a string, got {type(name).__name__}")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise TensorFileError(f"{where} ({name!r:.60}): unknown dtype {dtype!r:.40}; known: {', '.join(DTYPES)}")
    if not (isinstance(shape, list) and len(shape) <= MAX_NDIM
            and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)):
        raise TensorFileError(f"{where} ({name!r:.60}): the shape must be a list of at most {MAX_NDIM} integers "
                              f">= 0, got {shape!r:.80}")
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (off, n)) or off < 0 or n < 0:
        raise TensorFileError(f"{where} ({name!r:.60}): offset and nbytes must be integers >= 0, got {off!r:.30} "
                              f"and {n!r:.30}")
    if off + n > payload_bytes:
        raise TensorFileError(f"{where} ({name!r:.60}): bytes [{off}, {off + n}) lie beyond the "
                              f"{payload_bytes}-byte payload")
    itemsize = torch.empty(0, dtype=DTYPES[dtype]).element_size()
    if math.prod(shape) * itemsize != n:
        raise TensorFileError(f"{where} ({name!r:.60}): shape {shape} of {dtype} needs "
                              f"{math.prod(shape) * itemsize} bytes, the descriptor says {n}")
    return name, dtype, shape, off, n
