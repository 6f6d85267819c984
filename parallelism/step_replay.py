"""A training step replayed on ranks that share CPU cores: where a closed form no longer holds.

`step_model.predict`'s closed form (compute + bubble + exposed communication + overhead) assumes every rank owns its
device, so ranks that wait lose nothing and ranks that compute go at full speed. An emulated cluster on one machine
(`pslab plan --calibrate`: 4 ranks on 2 cores) breaks both: while a pipeline's ranks wait on a slow link, the other
ranks have the cores to themselves, and while all compute they take turns. This file replays one step in virtual
time instead. Each rank runs a program of

    cpu(w)        w seconds of work at one core's speed (the calibration's per-core rate)
    wait(w)       w seconds of wall time without a core (a collective on the critical path, a message in flight)
    send(k, d)    non-blocking: the message k arrives d = α + B/β later
    recv(k)       blocks until the message k has arrived

and the runnable ranks share the cores by **processor sharing**: with n ranks in a cpu() segment on C cores each
progresses at min(1, C/n) of a core. Ranks that run the same program at the same time (the dp, tp, cp copies of a
pipeline stage) are one replayed rank of weight w: they count w times in n. The step is the last rank's end.

Programs (`pipeline_programs`, built by step_model.replay_step_s), per pipeline stage s of each class of
pipeline groups (comm_cost.Placement):

    for each action of the schedule (schedule.py: GPipe, 1F1B, interleaved):
        recv(its input)                if the producing virtual stage lives on another rank
        cpu(F_s / (v·m) · ⅓ or ⅔)      the stage's FLOPs / the rate (+ its share of a micro-batch's fixed cost);
                                       a forward a third, a backward two thirds
        cpu + wait(tp_s / (2·v·m))     the stage's tensor-parallel collectives (critical, both directions)
        send(its output, α + A/β)      on the link the cut crosses (A: one micro-batch's boundary activation)
    cpu + wait(dp / ZeRO / cp / ep seconds, the overlappable part net of overlap)
    cpu(step_overhead_s)               the loop, the optimizer, Python: calibrated per core

A collective's seconds on a link of latency α are split: of its latencies (the seconds less the bytes' B/β,
CommTerm.wire_seconds) the share message_cpu_s / α is CPU (each message's software, send and receive:
`Cluster.message_cpu_s`, calibrated as the intra link's α less its emulated latency) and takes turns like compute;
the rest (the wire's latency, the bytes' time) is a wait. Simplifications: a boundary message is all wait (its
software share is not charged to the cores), and every stage takes the slowest stage's tp and gradient-sync
seconds (comm_model's terms are per kind, the slowest group's).

Without a pipeline this is max(1, N/C)·(compute + overhead + the messages' CPU) + the rest of the communication —
the closed form with contention; with
one, the replay shows what the closed form cannot: a slow boundary link costs less than m·(α + A/β) when the other
stage's ranks use the cores meanwhile, and a latency-bound 1F1B still pays a round trip every p micro-batches (the
dependencies are the schedule's own, `schedule.simulate`'s plus the messages' flight).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .memory_model import MemoryModelError
from .schedule import make_schedule

EPS = 1e-12          # relative: a remainder below EPS · max(1, now) is done (rounding)


class ReplayError(MemoryModelError):
    """A program that cannot finish (a recv whose message is never sent: a bug in the program builder) or a step
    too long to replay (the message says which)."""


@dataclass(frozen=True)
class Op:
    """One segment of a rank's program: kind "cpu" | "wait" (seconds), "send" (key, delay), "recv" (key)."""

    kind: str
    seconds: float = 0.0
    key: tuple = ()


def cpu(s: float) -> Op:
    return Op("cpu", max(0.0, s))


def wait(s: float) -> Op:
    return Op("wait", max(0.0, s))


def send(key: tuple, delay: float) -> Op:
    return Op("send", max(0.0, delay), key)


def recv(key: tuple) -> Op:
    return Op("recv", 0.0, key)


