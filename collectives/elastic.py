"""Elastic process groups: when a member dies (kill -9) or hangs (SIGSTOP), the survivors go on in a new group.

Who belongs is decided by one coordinator (the launcher's parent; in tests, the test), never by the members
themselves; this module is the mechanism. A membership is (generation g, members in ring order); members are
stable ids (the original ranks / data-parallel worker ids), and a member's rank in generation g is
`members.index(member)`. The protocol, through the job's rendezvous store:

    coordinator                                  member m (an ElasticGroup)
    publish(store, Membership(g, members))  ->   every wait of its generation-h group (h < g) calls check() at least
        key "elastic/membership":                every check_interval: one store read (rate-limited), and
        JSON {"g", "m", "r"[, "i"]} + "#" + HMAC g > h  ->  MembershipChanged(g)   (m in members: roll back, join)
                                                        ->  Expelled              (m left out: stop, cleanly)
                                                 join(): wait for g, destroy generation h's group (never waits on
                                                 a dead or stopped peer), build generation g's over
                                                 PrefixStore("elastic/<g>/", store), rank = members.index(m)

A member may be replaced by a new process with its id (a hung one, under on_failure = replace): the record's "i"
names each member's incarnation (0 its first process, n its n-th replacement; ElasticGroup(incarnation=)), so the
original, should it wake up, is Expelled like a left-out member instead of joining the replacement's generation.

Records are signed with the job's secret (`auth.sign`, like the endpoint records), so a process without it cannot
forge one: `current()` refuses a forged or unsigned record (AuthError), a member's `check()` ignores it (counted in
`refused`), `join()` waits past it. Generations only increase: `publish` replaces the record atomically
(`store.compare_set`) and refuses a generation not above the published one, and a member never goes back to a
generation below its own (someone with write access to the store could replay an old signed record: members ignore
it, a member that never joined would wait on it, and it cannot be newer than what the coordinator published).

A generation's group is all new, so nothing of an older one can reach into it:
  zmq    a new Transport: new sockets, ipc directory and shared-memory segments, addresses under elastic/<g>/, and
         credentials of realm "g<g>/" (a woken stale member's old connections, even to a reused tcp port, fail the
         handshake). The old transport closes at once, but what it still queues for a member of generation g
         (alive, by the coordinator's word) gets LINGER s to arrive: that member may still be finishing the last
         collective of generation h, which ended here (a left peer's queue is dropped, never awaited).
  torch  a new standalone gloo group (gloo_groups.standalone_gloo: not registered with torch.distributed, on
         loopback unless GLOO_SOCKET_IFNAME says otherwise); its ops work on private buffers, and the old group is
         destroyed, or left alive if a gloo op of it is still in flight (see torch_group.py). A gloo error (a killed
         peer closes its connections) becomes a wait for the next generation: MembershipChanged once it is
         published, PeerFailedError after `timeout` without one.

A collective interrupted by MembershipChanged or Expelled leaves its buffers undefined: the caller rolls back to
its last committed state (the training loop does: experiments/strategies/elastic.py). The interrupt hook costs
nothing on a plain (non-elastic) group: its waits test one attribute. A member that dies while the others join
generation g does not hold them either: zmq reads addresses (interruptibly) on first use; gloo's rendezvous runs in
a thread while `join` watches the store for generation g+1.

    eg = ElasticGroup("zmq", member=2, store=store, secret=secret, timeout=60)
    group = eg.join()                       # the first published generation that contains member 2
    while training:
        try:
            group.all_reduce(grads)
        except MembershipChanged as e:
            rollback(); group = eg.join(e.generation)
        # (Expelled: this member was declared failed: exit with EXIT_EXPELLED)
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from . import auth
from .curve import is_loopback
from .errors import AuthError, Expelled, MembershipChanged, PeerFailedError, RendezvousError
from .group import ProcessGroup

KEY = "elastic/membership"           # the store key of the newest membership record
MAX_MEMBERS = 1 << 16
MAX_REASON = 200
MAX_RECORD = 1 << 20
LINGER = 0.2                         # seconds queued messages get to reach a live member when a group is left
                                     # (a live member may be leaving too: its socket is gone, the wait is lost time;
                                     # what does not arrive is redone after the rollback to the agreed commit)
EXIT_EXPELLED = 3                    # the exit code a process uses when it stops because it was Expelled
_TRANSPORT_OPTIONS = ("bind_host", "use_ipc", "use_shm", "limits", "mailbox_bytes", "seq_window", "curve_keys_dir")
_ZMQ_GROUP_OPTIONS = ("small_bytes", "segment_bytes")

__all__ = ["EXIT_EXPELLED", "ElasticGroup", "Expelled", "Membership", "MembershipChanged", "PeerFailedError",
           "current", "publish"]


@dataclass(frozen=True)
class Membership:
    """Generation `generation` of the job: `members` (stable ids, ring order); rank of m = members.index(m)."""

    generation: int
    members: tuple[int, ...]
    reason: str = ""
    incarnations: tuple[int, ...] = ()   # per member: which of its processes (0 the first, n its n-th replacement);
                                         # () = any. A replaced member's earlier process is then no member

    def __post_init__(self) -> None:
        if type(self.generation) is not int or self.generation < 0:
            raise ValueError(f"a membership generation is an integer >= 0, got {self.generation!r:.40}")
        members = self.members
        if not isinstance(members, (tuple, list)) or not 1 <= len(members) <= MAX_MEMBERS or \
                any(type(x) is not int or x < 0 for x in members) or len(set(members)) != len(members):
            raise ValueError(f"members must be 1..{MAX_MEMBERS} distinct integer ids >= 0, got {members!r:.80}")
        object.__setattr__(self, "members", tuple(members))
        if not isinstance(self.reason, str) or len(self.reason) > MAX_REASON or not self.reason.isprintable():
            raise ValueError(f"reason must be printable text of at most {MAX_REASON} characters")
        inc = self.incarnations
        if not isinstance(inc, (tuple, list)) or (inc and len(inc) != len(self.members)) or \
                any(type(x) is not int or x < 0 for x in inc):
            raise ValueError(f"incarnations must be () or one integer >= 0 per member, got {inc!r:.80}")
        object.__setattr__(self, "incarnations", tuple(inc))

    def admits(self, member: int, incarnation: int = 0) -> bool:
        """Whether process `incarnation` of `member` belongs to this generation."""
        return member in self.members and (not self.incarnations or
                                           self.incarnations[self.members.index(member)] == incarnation)

    @property
    def world_size(self) -> int:
        return len(self.members)

    def rank_of(self, member: int) -> int:
        """The rank of `member` in this generation (ValueError if it is not a member)."""
        return self.members.index(member)


def _secret(secret: str | None) -> str:
    s = secret or auth.job_secret()
    if not s:
        raise AuthError(f"elastic membership records are signed with the job's secret: pass secret= or {auth.HOW}")
    return s


def _encode(m: Membership, secret: str) -> str:
    d: dict[str, Any] = {"g": m.generation, "m": list(m.members), "r": m.reason}
    if m.incarnations:
        d["i"] = list(m.incarnations)
    body = json.dumps(d, separators=(",", ":"))
    return body + "#" + auth.sign(secret, KEY, body)


def _decode(raw: bytes, secret: str) -> Membership:
    """The membership in a store record; AuthError if it is not signed with `secret`, RendezvousError if malformed."""
    if len(raw) > MAX_RECORD:
        raise RendezvousError(f"the membership record is {len(raw)} bytes, over the limit of {MAX_RECORD}")
    text = raw.decode("utf-8", "replace")
    body, sep, tag = text.rpartition("#")
    if not sep or not auth.verify(secret, KEY, body, tag):
        raise AuthError(f"the membership record in the store ({KEY}) is not signed with this job's secret: someone "
                        "else wrote it (or the coordinator has another PSLAB_JOB_SECRET); refused")
    try:
        d = json.loads(body)
        if type(d) is not dict or set(d) - {"i"} != {"g", "m", "r"} or type(d["m"]) is not list or \
                type(d.get("i", [])) is not list:
            raise ValueError("fields")
        return Membership(d["g"], tuple(d["m"]), d["r"], tuple(d.get("i", ())))
    except ValueError as e:
        raise RendezvousError(f"the membership record in the store is malformed ({e}); refused") from None


def current(store: Any, secret: str | None = None) -> Membership | None:
    """The newest published membership, or None if none was published; AuthError for a forged or unsigned record."""
    if not store.check([KEY]):
        return None
    return _decode(store.get(KEY), _secret(secret))


def publish(store: Any, m: Membership, secret: str | None = None) -> None:
    """Coordinator: make `m` the newest membership (signed). ValueError unless m.generation is above the published
    one; AuthError if the record in the store is forged (then the store is not this job's alone: fix that first)."""
    s = _secret(secret)
    new = _encode(m, s)
    for _ in range(100):                         # compare-and-set: racing coordinators cannot both win
        old = store.get(KEY) if store.check([KEY]) else b""
        if old:
            cur = _decode(old, s)
            if m.generation <= cur.generation:
                raise ValueError(f"membership generation {m.generation} is not newer than the published "
                                 f"{cur.generation} (members {list(cur.members)}): generations only increase")
        if store.compare_set(KEY, old.decode("utf-8", "replace"), new) == new.encode():
            return
    raise RendezvousError("the membership record kept changing while publishing (100 tries): two coordinators?")


class ElasticGroup:
    """One member's view of the job's elastic group: `join()` the generations the coordinator publishes.

    `group` is the current generation's ProcessGroup (None before the first join), `generation` its number (-1
    before), `membership` its Membership. Every wait inside `group` calls `check()`. `group_options`: for zmq the
    Transport's (bind_host: loopback unless curve_keys_dir is given, use_ipc, use_shm, limits, mailbox_bytes,
    seq_window) and ZmqGroup's (small_bytes, segment_bytes); for torch only torch_backend="gloo"."""

    def __init__(self, backend: str, member: int, store: Any, *, secret: str | None = None, timeout: float = 60.0,
                 check_interval: float = 0.05, incarnation: int = 0, **group_options: Any) -> None:
        if backend not in ("zmq", "torch"):
            raise ValueError(f"unknown backend {backend!r}; an elastic group is 'zmq' or 'torch' (gloo)")
        if type(member) is not int or member < 0:
            raise ValueError(f"member must be an integer id >= 0, got {member!r:.40}")
        if not timeout > 0 or not check_interval > 0:
            raise ValueError(f"timeout and check_interval must be > 0, got {timeout}, {check_interval}")
        allowed = _TRANSPORT_OPTIONS + _ZMQ_GROUP_OPTIONS if backend == "zmq" else ()
        if backend == "torch" and group_options.pop("torch_backend", "gloo") != "gloo":
            raise ValueError("an elastic torch group uses gloo (torch_backend='gloo'); NCCL groups are not elastic")
        unknown = sorted(set(group_options) - set(allowed))
        if unknown:
            raise ValueError(f"unknown options {unknown} for an elastic {backend} group; allowed: {list(allowed)}")
        host = group_options.get("bind_host", "127.0.0.1")
        if not is_loopback(host) and not group_options.get("curve_keys_dir"):
            raise RendezvousError(f"binding to {host} exposes the group beyond this host: pass curve_keys_dir= to "
                                  "encrypt and authenticate (see collectives.curve.generate_keys)")
        self.backend, self.member, self.store = backend, member, store
        self.incarnation = int(incarnation)              # this process of the member (Membership.incarnations)
        self.timeout, self.check_interval = float(timeout), float(check_interval)
        self._secret = _secret(secret)
        self._options = group_options
        self.group: ProcessGroup | None = None
        self.generation = -1
        self.membership: Membership | None = None
        self.refused = 0                                 # forged or malformed records seen (and ignored)
        self.expelled = False                            # Expelled was raised: the others went on without it
        self._last_check = float("-inf")
        self._raw, self._seen = b"", None                # the last record read and what it said

    def _read(self) -> Membership | None:
        """The newest valid membership in the store (None if none); forged records are ignored and counted."""
        if not self.store.check([KEY]):
            return None
        raw = self.store.get(KEY)
        if raw != self._raw:
            self._raw = raw
            try:
                self._seen = _decode(raw, self._secret)
            except (AuthError, RendezvousError):
                self._seen = None
                self.refused += 1
        return self._seen

    def check(self) -> None:
        """Raise MembershipChanged (or Expelled, if this member is left out) when a generation newer than this
        group's was published; one store read at most every `check_interval` seconds."""
        now = time.monotonic()
        if now - self._last_check < self.check_interval:
            return
        self._last_check = now
        m = self._read()
        if m is None or m.generation <= self.generation:
            return
        if not m.admits(self.member, self.incarnation):     # left out, or replaced by a newer process
            self.expelled = True
            raise Expelled(self.member, m.generation, m.members)
        raise MembershipChanged(m.generation, m.members)

    def join(self, min_generation: int = 0, timeout: float | None = None) -> ProcessGroup:
        """Leave the current generation's group (without waiting on its peers) and join the newest published
        generation >= max(min_generation, generation + 1) that contains this member; returns its group.

        Expelled if a newer generation leaves out this member after it had joined one (a member that never joined
        waits to be admitted); RendezvousError when none comes within `timeout` (default: the group timeout)."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        want = max(min_generation, self.generation + 1)
        pause = 0.001
        while True:
            m = self._read()
            if m is not None and m.generation >= want:
                if m.admits(self.member, self.incarnation):
                    self._leave(m.members)
                    try:
                        return self._enter(m)
                    except RendezvousError:
                        newer = self._read()
                        if newer is None or newer.generation <= m.generation:
                            raise
                        want = newer.generation          # the coordinator moved on while we rendezvoused
                        continue
                if self.generation >= 0:
                    self.expelled = True
                    self._leave(())
                    raise Expelled(self.member, m.generation, m.members)
            if time.monotonic() >= deadline:
                forged = f"; {self.refused} forged record(s) refused" if self.refused else ""
                raise RendezvousError(f"member {self.member}: no membership generation >= {want} containing it was "
                                      f"published within {limit:g}s (newest: {m}){forged}")
            time.sleep(pause)
            pause = min(2 * pause, self.check_interval)

    def _enter(self, m: Membership) -> ProcessGroup:
        rank, n = m.members.index(self.member), len(m.members)
        prefix = f"elastic/{m.generation}/"
        store = dist.PrefixStore(prefix, self.store)
        group: Any
        if self.backend == "zmq":
            from .transport import CurveKeys, Transport
            from .zmq_group import ZmqGroup
            topts = {k: v for k, v in self._options.items() if k in _TRANSPORT_OPTIONS and k != "curve_keys_dir"}
            if self._options.get("curve_keys_dir"):
                topts["curve"] = CurveKeys(self._options["curve_keys_dir"])
            gopts = {k: v for k, v in self._options.items() if k in _ZMQ_GROUP_OPTIONS}
            tr = Transport(rank, n, store, timeout=self.timeout, secret=self._secret, namespace=prefix,
                           realm=f"g{m.generation}/", **topts)
            tr.interrupt_every = self.check_interval
            group = ZmqGroup(tr, range(n), **gopts)
        else:
            from .torch_group import TorchGroup
            pg, meter = self._gloo(m, store, rank, n)
            group = TorchGroup(pg, range(n), rank, self.timeout, standalone=True, meter=meter)
            group.interrupt_every = self.check_interval
        group.store, group.members = store, m.members
        self.group, self.generation, self.membership = group, m.generation, m
        group.interrupt = self.check                     # after `generation` is set: g itself is not news
        return group

    def _gloo(self, m: Membership, store: Any, rank: int, n: int) -> tuple[Any, Any]:
        """Generation m's gloo group. gloo's rendezvous blocks until every member connects (or the timeout), so it
        runs in a thread while this one watches the store: RendezvousError at once if a newer generation is
        published meanwhile (a member of m died before connecting; the thread is left to time out)."""
        from .gloo_groups import standalone_gloo
        out: dict[str, Any] = {}

        def build() -> None:
            try:
                out["pg"], out["meter"] = standalone_gloo(store, rank, n, self.timeout)
            except Exception as e:                       # gloo: "Wait timeout", connection refused ...
                out["error"] = e
        th = threading.Thread(target=build, daemon=True, name=f"pslab-gloo-g{m.generation}")
        th.start()
        pause = 0.001
        while th.is_alive():
            th.join(pause)
            pause = min(2 * pause, self.check_interval)
            newer = self._read()
            if th.is_alive() and newer is not None and newer.generation > m.generation:
                raise RendezvousError(f"generation {newer.generation} was published while generation "
                                      f"{m.generation}'s gloo group formed")
        if "error" in out:
            raise RendezvousError(f"member {self.member}: the gloo group of generation {m.generation} did not form "
                                  f"within {self.timeout:g}s ({str(out['error'])[:200]})")
        return out["pg"], out["meter"]

    def _leave(self, staying: tuple[int, ...]) -> None:
        """Destroy the current generation's group. zmq: messages still queued for a member that is `staying` (in
        the next generation: alive) get LINGER s to be delivered (it may still need them: the last collective
        ended here but not there); those for anyone else are dropped at once (a dead peer never takes them)."""
        group, self.group = self.group, None
        if group is None:
            return
        group.interrupt = None
        if self.backend == "zmq":
            members = self.membership.members if self.membership else ()
            group.destroy(linger=0, lingers={r: LINGER if m in staying else 0.0 for r, m in enumerate(members)})
        else:
            group.destroy()

    def destroy(self) -> None:
        """Leave the current generation's group (the job's store stays); its members are taken to be alive
        unless this member was expelled."""
        self._leave(self.membership.members if self.membership and not self.expelled else ())

    def __enter__(self) -> ElasticGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def __repr__(self) -> str:
        return (f"ElasticGroup({self.backend}, member {self.member}, generation {self.generation}, "
                f"members {list(self.membership.members) if self.membership else []})")
