"""Sharded engine checkpoints on disk: one tensor file per rank, a manifest that commits the step, and a load that
re-cuts the pieces for whatever layout the resuming run has (`snapshot.py`).

    ROOT/step-<n:08d>/rank-<r:05d>.pslab     rank r's snapshot (`capture(replica, strategy, mesh)`: only what no
                                             other rank stores), in the `collectives.tensorfile` format (atomic,
                                             sha256 of the payload, no pickle)
    ROOT/step-<n:08d>/manifest.json          the commit, written last (temp + rename) by rank 0 after a barrier:
        {"format": 1, "step": n, "config_digest": hex, "layout": {world, dp, pp, tp, engine, ...},
         "files": [{"rank": r, "file": "rank-….pslab", "sha256": of the whole file, "bytes": size}]}

Save protocol (every rank, between steps): rank 0 un-commits a stale step-<n> → barrier → each rank writes its file →
barrier → rank 0 hashes the files and writes the manifest, then deletes every step older than the newest `keep`
committed ones. A crash anywhere leaves step-<n> without a manifest: ignored, the previous commit stands.

Load: the committed steps, newest first. A manifest of another config (digest) is refused at once with
`CheckpointMismatchError` — nothing of another experiment is ever loaded. A step whose files are missing, differ from
their manifest checksum, fail their own checksum or do not fit this model (names, shapes, selections, optimizer
state keys) is rejected with a warning (`log`) and the next older commit is tried. Every rank reads every file of
the step (small models; the files are on one host or a shared file system), so each re-cuts its own targets; the
ranks then check with one all-reduce that they all chose the same step. New rank r takes the RNG states of old rank r
(of old rank 0 when the world grew). What the files do not say — the learning rate, the batches — comes from the
resuming run: its optimizer's param_groups, and batch(worker, step) of its own schedule from the restored step on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pslab.collectives.tensorfile import TensorFileError, fsync_dir, read_tensor_file, write_tensor_file

from .engine import EngineError, Replica
from .snapshot import Snapshot, SnapshotError, capture, engine_kind, load_pieces

FORMAT = 1
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_RANK_FILE = re.compile(r"^rank-\d{5}\.pslab$")
log = logging.getLogger("pslab.parallelism.state_io")


class CheckpointMismatchError(EngineError):
    """The checkpoint was written by another config (workload, model or optimizer): it is never loaded."""


class CheckpointWriteError(EngineError):
    """A checkpoint could not be written (directory not writable, disk full); the message names the path."""


@dataclass
class Loaded:
    """What `load` restored: the step (the next step to run), its directory, and the newer commits it rejected."""

    step: int
    path: Path
    rejected: list[tuple[str, str]] = field(default_factory=list)


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def layout_of(replica: Replica, mesh: Any, **extra: Any) -> dict[str, Any]:
    """The world layout a manifest records."""
    return {"world": mesh.world.world_size, "dp": mesh.size("dp"), "pp": mesh.size("pp"), "tp": mesh.size("tp"),
            "engine": engine_kind(replica), **extra}


def save(root: str | os.PathLike, step: int, replica: Replica, strategy: Any, mesh: Any, config_digest: str,
         layout: dict[str, Any] | None = None, keep: int = 2) -> Path:
    """Write and commit this step's checkpoint; a collective over `mesh.world` (call on every rank, between steps).
    Returns the step directory. CheckpointWriteError if the files cannot be written."""
    world, rank = mesh.world, mesh.world.rank
    d = step_dir(root, step)
    try:
        if rank == 0:
            d.mkdir(parents=True, exist_ok=True)
            (d / MANIFEST).unlink(missing_ok=True)           # a stale commit of this step is void from now on
        world.barrier()
        tensors, meta = capture(replica, strategy, mesh)
        meta.update(step=step, rank=rank, world=world.world_size, coords=dict(mesh.coords))
        write_tensor_file(d / f"rank-{rank:05d}.pslab", tensors, meta)
        world.barrier()
        if rank == 0:
            _commit(root, d, step, world.world_size, config_digest, layout or layout_of(replica, mesh), keep)
    except (OSError, TensorFileError) as e:
        raise CheckpointWriteError(f"cannot write checkpoint step {step} under {root}: {e}") from None
    return d


def _commit(root: str | os.PathLike, d: Path, step: int, world: int, digest: str, layout: dict[str, Any],
            keep: int) -> None:
    files = []
    for r in range(world):
        p = d / f"rank-{r:05d}.pslab"
        data = p.read_bytes()
        files.append({"rank": r, "file": p.name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)})
    manifest = {"format": FORMAT, "step": step, "config_digest": digest, "layout": layout, "files": files}
    tmp = d / f".{MANIFEST}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, d / MANIFEST)
    fsync_dir(d)
    listed = {f["file"] for f in files}
    for stale in d.iterdir():                                # files of an earlier, uncommitted attempt
        if _RANK_FILE.match(stale.name) and stale.name not in listed:
            stale.unlink(missing_ok=True)
    committed = [s for s, _ in committed_steps(root)]
    if keep > 0 and len(committed) > keep:
        oldest_kept = committed[keep - 1]
        for s, p in _step_dirs(root):
            if s < oldest_kept:
                shutil.rmtree(p, ignore_errors=True)


def _step_dirs(root: str | os.PathLike) -> list[tuple[int, Path]]:
    r = Path(root)
    if not r.is_dir():
        return []
    out = [(int(m.group(1)), p) for p in r.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(out, reverse=True)


def committed_steps(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, directory) of every step with a manifest, newest first (not yet verified)."""
    return [(s, p) for s, p in _step_dirs(root) if (p / MANIFEST).is_file()]