def replay(programs: Sequence[Sequence[Op]], cores: float = 0.0, weights: Sequence[float] | None = None,
           max_events: int = 1_000_000) -> list[float]:
    """Each program's end time under processor sharing of `cores` (0: every rank its own core); `weights[r]`: how
    many real ranks program r stands for (default 1 each)."""
    n = len(programs)
    w = list(weights) if weights is not None else [1.0] * n
    pos, left = [0] * n, [0.0] * n
    started = [False] * n
    end = [0.0] * n
    arrive: dict[tuple, float] = {}
    now = 0.0
    for _ in range(max_events):
        tol = EPS * max(1.0, now)
        # take every instantaneous step (sends, arrived recvs, new segments)
        for r in range(n):
            while pos[r] < len(programs[r]):
                op = programs[r][pos[r]]
                if op.kind == "send":
                    arrive[op.key] = now + op.seconds
                elif op.kind == "recv":
                    if arrive.get(op.key, float("inf")) > now + tol:
                        break
                elif not started[r]:
                    left[r], started[r] = op.seconds, True
                    if left[r] > tol:
                        break
                elif left[r] > tol:
                    break
                pos[r] += 1
                started[r] = False
                end[r] = now
        active = [r for r in range(n) if pos[r] < len(programs[r])]
        if not active:
            return end
        busy = sum(w[r] for r in active if programs[r][pos[r]].kind == "cpu")
        rate = 1.0 if cores <= 0 or busy <= cores else cores / busy
        dt = float("inf")
        for r in active:
            op = programs[r][pos[r]]
            if op.kind == "cpu":
                dt = min(dt, left[r] / rate)
            elif op.kind == "wait":
                dt = min(dt, left[r])
            elif op.key in arrive:
                dt = min(dt, arrive[op.key] - now)
        if dt == float("inf"):
            stuck = [f"rank {r}: {programs[r][pos[r]]}" for r in active]
            raise ReplayError(f"replay deadlock: every unfinished rank waits for a message never sent "
                              f"({'; '.join(stuck)})")
        now += dt
        for r in active:
            op = programs[r][pos[r]]
            if op.kind == "cpu":
                left[r] -= dt * rate
            elif op.kind == "wait":
                left[r] -= dt
    raise ReplayError(f"the step did not replay in {max_events} events (a pipeline this long on shared cores: "
                      "plan it on a cluster without shared_cores)")


def pipeline_programs(p: int, m: int, v: int, schedule: str, stage_cpu_s: Sequence[float],
                      stage_tp_s: Sequence[tuple[float, float]], cut_s: Sequence[float], tail: Sequence[Sequence[Op]],
                      tag: object = 0) -> list[list[Op]]:
    """One program per stage of a p-stage pipeline: the schedule's actions with their cpu (a stage's step
    compute `stage_cpu_s[s]`, a forward ⅓ and a backward ⅔ of its 1/(v·m) share), tp collectives
    (`stage_tp_s[s]` = (cpu, wait) seconds per step, an even share per action) and boundary messages (`cut_s[c]`:
    seconds of one message over cut c, virtual stage c -> c+1, either direction), then `tail[s]`."""
    sched = make_schedule(schedule, p, m, v)
    last = p * v - 1
    progs: list[list[Op]] = []
    for s in range(p):
        ops: list[Op] = []
        for a in sched.actions[s]:
            c = a.virtual(p)
            frac = (1 / 3 if a.phase == "F" else 2 / 3) / (v * m)
            src = c - 1 if a.phase == "F" else (c + 1 if c < last else None)
            if src is not None and src >= 0 and src % p != s:
                ops.append(recv((tag, a.phase, a.micro, src)))
            tp_cpu, tp_wait = stage_tp_s[s]
            ops += [cpu(stage_cpu_s[s] * frac + tp_cpu / (2 * v * m)), wait(tp_wait / (2 * v * m))]
            dst = c + 1 if a.phase == "F" else c - 1
            if 0 <= dst <= last and dst % p != s:
                ops.append(send((tag, a.phase, a.micro, c), cut_s[min(c, dst)]))
        progs.append(ops + list(tail[s]))
    return progs
