"""Timing-only simulation (`[simulate] timing_only = true`, `--timing-only`): the PS simulator's event loop with no
gradients, no model and no optimizer -- only the consistency gate, versions, clocks, staleness, the compute-time
model and the network model. For throughput and staleness questions at 10^5-10^6 updates.

The idea: none of the simulator's *timing* depends on a gradient's values. An update's time and staleness are fixed by

    compute     worker w's clock-c step takes StragglerModel.step_time(w, c, compute_s)       (the same draws)
    network     t_arrive = max(t_send, link free) + (payload + header) / bandwidth + latency    (network.py)
    gate        a read at clock c proceeds when policy.may_read(c, clocks, committed)           (ps.consistency)
    versions    +1 per push (ASP, eager SSP) or per committed clock (BSP, SSP-agg, backup BSP: the first N = K - b
                pushes stamped c, later ones dropped); tau = version when applied - version read

and byte counts are the model's (known without computing anything). `TimingShard` is `ps.ShardState` minus its
tensors: the same clocks, committed clock, pending clock sets (first-N by arrival, summed in worker order), wait and
drop bookkeeping, asking the very same `Policy.may_read`. `TimingSimulator` is `experiments.sim.ps.Simulator`'s event
loop step for step -- same events, same heap sequence numbers, same link order -- so a run gives per-update records
(worker, step, time, staleness, bytes, wait, dropped) identical to the training mode's on the same schedule, with
`loss` and `batch` null (tests/experiments/test_sim_timing.py proves the equality for ASP, BSP, SSP, backup BSP).

Cost: about 4 heap events per update per shard and no tensor work: ~2 x 10^5 updates per wall second for 64 ASP
workers on one core of a 2-core machine (`pslab bench sim`, 1 shard; ~120x the training mode). A random compute
model (transient slowdowns, delays) costs one seeded generator per (w, t), ~15 us: ~5 x 10^4 updates/s then.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from typing import Any, Callable

from pslab.experiments.config import RunConfig
from pslab.experiments.errors import ExperimentError
from pslab.experiments.results.rundir import RunDir
from pslab.experiments.sim.network import Network
from pslab.experiments.stragglers import StragglerModel

READ_ARRIVE, REPLY, COMPUTE_DONE, PUSH_ARRIVE = range(4)  # as in experiments.sim.ps
FLUSH_EVERY = 8192          # records buffered before a write
PROGRESS_EVERY = 4096       # updates between progress-bar moves
DROPPED = ',"dropped":true'


class TimingShard:
    """ShardState's bookkeeping without parameters: version, clocks, gate, pending clocks, staleness, waits, drops."""

    def __init__(self, policy: Any, num_workers: int) -> None:
        from pslab.ps.consistency import policy_from_string
        self.policy = policy_from_string(policy)
        if self.policy.backups >= num_workers:
            raise ExperimentError(f"{self.policy} needs more workers than backups: got {num_workers} workers")
        self.num_workers, self.aggregate = num_workers, self.policy.aggregate
        self.needed = num_workers - self.policy.backups
        self.version, self.committed = 0, 0
        self.clocks = [0] * num_workers
        self.pending: dict[int, dict[int, int]] = {}             # clock -> {worker: version read}, arrival order
        self.blocked_since: dict[tuple[int, int], float] = {}
        self.taus: list[list[int]] = [[] for _ in range(num_workers)]
        self.waits: list[list[float]] = [[] for _ in range(num_workers)]
        self.dropped = [0] * num_workers
        self._gate: dict[int, bool] = {}       # may_read(clock) memo; a pure function of (clock, clocks, committed)

    def may_read(self, worker: int, clock: int, now: float) -> bool:
        ok = self._gate.get(clock)
        if ok is None:
            ok = self._gate[clock] = self.policy.may_read(clock, self.clocks, self.committed)
        if not ok:
            self.blocked_since.setdefault((worker, clock), now)
        return ok

    def read(self, worker: int, clock: int, now: float) -> tuple[int, int]:
        """(version, the worker's clock after the read); call only when may_read is True."""
        t0 = self.blocked_since.pop((worker, clock), None) if self.blocked_since else None
        self.waits[worker].append(0.0 if t0 is None else max(0.0, now - t0))
        if self.policy.backups and self.clocks[worker] < self.committed:
            self.clocks[worker] = self.committed                 # a straggler joins the current clock
            self._gate.clear()
        return self.version, self.clocks[worker]

    def push(self, worker: int, clock: int, read_version: int) -> tuple[bool, list[tuple[int, int]]]:
        """(dropped?, [(worker, tau) of the updates applied now]), as ShardState.push."""
        self._gate.clear()
        if not self.aggregate:
            tau = self.version - read_version
            self.taus[worker].append(tau)
            self.version += 1
            self.clocks[worker] += 1
            return False, [(worker, tau)]
        self.clocks[worker] += 1
        if clock < self.committed:                               # backup-BSP: completed without it
            self.dropped[worker] += 1
            return True, []
        self.pending.setdefault(clock, {})[worker] = read_version
        applied: list[tuple[int, int]] = []
        while len(self.pending.get(self.committed, ())) >= self.needed:
            chosen = sorted(list(self.pending.pop(self.committed).items())[:self.needed])
            for w, rv in chosen:
                tau = self.version - rv
                self.taus[w].append(tau)
                applied.append((w, tau))
            self.version += 1
            self.committed += 1
        return False, applied

    def summary(self) -> dict[str, Any]:
        """ShardState.stats.summary() of the same run (its time series excepted)."""
        from pslab.ps.staleness import StalenessStats
        st = StalenessStats(self.num_workers)
        for w in range(self.num_workers):
            st.per_worker[w] = Counter(self.taus[w])
            st.hist.update(st.per_worker[w])
            for seconds in self.waits[w]:
                st.record_wait(w, seconds)
            st.dropped[w] = self.dropped[w]
        return dict(st.summary())


