"""From a checkpoint file back to a `ShardState`, trusting nothing in the file.

`ps.checkpoint.load_checkpoint` has already checked the container (magic, checksum, every tensor descriptor).
Here every field of the shard's metadata is checked against the schema `ShardState.state_dict` writes, and against
the tensors present, before `ShardState.from_state_dict` sees it:

    version, committed, shard_id, reads, pushes     integers >= 0;  num_workers an integer in [1, 2^20]
    policy                                          a policy string;  committed <= version
    clocks                                          num_workers integers >= 0
    shapes      {name: shape}, each with a floating-point tensor param\\0<name> of prod(shape) elements
    optimizer   {spec: an OptimizerSpec dict, steps: int >= 0, state: {key\\0slot: {value} | {shape}}}, each
                {shape} slot with its tensor opt\\0key\\0slot of that many elements (and DC's mean squares)
    pending     [[clock, worker, read_version(, skipped)] ...]: worker in range, read_version <= version, one
                tensor pend\\0clock\\0worker\\0name per parameter unless skipped
    backups     distinct worker ids, each with one tensor bak\\0worker\\0name per parameter
    stats       {hist, per_worker, wait_seconds, dropped}: integer-like keys (workers in range), numbers >= 0
    members, membership_version   optional: distinct worker ids in range (at least one); an integer >= 0

Anything else is a `CheckpointError` naming the file and the field; `restore_state` also refuses a checkpoint of
another shard, worker count, policy or optimizer (`ServerConfig.check_checkpoint`), and turns any failure left in
`from_state_dict` into a CheckpointError. `restore_latest` (ps.checkpoint) then falls back to an older file.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

import torch

from .checkpoint import restore_latest
from .config import ServerConfig
from .consistency import policy_from_string
from .errors import CheckpointError, ConfigError
from .optim import OptimizerSpec
from .shard import ShardState

MAX_WORKERS = 1 << 20


class _Check:
    def __init__(self, path: Any, tensors: Mapping[str, torch.Tensor]) -> None:
        self.path, self.tensors = path, tensors

    def fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {self.path}: {what}; resuming from an older checkpoint if there is one")

    def int(self, value: Any, name: str, lo: int = 0, hi: int = 1 << 62) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise self.fail(f"meta field {name} must be an integer in [{lo}, {hi}], got {value!r:.40}")
        return value

    def number(self, value: Any, name: str) -> float:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < math.inf:
            raise self.fail(f"meta field {name} must be a finite number >= 0, got {value!r:.40}")
        return float(value)

    def map(self, value: Any, name: str) -> Mapping[Any, Any]:
        if not isinstance(value, dict):
            raise self.fail(f"meta field {name} must be a map, got {type(value).__name__}")
        return value

    def list(self, value: Any, name: str) -> list[Any]:
        if not isinstance(value, list):
            raise self.fail(f"meta field {name} must be a list, got {type(value).__name__}")
        return value

    def key(self, value: Any, name: str, hi: int = 1 << 62) -> int:
        """A map key that must be an integer (msgpack may keep it as one, or as its decimal string)."""
        if isinstance(value, str) and value.isdigit():
            value = int(value)
        return self.int(value, f"{name} key", 0, hi)

    def tensor(self, name: str, numel: int, floating: bool = False) -> None:
        t = self.tensors.get(name)
        printable = name.replace("\x00", "/")
        if t is None:
            raise self.fail(f"tensor {printable!r} is missing")
        if t.numel() != numel:
            raise self.fail(f"tensor {printable!r} has {t.numel()} elements, its shape says {numel}")
        if floating and not t.is_floating_point():
            raise self.fail(f"tensor {printable!r} has dtype {t.dtype}; parameters are floating point")


def check_state(path: Any, tensors: Mapping[str, torch.Tensor], meta: Any) -> None:
    """Raise CheckpointError unless (tensors, meta) is a complete, well-typed ShardState state_dict."""
    c = _Check(path, tensors)
    meta = c.map(meta, "meta")
    version = c.int(meta.get("version"), "version")
    workers = c.int(meta.get("num_workers"), "num_workers", 1, MAX_WORKERS)
    c.int(meta.get("shard_id"), "shard_id")
    committed = c.int(meta.get("committed"), "committed", 0, version)
    for name in ("reads", "pushes"):
        if name in meta:
            c.int(meta[name], name)
    if not isinstance(meta.get("policy"), str):
        raise c.fail(f"meta field policy must be a string, got {type(meta.get('policy')).__name__}")
    try:
        policy_from_string(meta["policy"])
    except ConfigError as e:
        raise c.fail(f"meta field policy: {e}") from None
    clocks = c.list(meta.get("clocks"), "clocks")
    if len(clocks) != workers:
        raise c.fail(f"meta field clocks holds {len(clocks)} clocks for {workers} workers")
    for i, clock in enumerate(clocks):
        c.int(clock, f"clocks[{i}]")
    shapes = c.map(meta.get("shapes"), "shapes")
    if not shapes:
        raise c.fail("meta field shapes is empty: a shard holds at least one parameter")
    numel: dict[str, int] = {}
    for name, shape in shapes.items():
        if not isinstance(name, str) or not isinstance(shape, list) or len(shape) > 8:
            raise c.fail(f"meta field shapes must map names to shapes (lists of at most 8 ints), got {name!r:.40}")
        numel[name] = math.prod(c.int(s, f"shapes[{name!r:.40}]") for s in shape)
        c.tensor(f"param\x00{name}", numel[name], floating=True)
    _check_optimizer(c, c.map(meta.get("optimizer"), "optimizer"), numel)
    for i, entry in enumerate(c.list(meta.get("pending"), "pending")):
        if not (isinstance(entry, list) and len(entry) in (3, 4)):
            raise c.fail(f"meta field pending[{i}] must be [clock, worker, read_version(, skipped)]")
        clock, w = c.int(entry[0], f"pending[{i}] clock"), c.int(entry[1], f"pending[{i}] worker", 0, workers - 1)
        c.int(entry[2], f"pending[{i}] read_version", 0, version)
        if clock < committed:
            raise c.fail(f"meta field pending[{i}] buffers clock {clock}, already committed ({committed})")
        if len(entry) == 3 or not entry[3]:
            for name, n in numel.items():
                c.tensor(f"pend\x00{clock}\x00{w}\x00{name}", n)
    backups = c.list(meta.get("backups"), "backups")
    if len(set(map(repr, backups))) != len(backups):
        raise c.fail("meta field backups names a worker twice")
    for w in backups:
        c.int(w, "backups[]", 0, workers - 1)
        for name, n in numel.items():
            c.tensor(f"bak\x00{w}\x00{name}", n)
    _check_stats(c, c.map(meta.get("stats"), "stats"), workers)
    if "membership_version" in meta:                 # optional (older checkpoints: every worker a member)
        c.int(meta["membership_version"], "membership_version")
    if "members" in meta:
        members = c.list(meta["members"], "members")
        if not members or len(set(map(repr, members))) != len(members):
            raise c.fail("meta field members must list distinct worker ids, at least one")
        for w in members:
            c.int(w, "members[]", 0, workers - 1)


def _check_optimizer(c: _Check, opt: Mapping[str, Any], numel: Mapping[str, int]) -> None:
    try:
        spec = OptimizerSpec.from_dict(c.map(opt.get("spec"), "optimizer.spec"))
    except (ConfigError, TypeError, ValueError) as e:
        raise c.fail(f"meta field optimizer.spec: {e}") from None
    c.int(opt.get("steps", 0), "optimizer.steps")
    for full, info in c.map(opt.get("state", {}), "optimizer.state").items():
        key, sep, slot = full.partition("\x00") if isinstance(full, str) else ("", "", "")
        if not sep or key not in numel:
            raise c.fail(f"meta field optimizer.state names {str(full).replace(chr(0), '/')!r:.60}, not a parameter's "
                         "slot")
        info = c.map(info, f"optimizer.state[{key!r:.40}]")
        if "value" in info:
            if not isinstance(info["value"], (int, float)) or isinstance(info["value"], bool):
                raise c.fail(f"meta field optimizer.state[{key!r:.40}] value must be a number")
        elif isinstance(info.get("shape"), list):
            c.tensor(f"opt\x00{full}", math.prod(c.int(s, "optimizer state shape") for s in info["shape"]))
        else:
            raise c.fail(f"meta field optimizer.state[{key!r:.40}] needs a value or a shape")
    if spec.delay_compensated and spec.dc_adaptive:
        for name, n in numel.items():
            c.tensor(f"opt\x00{name}\x00dc_mean_square", n)


def _check_stats(c: _Check, stats: Mapping[str, Any], workers: int) -> None:
    for k, v in c.map(stats.get("hist", {}), "stats.hist").items():
        c.key(k, "stats.hist")
        c.int(v, "stats.hist count")
    for w, hist in c.map(stats.get("per_worker", {}), "stats.per_worker").items():
        c.key(w, "stats.per_worker", workers - 1)
        for k, v in c.map(hist, "stats.per_worker[]").items():
            c.key(k, "stats.per_worker[]")
            c.int(v, "stats.per_worker count")
    for w, x in c.map(stats.get("wait_seconds", {}), "stats.wait_seconds").items():
        c.key(w, "stats.wait_seconds", workers - 1)
        c.number(x, "stats.wait_seconds[]")
    for w, x in c.map(stats.get("dropped", {}), "stats.dropped").items():
        c.key(w, "stats.dropped", workers - 1)
        c.int(x, "stats.dropped[]")


def restore_state(config: ServerConfig | None, path: Any, tensors: Mapping[str, torch.Tensor],
                  meta: Any) -> ShardState:
    """The ShardState a checkpoint holds, if it is valid and (given a config) written by this shard's config."""
    check_state(path, tensors, meta)
    if config is not None:
        config.check_checkpoint(path, meta)
    try:
        return ShardState.from_state_dict(tensors, meta)
    except (CheckpointError, ConfigError) as e:
        raise CheckpointError(f"checkpoint {path} cannot be restored: {e}") from None
    except Exception as e:  # a combination the schema does not cover: still one line, still a fallback
        raise CheckpointError(f"checkpoint {path} cannot be restored ({type(e).__name__}: {e})") from None


def restore(config: ServerConfig) -> tuple[Path, ShardState, list[list[str]]] | None:
    """The newest valid checkpoint in config.checkpoint_dir as (path, state, rejected newer files), or None; with
    config.restore_max_version, the newest one of at most that version (newer ones are passed over)."""
    if not config.checkpoint_dir:
        return None
    bound = config.restore_max_version

    def build(p: Path, tensors: Mapping[str, torch.Tensor], meta: Any) -> ShardState:
        if bound is not None and isinstance(meta, Mapping) and isinstance(meta.get("version"), int) \
                and meta["version"] > bound:
            raise CheckpointError(f"version {meta['version']} is past the restore point {bound} (a slot group "
                                  "restarted together resumes from its newest common checkpoint)")
        return restore_state(config, p, tensors, meta)
    return restore_latest(config.checkpoint_dir, build)


def load_state(path: str | Path, config: ServerConfig | None = None) -> ShardState:
    """One checkpoint file as a ShardState (CheckpointError if anything in it is wrong)."""
    from .checkpoint import load_checkpoint
    return restore_state(config, Path(path), *load_checkpoint(path))
