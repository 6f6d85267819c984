"""Who may do what on a shard: identities proven at the handshake, roles bound to connections.

Authentication is ZeroMQ's, done once per connection (`collectives.auth`): a shard's ROUTER socket is a PLAIN
server whose ZAP handler knows exactly the users "worker:0" .. "worker:<W-1>" and "admin", each with the password
credential(secret, user) = HMAC-SHA256(job secret, user). With CURVE (`curve_keys_dir`, required beyond loopback)
the shard keeps the cluster key pair as its identity and admits exactly the role key pairs derived from the secret
for the same users, so there too a connection proves a role. A socket without a valid credential never completes
the handshake: none of its messages reaches the shard. Every message then carries the user its connection proved
(the frame property "User-Id"), and the shard checks each request against it:

    register as w          only if User-Id == "worker:w" (and header src == w)
    push, pull             only on a registered connection, as the worker it registered as (header src == w)
    init                   only the designated owner: registered worker 0, or "admin"; once (a second one is an
                           AlreadyInitializedError)
    checkpoint, shutdown,  only "admin" (the job's controller: whoever started the shards)
    members
    stats, ping            any authenticated connection

One live registration per worker id: a second connection registering as w is refused (DuplicateWorkerError)
unless it carries the token the registered client chose (the same client on a new connection), or the registered
connection is gone. A connection is "gone" when a message to it cannot be routed (ROUTER_MANDATORY: the peer's
pipe is closed); quiet connections are probed every `sweep_interval` with a seq-0 notice that clients ignore, so a
vanished peer's registration, parked reads and shared-memory link are freed within about a second.

Limits of the model: the job's members hold the secret, so a hostile member could derive any credential; the
roles guard against mistakes and stale processes inside the job, the handshake against everyone outside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .errors import AccessDeniedError, ConfigError, DuplicateWorkerError, NotRegisteredError, ProtocolError
from .protocol import ADMIN_OPS

from pslab.collectives import auth
from pslab.collectives.auth import credential, curve_client, curve_server, new_job_secret, plain_client, plain_server
from pslab.collectives.errors import AuthError

ADMIN = "admin"
TOKEN_MAX = 64


def worker_user(worker: int) -> str:
    """The PLAIN user name of data-parallel worker `worker`."""
    return f"worker:{worker}"


def shard_users(num_workers: int) -> list[str]:
    """Every user a shard serving `num_workers` workers admits."""
    return [worker_user(w) for w in range(num_workers)] + [ADMIN]


def job_secret() -> str | None:
    """PSLAB_JOB_SECRET, else the content of PSLAB_JOB_SECRET_FILE (a 0600 file), else None; ConfigError if unusable."""
    try:
        return auth.job_secret()
    except AuthError as e:
        raise ConfigError(str(e)) from None


_STARTED: dict[str, str] = {}     # address -> the secret of a shard this process started (ps.start_servers)


def remember_secret(addresses: Iterable[str], secret: str) -> None:
    """Note that the shards at `addresses` were started here with `secret` (so a client in this process finds it)."""
    for a in addresses:
        _STARTED[a] = secret


def forget_secret(addresses: Iterable[str]) -> None:
    for a in addresses:
        _STARTED.pop(a, None)


def secret_for(addresses: Iterable[str]) -> str | None:
    """The secret to connect to `addresses` with when none is given: that of shards this process started there
    (all the same one), else the job's (`job_secret`). Nothing is written to the environment."""
    known = {_STARTED.get(a) for a in addresses}
    if len(known) == 1 and None not in known:
        return known.pop()
    return job_secret()


def check_secret(secret: Any) -> str:
    """`secret` if it is a usable job secret (>= 32 printable characters, no spaces), else a ConfigError."""
    if secret is None:
        raise ConfigError("a shard needs the job's secret: pass secret= (start_servers makes one), --secret-file, "
                          "or set PSLAB_JOB_SECRET / PSLAB_JOB_SECRET_FILE")
    s = secret.strip() if isinstance(secret, str) else ""
    if len(s) < 32 or not s.isprintable() or " " in s:
        raise ConfigError("the job secret must be at least 32 printable characters without spaces (e.g. "
                          "pslab.collectives.auth.new_job_secret())")
    return s


@dataclass
class Peer:
    """What a shard knows about one authenticated connection."""

    user: str | None
    last_seen: float
    worker: int | None = None        # the worker id it registered as
    last_seq: int = 0


