"""The timeline: spans of what each process did and when, for `pslab trace` (Chrome trace / Perfetto) and its analysis.

Off unless started (`start`, by a run with [trace] enabled = true). Then every process keeps, in memory, bounded:

    X  complete events  name, cat, ts, dur (µs, wall clock), tid (the thread), args
         cat: compute (forward, backward, a micro-batch's F or B), comm (a collective or blocking p2p: the flight
         recorder's entries, flight.py, one hook for both backends; args: group axis, seq, numel, dtype, bytes;
         a wait on another thread's communication), pad (straggler padding), wait (a PS read parked at a gate),
         ps (a shard's apply of a push), sync / phase (the loop's phases), io (a checkpoint), elastic (a recovery)
    b/e async pairs     isend / irecv from call to wait (they need not nest with the spans around them)

and writes them as JSON (`trace-<who>.json`, never pickle) when it stops; `experiments/results/timeline.py` merges
the files of a run into one trace.json (one track per rank and shard, flows from each send to its receive) and
measures compute / communication / exposed communication / waiting per rank from it.

Clocks: every event is stamped start-of-trace wall time + perf_counter elapsed (µs), so processes on one host share
one clock (the offset is taken once per process, at start); the flight recorder's wall-clock stamps are mapped onto
it with the offset of the moment they arrive. (Across hosts the wall
clocks differ by what NTP leaves: the merged trace says so.) A cap (`max_events`, default 200,000) bounds memory
and file size; events past it are counted, not kept, and the merged trace notes it.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import Any, Iterator

from . import flight

FORMAT = "pslab-trace/1"
ENV_DIR = "PSLAB_TRACE_DIR"        # set by a traced run for the processes it starts (PS shards start tracing there)
MAX_EVENTS = 200_000
ASYNC_OPS = ("isend", "irecv")
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
            "uint8": 1, "bool": 1}


class Tracer:
    """This process's events (see the module docstring); `TRACER` while started."""

    def __init__(self, directory: str, who: str, meta: dict[str, Any], max_events: int = MAX_EVENTS) -> None:
        self.directory, self.who, self.meta, self.max_events = directory, who, dict(meta), max_events
        self.events: list[tuple] = []           # (ph, name, cat, ts_us, dur_us, tid, args)
        self.dropped = 0
        self.offset = time.time() - time.perf_counter()
        self.step = -1                           # the training step in progress (the loop sets it)

    def _add(self, ev: tuple) -> None:
        if len(self.events) >= self.max_events:
            self.dropped += 1
            return
        self.events.append(ev)                   # (list.append is atomic under the GIL)

    def complete(self, name: str, cat: str, pc0: float, pc1: float, **args: Any) -> None:
        """A span from perf_counter time pc0 to pc1 on the calling thread."""
        if self.step >= 0:
            args.setdefault("step", self.step)
        self._add(("X", name, cat, (pc0 + self.offset) * 1e6, max(0.0, pc1 - pc0) * 1e6, threading.get_ident(),
                   args))

    @contextlib.contextmanager
    def span(self, name: str, cat: str, **args: Any) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.complete(name, cat, t0, time.perf_counter(), **args)

    def on_call(self, i: int) -> None:
        """The flight recorder's hook: an ended call becomes a comm event."""
        rec = flight.RECORDER
        _, g, seq, op, numel, dt, peer, t0, state, t1 = rec.slot(i)
        name = rec.ops[op]
        if name.startswith("ps."):               # a PS client's call: the strategy's push_pull span shows it
            return
        grp = rec.groups[g]
        dtype = rec.dtypes[dt]
        args = {"group": grp.get("name") or "world", "ranks": grp["ranks"], "gen": grp["n"], "seq": seq,
                "numel": numel, "dtype": dtype, "bytes": numel * ITEMSIZE.get(dtype, 0),
                "state": flight.STATES[state]}
        if peer >= 0:
            args["peer"] = peer
        if self.step >= 0:
            args["step"] = self.step
        # the recorder stamps wall time; spans use perf_counter + the start offset: map by the offset of now, so
        # that NTP slewing the wall clock during a run cannot push a call outside the span it is nested in
        shift = self.offset - (time.time() - time.perf_counter())
        ts, te = (t0 + shift) * 1e6, (t1 + shift) * 1e6
        if name in ASYNC_OPS:
            self._add(("b", name, "comm", ts, 0.0, i, args))
            self._add(("e", name, "comm", te, 0.0, i, {}))
        else:
            self._add(("X", name, "comm", ts, max(0.0, te - ts), threading.get_ident(), args))

    def write(self) -> str:
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        path = os.path.join(self.directory, f"trace-{self.who}.json")
        tids: dict[int, int] = {}
        main = threading.main_thread().ident
        events = []
        for ph, name, cat, ts, dur, tid, args in list(self.events):
            if ph == "X":
                tid = 0 if tid == main else tids.setdefault(tid, len(tids) + 1)
            events.append({"ph": ph, "name": name, "cat": cat, "ts": round(ts, 3), "dur": round(dur, 3),
                           "tid": tid, "args": args})
        flight.write_private(path, json.dumps(
            {"format": FORMAT, "who": self.who, "pid": os.getpid(), "meta": self.meta,
             "threads": {"0": "main", **{str(v): f"thread {v}" for v in tids.values()}},
             "dropped": self.dropped, "max_events": self.max_events, "events": events}))
        return path


TRACER: Tracer | None = None
_NULL = contextlib.nullcontext()


def start(directory: str, who: str, max_events: int = MAX_EVENTS, **meta: Any) -> Tracer:
    """Record this process's timeline into `directory` (written by `stop`)."""
    global TRACER
    TRACER = Tracer(directory, who, meta, max_events)
    flight.RECORDER.on_call = TRACER.on_call
    return TRACER


def stop() -> str | None:
    """Write and stop; the file's path, or None if tracing was off."""
    global TRACER
    t, TRACER = TRACER, None
    if t is None:
        return None
    if flight.RECORDER.on_call == t.on_call:
        flight.RECORDER.on_call = None
    return t.write()


def span(name: str, cat: str, **args: Any) -> Any:
    """`with trace.span("optimizer", "compute"):` -- a no-op context while tracing is off."""
    t = TRACER
    return _NULL if t is None else t.span(name, cat, **args)


def waiting(what: str) -> Any:
    """`with trace.waiting("all-reduce bucket"): future.result()` -- a thread blocked on communication another
    thread (or an isend) carries: counted as communication, so it is exposed, not compute."""
    t = TRACER
    return _NULL if t is None else t.span(f"wait: {what}", "comm")


def complete(name: str, cat: str, pc0: float, pc1: float, **args: Any) -> None:
    t = TRACER
    if t is not None:
        t.complete(name, cat, pc0, pc1, **args)


def set_step(step: int) -> None:
    t = TRACER
    if t is not None:
        t.step = step
