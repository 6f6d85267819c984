"""Match the ranks' flight records (flight.py) and say in words what went wrong, like torchfrtrace.

Collectives are matched per group by sequence number: at each #seq every member must have called the same op, on
the same number of elements of the same dtype. The first seq where they do not is the group's verdict:

    missing ranks   some members never called #seq (they finished, died, or wait elsewhere) -- the usual hang
    type mismatch   members called different ops at #seq (one rank skipped a call, or the order differs)
    size / dtype    same op, different numel or dtype
    state           all called it, some completed it and some did not

Point-to-point calls are matched per ordered pair by count: rank a's k-th send to b is b's k-th receive from a. A
receive with no send names the rank that never sent; a send never received, the rank that never received.
Only the window every member still holds is compared (the buffers are rings of PSLAB_FLIGHT_ENTRIES).
Layers above add what only they know through the dumps' contexts: a "waits" list of sentences (a PS shard: which
worker is parked at its SSP gate, waiting for which straggler) is quoted as is.

    d = diagnose_dir("runs/x/flight");  print("\\n".join(d.problems or ["no problem found"]))
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from . import flight
from .errors import CollectivesError
from .flight import FIELDS, FORMAT, P2P_OPS

MAX_FILE_BYTES = 64 << 20


class FlightRecordError(CollectivesError, ValueError):
    """A flight record file is not one pslab wrote (or was cut short): its path and what is wrong."""


@dataclasses.dataclass
class Diagnosis:
    problems: list[str]           # the verdicts, most telling first
    notes: list[str]              # what matched, where each rank was
    records: int                  # flight records read


def _check_entry(e: Any, path: str, ngroups: int) -> dict[str, Any]:
    if not isinstance(e, dict) or set(e) != set(FIELDS):
        raise FlightRecordError(f"{path}: an entry is not {{{', '.join(FIELDS)}}}")
    ints = ("group", "seq", "numel", "peer")
    if not all(isinstance(e[k], int) and not isinstance(e[k], bool) for k in ints):
        raise FlightRecordError(f"{path}: an entry's {'/'.join(ints)} are not integers")
    if not 0 <= e["group"] < ngroups:
        raise FlightRecordError(f"{path}: an entry names group {e['group']}, the record has {ngroups}")
    if not all(isinstance(e[k], str) for k in ("op", "dtype", "state", "error")) or \
            e["state"] not in ("started", "completed", "failed"):
        raise FlightRecordError(f"{path}: an entry's op/dtype/state/error are not valid strings")
    if not all(isinstance(e[k], (int, float)) and math.isfinite(e[k]) for k in ("t0", "t1")):
        raise FlightRecordError(f"{path}: an entry's times are not finite numbers")
    return e


def read_ring(path: str) -> dict[str, Any]:
    try:
        return flight.read_ring(path)
    except (OSError, ValueError) as exc:
        raise FlightRecordError(f"{path}: not a readable flight ring ({exc})") from None


def load_record(path: str) -> dict[str, Any]:
    """Read and validate one flight record (JSON, never pickle)."""
    if os.path.getsize(path) > MAX_FILE_BYTES:
        raise FlightRecordError(f"{path}: larger than {MAX_FILE_BYTES >> 20} MiB; not a flight record")
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError) as exc:
        raise FlightRecordError(f"{path}: not readable JSON ({exc})") from None
    return _checked(d, path)


def _checked(d: Any, path: str) -> dict[str, Any]:
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise FlightRecordError(f"{path}: not a {FORMAT} record")
    groups = d.get("groups")
    if not isinstance(groups, list) or not all(
            isinstance(g, dict) and isinstance(g.get("ranks"), list) and all(isinstance(r, int) for r in g["ranks"])
            and isinstance(g.get("n"), int) and isinstance(g.get("rank"), int) for g in groups):
        raise FlightRecordError(f"{path}: its groups are not [{{ranks, n, rank, ...}}]")
    if not isinstance(d.get("entries"), list) or not isinstance(d.get("who"), str) or \
            not isinstance(d.get("reason"), str) or not isinstance(d.get("contexts", {}), dict):
        raise FlightRecordError(f"{path}: who/reason/entries/contexts missing or of the wrong type")
    d["entries"] = [_check_entry(e, path, len(groups)) for e in d["entries"]]
    return d


def _what(e: dict[str, Any]) -> str:
    return f"{e['op']} #{e['seq']} ({e['numel']} x {e['dtype']})" if e["dtype"] else f"{e['op']} #{e['seq']}"


def _ended(d: dict[str, Any]) -> str:
    r = d["reason"]
    if r == "finished":
        return "then finished its program"
    if r.startswith("no record"):
        return "(it wrote no record of its own: still running, or killed or aborted)"
    if r.startswith("SIGUSR1"):
        return "and was still running when asked"
    return f"and then {r}" if r.startswith("failed") else f"(its record was written on: {r})"


def _names(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


class _Group:
    def __init__(self, key: tuple, name: str) -> None:
        self.key, self.name = key, name
        self.members: dict[int, dict[str, Any]] = {}      # global rank -> its dump
        self.entries: dict[int, list[dict[str, Any]]] = {}
        self.missing: set[int] = set()                      # (set by _collectives) ranks absent from a call ...
        self.waiting: set[int] = set()                      # ... that these wait in

    @property
    def label(self) -> str:
        return f"{self.name + ' ' if self.name else ''}group [{', '.join(map(str, self.key[0]))}]"


def diagnose(records: list[dict[str, Any]]) -> Diagnosis:
    """The verdicts over validated records (load_record)."""
    groups: dict[tuple, _Group] = {}
    problems: list[str] = []
    notes: list[str] = []
    for d in records:
        for gi, g in enumerate(d["groups"]):
            key = (tuple(g["ranks"]), g["n"])
            grp = groups.setdefault(key, _Group(key, str(g.get("name", ""))))
            if not 0 <= g["rank"] < len(g["ranks"]):
                continue
            me = g["ranks"][g["rank"]]
            grp.members[me] = d
            grp.entries[me] = [e for e in d["entries"] if e["group"] == gi]
        for name, ctx in d.get("contexts", {}).items():
            waits = ctx.get("waits", []) if isinstance(ctx, dict) else []
            problems.extend(f"{d['who']}: {w}" for w in waits if isinstance(w, str))
    for key in sorted(groups, key=lambda k: (-len(k[0]), k)):
        grp = groups[key]
        missing = [r for r in key[0] if r not in grp.members]
        found = _collectives(grp) + _p2p(grp)
        if missing and (found or any(e["state"] != "completed" for es in grp.entries.values() for e in es)):
            found.append(f"{grp.label}: {_names(missing)} left no flight record (killed, or never started)")
        problems.extend(found)
    problems = _root(groups, records) + problems
    for d in records:
        for e in d["entries"]:
            if e["state"] == "started" and d["reason"] != "finished":
                g = d["groups"][e["group"]]
                where = f"{d['who']} is in {_what(e)} of {g.get('name') or 'the'} group {g['ranks']}"
                notes.append(f"{where}, not completed" if d["reason"].startswith("no record") else
                             f"{where}, for {max(0.0, d['time'] - e['t0']):.1f} s when it wrote its record")
    return Diagnosis(problems, notes, len(records))


def _root(groups: dict[tuple, _Group], records: list[dict[str, Any]]) -> list[str]:
    """The rank(s) the others wait for: missing from a call somewhere and inside no unfinished call themselves
    (stopped, hung outside communication, dead, or finished) -- said first, since every other verdict follows."""
    missing = set().union(*(g.missing for g in groups.values())) if groups else set()
    waiting = set().union(*(g.waiting for g in groups.values())) if groups else set()
    busy = set()
    for g in groups.values():
        for r, es in g.entries.items():
            if es and es[-1]["state"] == "started":
                busy.add(r)
    root = sorted(missing - busy)
    if not root or len(missing) < 2 and len(groups) < 2:
        return []
    it = "it" if len(root) == 1 else "them"
    return [f"{_names(root)}: what the others wait for -- in no call of {'its' if it == 'it' else 'their'} own "
            f"(stopped, hung outside communication, dead, or finished) while "
            f"{_names(sorted(waiting - set(root)))} wait for {it}"]


def _collectives(grp: _Group) -> list[str]:
    by = {r: {e["seq"]: e for e in es if e["op"] not in P2P_OPS} for r, es in grp.entries.items()}
    held = [s for s in by.values() if s]
    if not held:
        return []
    lo, hi = max(min(s) for s in held), max(max(s) for s in held)
    for seq in range(lo, hi + 1):
        at = {r: s.get(seq) for r, s in by.items()}
        there = {r: e for r, e in at.items() if e is not None}
        absent = sorted(r for r, e in at.items() if e is None)
        first = there[min(there)]
        if absent:
            where = "; ".join(
                f"rank {r} last called {_what(by[r][max(by[r])]) if by[r] else 'nothing in this group'} "
                f"{_ended(grp.members[r])}" for r in absent)
            waiting = sorted(r for r, e in there.items() if e["state"] != "completed")
            verb = " waits in" if len(waiting) == 1 else " wait in"
            grp.missing, grp.waiting = set(absent), set(waiting)
            return [f"{grp.label}: missing {_names(absent)} in collective {_what(first)}"
                    f"{' that ' + _names(waiting) + verb if waiting else ''}; {where}"]
        for field, kind in (("op", "collective type"), ("numel", "size"), ("dtype", "dtype")):
            values = {e[field] for e in there.values()}
            if len(values) > 1:
                who = ", ".join(f"rank {r} {_what(e)}" for r, e in sorted(there.items()))
                return [f"{grp.label}: {kind} mismatch at collective #{seq}: {who}"]
        states = {e["state"] for e in there.values()}
        if len(states) > 1 and "completed" in states:
            who = ", ".join(f"rank {r} {e['state']}" for r, e in sorted(there.items()))
            return [f"{grp.label}: state mismatch at {_what(first)}: {who}"]
        if "failed" in states:
            r, e = next((r, e) for r, e in sorted(there.items()) if e["state"] == "failed")
            return [f"{grp.label}: {_what(e)} failed on rank {r}: {e['error']}"]
    return []


def _p2p(grp: _Group) -> list[str]:
    out = []
    for a in grp.members:
        for b in grp.members:
            if a == b:
                continue
            sends = {e["seq"]: e for e in grp.entries[a] if e["op"] in ("send", "isend") and e["peer"] == b}
            recvs = {e["seq"]: e for e in grp.entries[b] if e["op"] in ("recv", "irecv") and e["peer"] == a}
            if not sends and not recvs:
                continue
            lo = max(min(sends, default=0), min(recvs, default=0))
            for k in sorted(set(sends) | set(recvs)):
                if k < lo:
                    continue
                s, r = sends.get(k), recvs.get(k)
                if s is None and r is not None and r["state"] != "completed":
                    out.append(f"{grp.label}: rank {b} waits in {_what(r)} from rank {a}, which never sent "
                               f"it: rank {a} sent {len(sends)} message(s) to rank {b} {_ended(grp.members[a])}")
                    break
                if r is None and s is not None and s["state"] != "completed":
                    out.append(f"{grp.label}: rank {a}'s {_what(s)} to rank {b} was never received: rank {b} "
                               f"received {len(recvs)} from rank {a} {_ended(grp.members[b])}")
                    break
                if s is not None and r is not None and (s["numel"], s["dtype"]) != (r["numel"], r["dtype"]):
                    out.append(f"{grp.label}: p2p #{k} from rank {a} to rank {b}: sent {_what(s)}, "
                               f"received into {_what(r)} (size or dtype mismatch)")
                    break
    return out


def diagnose_dir(path: str) -> Diagnosis:
    """Read every flight-*.json in `path` (a run dir's flight/ or the directory itself) and diagnose them."""
    if os.path.isdir(os.path.join(path, "flight")):
        path = os.path.join(path, "flight")
    if not os.path.isdir(path):
        raise FlightRecordError(f"{path}: no such directory (a run directory, or its flight/ folder)")
    names = sorted(os.listdir(path))
    records: dict[str, dict[str, Any]] = {}
    for f in names:
        if f.startswith("flight-") and f.endswith(".json") and not f.endswith(".groups.json"):
            d = load_record(os.path.join(path, f))
            records[d["who"]] = d
    for f in names:      # a process that wrote no record, or called more after it wrote one: what its ring file has
        if f.startswith("flight-") and f.endswith(".ring"):
            ring = _checked(read_ring(os.path.join(path, f)), os.path.join(path, f))
            dumped = records.get(ring["who"])
            if dumped is None or ring["written"] > dumped.get("written", 0):
                records[ring["who"]] = ring
    if not records:
        raise FlightRecordError(f"{path}: no flight records (flight-*.json or flight-*.ring) in it: a run directory "
                                "of a pslab run, or its flight/ folder")
    return diagnose(list(records.values()))
