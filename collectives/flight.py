"""The flight recorder: every process keeps its last N calls of every process group, always on, and writes them out
when something goes wrong, so that `pslab diagnose` can say which rank never joined which call.

Like PyTorch's NCCL flight recorder (TORCH_NCCL_TRACE_BUFFER_SIZE), one entry per call:

    group      the group's key: its members (global ranks), its name (the mesh axes it serves: dp, tp, pp, ...)
               and n, the how-many-th group with these members this process used (so generations differ)
    seq        collectives: the group's sequence number (the same call has the same seq on every member);
               p2p: the count of calls to/from that peer in that direction (send #k matches receive #k)
    op         all_reduce, reduce_scatter, all_gather, broadcast, all_to_all, barrier, send, recv, isend, irecv,
               or a layer above's (ps.push, ps.pull, ...: `record`)
    numel, dtype, peer (p2p: the peer's global rank; broadcast: the source's)
    state      started -> completed | failed;  t0, t1 (wall clock seconds)

The entries live in fixed 64-byte binary slots of a memory map (`Recorder`), a file in PSLAB_FLIGHT_DIR when it is
set, so they outlive a killed or aborted process. They are written by the wrapper `ProcessGroup.__init_subclass__`
puts around each public call of a backend (flight_wrap.py; both backends record alike), generated with the method's
own signature. Each entry is one call a user made: a backend's public calls do not call each other (send waits on its
own _isend), and a hierarchical all-reduce's sub-groups are quiet (`_flight_quiet`). Cost per call: one 64-byte
slot packed, one clock read, a tensor's numel and dtype, one state byte (a completed call's end time is taken only
while a timeline is recorded): ~0.6 µs in a tight loop, ~1.3 µs inside a real call on a 2-core VM, where caches and
branch predictors are the call's as well. `pslab bench collectives --peers noflight` prices it against the
backend's own unwrapped methods: a 4 KiB all-reduce of two ranks (~15-30 µs of Python) takes ~8 % longer with it
(median of 5 runs of 31 paired reps; the earlier *args wrapper with a per-thread depth counter cost ~14 %). A
cost of 2 % there (~0.4 µs) is out of reach for any per-call Python; it would need the entry written in C.

When the record is written as JSON (`flight-<who>.json` in PSLAB_FLIGHT_DIR, atomically; nowhere without it):
a collective that raises (timeout, mismatch, dead peer), SIGUSR1 (the launcher asks a hung rank; `install_signal`),
a rank's end under `collectives.launch` (failed or not: a rank that finished early is evidence too), `dump()`.
PSLAB_FLIGHT_ENTRIES sets N (default 2000). `context(name, fn)` adds what a layer above knows at dump time (a PS
shard: who is parked at its gate, waiting for whom).
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import os
import signal
import socket
import struct
import threading
import time
from typing import Any, Callable

ENV_DIR = "PSLAB_FLIGHT_DIR"
ENV_ENTRIES = "PSLAB_FLIGHT_ENTRIES"
DEFAULT_ENTRIES = 2000
FORMAT = "pslab-flight/1"
P2P_OPS = ("send", "recv", "isend", "irecv")
TRACED_OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "barrier") + P2P_OPS

# an entry's fields as written in the JSON record
FIELDS = ("group", "seq", "op", "numel", "dtype", "peer", "state", "t0", "t1", "error")


def _entries_from_env() -> int:
    raw = os.environ.get(ENV_ENTRIES, "")
    try:
        n = int(raw) if raw else DEFAULT_ENTRIES
    except ValueError:
        n = DEFAULT_ENTRIES
    return max(16, min(n, 1 << 20))


RING_MAGIC = b"pslabFR2"
RING_HEADER = struct.Struct("<8sq")            # magic, capacity
# one slot per call: index (0, 1, ... for ordering), group, seq, op code, numel, dtype code, peer, t0, state, t1
RING_SLOT = struct.Struct("<qiqBqBidBd")
END_AT = 42                                     # offset of (state, t1) in a slot, written when the call ends
END = struct.Struct("<Bd")
SLOT_BYTES = 64
STATES = ("started", "completed", "failed")
EMPTY = -1
EMPTY_SLOT = struct.pack("<q", EMPTY) + bytes(SLOT_BYTES - 8)


class Recorder:
    """This process's ring of calls (one per process: `RECORDER`), fixed-size binary slots in a memory map.

    With PSLAB_FLIGHT_DIR set the map is a file, `flight-<who>.ring` (+ `flight-<who>.groups.json`: the groups and
    the op and dtype names the slots' codes stand for): the kernel keeps what was written even if the process is then
    killed or aborted (gloo ends a process with SIGABRT on a size mismatch), so a process that could not write its
    JSON record still leaves its calls (`read_ring`). Without it, an anonymous map (dumps still work, given a
    directory)."""

    def __init__(self, entries: int | None = None) -> None:
        self.capacity = entries or _entries_from_env()
        self.groups: list[dict[str, Any]] = []      # index = the slots' group field
        self._gidx: dict[int, int] = {}              # id(group object) -> index
        self._cseq: list[Any] = []                   # per group: its collective numbers (itertools.count)
        self._pseq: dict[tuple, int] = collections.defaultdict(int)   # (group, direction, peer) -> next p2p count
        self.ops: list[str] = list(TRACED_OPS)
        self.dtypes: list[str] = [""]
        self._opcode = {o: i for i, o in enumerate(self.ops)}
        self._dtcode: dict[Any, int] = {}
        self.errors: dict[int, str] = {}             # slot index -> why that call failed (the last few)
        self._contexts: dict[str, Callable[[], Any]] = {}
        self.who = ""                                # "rank3", "shard0": the dump's name (set_identity)
        self.enabled = True                          # False: calls pass unrecorded (`paused`: the bench's price)
        self.on_call: Callable[[int], None] | None = None   # the tracer's hook (trace.py): each ended slot index
        self.count = itertools.count()               # slot indexes (next() is atomic: threads never share one)
        self.written = 0                             # calls begun (slot index + 1 of the latest)
        self.ring_path = ""
        self._map(None)

    def _map(self, path: str | None) -> None:
        import mmap
        size = RING_HEADER.size + self.capacity * SLOT_BYTES
        if path is None:
            self.mm = mmap.mmap(-1, size)
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                os.ftruncate(fd, size)
                self.mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        RING_HEADER.pack_into(self.mm, 0, RING_MAGIC, self.capacity)
        self.mm[RING_HEADER.size:] = EMPTY_SLOT * self.capacity      # every slot empty (index -1), in one write

    def attach_file(self, directory: str) -> None:
        """Keep the ring in `directory`/flight-<who>.ring (see the class docstring); errors leave it in memory."""
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            self.ring_path = os.path.join(directory, f"flight-{self.who}.ring")
            self._map(self.ring_path)
            self.count, self.written = itertools.count(), 0
            for g in self.groups:               # groups cached the old map: they look themselves up again
                obj = g["obj"]()
                if getattr(obj, "_flight_gi", None) is not None:
                    obj._flight_gi = None
            self._write_meta()
        except OSError:
            self.ring_path = ""

    def _meta(self) -> dict[str, Any]:
        return {"format": FORMAT, "who": self.who or f"pid{os.getpid()}", "pid": os.getpid(),
                "host": socket.gethostname(), "ops": self.ops, "dtypes": self.dtypes,
                "groups": [{k: v for k, v in g.items() if k != "obj"} for g in self.groups]}

    def _write_meta(self) -> None:
        if not self.ring_path:
            return
        try:
            write_private(self.ring_path[:-len(".ring")] + ".groups.json", json.dumps(self._meta()))
        except OSError:
            pass

    # ---- identity of groups, ops and dtypes -------------------------------------------------------------------------
    def group_index(self, group: Any) -> int:
        mine = getattr(group, "_flight_gi", None)      # (recorder, index) cached on the group: one lookup per call
        if mine is not None and mine[0] is self:
            return mine[1]
        i = self._gidx.get(id(group))
        if i is not None and self.groups[i]["obj"]() is group:
            return i
        import weakref
        ranks = [int(r) for r in getattr(group, "ranks", ())]
        n = sum(1 for g in self.groups if g["ranks"] == ranks)
        try:
            ref: Callable[[], Any] = weakref.ref(group)
        except TypeError:
            ref = (lambda g=group: g)
        self.groups.append({"ranks": ranks, "n": n, "obj": ref, "backend": getattr(group, "backend", "?"),
                            "rank": int(getattr(group, "rank", -1))})
        self._cseq.append(itertools.count())
        i = self._gidx[id(group)] = len(self.groups) - 1
        try:        # what the wrapper needs, cached on the group: recorder, index, its counter, dtype codes, map
            group._flight_gi = (self, i, self._cseq[i], self._dtcode, self.mm, self.capacity)
        except AttributeError:
            pass
        self._write_meta()
        return i

    def name_group(self, group: Any, name: str) -> None:
        """Label a group with a mesh axis it serves (several axes may share one group: "dp+mp")."""
        g = self.groups[self.group_index(group)]
        names = [x for x in g.get("name", "").split("+") if x]
        if name not in names:
            g["name"] = "+".join(names + [name])
            self._write_meta()

    def op_code(self, op: str) -> int:
        c = self._opcode.get(op)
        if c is None:
            if len(self.ops) >= 255:
                raise ValueError("the flight recorder knows 255 op names at most")
            c = self._opcode[op] = len(self.ops)
            self.ops.append(op)
            self._write_meta()
        return c

    def dtype_code(self, dtype: Any) -> int:
        c = self._dtcode.get(dtype)
        if c is None:
            name = str(dtype).replace("torch.", "")
            if name in self.dtypes:
                c = self.dtypes.index(name)
            else:
                c = len(self.dtypes)
                self.dtypes.append(name[:32])
                self._write_meta()
            self._dtcode[dtype] = c
        return c

    # ---- recording ---------------------------------------------------------------------------------------------------
    def begin(self, gi: int, op: int, numel: int, dtype: int, peer: int, p2p: str = "") -> int:
        """A call starts: its slot index (for `end`). `p2p`: "s"/"r" for a send/receive (counted per peer)."""
        seq = self.p2p_seq(gi, p2p, peer) if p2p else next(self._cseq[gi])
        i = next(self.count)
        self.written = i + 1
        RING_SLOT.pack_into(self.mm, RING_HEADER.size + (i % self.capacity) * SLOT_BYTES,
                            i, gi, seq, op, numel, dtype, peer, time.time(), 0, 0.0)
        return i

    def p2p_seq(self, gi: int, direction: str, peer: int) -> int:
        """The count of earlier sends ("s") to / receives ("r") from `peer` on group gi: send #k matches receive #k."""
        key = (gi, direction, peer)
        seq = self._pseq[key]
        self._pseq[key] = seq + 1
        return seq

    def fields(self, t: Any) -> tuple[int, int]:
        """(numel, dtype code) of what a call was given: a tensor, an array, or nothing (a barrier: 1, "")."""
        if t is None:
            return 1, 0
        try:
            numel = int(t.numel())
        except (AttributeError, TypeError):
            numel = int(getattr(t, "size", 1))
        dt = getattr(t, "dtype", None)
        return numel, (self.dtype_code(dt) if dt is not None else 0)

    def end(self, i: int, error: BaseException | None = None) -> None:
        if self.written - i > self.capacity:          # its slot was reused meanwhile
            return
        off = RING_HEADER.size + (i % self.capacity) * SLOT_BYTES + END_AT
        hook = self.on_call
        if error is None and hook is None:   # the common case, kept cheap: the state byte only (t1 stays 0: the
            self.mm[off] = 1                 # recorder's verdicts need none; the timeline's hook gets one)
            return
        if error is not None:
            self.errors[i] = f"{type(error).__name__}: {error}"[:300]
            if len(self.errors) > 64:
                del self.errors[min(self.errors)]
        END.pack_into(self.mm, off, 1 if error is None else 2, time.time())
        if hook is not None:
            hook(i)

    def slot(self, i: int) -> tuple:
        """(index, group, seq, op code, numel, dtype code, peer, t0, state, t1) of slot index i."""
        return RING_SLOT.unpack_from(self.mm, RING_HEADER.size + (i % self.capacity) * SLOT_BYTES)

    def context(self, name: str, fn: Callable[[], Any]) -> None:
        """At each dump, `fn()` (plain JSON data) is written under contexts[name]; a failing fn is noted, not fatal."""
        self._contexts[name] = fn

    # ---- writing -----------------------------------------------------------------------------------------------------
    def snapshot(self, reason: str) -> dict[str, Any]:
        contexts = {}
        for name, fn in list(self._contexts.items()):
            try:
                contexts[name] = fn()
            except Exception as exc:  # a dump must not fail because a layer above could not say its state
                contexts[name] = {"error": f"{type(exc).__name__}: {exc}"}
        meta = self._meta()
        entries, _ = _entries(bytes(self.mm), self.capacity, meta["ops"], meta["dtypes"], self.errors)
        return {**meta, "reason": reason[:500], "time": time.time(), "capacity": self.capacity,
                "written": self.written, "entries": entries, "contexts": contexts}

    def dump(self, reason: str, directory: str | None = None) -> str | None:
        """Write the buffer to `directory` (default PSLAB_FLIGHT_DIR); the path, or None when there is nowhere."""
        d = directory or os.environ.get(ENV_DIR)
        if not d:
            return None
        try:
            os.makedirs(d, mode=0o700, exist_ok=True)
            path = os.path.join(d, f"flight-{self.who or 'pid' + str(os.getpid())}.json")
            write_private(path, json.dumps(self.snapshot(reason)))
            return path
        except OSError:
            return None


def write_private(path: str, text: str) -> None:
    """Atomically replace `path` with `text`, through a 0600 temp file that is never a link planted by someone
    else (O_EXCL | O_NOFOLLOW)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.unlink(tmp)                       # a stale one of ours (a link is removed, not followed)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _entries(data: bytes, capacity: int, ops: list[str], dtypes: list[str],
             errors: dict[int, str] | None = None) -> tuple[list[dict[str, Any]], int]:
    """The slots of a ring, oldest first, as entry dicts (FIELDS); and how many calls the ring has seen (its newest
    slot's index + 1)."""
    rows = []
    for k in range(capacity):
        row = RING_SLOT.unpack_from(data, RING_HEADER.size + k * SLOT_BYTES)
        if row[0] != EMPTY:
            rows.append(row)
    rows.sort()
    out = []
    for i, g, seq, op, numel, dt, peer, t0, state, t1 in rows:
        if op >= len(ops) or dt >= len(dtypes) or state >= len(STATES):
            raise ValueError(f"slot {i} names op {op} / dtype {dt} / state {state} that the record does not know")
        out.append({"group": g, "seq": seq, "op": ops[op], "numel": numel, "dtype": dtypes[dt], "peer": peer,
                    "state": STATES[state], "t0": t0, "t1": t1, "error": (errors or {}).get(i, "")})
    return out, (rows[-1][0] + 1 if rows else 0)


RECORDER = Recorder()              # a fresh one per process by set_identity (a launched rank, a shard)


def set_identity(who: str, directory: str | None = None) -> None:
    """Name this process in dumps ("rank3", "shard0"); a fresh buffer for a fresh process (a forked child), mirrored
    into `directory` (default PSLAB_FLIGHT_DIR, if set; it is then set for this process's dumps too)."""
    global RECORDER
    hook = RECORDER.on_call
    RECORDER = Recorder()
    RECORDER.who = who
    RECORDER.on_call = hook
    d = directory or os.environ.get(ENV_DIR)
    if d:
        os.environ[ENV_DIR] = d
        RECORDER.attach_file(d)


@contextlib.contextmanager
def paused() -> Any:
    """Calls inside pass unrecorded (the bench's "noflight" peer: the recorder's price). Swaps in a recorder that is
    off, so the wrapper's cached fast path notices at no cost of its own."""
    global RECORDER
    mine = RECORDER
    off = Recorder(entries=16)
    off.enabled, off.who, off.on_call = False, mine.who, None
    RECORDER = off
    try:
        yield
    finally:
        RECORDER = mine


def read_ring(path: str) -> dict[str, Any]:
    """A process's ring file (+ its .groups.json) as a record like a dump's, with reason "no record of its own ..."
    (no contexts, no error texts). Raises ValueError for a file that is not one."""
    with open(path, "rb") as f:
        data = f.read(RING_HEADER.size + (1 << 20) * SLOT_BYTES + 1)
    if len(data) < RING_HEADER.size:
        raise ValueError(f"{path}: too short for a flight ring")
    magic, cap = RING_HEADER.unpack_from(data, 0)
    if magic != RING_MAGIC or not 0 < cap <= 1 << 20 or len(data) != RING_HEADER.size + cap * SLOT_BYTES:
        raise ValueError(f"{path}: not a pslab flight ring")
    with open(path[:-len(".ring")] + ".groups.json") as f:
        meta = json.load(f)
    if not isinstance(meta, dict) or not all(isinstance(meta.get(k), list) for k in ("ops", "dtypes", "groups")):
        raise ValueError(f"{path}: its .groups.json is not a flight ring's")
    entries, written = _entries(data, cap, [str(o) for o in meta["ops"]], [str(d) for d in meta["dtypes"]])
    return {"format": FORMAT, "who": str(meta.get("who", "")), "pid": meta.get("pid", -1),
            "host": str(meta.get("host", "")), "ops": meta["ops"], "dtypes": meta["dtypes"],
            "reason": "no record of its own (still running, or killed or aborted): its calls as its ring file has them",
            "time": os.path.getmtime(path), "capacity": cap, "groups": meta["groups"],
            "written": written, "entries": entries, "contexts": {}}


def dump(reason: str, directory: str | None = None) -> str | None:
    return RECORDER.dump(reason, directory)


def install_signal() -> None:
    """SIGUSR1 writes the buffer (chained after whatever handler faulthandler or others put there first: call this
    before `faulthandler.register(SIGUSR1, chain=True)`)."""
    def handler(signum: int, frame: Any) -> None:
        RECORDER.dump("SIGUSR1 (asked by the launcher, or by hand: kill -USR1)")
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, handler)
