"""A traced run's timeline: the processes' trace files merged into one Chrome trace, and what it measures.

    merge(run_dir) -> RUN_DIR/trace.json    open it in ui.perfetto.dev or chrome://tracing

One track (pid) per rank, named "rank 3 · dp1 pp1 tp0", and per PS shard; a thread row per Python thread (the
main loop, a data-parallel communication thread); flows (`s` -> `f`, one id) from every send to its receive (the
k-th send from a to b in a group is b's k-th receive from a) and from a PS push_pull to the shard's apply of it.

Analysis (HTA's definitions, on CPU spans), per rank over its steady steps (every traced step but the first, which
connects; not the start-up, the final barrier or evaluation after the last step):

    compute     time inside compute spans (forward, backward, F/B of a micro-batch, the optimizer's part of
                "sync + update") minus the communication calls nested in them on the same thread
    comm        the union of communication intervals (collectives, blocking p2p, PS push_pull), on any thread;
                an isend/irecv in flight is drawn but not counted (issued early, waited late, it would count
                the whole step): what it costs shows where a rank blocks on it
    exposed     comm not overlapped by compute (what the step waits for)
    overlap     |compute ∩ comm| / |comm|  (0: fully exposed; 1: fully hidden behind compute)
    waiting     PS reads parked at a shard's gate (shard tracks; and summed per worker);  padding: a step padded to
                train.base_step_s or by a straggler's factor ([stragglers])

Pipeline bubble, measured: per step, 1 − Σ_stages busy / (p · makespan) over the F/B compute spans of one
pipeline (ranks with the same coordinates but pp), next to (p − 1)/(m + p − 1) for GPipe and 1F1B (and
(p − 1)/(v·m + p − 1) with v virtual stages, interleaved 1F1B).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Iterable

from pslab.experiments.errors import ExperimentError

FORMAT = "pslab-trace/1"
MAX_FILE_BYTES = 512 << 20
CATS = ("compute", "comm", "sync", "phase", "pad", "wait", "ps", "step", "io", "elastic")


class TraceError(ExperimentError, ValueError):
    """A run's trace files are missing or are not pslab's."""


def _load(path: Path) -> dict[str, Any]:
    if path.stat().st_size > MAX_FILE_BYTES:
        raise TraceError(f"{path}: over {MAX_FILE_BYTES >> 20} MiB; not a pslab trace file")
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TraceError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT or not isinstance(d.get("events"), list) \
            or not isinstance(d.get("who"), str) or not isinstance(d.get("meta"), dict):
        raise TraceError(f"{path}: not a {FORMAT} file")
    for e in d["events"]:
        if not (isinstance(e, dict) and e.get("ph") in ("X", "b", "e") and isinstance(e.get("name"), str)
                and e.get("cat") in CATS and all(isinstance(e.get(k), (int, float)) and math.isfinite(e[k])
                                                 for k in ("ts", "dur", "tid")) and isinstance(e.get("args"), dict)):
            raise TraceError(f"{path}: an event is not {{ph X|b|e, name, cat, ts, dur, tid, args}}: {str(e)[:120]}")
    return d


def load_run(run_dir: str | Path) -> list[dict[str, Any]]:
    """The trace files of a run (RUN_DIR/trace/trace-*.json), ranks first, then shards."""
    if not Path(run_dir).is_dir():
        raise TraceError(f"{run_dir}: no such directory (a run directory made with --trace)")
    folder = Path(run_dir) / "trace"
    files = sorted(folder.glob("trace-*.json")) if folder.is_dir() else []
    if not files:
        raise TraceError(f"{run_dir}: no trace files (RUN_DIR/trace/trace-*.json): run it with --trace "
                         "(or [trace] enabled = true)")
    procs = [_load(f) for f in files]
    return sorted(procs, key=lambda d: (d["meta"].get("role") != "rank", d["meta"].get("rank", 0),
                                        d["meta"].get("shard", 0), d["who"]))


def _pid(d: dict[str, Any]) -> int:
    m = d["meta"]
    return int(m["rank"]) if m.get("role") == "rank" else 1000 + int(m.get("shard", 0))


def _track_name(d: dict[str, Any]) -> str:
    m = d["meta"]
    if m.get("role") == "rank":
        return f"rank {m['rank']}" + (f" · {m['label']}" if m.get("label") else "")
    return f"PS shard {m.get('shard', 0)}"


def chrome_trace(procs: list[dict[str, Any]]) -> dict[str, Any]:
    """One Chrome-trace object from the processes' events (module docstring)."""
    out: list[dict[str, Any]] = []
    for d in procs:
        pid = _pid(d)
        out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": _track_name(d)}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for tid, name in d.get("threads", {}).items():
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": int(tid), "args": {"name": name}})
        for e in d["events"]:
            ev = {"ph": e["ph"], "name": e["name"], "cat": e["cat"], "ts": e["ts"], "pid": pid, "args": e["args"]}
            if e["ph"] == "X":
                ev["dur"], ev["tid"] = e["dur"], int(e["tid"])
            else:                                   # async pairs: their own row, matched by id
                ev["id"], ev["tid"] = f"{pid}.{int(e['tid'])}", 0
            out.append(ev)
    out.extend(_flows(procs))
    notes = [f"{d['who']}: {d['dropped']} events past its cap of {d.get('max_events')} were not kept"
             for d in procs if d.get("dropped")]
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"made_by": "pslab trace", "clock": "wall clock (one host: shared; across hosts: as NTP "
                                                              "keeps them)", "notes": notes}}


