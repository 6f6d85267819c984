"""The flight recorder's wrapper: what `ProcessGroup.__init_subclass__` puts around each public call of a backend, so
every call leaves an entry in this process's ring (flight.py) — both backends alike.

Generated per backend method with the method's own signature (a *args / **kwargs wrapper costs a tuple and a dict
per call, ~0.2 µs: half the price), it reads the group's cache (recorder, group index, the group's collective
counter, dtype codes, the ring's map) and writes one 64-byte slot: index, group, seq, op, numel, dtype, peer, start
time; a completed call flips one state byte (its end time is taken only while a timeline is recorded). Each entry is
one call a user made: a backend's public calls do not call each other (send waits on its own _isend), and a
hierarchical all-reduce's sub-groups are quiet (`_flight_quiet`). A call that raises is marked failed and the record
written (flight.dump); an isend / irecv returns a handle whose wait() completes its entry.

Cost: ~0.6 µs a call in a tight loop, ~1.3 µs inside a real call (`pslab bench collectives --peers noflight`; see
flight.py's docstring for the figures).
"""

from __future__ import annotations

import functools
import inspect
import time
from typing import Any, Callable

from . import flight
from .flight import END_AT, P2P_OPS, RING_HEADER, RING_SLOT, SLOT_BYTES, TRACED_OPS, Recorder


class _RecordedWork:
    """An isend/irecv handle whose wait() completes its entry."""

    def __init__(self, work: Any, i: int, rec: Recorder) -> None:
        self._work, self._i, self._rec, self._done = work, i, rec, False

    def wait(self, timeout: float | None = None) -> Any:
        try:
            out = self._work.wait(timeout) if timeout is not None else self._work.wait()
        except Exception as exc:
            self._rec.end(self._i, exc)
            _dump_on(exc, self._rec, self._i)
            raise
        if not self._done:
            self._done = True
            self._rec.end(self._i)
        return out

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _dump_on(exc: Exception, rec: Recorder, i: int) -> None:
    _, _, seq, op, *_ = rec.slot(i)
    rec.dump(f"{rec.ops[op]} #{seq} failed: {type(exc).__name__}: {exc}")


def _paramlists(fn: Callable) -> tuple[str, str, list[str], dict[str, Any]] | None:
    """(the parameter list after self, the call's argument list, the parameter names, the defaults by name) of a
    backend method, for a wrapper with its own signature; None when it takes *args or **kwargs."""
    params, args, names, defaults = [], [], [], {}
    keyword_only = False
    for k, prm in enumerate(inspect.signature(fn).parameters.values()):
        if k == 0:
            continue
        if prm.kind in (prm.VAR_POSITIONAL, prm.VAR_KEYWORD, prm.POSITIONAL_ONLY):
            return None
        if prm.kind == prm.KEYWORD_ONLY and not keyword_only:
            keyword_only = True
            params.append("*")
        text = prm.name
        if prm.default is not prm.empty:
            defaults[f"_default_{prm.name}"] = prm.default
            text += f"=_default_{prm.name}"
        params.append(text)
        args.append(f"{prm.name}={prm.name}" if keyword_only else prm.name)
        names.append(prm.name)
    return ", ".join(params), ", ".join(args), names, defaults


