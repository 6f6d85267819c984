"""Who may talk to a job's sockets: a per-job secret, one credential per role, ZeroMQ PLAIN (or CURVE) via ZAP.

    secret = new_job_secret()                     # 32 random bytes, hex: made once by the launcher
    credential(secret, "rank:3")                  # = hex HMAC-SHA256(secret, "rank:3"): rank 3's password
    auth = plain_server(ctx, pull, secret, ["rank:0", "rank:1"])   # before bind; auth.stop() after close
    plain_client(push, secret, "rank:0")          # before connect

The secret reaches the processes of a job through their arguments or environment, never through the rendezvous
store: `collectives.launch` makes one and hands it to the ranks it starts (and exports `PSLAB_JOB_SECRET` in them);
under torchrun/SLURM every process reads `PSLAB_JOB_SECRET` or `PSLAB_JOB_SECRET_FILE` (a file of mode 0600).

The ZMTP handshake checks the credential once per connection (ZAP, handled by a thread per context), so messages
pay nothing for it; every message a socket receives then carries the authenticated user name as the frame
property "User-Id" (`frame.get("User-Id")` on a `copy=False` frame), which a receiver compares with the sender the
header claims. PLAIN sends the password in clear over the connection: fine on loopback and ipc (other accounts
cannot read them), and a client only connects to endpoints whose store record is signed with the secret (`sign`),
so it never hands its password to a stranger. Beyond loopback use CURVE: `curve_server`/`curve_client` keep the
cluster key pair of `collectives.curve` as the server's identity and give each role its own client key pair
derived from the secret, so there too the User-Id is the role.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import threading
import weakref
from collections.abc import Iterable

import zmq
from zmq.utils import z85

from .errors import AuthError

ENV_SECRET = "PSLAB_JOB_SECRET"
ENV_SECRET_FILE = "PSLAB_JOB_SECRET_FILE"
_MIN_LEN = 32
HOW = (f"set {ENV_SECRET} to the same random value in every process of the job, e.g. "
       f"{ENV_SECRET}=$(python -c 'import secrets; print(secrets.token_hex(32))'), or {ENV_SECRET_FILE} to a 0600 "
       "file holding it (collectives.launch does this for you)")


def new_job_secret() -> str:
    """A fresh per-job secret: 32 random bytes as 64 hex characters."""
    return secrets.token_hex(32)


def _checked(value: str, where: str) -> str:
    value = value.strip()
    if len(value) < _MIN_LEN or not value.isprintable() or " " in value:
        raise AuthError(f"{where}: the job secret must be at least {_MIN_LEN} printable characters without spaces "
                        f"(e.g. secrets.token_hex(32)); {HOW}")
    return value


def job_secret() -> str | None:
    """This job's secret from PSLAB_JOB_SECRET, else from the file named by PSLAB_JOB_SECRET_FILE; None if neither.

    The file must be a regular file readable by its owner only (mode 0600 or stricter)."""
    value = os.environ.get(ENV_SECRET)
    if value:
        return _checked(value, ENV_SECRET)
    path = os.environ.get(ENV_SECRET_FILE)
    if not path:
        return None
    data = read_private_file(path, f"{ENV_SECRET_FILE}={path}", HOW)
    return _checked(data, f"{ENV_SECRET_FILE}={path}")


def read_private_file(path: str, what: str, hint: str = "") -> str:
    """The text of `path` (at most 4 KiB), which must be a regular file readable by its owner only (0600); else an
    AuthError naming it as `what` (a symlink is not followed)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise AuthError(f"{what}: cannot open ({e.strerror}){'; ' + hint if hint else ''}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077:
            raise AuthError(f"{what} must be a regular file of mode 0600 (chmod 600 {path})")
        return os.read(fd, 4096).decode("utf-8", "replace")
    finally:
        os.close(fd)


def credential(secret: str, user: str) -> str:
    """The password of `user` (a role such as "rank:3") in the job of `secret`: hex HMAC-SHA256(secret, user)."""
    return hmac.new(secret.encode(), user.encode(), hashlib.sha256).hexdigest()


def sign(secret: str, label: str, value: str) -> str:
    """A tag proving that `value`, published under `label` (e.g. a store key), comes from a member of the job."""
    return hmac.new(secret.encode(), f"{label}\0{value}".encode(), hashlib.sha256).hexdigest()


def verify(secret: str, label: str, value: str, tag: str) -> bool:
    return hmac.compare_digest(sign(secret, label, value), tag)


class _Shared:
    """A context's ZAP handler (zmq.auth allows one per context): passwords and role keys per ZAP domain."""

    def __init__(self, ctx: zmq.Context) -> None:
        from zmq.auth.thread import ThreadAuthenticator
        self.ctx, self.pid = weakref.ref(ctx), os.getpid()
        self.auth = ThreadAuthenticator(ctx)
        self.auth.start()
        self.domains: set[str] = set()
        self.roles: dict[bytes, str] = {}            # z85 CURVE client key -> role: that connection's User-Id
        default = self.auth.curve_user_id
        self.auth.curve_user_id = lambda key: self.roles.get(z85.encode(key)) or default(key)


_LOCK = threading.Lock()
_SHARED: dict[int, _Shared] = {}                    # id(context) -> its handler, while a socket uses it
_COUNT = [0]


def _shared(ctx: zmq.Context) -> _Shared | None:
    """The live handler of `ctx` in this process (not one of a dead context that had the same id, nor one
    inherited through fork)."""
    shared = _SHARED.get(id(ctx))
    if shared is not None and (shared.ctx() is not ctx or shared.pid != os.getpid()):
        del _SHARED[id(ctx)]
        return None
    return shared


class Authenticator:
    """One socket's entry in its context's ZAP handler (one zmq.auth ThreadAuthenticator per context, shared by
    every socket of that context served by `plain_server` or `curve_server`); `stop()` removes the entry, and the
    last one stops the handler thread. Do not mix with `curve.serve_curve` in the same context."""

    def __init__(self, ctx: zmq.Context, domain: str) -> None:
        self.ctx, self.domain, self._stopped = ctx, domain, False

    def stop(self) -> None:
        with _LOCK:
            if self._stopped:
                return
            self._stopped = True
            shared = _shared(self.ctx)
            if shared is None:
                return
            shared.auth.passwords.pop(self.domain, None)
            shared.auth.credentials_providers.pop(self.domain, None)
            shared.domains.discard(self.domain)
            if not shared.domains:
                del _SHARED[id(self.ctx)]
                shared.auth.stop()


def _register(ctx: zmq.Context, sock: zmq.Socket) -> tuple[_Shared, str]:
    """The context's ZAP handler (started on first use) and a fresh ZAP domain, set on `sock`."""
    with _LOCK:
        shared = _shared(ctx)
        if shared is None:
            shared = _SHARED[id(ctx)] = _Shared(ctx)
        _COUNT[0] += 1
        domain = f"pslab-{os.getpid()}-{_COUNT[0]}"
        shared.domains.add(domain)
    sock.zap_domain = domain.encode()
    return shared, domain


def plain_server(ctx: zmq.Context, socket: zmq.Socket, secret: str, users: Iterable[str]) -> Authenticator:
    """Make `socket` (before bind) a PLAIN server admitting exactly `users`, each with its `credential`."""
    shared, domain = _register(ctx, socket)
    shared.auth.configure_plain(domain=domain, passwords={u: credential(secret, u) for u in users})
    socket.plain_server = True
    return Authenticator(ctx, domain)


def plain_client(socket: zmq.Socket, secret: str, user: str) -> None:
    """Make `socket` (before connect) a PLAIN client that authenticates as `user`."""
    socket.plain_username = user.encode()
    socket.plain_password = credential(secret, user).encode()


def role_keys(secret: str, user: str) -> tuple[bytes, bytes]:
    """(public, secret) z85 CURVE client key pair of `user`, derived from the job secret."""
    sec = z85.encode(hmac.new(secret.encode(), f"curve\0{user}".encode(), hashlib.sha256).digest())
    return zmq.curve_public(sec), sec


class _RoleKeys:
    """ZAP credentials provider + User-Id map for `curve_server`: a client key is admitted iff it is a role's."""

    def __init__(self, secret: str, users: Iterable[str]) -> None:
        self.by_key = {role_keys(secret, u)[0]: u for u in users}

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.by_key


def curve_server(ctx: zmq.Context, socket: zmq.Socket, server_keys: tuple[bytes, bytes], secret: str,
                 users: Iterable[str]) -> Authenticator:
    """Make `socket` (before bind) a CURVE server with the cluster key pair `server_keys` (`curve.load_keys`)
    that admits only the role key pairs of `users` (`role_keys`); each message's User-Id is the role."""
    shared, domain = _register(ctx, socket)
    provider = _RoleKeys(secret, users)
    shared.roles.update(provider.by_key)
    shared.auth.configure_curve_callback(domain=domain, credentials_provider=provider)
    pub, sec = server_keys
    socket.curve_secretkey, socket.curve_publickey, socket.curve_server = sec, pub, True
    return Authenticator(ctx, domain)


def curve_client(socket: zmq.Socket, server_keys: tuple[bytes, bytes], secret: str, user: str) -> None:
    """Make `socket` (before connect) a CURVE client of a `curve_server`, authenticating as `user`."""
    pub, sec = role_keys(secret, user)
    socket.curve_secretkey, socket.curve_publickey, socket.curve_serverkey = sec, pub, server_keys[0]