def _flows(procs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Flow events: each send to its receive (by group, pair and count) and each push_pull to its shard applies."""
    sends: dict[tuple, tuple[int, dict]] = {}
    recvs: dict[tuple, tuple[int, dict]] = {}
    pushes: dict[tuple, tuple[int, dict]] = {}
    applies: list[tuple[int, dict]] = []
    for d in procs:
        pid = _pid(d)
        me = d["meta"].get("rank")
        for e in d["events"]:
            a = e["args"]
            if e["ph"] == "e":
                continue
            if e["name"] in ("send", "isend", "recv", "irecv") and "peer" in a:
                key = (tuple(a.get("ranks", ())), a.get("gen", 0), a.get("seq", 0))
                if e["name"] in ("send", "isend"):
                    sends[(me, a["peer"]) + key] = (pid, e)
                else:
                    recvs[(a["peer"], me) + key] = (pid, e)
            elif e["name"] == "push_pull":
                pushes[(a.get("worker"), a.get("clock"))] = (pid, e)
            elif e["name"] == "apply push":
                applies.append((pid, e))
    out: list[dict[str, Any]] = []
    n = 0
    for key, (spid, s) in sends.items():
        hit = recvs.get(key)
        if hit is None:
            continue
        rpid, r = hit
        n += 1
        out += _flow(n, "p2p", spid, s, rpid, r)
    for apid, a in applies:
        hit = pushes.get((a["args"].get("worker"), a["args"].get("clock")))
        if hit is None:
            continue
        ppid, p = hit
        n += 1
        out += _flow(n, "push", ppid, p, apid, a)
    return out


def _flow(n: int, name: str, spid: int, s: dict, rpid: int, r: dict) -> list[dict[str, Any]]:
    stid = 0 if s["ph"] != "X" else int(s["tid"])
    rtid = 0 if r["ph"] != "X" else int(r["tid"])
    return [{"ph": "s", "name": name, "cat": "flow", "id": n, "pid": spid, "tid": stid, "ts": s["ts"]},
            {"ph": "f", "bp": "e", "name": name, "cat": "flow", "id": n, "pid": rpid, "tid": rtid,
             "ts": max(r["ts"], s["ts"])}]


# ---- intervals ----------------------------------------------------------------------------------------------------
def _union(iv: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(iv):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(iv: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in iv)


def _intersect(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def _minus(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out = []
    for a, b in x:
        cur = a
        for c, d in y:
            if d <= cur or c >= b:
                continue
            if c > cur:
                out.append((cur, c))
            cur = max(cur, d)
        if cur < b:
            out.append((cur, b))
    return out


def steady(d: dict[str, Any]) -> list[dict[str, Any]]:
    """A rank's events of its steady steps: tagged with a step, the first step left out (it connects, and sends
    the pipeline's shape headers) when there are others; a shard's events: all of them."""
    if d["meta"].get("role") != "rank":
        return d["events"]
    steps = {e["args"]["step"] for e in d["events"] if isinstance(e["args"].get("step"), int)}
    keep = steps - {min(steps)} if len(steps) > 1 else steps
    return [e for e in d["events"] if e["args"].get("step") in keep]


def _intervals(d: dict[str, Any], events: list[dict[str, Any]] | None = None) -> dict[str, list[tuple[float, float]]]:
    """Per category, the union of this process's intervals (µs); compute excludes nested comm on its thread."""
    comm, by_cat = [], {c: [] for c in CATS}
    per_thread_comm: dict[int, list[tuple[float, float]]] = {}
    events = d["events"] if events is None else events
    for e in events:
        a, b = e["ts"], e["ts"] + e["dur"]
        if e["ph"] != "X":          # isend/irecv in flight: drawn, not counted (see the module docstring)
            continue
        by_cat[e["cat"]].append((a, b))
        if e["cat"] == "comm":
            comm.append((a, b))
            per_thread_comm.setdefault(int(e["tid"]), []).append((a, b))
    compute = []
    for e in events:               # compute-like spans minus the comm nested in them on their own thread
        if e["ph"] == "X" and e["cat"] in ("compute", "sync"):
            span = [(e["ts"], e["ts"] + e["dur"])]
            compute += _minus(span, _union(per_thread_comm.get(int(e["tid"]), [])))
    out = {c: _union(v) for c, v in by_cat.items()}
    out["comm"], out["compute"] = _union(comm), _union(compute)
    return out


def breakdown(procs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per process: seconds of compute, comm, exposed comm, waiting, padding, the overlap ratio and the traced
    window (first to last step span)."""
    rows = []
    for d in procs:
        iv = _intervals(d, steady(d))
        comp, comm = iv["compute"], iv["comm"]
        exposed = _minus(comm, comp)
        window = _union(iv["phase"] + iv["compute"] + iv["sync"] + iv["pad"] + iv["comm"] + iv["ps"] + iv["wait"])
        span = (window[-1][1] - window[0][0]) if window else 0.0
        rows.append({"who": _track_name(d), "role": d["meta"].get("role", "?"),
                     "window_s": span / 1e6, "compute_s": _length(comp) / 1e6, "comm_s": _length(comm) / 1e6,
                     "exposed_comm_s": _length(exposed) / 1e6, "wait_s": _length(iv["wait"]) / 1e6,
                     "pad_s": _length(iv["pad"]) / 1e6, "ps_apply_s": _length(iv["ps"]) / 1e6,
                     "overlap": (_length(_intersect(comp, comm)) / _length(comm)) if comm else None})
    return rows


def bubble(procs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The measured pipeline bubble (median over steps and pipelines) next to its formula; None without pp."""
    ranks = [d for d in procs if d["meta"].get("role") == "rank"]
    if not ranks or ranks[0]["meta"].get("sizes", {}).get("pp", 1) < 2:
        return None
    meta = ranks[0]["meta"]
    p, m = int(meta["sizes"]["pp"]), int(meta.get("micro_batches", 1))
    pipes: dict[tuple, list[dict[str, Any]]] = {}
    for d in ranks:
        key = tuple(sorted((ax, v) for ax, v in d["meta"]["coords"].items() if ax != "pp"))
        pipes.setdefault(key, []).append(d)
    fractions = []
    for members in pipes.values():
        steps: dict[int, list[list[tuple[float, float]]]] = {}
        for d in members:
            per: dict[int, list[tuple[float, float]]] = {}
            for e in d["events"]:
                if e["ph"] == "X" and e["cat"] == "compute" and e["name"] in ("F", "B") and "step" in e["args"]:
                    per.setdefault(int(e["args"]["step"]), []).append((e["ts"], e["ts"] + e["dur"]))
            for st, iv in per.items():
                steps.setdefault(st, []).append(iv)
        for st, stages in sorted(steps.items())[1:]:          # the first step connects: not a steady step
            if len(stages) != p:
                continue
            start = min(a for iv in stages for a, _ in iv)
            end = max(b for iv in stages for _, b in iv)
            busy = sum(b - a for iv in stages for a, b in iv)
            fractions.append(1 - busy / (p * (end - start)))
    if not fractions:
        return None
    v = int(meta.get("virtual_stages", 1) or 1)
    formula = (p - 1) / (v * m + p - 1)
    return {"p": p, "m": m, "v": v, "schedule": meta.get("schedule", "?") if v == 1 else "interleaved-1f1b",
            "measured": statistics.median(fractions), "formula": formula, "steps": len(fractions)}


def gate_waits(procs: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds each PS worker's reads spent parked at the shards' gates (summed over shards; {} without PS)."""
    out: dict[str, float] = {}
    for d in procs:
        for e in d["events"]:
            if e["ph"] == "X" and e["cat"] == "wait" and "worker" in e["args"]:
                w = str(e["args"]["worker"])
                out[w] = out.get(w, 0.0) + e["dur"] / 1e6
    return dict(sorted(out.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0))


def merge(run_dir: str | Path) -> tuple[Path, dict[str, Any]]:
    """Write RUN_DIR/trace.json and RUN_DIR/trace_analysis.json; return (trace path, analysis)."""
    procs = load_run(run_dir)
    path = Path(run_dir) / "trace.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(chrome_trace(procs)))
    tmp.replace(path)
    analysis = {"processes": breakdown(procs), "bubble": bubble(procs), "gate_wait_by_worker": gate_waits(procs)}
    (Path(run_dir) / "trace_analysis.json").write_text(json.dumps(analysis, indent=1))
    return path, analysis


def format_analysis(analysis: dict[str, Any]) -> str:
    lines = [f"{'track':<28}{'window s':>9}{'compute':>9}{'comm':>9}{'exposed':>9}{'overlap':>9}{'wait':>8}"
             f"{'pad':>8}"]
    for r in analysis["processes"]:
        ov = "-" if r["overlap"] is None else f"{r['overlap']:.0%}"
        lines.append(f"{r['who'][:27]:<28}{r['window_s']:>9.3f}{r['compute_s']:>9.3f}{r['comm_s']:>9.3f}"
                     f"{r['exposed_comm_s']:>9.3f}{ov:>9}{r['wait_s']:>8.3f}{r['pad_s']:>8.3f}")
    lines.append("(seconds over the steady steps -- every step but the first; compute excludes communication nested "
                 "in it; exposed = communication not overlapped by compute; overlap = compute ∩ comm / comm; pad = "
                 "time padded to train.base_step_s or by a straggler's factor)")
    waits = analysis.get("gate_wait_by_worker")
    if waits:
        lines.append("reads parked at the PS gates, per worker: " +
                     ", ".join(f"worker {w} {v:.3f} s" for w, v in waits.items()))
    b = analysis.get("bubble")
    if b:
        v = b.get("v", 1)
        lines.append(f"pipeline bubble ({b['schedule']}, p={b['p']}, m={b['m']}{f', v={v}' if v > 1 else ''}): "
                     f"measured {b['measured']:.1%} (median of {b['steps']} steps) vs "
                     f"(p−1)/({'v·' if v > 1 else ''}m+p−1) = {b['formula']:.1%}")
    return "\n".join(lines)