# The wrapper of one backend call, generated with the method's own signature (a *args / **kwargs wrapper costs a
# tuple and a dict per call, ~0.2 µs: half the recorder's price). {tensor}: the parameter whose numel and dtype are
# recorded; {peer}: the peer's global rank; {seq}: the group's next collective number, or the p2p count.
_TEMPLATE = """
def make(fn, code, pack_slot, now, HEADER, SLOT_BYTES, END_AT, _cache, _dump_on, _RecordedWork, _peer{defaults}):
    def {name}(self{comma}{params}):
        mine = self._flight_gi
        if mine is None or mine[0] is not RECORDER:
            mine = _cache(self)
            if mine is None:
                return fn(self{comma}{args})
        rec, gi, seqs, dtcodes, mm, cap = mine
        {fields}
        peer = {peer}
        seq = {seq}
        i = next(rec.count)
        rec.written = i + 1
        off = HEADER + (i % cap) * SLOT_BYTES
        pack_slot(mm, off, i, gi, seq, code, numel, dtype, peer, now(), 0, 0.0)
        try:
            out = fn(self{comma}{args})
        except Exception as exc:
            rec.end(i, exc)
            _dump_on(exc, rec, i)
            raise
        {finish}
    return {name}
"""
_FIELDS = """try:
            numel = {tensor}.numel()
            dtype = dtcodes[{tensor}.dtype]
        except (AttributeError, KeyError, TypeError):   # not a torch tensor, or a dtype first seen
            numel, dtype = rec.fields({tensor})"""
_FINISH_SYNC = """if rec.on_call is None and rec.written - i <= cap:   # Recorder.end's common case, inlined
        mm[off + END_AT] = 1
    else:
        rec.end(i)
    return out"""


def _cache(group: Any) -> tuple | None:
    """The wrapper's slow path: (recorder, group index, the group's collective counter, dtype codes) cached on the
    group; None when calls pass unrecorded (a sub-group of a hierarchical all-reduce, or the recorder paused)."""
    rec = flight.RECORDER
    if not rec.enabled or getattr(group, "_flight_quiet", False):
        return None
    rec.group_index(group)
    return group._flight_gi


def recorded(op: str, fn: Callable) -> Callable:
    """Wrap a backend's public `op` so every call leaves an entry (ProcessGroup.__init_subclass__ applies it).
    Kept to the bone: it runs on every call of every group (the bench's "noflight" peer prices it). A backend's
    public calls must not call each other (send calls its own _isend, not isend): each entry is one call a user made."""
    lists = _paramlists(fn)
    if lists is None:
        raise TypeError(f"{fn.__qualname__}: a recorded backend call takes named parameters (no *args, **kwargs)")
    params, args, names, defaults = lists
    p2p = ("s" if op in ("send", "isend") else "r") if op in P2P_OPS else ""
    tensor = ("input" if op in ("reduce_scatter", "all_gather") else "output" if op == "all_to_all" else
              "tensor") if names else "None"
    if tensor != "None" and tensor not in names:
        tensor = names[0]
    who = "dst" if p2p == "s" else "src"
    peer = f"_peer(self, {who})" if (p2p or op == "broadcast") and who in names else "-1"
    seq = f'rec.p2p_seq(gi, "{p2p}", peer)' if p2p else "next(seqs)"
    finish = "return _RecordedWork(out, i, rec)" if op in ("isend", "irecv") else _FINISH_SYNC
    fields = "numel, dtype = 1, 0" if tensor == "None" else _FIELDS.format(tensor=tensor)
    src = _TEMPLATE.format(name=op, comma=", " if params else "", params=params, args=args, tensor=tensor,
                           peer=peer, seq=seq, finish=finish.replace("\n", "\n    "), fields=fields,
                           defaults="".join(f", {d}" for d in defaults))
    scope: dict[str, Any] = {}
    # run in flight's namespace: the wrapper reads the live RECORDER (set_identity replaces it); the rest it
    # needs comes in as the factory's arguments (closure cells: as fast as locals)
    exec(compile(src, f"<flight wrapper of {fn.__qualname__}>", "exec"), vars(flight), scope)
    call = scope["make"](fn, TRACED_OPS.index(op), RING_SLOT.pack_into, time.time, RING_HEADER.size, SLOT_BYTES,
                         END_AT, _cache, _dump_on, _RecordedWork, _peer, *defaults.values())
    return functools.wraps(fn)(call)


def _peer(group: Any, r: Any) -> int:
    try:
        return int(group.ranks[int(r)])
    except (IndexError, TypeError, ValueError):
        return -1
