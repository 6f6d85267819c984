"""Pipeline schedules as data: per-stage lists of (stage, micro-batch, F/B, chunk) actions.

A schedule is pure: no tensors, no sockets. The executor (`pipeline.py`) runs it over send/recv; a test reads it;
`plot.py` draws it. Three schedules for p stages (ranks) and m micro-batches:

- **GPipe**: every stage runs F0 … F(m−1), then B0 … B(m−1). Each stage holds all m micro-batches' activations
  before its first backward, so peak in-flight activations per stage = m.
- **1F1B** (PipeDream-flush): stage s runs w = min(p−s−1, m) warm-up forwards, then alternates one forward and one
  backward, then drains the remaining backwards. Peak in-flight activations on stage s = min(p−s, m) ≤ p.

With equal stage times (t_f per forward, t_b per backward on every stage) both take (m+p−1)(t_f+t_b) and each stage
is busy m(t_f+t_b), so the **bubble fraction** is

    bubble = 1 − m(t_f+t_b) / ((m+p−1)(t_f+t_b)) = (p−1)/(m+p−1).

- **Interleaved 1F1B** (Narayanan et al. 2021, §2.2; Megatron-LM's order): the model is cut into v·p chunks and
  rank s holds v of them, chunks s, s+p, …, s+(v−1)p ("virtual stages" c = k·p + s, k = 0..v−1), so a micro-batch
  visits every rank v times, wrapping from rank p−1 back to rank 0. Each rank's forwards run in groups of p
  micro-batches per chunk (forward n: chunk k = (n mod pv) div p, micro-batch (n div pv)·p + n mod p; backwards the
  same with the chunks reversed), warm-up 2(p−s−1) + (v−1)p forwards, then one forward one backward. An action takes
  t_f/v (t_b/v): the fill and drain cost p−1 *chunk* slots instead of p−1 stage slots, so

    bubble = (p−1)/v / (m + (p−1)/v) = (p−1)/(v·m + p−1)

  at the price of (v·p−1)/(p−1) times the boundary traffic (v·p − 1 cuts a micro-batch crosses instead of p − 1) and more
  activations in flight during warm-up. Needs m to be a multiple of p (the groups of p).

`simulate` replays a schedule in virtual time under those dependencies (F(c,i) after F(c−1,i); B(c,i) after
B(c+1,i), and B(last,i) after F(last,i), c the virtual stage; actions of one rank in list order) and returns the
timeline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Phase = Literal["F", "B"]


class ScheduleError(ValueError):
    """A schedule was asked for with impossible sizes, or a schedule's actions are inconsistent."""


@dataclass(frozen=True, order=True)
class Action:
    """One unit of pipeline work: run `phase` ("F" forward or "B" backward) of `micro` on rank `stage`, with its
    model chunk `chunk` (0 unless interleaved: then the virtual stage chunk·p + stage)."""

    stage: int
    micro: int
    phase: Phase
    chunk: int = 0

    def virtual(self, p: int) -> int:
        """The virtual stage this action runs: chunk·p + stage (= stage without interleaving)."""
        return self.chunk * p + self.stage

    def __str__(self) -> str:
        return f"{self.phase}{self.micro}@s{self.stage}" + (f".{self.chunk}" if self.chunk else "")


@dataclass(frozen=True)
class PipelineSchedule:
    """`actions[s]` is the ordered list of actions stage s executes in one training step."""

    name: str
    stages: int
    micro_batches: int
    actions: tuple[tuple[Action, ...], ...]
    virtual_stages: int = 1          # v: model chunks per rank (interleaved 1F1B)

    def __post_init__(self) -> None:
        validate(self)

    def for_stage(self, stage: int) -> tuple[Action, ...]:
        return self.actions[stage]

    def peak_in_flight(self) -> list[int]:
        """Per stage: the most micro-batches whose forward has run and whose backward has not (activations held;
        interleaved: (chunk, micro-batch) pairs, each 1/v of a stage's activations)."""
        peaks = []
        for acts in self.actions:
            live = peak = 0
            for a in acts:
                live += 1 if a.phase == "F" else -1
                peak = max(peak, live)
            peaks.append(peak)
        return peaks

    def theoretical_bubble(self) -> float:
        """(p−1)/(v·m+p−1): the idle fraction of every stage when all stage times are equal (v = 1: (p−1)/(m+p−1))."""
        p, m, v = self.stages, self.micro_batches, self.virtual_stages
        return (p - 1) / (v * m + p - 1)


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