def step_time_table(model: StragglerModel, workers: int, base_s: float) -> list[float] | None:
    """Per-worker step times when they do not depend on the step: step_time = base * factor_w * transient + delay,
    so without transient slowdowns or delays it is base * factor_w for every t. None when the model is random."""
    c = model.cfg
    if c.transient_prob > 0 or (c.delay != "none" and c.delay_mean_s > 0):
        return None
    return [model.step_time(w, 0, base_s) for w in range(workers)]


def record_line(w: int, step: int, now: float, tau: int | None, sent: int, recv: int, wait: float,
                dropped: bool = False) -> str:
    """One metrics.jsonl line, byte for byte what JsonlWriter writes for the UpdateRecord (loss, batch null)."""
    return (f'{{"worker":{w},"step":{step},"clock":{step + 1},"time_s":{now!r},"loss":null,"staleness":'
            f'{"null" if tau is None else tau},"bytes_sent":{sent},"bytes_recv":{recv},"wait_s":{wait!r},'
            f'"batch":null{DROPPED if dropped else ""}}}\n')


class TimingSimulator:
    """pslab.experiments.sim.ps.Simulator's event loop, without tensors (see the module docstring)."""

    def __init__(self, cfg: RunConfig, progress: Callable[[int], None] | None = None) -> None:
        from pslab.ps import make_partition
        from pslab.experiments.workloads import get_params, get_workload
        self.cfg, self.progress = cfg, progress
        t = cfg.train
        self.K, self.steps, self.S = t.workers, t.steps, t.shards
        wl = get_workload(cfg.workload.name, self.K, cfg.workload.batch_size, cfg.workload.seed,
                          **cfg.workload.overrides())
        self.shard_bytes = make_partition(get_params(wl.make_model()), t.shards).bytes_per_shard()
        self.shards = [TimingShard(cfg.strategy.policy, self.K) for _ in range(self.S)]
        self.net = Network(cfg.simulate, self.S)
        self.straggle = StragglerModel(cfg.stragglers, cfg.workload.seed)

    def run(self, rundir: RunDir) -> dict[str, Any]:   # noqa: C901 -- one tight loop, kept flat on purpose
        K, S, steps, shards = self.K, self.S, self.steps, self.shards
        net, cfg = self.net, self.cfg
        compute_s = cfg.simulate.compute_s
        table = step_time_table(self.straggle, K, compute_s)
        step_time = self.straggle.step_time
        # per (worker, shard): (wire bytes, link seconds, latency) of a read request, a reply, a push
        req = [[net.route(w, 0) for _ in range(S)] for w in range(K)]
        rep = [[net.route(w, self.shard_bytes[s]) for s in range(S)] for w in range(K)]
        psh = [[net.route(w, self.shard_bytes[s]) for s in range(S)] for w in range(K)]
        links_in, links_out = net.links_in, net.links_out
        heap: list[tuple[float, int, int, int, int, Any]] = []
        push, pop, seq = heapq.heappush, heapq.heappop, itertools.count()
        clock, gate_wait, recv = [0] * K, [0.0] * K, [0] * K
        done, nrep = [False] * K, [0] * K
        abort = cfg.train.backup_abort
        computing, token = [-1] * K, [0] * K                     # token of the compute in flight (-1: none)
        rver, rclock = [[0] * S for _ in range(K)], [0] * K      # versions read per shard; max clock replied
        pending: list[deque] = [deque() for _ in range(K)]      # (step, sent, recv, wait) awaiting shard 0
        blocked: list[dict[int, float]] = [dict() for _ in range(S)]
        buf: list[str] = []
        applied, made, now = 0, 0, 0.0
        f = open(rundir.metrics_path, "a")

        def send_read(w: int, now: float) -> None:
            gate_wait[w], recv[w], nrep[w], rclock[w] = 0.0, 0, 0, 0
            for s in range(S):
                n, d, lat = req[w][s]
                link = links_in[s]                                # Link.occupy, inlined
                start = max(now, link.free_at)
                link.free_at = start + d
                link.bytes += n
                push(heap, (link.free_at + lat, next(seq), READ_ARRIVE, w, s, None))

        def try_read(w: int, s: int, since: float, now: float) -> bool:
            st = shards[s]
            if not st.may_read(w, clock[w], now):
                return False
            version, c = st.read(w, clock[w], now)
            if now - since > gate_wait[w]:
                gate_wait[w] = now - since
            n, d, lat = rep[w][s]
            link = links_out[s]
            start = max(now, link.free_at)
            link.free_at = start + d
            link.bytes += n
            push(heap, (link.free_at + lat, next(seq), REPLY, w, s, (version, c)))
            return True

        try:
            for w in range(K):
                send_read(w, now)
            while heap:
                now, _, kind, w, s, payload = pop(heap)
                if kind == PUSH_ARRIVE:
                    st = shards[s]
                    dropped, ups = st.push(w, payload[0], payload[1])
                    if s == 0:
                        if dropped:
                            step, sent, r, wait = pending[w].pop()
                            buf.append(record_line(w, step, now, None, sent, r, wait, True))
                        for v, tau in ups:
                            if pending[v]:
                                step, sent, r, wait = pending[v].popleft()
                                buf.append(record_line(v, step, now, tau, sent, r, wait))
                                applied += 1
                        if len(buf) >= FLUSH_EVERY:
                            f.write("".join(buf))
                            buf.clear()
                    if abort and ups:                            # as Simulator._abort_committed
                        committed = min(x.committed for x in shards)
                        for v in range(K):
                            if computing[v] >= 0 and clock[v] < committed:
                                computing[v] = -1
                                buf.append(record_line(v, clock[v], now, None, 0, recv[v], gate_wait[v], True))
                                made += 1
                                if self.progress and made % PROGRESS_EVERY == 0:
                                    self.progress(PROGRESS_EVERY)
                                send_read(v, now)
                    b = blocked[s]
                    if b:
                        for v in sorted(b):
                            if try_read(v, s, b[v], now):
                                del b[v]
                elif kind == READ_ARRIVE:
                    if not try_read(w, s, now, now):
                        blocked[s][w] = now
                elif kind == REPLY:
                    rver[w][s] = payload[0]
                    if payload[1] > rclock[w]:
                        rclock[w] = payload[1]
                    recv[w] += self.shard_bytes[s]
                    nrep[w] += 1
                    if nrep[w] < S:
                        continue
                    if rclock[w] > clock[w]:                     # backup-BSP may move a worker up
                        clock[w] = rclock[w]
                    c = clock[w]
                    if c >= steps:
                        done[w] = True
                        continue
                    dt = table[w] if table is not None else step_time(w, c, compute_s)
                    token[w] += 1
                    computing[w] = token[w]
                    push(heap, (now + dt, next(seq), COMPUTE_DONE, w, 0, token[w]))
                else:                                            # COMPUTE_DONE
                    if payload != computing[w]:
                        continue                                 # aborted: its clock was committed without it
                    computing[w] = -1
                    c, sent = clock[w], 0
                    for s in range(S):
                        n, d, lat = psh[w][s]
                        sent += self.shard_bytes[s]
                        link = links_in[s]
                        start = max(now, link.free_at)
                        link.free_at = start + d
                        link.bytes += n
                        push(heap, (link.free_at + lat, next(seq), PUSH_ARRIVE, w, s, (c, rver[w][s])))
                    pending[w].append((c, sent, recv[w], gate_wait[w]))
                    clock[w] = c + 1
                    made += 1
                    if self.progress and made % PROGRESS_EVERY == 0:
                        self.progress(PROGRESS_EVERY)
                    if c + 1 < steps:
                        send_read(w, now)
                    else:
                        done[w] = True
            stuck = [w for w in range(K) if not done[w]]
            if stuck:
                raise ExperimentError(f"simulation stopped with workers {stuck} blocked at the consistency gate "
                                      f"({cfg.strategy.policy}); this is a deadlock in the policy")
            for w in range(K):                   # pushes that never became an update (e.g. a clock left incomplete)
                while pending[w]:
                    step, sent, r, wait = pending[w].popleft()
                    buf.append(record_line(w, step, now, None, sent, r, wait))
            f.write("".join(buf))
        finally:
            f.close()
        if self.progress and made % PROGRESS_EVERY:
            self.progress(made % PROGRESS_EVERY)
        return {"virtual_time_s": now, "applied_updates": applied, "timing_only": True,
                "shard_stats": [st.summary() for st in shards]}


def simulate_timing(cfg: RunConfig, rundir: RunDir, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    return TimingSimulator(cfg, progress).run(rundir)
