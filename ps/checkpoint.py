"""Shard checkpoints: one self-describing file per checkpoint, written atomically, verified by checksum. No pickle.

The file format is `collectives.tensorfile` (shared with the engines' checkpoints, `parallelism.state_io`):

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

import logging
import os
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

import torch

from pslab.collectives.tensorfile import DTYPES as _DTYPES, FORMAT, MAGIC, MAX_NDIM  # noqa: F401  (kept names)
from pslab.collectives.tensorfile import TensorFileError, read_tensor_file, write_tensor_file

from .errors import CheckpointError


def save_checkpoint(directory: str | os.PathLike, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any],
                    *, keep: int = 2) -> Path:
    """Write a checkpoint of (tensors, meta) atomically into `directory`; keep the newest `keep` files."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    final = d / f"ckpt-{int(meta.get('version', 0)):012d}.pslab"
    try:
        write_tensor_file(final, tensors, meta)
    except TensorFileError as e:
        raise CheckpointError(str(e)) from None
    for old in sorted(d.glob("ckpt-*.pslab"))[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    return final


def load_checkpoint(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read and verify one checkpoint file; raises CheckpointError (what is wrong, which file) if it is corrupt."""
    try:
        return read_tensor_file(path)
    except TensorFileError as e:
        raise CheckpointError(str(e)) from None


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
log = logging.getLogger("pslab.ps.checkpoint")


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
