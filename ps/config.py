"""`ServerConfig`: everything one shard server needs, validated in one place (ps.server serves it, ps.processes
starts one process per config, `pslab server` builds one from its flags). Authentication: every shard requires
credentials derived from the job's secret (`secret`, else PSLAB_JOB_SECRET[_FILE]): ZeroMQ PLAIN, or CURVE when
`curve_keys_dir` is given (ps.admission says who may do what)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from dataclasses import dataclass, field
from typing import Any, Mapping

from pslab.collectives.curve import is_loopback

from .admission import check_secret, job_secret
from .consistency import policy_from_string
from .errors import CheckpointError, ConfigError
from .optim import OptimizerSpec, optimizer_from_string

NONFINITE_POLICIES = ("reject", "skip")


def check_writable_dir(directory: str) -> None:
    """Make `directory` (and its parents) and prove it writable by creating and removing a probe file; ConfigError
    naming the cause otherwise (a parent that is a regular file, a read-only file system, no permission). Root
    passes every os.access check, so only a real write tells."""
    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=d, prefix=".pslab-probe-"):
            pass
    except OSError as e:
        raise ConfigError(f"checkpoint_dir {directory!r} is not a writable directory ({e.strerror or e}): choose "
                          "another directory") from None


@dataclass
class ServerConfig:
    """Everything a shard server needs; `bind` may end in ":0" (tcp) to pick a free port.

    `optimizer` takes an `OptimizerSpec` or its string form ("adam:lr=1e-3"); either way the config holds the
    parsed `OptimizerSpec` from construction on (a bad string raises ConfigError here).
    """

    bind: str = "tcp://127.0.0.1:0"
    shard_id: int = 0
    num_workers: int = 1
    policy: str = "asp"
    optimizer: OptimizerSpec | str = "sgd:lr=0.01"
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0             # versions between automatic checkpoints (0: only on demand)
    request_timeout: float = 120.0        # longest a pull may wait on the gate (0: forever)
    idle_timeout: float = 0.0             # exit after this many seconds without any message (0: never)
    max_message_bytes: int = 1 << 31
    shm: bool = True                      # offer same-host clients the shared-memory payload path (shm_path.py)
    curve_keys_dir: str | None = None     # CURVE encryption + authentication (required to bind beyond loopback)
    secret: str | None = field(default=None, repr=False)  # the job secret; None: PSLAB_JOB_SECRET[_FILE]
    nonfinite: str = "reject"             # a push holding NaN/Inf: "reject" (error reply) | "skip" (drop, ack)
    max_shm_links: int = 0                # shared-memory links held at once (0: one per worker)
    sweep_interval: float = 1.0           # seconds between liveness checks of quiet connections
    shm_idle_timeout: float = 30.0        # free a link's reply segment unused this long (re-made on demand)
    restore_max_version: int | None = None  # restore the newest checkpoint of at most this version (a slot
                                            # group's common restore point, ps.processes); None: the newest

    def __post_init__(self) -> None:
        self.optimizer = optimizer_from_string(self.optimizer)

    @property
    def spec(self) -> OptimizerSpec:
        """`optimizer`, typed as the `OptimizerSpec` it holds (parsed if a string was assigned after construction)."""
        return optimizer_from_string(self.optimizer)

    def validate(self) -> None:
        """Raise ConfigError naming the fix if this config cannot be served (policy, optimizer, bind, checkpoints)."""
        policy_from_string(self.policy)
        self.optimizer = optimizer_from_string(self.optimizer)
        if not (self.bind.startswith("tcp://") or self.bind.startswith("ipc://")):
            raise ConfigError(f"bind address {self.bind!r} must start with tcp:// or ipc://")
        if self.num_workers < 1 or self.shard_id < 0 or self.checkpoint_every < 0:
            raise ConfigError("num_workers must be >= 1, shard_id >= 0 and checkpoint_every >= 0")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ConfigError("checkpoint_every needs checkpoint_dir")
        if self.request_timeout < 0 or self.idle_timeout < 0:
            raise ConfigError(f"request_timeout and idle_timeout are seconds >= 0 (0: never), got "
                              f"{self.request_timeout!r} and {self.idle_timeout!r}")
        if self.bind.startswith("tcp://"):
            port = self.bind.rsplit(":", 1)[-1]
            if not (port.isdigit() and 0 <= int(port) <= 65535):
                raise ConfigError(f"bind address {self.bind!r} needs a port 0..65535 (0: pick a free one)")
        elif not os.path.isdir(os.path.dirname(self.bind[len("ipc://"):]) or "."):
            raise ConfigError(f"bind address {self.bind!r}: the directory of the ipc path does not exist")
        if self.checkpoint_dir:
            check_writable_dir(self.checkpoint_dir)
        if self.restore_max_version is not None and not (isinstance(self.restore_max_version, int)
                                                         and self.restore_max_version >= 0):
            raise ConfigError(f"restore_max_version must be None or an integer >= 0; got {self.restore_max_version!r}")
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ConfigError(f"nonfinite must be one of {', '.join(NONFINITE_POLICIES)}; got {self.nonfinite!r}")
        if not (self.max_shm_links >= 0 and self.sweep_interval > 0 and self.shm_idle_timeout >= 0):
            raise ConfigError("max_shm_links must be >= 0 (0: one per worker), sweep_interval > 0 and "
                              "shm_idle_timeout >= 0 seconds")
        self.secret = check_secret(self.secret if self.secret is not None else job_secret())
        host = self.bind[len("tcp://"):].rsplit(":", 1)[0] if self.bind.startswith("tcp://") else "127.0.0.1"
        if not is_loopback(host) and not self.curve_keys_dir:
            raise ConfigError(f"binding to {self.bind} exposes the shard beyond this host: give curve_keys_dir "
                              "(--curve-keys DIR; make one with collectives.curve.generate_keys and copy it to every "
                              "host), or bind to 127.0.0.1")

    def check_checkpoint(self, path: Any, meta: Mapping[str, Any]) -> None:
        """Raise CheckpointError (naming the fix) if the checkpoint at `path` (its `meta`) was written by another
        shard, for another number of workers, or under another policy or optimizer than this config's."""
        if meta.get("shard_id") != self.shard_id or meta.get("num_workers") != self.num_workers:
            raise CheckpointError(f"checkpoint {path} is for shard {meta.get('shard_id')} with "
                                  f"{meta.get('num_workers')} workers, not shard {self.shard_id} with "
                                  f"{self.num_workers}; use another checkpoint directory")
        if str(policy_from_string(self.policy)) != meta.get("policy"):
            raise CheckpointError(f"checkpoint {path} was written under policy {meta.get('policy')}, but this "
                                  f"server runs {self.policy}; use the same policy or another directory")
        written = dict(meta["optimizer"]["spec"])
        written.setdefault("staleness_rule", "mean")     # written before the rule was a field: the rule of then
        if not written.get("staleness_lr"):               # (without staleness_lr the rule changes nothing)
            written["staleness_rule"] = self.spec.staleness_rule
        if self.spec.to_dict() != written:
            raise CheckpointError(f"checkpoint {path} was written with optimizer "
                                  f"{OptimizerSpec.from_dict(meta['optimizer']['spec']).to_string()}, but this "
                                  f"server runs {self.spec.to_string()}; use the same optimizer or another directory")
