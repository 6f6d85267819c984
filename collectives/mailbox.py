"""The mailbox of early arrivals: messages that reached a rank before it asked for them, filed under (src, key).

A message may be filed only if a legitimate peer could have sent it now:

    key      a list of 1..6 ints (64-bit) or strings (at most 64 chars): hashable, small, never nested
    group    the key names a group of this rank (k[0] = group id, or k = ["p2p", group id, tag, count]); the group's
             route (`Mailbox.routes[gid]`) checks the rest: sender a member, exactly one tensor, key shape, and
             floor <= seq (or p2p count) < floor + window, floor = the collective in progress (or the receives of
             that (sender, tag) done so far)
Messages under one (src, key) queue in arrival order (a legitimate sender sends one; whatever else its
credential sent first cannot push it out: the receiver takes them in turn and drops those that do not fit).
Anything else is a `WireError`: the transport drops and counts it. Below the floor means a collective this rank has
finished, so no legitimate peer can still be sending for it; such leftovers are purged when a group begins its next
collective. A message that passes every check comes from an authenticated member (the transport checked its
User-Id), so it is never dropped: if it lies beyond the window, or filing it would exceed the byte budget,
`MailboxOverflowError` is raised, naming the limit to raise (`mailbox_bytes=`, `seq_window=`), instead of a silent
drop that would deadlock the group. Each filed message costs its frame bytes + OVERHEAD toward the budget.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import MailboxOverflowError, WireError
from .wire import Message

Key = tuple
Route = Callable[[int, Key, dict, bool], None]   # (sender, key, header, wanted) -> None, or raises

MAILBOX_BYTES = 1 << 30     # default byte budget of early arrivals per rank
SEQ_WINDOW = 1024           # default: how many collectives (or p2p messages per tag) a peer may run ahead
OVERHEAD = 512              # bytes charged per filed message on top of its frames (header, bookkeeping)
MAX_KEY_LEN = 6
MAX_KEY_STR = 64
_INT64 = 1 << 63


def routing_key(k: Any) -> Key:
    """The header's routing key `meta["k"]` as a tuple, or WireError if it is not a short flat list of scalars."""
    if type(k) is not list or not 1 <= len(k) <= MAX_KEY_LEN:
        raise WireError(f"routing key must be a list of 1..{MAX_KEY_LEN} ints or strings, got {k!r:.80}")
    for x in k:       # exact types: no bool, no float, nothing unhashable (msgpack ints are 64-bit already)
        t = type(x)
        if not (t is int and -_INT64 <= x < _INT64 or t is str and len(x) <= MAX_KEY_STR):
            raise WireError(f"routing key items must be 64-bit ints or strings of at most {MAX_KEY_STR} chars, got "
                            f"{x!r:.60}")
    return tuple(k)


def tensor_count(h: dict) -> int:
    """Tensors a header announces: one frame per descriptor, plus one shared-memory payload."""
    return len(h["t"]) + ("shm" in h["meta"])


class Mailbox:
    """Early arrivals of one rank, with a byte budget; `routes` maps group ids to their acceptance rules."""

    def __init__(self, rank: int, budget: int = MAILBOX_BYTES, window: int = SEQ_WINDOW) -> None:
        if budget < OVERHEAD or window < 1:
            raise ValueError(f"mailbox budget must be >= {OVERHEAD} bytes and window >= 1; got {budget}, {window}")
        self.rank, self.budget, self.window = rank, budget, window
        self.items: dict[tuple[int, Key], list[tuple[Message, dict, int]]] = {}
        self.bytes = 0
        self.routes: dict[str, Route] = {}

    def __len__(self) -> int:
        return sum(len(q) for q in self.items.values())

    def route(self, src: int, key: Key, header: dict, wanted: bool) -> None:
        """Raise WireError unless a group of this rank accepts (src, key) now (`wanted`: the caller waits for it)."""
        gid = key[1] if key[0] == "p2p" and len(key) > 1 else key[0]
        rule = self.routes.get(gid) if isinstance(gid, str) else None
        if rule is not None:
            rule(src, key, header, wanted)
        elif not wanted:     # a key no group knows is filed only if someone waits for it (Transport.recv users)
            raise WireError(f"routing key {key!r:.80} names no group of rank {self.rank}")

    def in_window(self, what: str, value: int, floor: int, src: int, key: Key) -> None:
        """The sequence check every route shares: stale -> WireError, too far ahead -> MailboxOverflowError."""
        if value < floor:
            raise WireError(f"{what} {value} from rank {src} is behind this rank's {floor}: stale, dropped")
        if value >= floor + self.window:
            raise MailboxOverflowError(
                f"rank {self.rank}: rank {src} is {value - floor} {what}s ahead under {key!r:.60}, beyond the window "
                f"of {self.window}; raise it with seq_window= (init_process_group or collectives.launch)")

    def file(self, src: int, key: Key, msg: Message, header: dict, nbytes: int) -> None:
        """Keep `msg` (and its header) until `take(src, key)`; MailboxOverflowError over the byte budget."""
        cost = nbytes + OVERHEAD
        if self.bytes + cost > self.budget:
            raise MailboxOverflowError(
                f"rank {self.rank}: {len(self.items)} early messages hold {self.bytes} bytes and one more of {cost} "
                f"from rank {src} under {key!r:.60} exceeds the mailbox budget of {self.budget} bytes; raise it with "
                f"mailbox_bytes= (init_process_group or collectives.launch)")
        self.items.setdefault((src, key), []).append((msg, header, cost))
        self.bytes += cost

    def take(self, src: int, key: Key) -> tuple[Message, dict] | None:
        """The oldest message filed under (src, key) and its header, or None."""
        queue = self.items.get((src, key))
        if not queue:
            return None
        msg, header, cost = queue.pop(0)
        if not queue:
            del self.items[(src, key)]
        self.bytes -= cost
        return msg, header

    def purge(self, stale: Callable[[int, Key], bool]) -> int:
        """Remove the entries for which `stale(src, key)` holds; returns how many."""
        gone = [sk for sk in self.items if stale(*sk)]
        n = 0
        for sk in gone:
            for _, _, cost in self.items.pop(sk):
                self.bytes -= cost
                n += 1
        return n