def interleaved_1f1b(stages: int, micro_batches: int, virtual_stages: int) -> PipelineSchedule:
    """Interleaved 1F1B (Megatron-LM's order, module docstring): v chunks per rank, micro-batches in groups of p."""
    _check_sizes(stages, micro_batches)
    p, m, v = stages, micro_batches, virtual_stages
    if v < 2:
        raise ScheduleError(f"interleaving needs virtual_stages >= 2, got {v} (1 is plain 1f1b)")
    if p < 2:
        raise ScheduleError("interleaving needs at least 2 pipeline stages")
    if m % p:
        raise ScheduleError(f"interleaved 1F1B runs micro-batches in groups of p = {p}: the micro-batch count (m) "
                            f"must be a multiple of {p}, got {m}; try {max(p, m - m % p)} or {m - m % p + p}")
    total = m * v

    def act(s: int, n: int, phase: Phase) -> Action:
        """Stage s's n-th forward (or backward): chunk (n mod pv) div p (reversed backward), micro-batch
        (n div pv)·p + n mod p."""
        k = (n % (p * v)) // p
        return Action(s, (n // (p * v)) * p + n % p, phase, v - 1 - k if phase == "B" else k)

    all_acts = []
    for s in range(p):
        warm = min(2 * (p - s - 1) + (v - 1) * p, total)
        acts = [act(s, n, "F") for n in range(warm)]
        for n in range(total - warm):                  # steady state: one forward, one backward
            acts += [act(s, warm + n, "F"), act(s, n, "B")]
        acts += [act(s, n, "B") for n in range(total - warm, total)]
        all_acts.append(tuple(acts))
    return PipelineSchedule("interleaved-1f1b", p, m, tuple(all_acts), v)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def make_schedule(name: str, stages: int, micro_batches: int, virtual_stages: int = 1) -> PipelineSchedule:
    """Build a schedule by name ('gpipe' or '1f1b'); '1f1b' with virtual_stages v > 1 is interleaved 1F1B."""
    try:
        factory = SCHEDULES[name.lower()]
    except KeyError:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}") from None
    if virtual_stages < 1:
        raise ScheduleError(f"virtual_stages must be >= 1, got {virtual_stages}")
    if virtual_stages > 1:
        if factory is not one_f_one_b:
            raise ScheduleError(f"virtual_stages > 1 interleaves 1F1B; schedule {name!r} has no interleaved form")
        return interleaved_1f1b(stages, micro_batches, virtual_stages)
    return factory(stages, micro_batches)


def validate(schedule: PipelineSchedule) -> None:
    """Every stage runs F and B of every (chunk, micro-batch) exactly once, F before B, and actions name their own
    stage."""
    if len(schedule.actions) != schedule.stages:
        raise ScheduleError(f"{schedule.name}: {len(schedule.actions)} action lists for {schedule.stages} stages")
    want = {(k, i, ph) for k in range(schedule.virtual_stages) for i in range(schedule.micro_batches)
            for ph in ("F", "B")}
    for s, acts in enumerate(schedule.actions):
        got = [(a.chunk, a.micro, a.phase) for a in acts]
        if any(a.stage != s for a in acts) or sorted(got) != sorted(want) or len(got) != len(want):
            chunks = f" of chunks 0..{schedule.virtual_stages - 1}" if schedule.virtual_stages > 1 else ""
            raise ScheduleError(f"{schedule.name}: stage {s} must run F and B of micro-batches "
                                f"0..{schedule.micro_batches - 1}{chunks} exactly once each")
        seen_f: set[tuple[int, int]] = set()
        for a in acts:
            if a.phase == "F":
                seen_f.add((a.chunk, a.micro))
            elif (a.chunk, a.micro) not in seen_f:
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
    """Replay `schedule` with equal stage times (a stage's forward t_forward, its backward t_backward; interleaved:
    each chunk's action 1/v of that); raises ScheduleError if the schedule deadlocks."""
    p, v = schedule.stages, schedule.virtual_stages
    last = p * v - 1

    def at(c: int, i: int, ph: Phase) -> Action:          # the action of virtual stage c
        return Action(c % p, i, ph, c // p)
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
                c = a.virtual(p)
                if a.phase == "F":
                    dep = at(c - 1, a.micro, "F") if c > 0 else None
                else:
                    dep = at(c + 1, a.micro, "B") if c < last else at(c, a.micro, "F")
                if dep is not None and dep not in done:
                    break
                start = max(clock[s], done[dep] if dep is not None else 0.0)
                end = start + (t_forward if a.phase == "F" else t_backward) / v
                done[a], clock[s] = end, end
                spans[s].append((a, start, end))
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [str(schedule.actions[s][pos[s]]) for s in range(p) if pos[s] < len(schedule.actions[s])]
            raise ScheduleError(f"{schedule.name}: deadlock, every stage waits ({', '.join(stuck)})")
    return Timeline(schedule, spans)