def read_manifest(d: Path, config_digest: str | None = None) -> dict[str, Any]:
    """A step's manifest, schema-checked. SnapshotError if malformed; CheckpointMismatchError if its config
    digest is not `config_digest`."""
    try:
        m = json.loads((d / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise SnapshotError(f"checkpoint {d}: unreadable manifest ({type(e).__name__}: {e})") from None
    ok = (isinstance(m, dict) and m.get("format") == FORMAT and isinstance(m.get("step"), int)
          and isinstance(m.get("config_digest"), str) and isinstance(m.get("layout"), dict)
          and isinstance(m.get("files"), list) and m["files"])
    if not ok:
        raise SnapshotError(f"checkpoint {d}: the manifest must hold format {FORMAT}, step, config_digest, layout "
                            "and a non-empty files list")
    if m["step"] != int(d.name.split("-")[1]):
        raise SnapshotError(f"checkpoint {d}: its manifest is for step {m['step']}")
    for i, f in enumerate(m["files"]):
        if not (isinstance(f, dict) and f.get("rank") == i and isinstance(f.get("file"), str)
                and _RANK_FILE.match(f["file"]) and isinstance(f.get("sha256"), str)):
            raise SnapshotError(f"checkpoint {d}: manifest file entry {i} must be {{rank: {i}, file: rank-….pslab, "
                                "sha256}")
    if config_digest is not None and m["config_digest"] != config_digest:
        raise CheckpointMismatchError(
            f"checkpoint {d} was written by another config (digest {m['config_digest'][:12]}, this run's "
            f"{config_digest[:12]}): the workload, model or optimizer differ; resume with the run's own config")
    return m


def read_step(d: Path, manifest: dict[str, Any]) -> list[Snapshot]:
    """Every rank file of a committed step, each checked against the manifest's checksum and its own."""
    out = []
    for f in manifest["files"]:
        p = d / f["file"]
        try:
            data = p.read_bytes()
        except OSError as e:
            raise SnapshotError(f"checkpoint {d}: shard {f['file']} is missing or unreadable ({e.strerror})") from None
        if hashlib.sha256(data).hexdigest() != f["sha256"]:
            raise SnapshotError(f"checkpoint {d}: shard {f['file']} does not match its manifest checksum (corrupt "
                                "or replaced)")
        try:
            tensors, meta = read_tensor_file(p)
        except TensorFileError as e:
            raise SnapshotError(str(e)) from None
        if meta.get("rank") != f["rank"] or meta.get("step") != manifest["step"]:
            raise SnapshotError(f"checkpoint {d}: shard {f['file']} says rank {meta.get('rank')!r:.10} step "
                                f"{meta.get('step')!r:.10}, its manifest rank {f['rank']} step {manifest['step']}")
        out.append((tensors, meta))
    return out


def load(root: str | os.PathLike, replica: Replica, strategy: Any, mesh: Any, config_digest: str | None
         ) -> Loaded | None:
    """Restore the newest committed checkpoint under `root` that verifies and fits, re-cut for this replica's layout.
    A collective over `mesh.world`. None if there is no committed checkpoint; SnapshotError if every one is rejected;
    CheckpointMismatchError for another config's."""
    rejected: list[tuple[str, str]] = []
    found: Loaded | None = None
    for step, d in committed_steps(root):
        try:
            manifest = read_manifest(d, config_digest)
            sources = read_step(d, manifest)
            old_world = len(sources)
            rank = mesh.world.rank
            load_pieces(replica, strategy, sources, rng_from=rank if rank < old_world else 0, where=f"checkpoint {d}",
                        local_from=rank if old_world == mesh.world.world_size else None)
        except SnapshotError as e:
            log.warning("rejected checkpoint %s: %s", d, e)
            rejected.append((str(d), str(e)))
            continue
        if rejected:
            log.warning("resuming from the older checkpoint %s (step %d)", d, step)
        found = Loaded(step, d, rejected)
        break
    _agree(mesh, -1 if found is None else found.step)
    if found is None and rejected:
        raise SnapshotError(f"no valid checkpoint under {root}: " + "; ".join(r for _, r in rejected))
    return found


def _agree(mesh: Any, step: int) -> None:
    """Every rank must have restored the same step (else some would train on other weights)."""
    if mesh.world.world_size == 1:
        return
    t = torch.tensor([float(step), -float(step)], dtype=torch.float64)
    mesh.world.all_reduce(t, op="max")
    if int(t[0]) != step or int(-t[1]) != step:
        raise EngineError(f"ranks restored different checkpoints (steps {int(-t[1])} to {int(t[0])}); the files "
                          "changed while loading, or not every rank sees the same directory")
