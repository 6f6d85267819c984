"""RUN_DIR/events.jsonl: the one writer of the event schema (experiments/faults/spec.py: EVENTS, EVENT_FIELDS), for
real runs (the supervisor) and the simulator alike."""

from __future__ import annotations

from typing import Any

from pslab.experiments.errors import ExperimentError
from pslab.experiments.faults.spec import EVENT_FIELDS, EVENTS
from pslab.experiments.results.rundir import JsonlWriter


class EventLog:
    """RUN_DIR/events.jsonl: one object per line, keys in EVENT_FIELDS order, absent fields left out."""

    def __init__(self, path: Any) -> None:
        self.writer = JsonlWriter(path)
        self.records: list[dict[str, Any]] = []

    def write(self, event: str, time_s: float, who: str, **fields: Any) -> dict[str, Any]:
        if event not in EVENTS:
            raise ExperimentError(f"unknown event {event!r}; events are {', '.join(EVENTS)}")
        fields.update(time_s=float(time_s), event=event, who=who)
        unknown = sorted(set(fields) - set(EVENT_FIELDS))
        if unknown:
            raise ExperimentError(f"event field {unknown[0]!r} is not in the schema ({', '.join(EVENT_FIELDS)})")
        rec = {k: round(v, 9) if isinstance(v, float) else v for k in EVENT_FIELDS
               if (v := fields.get(k)) is not None}
        self.writer.write(rec)
        self.records.append(rec)
        return rec

    def summary(self) -> dict[str, Any]:
        """For summary.json: counts per event kind."""
        out: dict[str, int] = {}
        for r in self.records:
            out[r["event"]] = out.get(r["event"], 0) + 1
        return out

    def close(self) -> None:
        self.writer.close()