class Admission:
    """One shard's connections: who each one is, what it registered as, what it may do."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.peers: dict[bytes, Peer] = {}
        self.holder: dict[int, bytes] = {}      # worker -> identity of its registered connection
        self.tokens: dict[int, str] = {}        # worker -> the token its registered client chose

    # ------------------------------------------------------------------ identities
    def seen(self, identity: bytes, user: str | None, now: float) -> Peer:
        p = self.peers.get(identity)
        if p is None:
            p = self.peers[identity] = Peer(user, now)
        p.last_seen = now
        return p

    @staticmethod
    def is_admin(user: str | None) -> bool:
        return user == ADMIN

    @property
    def registered(self) -> dict[bytes, int]:
        """identity -> worker id, for every registered connection."""
        return {i: p.worker for i, p in self.peers.items() if p.worker is not None}

    # ------------------------------------------------------------------ checks
    def check(self, identity: bytes, op: str, src: int) -> Peer:
        """Raise AccessDeniedError / ProtocolError unless this connection may send `op` now (changes nothing)."""
        p = self.peers[identity]
        if op in ADMIN_OPS:
            if not self.is_admin(p.user):
                raise AccessDeniedError(f"{op} needs the job's admin credential; this connection is {p.user!r} "
                                        "(use ps.connect_admin or ServerGroup.admin())")
        elif op == "init":
            if not (self.is_admin(p.user) or (p.worker == 0 and src == 0)):
                raise AccessDeniedError(f"init is for the designated owner (worker 0 or admin); this connection is "
                                        f"{p.user!r}" + (f", registered as worker {p.worker}" if p.worker is not None
                                                         else ", not registered"))
        elif op in ("pull", "push"):
            if p.worker is None:
                raise NotRegisteredError(f"{op} from an unregistered connection; send 'register' with your worker id "
                                         "first (after a shard restart: client.resync())")
            if src != p.worker:
                raise AccessDeniedError(f"{op} claims worker {src} but this connection registered as worker "
                                        f"{p.worker}")
        return p

    def check_register(self, identity: bytes, worker: int, src: int, token: Any, alive: Callable[[bytes], bool]
                       ) -> list[bytes]:
        """Whether this connection may register as `worker` (AccessDeniedError / DuplicateWorkerError if not);
        returns the connections this registration replaces (the same client's old one, or a vanished one).
        Changes nothing: `bind` does, once everything else about the request is checked."""
        p = self.peers[identity]
        if p.user == ADMIN:
            raise AccessDeniedError("an admin connection does not register as a worker")
        if p.user != worker_user(worker) or src != worker:
            raise AccessDeniedError(f"this connection is authenticated as {p.user!r} and may not register as "
                                    f"worker {worker} (header src {src})")
        if token is not None and not (isinstance(token, str) and 0 < len(token) <= TOKEN_MAX):
            raise ProtocolError(f"register field 'token' must be a string of at most {TOKEN_MAX} chars")
        cur = self.holder.get(worker)
        if cur is None or cur == identity:
            return []
        same_client = token is not None and self.tokens.get(worker) == token
        if not same_client and alive(cur):
            raise DuplicateWorkerError(f"worker {worker} is already registered on another live connection; close "
                                       "that client first (or connect as another worker)")
        return [cur]

    def bind(self, identity: bytes, worker: int, token: str | None) -> None:
        """Register this connection as `worker` (after `check_register` and forgetting what it returned)."""
        p = self.peers[identity]
        p.worker = worker
        self.holder[worker] = identity
        if token is not None:
            self.tokens[worker] = token
        else:
            self.tokens.pop(worker, None)

    def forget(self, identity: bytes) -> None:
        """Drop everything known about a connection (it unregistered or is gone)."""
        p = self.peers.pop(identity, None)
        if p is not None and p.worker is not None and self.holder.get(p.worker) == identity:
            del self.holder[p.worker]
            self.tokens.pop(p.worker, None)

    def quiet(self, now: float, after: float) -> list[bytes]:
        """Connections that sent nothing for `after` seconds (candidates for a liveness probe)."""
        return [i for i, p in self.peers.items() if now - p.last_seen > after]


__all__ = ["ADMIN", "Admission", "Peer", "check_secret", "credential", "curve_client", "curve_server", "job_secret",
           "remember_secret", "forget_secret", "secret_for",
           "new_job_secret", "plain_client", "plain_server", "shard_users", "worker_user"]
