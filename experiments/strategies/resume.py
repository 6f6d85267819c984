"""Engine checkpoints in a run, and `pslab run --resume RUN_DIR`: the glue between the loop, the runner and
`parallelism.state_io` (sharded save, manifest commit, re-cut on load).

In the loop (every rank; strategies allreduce with every engine, and local):

    step = resume.start(cfg, run_path, replica, strategy, mesh)        after strategy.attach: 0, or the step restored
    resume.maybe_save(cfg, run_path, step, replica, strategy, mesh)    after each step (step = steps done so far)

`maybe_save` writes RUN_DIR/checkpoints/step-<n>/ every `faults.checkpoint_every` steps (the last 2 commits are
kept). `start` restores the newest committed checkpoint that verifies, if the run directory has one (a fresh run
directory never does): bitwise on the same layout, re-cut on another. Parameter-server runs (ps-*) checkpoint their
shards instead (`faults.shard_checkpoint_every`); `faults.checkpoint_every` is refused for them.

Resuming (`resume_config`, then `runner.execute(..., resume=rd)` which calls `prepare` and `append_parts`): the run's
own config.toml plus `--set` overrides that change the layout or the length (train.workers, parallel.*, train.steps,
train.backend, ...). Overrides of what the checkpoint's state depends on (IDENTITY: the workload, its batch size and
seed, the optimizer; FIXED adds the sequence length and the MoE settings) are refused; so is a manifest whose config digest is another. At a new data-parallel size
D' the run goes on as a D'-worker run from the restored step s: each worker keeps workload.batch_size examples per
step (the global batch becomes D' x batch_size), the training set is split into D' worker shards (`BatchSchedule`),
worker w takes batch(w, s), batch(w, s + 1), ..., and the step's learning rate follows train.lr_rule for D'
(linear: lr x D') — the optimizer's state (momentum, Adam moments and step) is restored, its lr is not.
Records are appended: metrics and eval records after the checkpoint's step (the steps that will be redone) are
dropped, the resumed run's times continue from the last kept record, and summary.json is rewritten at the end.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pslab.collectives import trace
from pslab.experiments.config import RunConfig, load_config
from pslab.experiments.errors import ConfigError
from pslab.experiments.results.rundir import RunDir, read_jsonl, write_jsonl

IDENTITY = (("workload", "name"), ("workload", "batch_size"), ("workload", "seed"), ("train", "optimizer"))
# refused on resume too (the model's shape or its training loss), but not in the digest (older checkpoints verify)
FIXED = IDENTITY + tuple(("workload", k) for k in ("seq_len", "experts", "top_k", "capacity_factor", "aux_weight"))
KEEP = 2
log = logging.getLogger("pslab.experiments.resume")


def checkpoint_root(run_path: str | Path) -> Path:
    return Path(run_path) / "checkpoints"


def config_digest(cfg: RunConfig) -> str:
    """sha256 of the settings a checkpoint's state depends on (IDENTITY): its manifest must carry the same."""
    ident = {f"{s}.{k}": getattr(getattr(cfg, s), k) for s, k in IDENTITY}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def _layout(cfg: RunConfig, replica: Any, mesh: Any) -> dict[str, Any]:
    from pslab.parallelism.state_io import layout_of
    return layout_of(replica, mesh, strategy=cfg.train.strategy, zero=cfg.parallel.zero, workers=cfg.train.workers)


def start(cfg: RunConfig, run_path: str | Path, replica: Any, strategy: Any, mesh: Any) -> int:
    """The step to start at: 0 for a fresh run; the restored step if RUN_DIR/checkpoints holds a committed
    checkpoint (a collective: every rank calls it). Raises CheckpointMismatchError / SnapshotError (one line)."""
    from pslab.parallelism.state_io import committed_steps, load
    root = checkpoint_root(run_path)
    if cfg.strategy.uses_ps or not committed_steps(root):
        return 0
    loaded = load(root, replica, strategy, mesh, config_digest(cfg))
    return 0 if loaded is None else loaded.step


def maybe_save(cfg: RunConfig, run_path: str | Path, step: int, replica: Any, strategy: Any, mesh: Any) -> bool:
    """Checkpoint after `step` steps if faults.checkpoint_every divides it (a collective); True if it saved."""
    every = cfg.faults.checkpoint_every
    if every <= 0 or step <= 0 or step % every or cfg.strategy.uses_ps:
        return False
    from pslab.parallelism.state_io import save
    with trace.span("checkpoint", "io", step=step):
        save(checkpoint_root(run_path), step, replica, strategy, mesh, config_digest(cfg),
             _layout(cfg, replica, mesh), keep=KEEP)
    return True


# ---- the runner's side: `pslab run --resume RUN_DIR` ----------------------------------------------------------------

