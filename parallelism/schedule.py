"""Pipeline schedules as data: per-stage lists of (stage, micro-batch, F/B) actions.

A schedule is pure: no tensors, no sockets. The executor (`pipeline.py`) runs it over send/recv; a test reads it;
`plot.py` draws it. Two schedules for p stages and m micro-batches:

- **GPipe**: every stage runs F0 … F(m−1), then B0 … B(m−1). Each stage holds all m micro-batches' activations
  before its first backward, so peak in-flight activations per stage = m.
- **1F1B** (PipeDream-flush): stage s runs w = min(p−s−1, m) warm-up forwards, then alternates one forward and one
  backward, then drains the remaining backwards. Peak in-flight activations on stage s = min(p−s, m) ≤ p.

With equal stage times (t_f per forward, t_b per backward on every stage) both take (m+p−1)(t_f+t_b) and each stage
is busy m(t_f+t_b), so the **bubble fraction** is

    bubble = 1 − m(t_f+t_b) / ((m+p−1)(t_f+t_b)) = (p−1)/(m+p−1).

`simulate` replays a schedule in virtual time under those dependencies (F(s,i) after F(s−1,i); B(s,i) after
B(s+1,i), and B(p−1,i) after F(p−1,i); actions of one stage in list order) and returns the timeline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Phase = Literal["F", "B"]


class ScheduleError(ValueError):
    """A schedule was asked for with impossible sizes, or a schedule's actions are inconsistent."""


@dataclass(frozen=True, order=True)
class Action:
    """One unit of pipeline work: run `phase` ("F" forward or "B" backward) of `micro` on `stage`."""

    stage: int
    micro: int
    phase: Phase

    def __str__(self) -> str:
        return f"{self.phase}{self.micro}@s{self.stage}"


@dataclass(frozen=True)
class PipelineSchedule:
    """`actions[s]` is the ordered list of actions stage s executes in one training step."""

    name: str
    stages: int
    micro_batches: int
    actions: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        validate(self)

    def for_stage(self, stage: int) -> tuple[Action, ...]:
        return self.actions[stage]

    def peak_in_flight(self) -> list[int]:
        """Per stage: the most micro-batches whose forward has run and whose backward has not (activations held)."""
        peaks = []
        for acts in self.actions:
            live = peak = 0
            for a in acts:
                live += 1 if a.phase == "F" else -1
                peak = max(peak, live)
            peaks.append(peak)
        return peaks

    def theoretical_bubble(self) -> float:
        """(p−1)/(m+p−1): the idle fraction of every stage when all stage times are equal."""
        p, m = self.stages, self.micro_batches
        return (p - 1) / (m + p - 1)


def _check_sizes(stages: int, micro_batches: int) -> None:
    if stages < 1 or micro_batches < 1:
        raise ScheduleError(f"need stages >= 1 and micro_batches >= 1, got stages={stages}, "
                            f"micro_batches={micro_batches}")


def gpipe(stages: int, micro_batches: int) -> PipelineSchedule:
    """GPipe: all forwards, then all backwards (fill, drain)."""
    _check_sizes(stages, micro_batches)
    acts = tuple(
        tuple(Action(s, i, "F") for i in range(micro_batches)) + tuple(Action(s, i, "B") for i in range(micro_batches))
        for s in range(stages))
    return PipelineSchedule("gpipe", stages, micro_batches, acts)


def one_f_one_b(stages: int, micro_batches: int) -> PipelineSchedule:
    """1F1B (PipeDream-flush): warm-up forwards, steady one-forward-one-backward, cool-down backwards."""
    _check_sizes(stages, micro_batches)
    all_acts = []
    for s in range(stages):
        warm = min(stages - s - 1, micro_batches)
        acts = [Action(s, i, "F") for i in range(warm)]
        f, b = warm, 0
        while f < micro_batches:
            acts.append(Action(s, f, "F"))
            f += 1
            acts.append(Action(s, b, "B"))
            b += 1
        acts.extend(Action(s, i, "B") for i in range(b, micro_batches))
        all_acts.append(tuple(acts))
    return PipelineSchedule("1f1b", stages, micro_batches, tuple(all_acts))


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def make_schedule(name: str, stages: int, micro_batches: int) -> PipelineSchedule:
    """Build a schedule by name ('gpipe' or '1f1b')."""
    try:
        factory = SCHEDULES[name.lower()]
    except KeyError:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}") from None
    return factory(stages, micro_batches)


def validate(schedule: PipelineSchedule) -> None:
    """Every stage runs F and B of every micro-batch exactly once, F before B, and actions name their own stage."""
    if len(schedule.actions) != schedule.stages:
        raise ScheduleError(f"{schedule.name}: {len(schedule.actions)} action lists for {schedule.stages} stages")
    want = {(i, ph) for i in range(schedule.micro_batches) for ph in ("F", "B")}
    for s, acts in enumerate(schedule.actions):
        got = [(a.micro, a.phase) for a in acts]
        if any(a.stage != s for a in acts) or sorted(got) != sorted(want) or len(got) != len(want):
            raise ScheduleError(f"{schedule.name}: stage {s} must run F and B of micro-batches "
                                f"0..{schedule.micro_batches - 1} exactly once each")
        seen_f: set[int] = set()
        for a in acts:
            if a.phase == "F":
                seen_f.add(a.micro)
            elif a.micro not in seen_f:
                raise ScheduleError(f"{schedule.name}: stage {s} runs B{a.micro} before F{a.micro}")


@dataclass
class Timeline:
    """Virtual-time replay: `spans[s]` = [(action, start, end)], plus the makespan and per-stage bubble."""

    schedule: PipelineSchedule
    spans: list[list[tuple[Action, float, float]]] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        return max((end for spans in self.spans for _, _, end in spans), default=0.0)

    def bubble_fractions(self) -> list[float]:
        total = self.makespan
        return [1.0 - sum(e - b for _, b, e in spans) / total for spans in self.spans]

    def bubble_fraction(self) -> float:
        fr = self.bubble_fractions()
        return sum(fr) / len(fr)


def simulate(schedule: PipelineSchedule, t_forward: float = 1.0, t_backward: float = 2.0) -> Timeline:
    """Replay `schedule` with equal stage times; raises ScheduleError if the schedule deadlocks."""
    p = schedule.stages
    done: dict[Action, float] = {}
    pos = [0] * p
    clock = [0.0] * p
    spans: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
    remaining = sum(len(a) for a in schedule.actions)
    while remaining:
        progressed = False
        for s in range(p):
            while pos[s] < len(schedule.actions[s]):
                a = schedule.actions[s][pos[s]]
                if a.phase == "F":
                    dep = Action(s - 1, a.micro, "F") if s > 0 else None
                else:
                    dep = Action(s + 1, a.micro, "B") if s < p - 1 else Action(s, a.micro, "F")
                if dep is not None and dep not in done:
                    break
                start = max(clock[s], done[dep] if dep is not None else 0.0)
                end = start + (t_forward if a.phase == "F" else t_backward)
                done[a], clock[s] = end, end
                spans[s].append((a, start, end))
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [str(schedule.actions[s][pos[s]]) for s in range(p) if pos[s] < len(schedule.actions[s])]
            raise ScheduleError(f"{schedule.name}: deadlock, every stage waits ({', '.join(stuck)})")
    return Timeline(schedule, spans)
