"""The exceptions of the parameter server.

Every failure a user can meet has its own class and a message that says what to do. All derive from `PSError`, so
`except PSError` catches everything this package raises on purpose (the `pslab` CLI prints them as one line).
On the wire, an error reply carries the class name (`kind`) and the message; the client re-raises the same class.
"""

from __future__ import annotations


class PSError(RuntimeError):
    """Base class of every error raised on purpose by `ps`."""


class ConfigError(PSError, ValueError):
    """A policy string, optimizer option, partition or server setting is invalid; the message lists valid values."""


class ProtocolError(PSError, ValueError):
    """A request is malformed or not allowed now: unknown op, missing field, unregistered worker ..."""


class UnknownKeyError(ProtocolError, KeyError):
    """A push or init names a parameter this shard does not own."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ShapeError(ProtocolError):
    """A pushed tensor has the wrong shape or dtype for its parameter."""


class DuplicateRequestError(ProtocolError):
    """A request id (seq) was not larger than the previous accepted one from the same connection."""


class ClockError(ProtocolError):
    """A push or pull carries a clock that does not match the worker's clock on the shard."""


class NotInitializedError(ProtocolError):
    """A push arrived before the parameters were initialised (the owner must call `init` first)."""


class NonFiniteGradientError(ProtocolError):
    """A push carried NaN or Inf: it is refused whole and the parameters are unchanged (the message names the
    tensor); usually the learning rate is too large or the loss diverged."""


class AccessDeniedError(ProtocolError):
    """An authenticated connection asked for something its identity does not allow: to register as another worker
    than its credential names, to push or pull as another worker than it registered as, to init without being the
    designated owner, or an admin operation (shutdown, checkpoint) without the job's admin credential."""


class DuplicateWorkerError(AccessDeniedError):
    """A worker id is already registered on another live connection (and this one did not prove to be the same
    client): close the other client first, or connect as another worker."""


class MembershipError(ProtocolError):
    """A membership change is malformed or stale (its version is not newer than the shard's)."""


class NotAMemberError(ProtocolError):
    """A worker removed from the membership pushed or pulled: the controller must re-admit it (set_members), then the
    worker calls resync()."""


class NotRegisteredError(ProtocolError):
    """A push or pull on a connection that is not registered: after a shard restart, the client must resync()."""


class ShardLostError(PSError):
    """The connection to a shard dropped (it died or was restarted) with requests in flight; call resync() once it is
    back (the requests are not retried: the shard may or may not have applied them)."""


class CheckpointWarning(UserWarning):
    """A shard's periodic checkpoint failed (the push that triggered it was applied; the last good checkpoint
    stays the restore point)."""


class AlreadyInitializedError(ProtocolError):
    """A second `init`: the shard already holds parameters (from the first init, or restored from a checkpoint)."""


class ShmLimitError(ProtocolError):
    """A shard already holds as many shared-memory links as it allows (`max_shm_links`)."""


class AuthenticationError(PSError):
    """A shard refused this client's credential during the handshake (wrong or missing job secret, or a user the
    shard does not know)."""


class GateTimeoutError(PSError, TimeoutError):
    """A pull waited on the consistency gate longer than the server's request timeout (a worker is stuck or dead)."""


class RequestTimeoutError(PSError, TimeoutError):
    """A shard did not answer a client request in time: is the server process alive and reachable?"""


class CheckpointError(PSError):
    """A checkpoint is missing, corrupt (bad magic, truncated, checksum mismatch) or does not match this shard."""


class RemoteError(PSError):
    """A server answered with an error class the client does not know; carries the remote kind and message."""


ERROR_CLASSES: dict[str, type[PSError]] = {c.__name__: c for c in (
    PSError, ConfigError, ProtocolError, UnknownKeyError, ShapeError, DuplicateRequestError, ClockError,
    NotInitializedError, NonFiniteGradientError, AccessDeniedError, DuplicateWorkerError, AlreadyInitializedError,
    ShmLimitError, AuthenticationError, GateTimeoutError, RequestTimeoutError, CheckpointError, RemoteError,
    MembershipError, NotAMemberError, NotRegisteredError, ShardLostError)}


def error_from_reply(kind: str, message: str, shard: int | None = None) -> PSError:
    """Rebuild the exception a server reported (unknown kinds become `RemoteError`)."""
    cls = ERROR_CLASSES.get(kind, RemoteError)
    where = f"shard {shard}: " if shard is not None else ""
    return cls(f"{where}{message}")
