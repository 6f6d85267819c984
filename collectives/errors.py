"""The exceptions of the communication layer.

Every failure a user can meet has its own class and a message that says what to do. All derive from
`CollectivesError`, so `except CollectivesError` catches everything this layer raises on purpose.
"""

from __future__ import annotations


class CollectivesError(RuntimeError):
    """Base class of every error raised on purpose by `collectives`."""


class WireError(CollectivesError, ValueError):
    """A message on the wire is malformed: bad header, unknown dtype, frame length mismatch, over a limit ...

    The receiver drops the message (or answers with an error reply) and keeps working.
    """


class PeerTimeoutError(CollectivesError, TimeoutError):
    """A peer did not answer within the timeout: names the op, its sequence number and the silent peer."""

    def __init__(self, op: str, seq: int, peer: int, timeout: float, detail: str = "") -> None:
        self.op, self.seq, self.peer, self.timeout = op, seq, peer, timeout
        msg = (f"{op} #{seq}: rank {peer} did not answer within {timeout:g}s"
               f"{' (' + detail + ')' if detail else ''}; is that process alive and in the same collective?")
        super().__init__(msg)

    def __reduce__(self):  # keep picklable across multiprocessing (launcher only; never on the wire)
        return (PeerTimeoutError, (self.op, self.seq, self.peer, self.timeout))


class CollectiveMismatchError(CollectivesError):
    """Ranks called different collectives (or different shapes) at the same sequence number."""


class RendezvousError(CollectivesError):
    """The group could not be formed: missing environment variables, port in use, store unreachable."""


class AuthError(RendezvousError):
    """The job's credential is missing or unusable (no PSLAB_JOB_SECRET for a multi-process job, a secret file
    readable by others, a too short secret), or a peer's published address is not signed with it."""


class MailboxOverflowError(CollectivesError):
    """Legitimate early arrivals from authenticated peers exceed the mailbox's byte budget or sequence window:
    raised instead of dropping them (which would deadlock the group); the message says which limit to raise."""


class LaunchError(CollectivesError):
    """A rank started by `collectives.launch` failed or the launch timed out; carries the rank's traceback."""


class MembershipChanged(CollectivesError):
    """A newer elastic membership was published (collectives/elastic.py) while this group waited: the group is
    stale. Buffers of the interrupted collective are undefined; roll back, then `ElasticGroup.join()` generation
    `generation` (the newer one)."""

    def __init__(self, generation: int, members: tuple[int, ...] = (), detail: str = "") -> None:
        self.generation, self.members, self.detail = generation, tuple(members), detail
        super().__init__(f"membership generation {generation} (members {list(members)}) was published"
                         f"{' (' + detail + ')' if detail else ''}; roll back and join it (ElasticGroup.join)")

    def __reduce__(self):  # picklable across multiprocessing (launcher only; never on the wire)
        return (MembershipChanged, (self.generation, self.members, self.detail))


class Expelled(CollectivesError):
    """This member is not in the newest elastic membership (it was declared failed, e.g. while SIGSTOPped): it must
    stop, cleanly, without touching shared state (the survivors went on without it)."""

    def __init__(self, member: int, generation: int, members: tuple[int, ...] = ()) -> None:
        self.member, self.generation, self.members = member, generation, tuple(members)
        super().__init__(f"member {member} is not in membership generation {generation} (members {list(members)}): "
                         f"it was declared failed; stop this process (the others continue without it)")

    def __reduce__(self):
        return (Expelled, (self.member, self.generation, self.members))


class PeerFailedError(CollectivesError):
    """A peer of the group failed in the middle of a collective (e.g. gloo: connection closed by a killed peer) and
    no newer membership was published within the timeout; without an elastic coordinator the job cannot go on."""