def resume_config(run_dir: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """RUN_DIR's config.toml with `overrides` applied and without its injected faults (they happened; give new ones
    with --set faults.events=...); ConfigError (one line) if an override changes what the checkpoints depend on,
    if the run is a ps-* run, or if RUN_DIR holds no committed checkpoint."""
    from pslab.parallelism.state_io import committed_steps
    d = Path(run_dir)
    if not (d / "config.toml").is_file():
        raise ConfigError(f"--resume {d}: not a pslab run directory (no config.toml)")
    before = load_config(d / "config.toml")
    cfg = load_config(d / "config.toml", list(overrides))
    if not any(o.strip().startswith("faults.events") for o in overrides):
        cfg.faults.events = []          # the run's injected faults happened already; --set faults.events=... for new
        cfg.validate()
    for s, k in FIXED:
        old, new = getattr(getattr(before, s), k), getattr(getattr(cfg, s), k)
        if old != new:
            raise ConfigError(f"--resume: {s}.{k} = {new!r} differs from the run's {old!r}; a checkpoint continues "
                              "the same workload, model and optimizer (start a new run to change them)")
    if cfg.strategy.uses_ps:
        raise ConfigError(f"--resume continues engine checkpoints (allreduce, local); {cfg.strategy} runs restart "
                          "their shards from faults.shard_checkpoint_every checkpoints instead")
    if not committed_steps(checkpoint_root(d)):
        raise ConfigError(f"--resume {d}: no committed checkpoint under {checkpoint_root(d)} (run with "
                          "--set faults.checkpoint_every=<k> to write them)")
    return cfg


@dataclass
class ResumePlan:
    """Where the resumed run starts: the step, the global updates counted before it (at the old worker count), the
    time its records continue at, whether an evaluation at that step is kept from before."""

    step: int
    updates: int
    time_offset: float
    old_eval_at_step: bool


def newest_valid_step(cfg: RunConfig, run_path: str | Path) -> tuple[int, dict[str, Any]]:
    """(step, manifest) of the newest committed checkpoint whose files verify, without a model: what the ranks will
    restore (they also check it against the model). SnapshotError if none is valid."""
    from pslab.parallelism.snapshot import SnapshotError, check_snapshot
    from pslab.parallelism.state_io import committed_steps, read_manifest, read_step
    rejected = []
    for step, d in committed_steps(checkpoint_root(run_path)):
        try:
            manifest = read_manifest(d, config_digest(cfg))
            for i, (tensors, meta) in enumerate(read_step(d, manifest)):
                check_snapshot(tensors, meta, f"checkpoint {d} rank {i}")
        except SnapshotError as e:
            log.warning("rejected checkpoint %s: %s", d, e)
            rejected.append(str(e))
            continue
        return step, manifest
    raise SnapshotError(f"no valid checkpoint under {checkpoint_root(run_path)}: " + "; ".join(rejected))


def prepare(cfg: RunConfig, rd: RunDir) -> ResumePlan:
    """Before the resumed ranks start: pick the step, keep the records before it, record the resume in env.json and
    write the resumed config as config.toml (the previous one kept as config.before-step-<n>.toml)."""
    from pslab.experiments.config import to_toml
    step, manifest = newest_valid_step(cfg, rd.path)
    if cfg.train.steps <= step:
        raise ConfigError(f"--resume: train.steps = {cfg.train.steps} is not beyond the checkpoint's step {step}; "
                          f"pass --set train.steps=<n> with n > {step}")
    old_workers = int(manifest["layout"].get("workers", manifest["layout"].get("dp", 1)))
    rd.merge_parts("metrics")                       # what a killed run left in part files
    rd.merge_parts("eval")
    metrics = [r for r in read_jsonl(rd.metrics_path) if r.get("step", 0) < step]
    evals = [r for r in read_jsonl(rd.eval_path) if r.get("updates", 0) <= step * old_workers]
    write_jsonl(rd.metrics_path, metrics)
    write_jsonl(rd.eval_path, evals)
    offset = max([0.0] + [float(r.get("time_s", 0.0)) for r in metrics + evals])
    (rd.path / "summary.json").unlink(missing_ok=True)
    cfg_p = rd.path / "config.toml"
    kept = rd.path / f"config.before-step-{step}.toml"
    if not kept.exists():                           # (a second resume from the same step keeps the first's)
        cfg_p.replace(kept)
    cfg_p.write_text(to_toml(cfg.to_dict()))
    env_p = rd.path / "env.json"
    env = json.loads(env_p.read_text()) if env_p.is_file() else {}
    env.pop("interrupted", None)
    env.setdefault("resumed", []).append({"from_step": step, "argv": sys.argv,
                                          "workers": cfg.train.workers, "parallel": cfg.parallel.describe(),
                                          "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    env_p.write_text(json.dumps(env, indent=2))
    return ResumePlan(step, step * old_workers, offset,
                      any(r.get("updates") == step * old_workers for r in evals))


def append_parts(cfg: RunConfig, rd: RunDir, plan: ResumePlan) -> None:
    """After the resumed ranks ended, before the parts are merged: their times continue at the plan's offset, their
    evaluations count updates on from the plan's (the loop counts step x K at the new K), and the resumed run's
    evaluation of the restored weights is dropped where the first run's is kept."""
    at = plan.step * cfg.train.workers            # what the loop calls the restored point
    for kind in ("metrics", "eval"):
        for part in sorted(rd.path.glob(f"{kind}.w*.jsonl")):
            records = read_jsonl(part)
            for r in records:
                r["time_s"] = float(r.get("time_s", 0.0)) + plan.time_offset
            if kind == "eval":
                records = [{**r, "updates": plan.updates + r["updates"] - at} for r in records
                           if isinstance(r.get("updates"), int)
                           and (r["updates"] > at or (r["updates"] == at and not plan.old_eval_at_step))]
            write_jsonl(part, records)

