"""The job controller's connection to its shards: authenticated as "admin", it may init (as the owner would),
read stats, checkpoint and shut the shards down -- the operations a worker's connection is refused (ps.admission).

    with servers.admin() as admin:               # ServerGroup.admin(): same addresses, the group's secret
        admin.checkpoint().result()              # Future[list of {path, version}]
        admin.set_members([0, 1, 3], version=1).result()   # worker 2 is gone: the gates stop waiting for it
        admin.shutdown_servers()

An admin client does not register (it is no worker: no clock, no push, no pull, no shared-memory path); connecting
pings every shard, so a refused credential is an AuthenticationError at once.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Mapping, NoReturn, Sequence

from .admission import ADMIN
from .client import PSClient
from .errors import ConfigError, PSError
from .futures import reply_metas

_NO_MODEL = {"(no model)": (1,)}        # an admin client made without params only needs some partition


class AdminClient(PSClient):
    """A PSClient authenticated as "admin" (see the module docstring)."""

    def __init__(self, addresses: Sequence[str], params: Mapping[str, Any] | None = None, *, timeout: float = 60.0,
                 secret: str | None = None, curve_keys_dir: str | None = None) -> None:
        self._model = params is not None
        super().__init__(addresses, -1, params if params is not None else _NO_MODEL, timeout=timeout, shm=False,
                         curve_keys_dir=curve_keys_dir, secret=secret, user=ADMIN)

    def _register(self) -> list[tuple[dict[str, Any], Any]]:
        """No registration: ping every shard, which proves the handshake."""
        self._all("ping").result(self.timeout + 1)     # a refused handshake: AuthenticationError (ps.client)
        return []

    def init(self, params: Mapping[str, Any]) -> Future:
        if not self._model:
            raise ConfigError("this admin client was made without params=: pass the model's parameters (or shapes) "
                              "to connect_admin to init the shards")
        return super().init(params)

    def checkpoint(self) -> Future:
        """Ask every shard to write a checkpoint now; Future[list of {path, version}]."""
        return self._all("checkpoint", finish=reply_metas)

    def set_members(self, alive: Sequence[int], version: int) -> Future:
        """Make `alive` the workers every shard waits for, as membership `version` (> the last one; repeating the
        same version and set is a no-op). Removed workers' registrations are dropped and the reads and clocks that
        waited only for them go on; a re-admitted worker starts at the committed clock (aggregating policies) or the
        slowest live clock, after its resync(). Future[list of per shard {members, version, committed, clocks,
        shard_version}]."""
        return self._all("members", {"alive": [int(w) for w in alive], "version": int(version)},
                         finish=reply_metas)

    def shutdown_servers(self, timeout: float = 10.0) -> None:
        """Ask every shard to checkpoint (if configured) and exit."""
        self._all("shutdown", timeout=timeout).result(timeout + 1)

    def _no(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise PSError("an admin client does not push or pull (it is no worker): use ps.connect as a worker")

    pull = push = push_pull = resync = grad_buffers = _no


def connect_admin(addresses: Sequence[str], params: Mapping[str, Any] | None = None, *, secret: str | None = None,
                  timeout: float = 60.0, curve_keys_dir: str | None = None) -> AdminClient:
    """Connect to the shards at `addresses` (shard order) as the job's admin. `params` (names -> tensors or shapes)
    only if this client will `init` them; `secret`: the job secret (None: PSLAB_JOB_SECRET / _FILE)."""
    return AdminClient(addresses, params, timeout=timeout, secret=secret, curve_keys_dir=curve_keys_dir)
