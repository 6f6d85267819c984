"""Start N local processes for a function, wired into one group; the first failure ends them all.

    results = launch(work, world_size=4, backend="zmq", args=(...), timeout=60)   # one result per rank

Children are forked from a forkserver that has imported torch once (start_method="forkserver", the default),
so a launch costs a fork, not a fresh interpreter. Nothing of the job listens beyond loopback, and nothing is
reachable by another account: the rendezvous store is a `torch.distributed.FileStore` in a fresh 0700 temp
directory (no network listener; removed at the end), the ranks bind ipc sockets in their own 0700 directories and
tcp on 127.0.0.1 only (gloo, for backend="torch", on the loopback interface unless GLOO_SOCKET_IFNAME says
otherwise), and every zmq connection authenticates with a per-job secret (`secret=`, else the caller's
PSLAB_JOB_SECRET, else a fresh `auth.new_job_secret()`) that reaches the children through their process
arguments, never through the store; each child also exports it
as PSLAB_JOB_SECRET, so what `fn` starts (a PS client) can prove it belongs to the job. Each child sets
`torch.set_num_threads(1)` and the torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK), builds the group and calls
`fn(group, *args)`. Results come back through one pipe per child (to these trusted local processes only).
If any rank raises, the others are killed and `LaunchError` carries that rank's traceback; if the whole launch
outlives `timeout`, every child is killed and `LaunchError` says which ranks were still running and where: each
hung rank's Python stacks (faulthandler, asked for with SIGUSR1) are appended to the message.
With `return_exceptions=True` a failed or killed rank yields a `RankFailure` instead and the others run on.

Supervision (`supervisor=`, see `Supervisor`): every child beats a heartbeat (a shared-memory clock slot written by a
daemon thread every `supervisor.heartbeat_s`; SIGSTOP freezes it), and the parent names a rank that died or hung (no
beat for `supervisor.detect_s`) and asks the supervisor whether the job goes on without it. A death is known from the
kernel at once: the parent holds a pidfd per child (`os.pidfd_open`), readable the moment the process exits, and
waits on it together with the children's pipes -- not on the pipe's end of file (any process that inherited the
write end keeps it open) nor on the forkserver's exit-status report alone. What a dead child wrote before it died is
still read first. When a rank reports an error, every other rank's death is looked for before that error is
recorded, so a survivor's inference ("a peer failed") never comes before, nor instead of, the supervisor's verdict on
the rank that actually died.
A hang is judged against the load: the parent measures how late its own 50 ms polls wake up (`Job.lag_s`: the
largest lateness over the last LAG_WINDOW_S seconds), and a silent heartbeat means a hang only when it is older than
`detect_s + LAG_FACTOR * lag_s` -- on a machine so loaded that the parent itself wakes seconds late, the ranks' beat
threads do too, and that is not a hang. Nor is a silent child whose CPU time still grows (procstate.cpu_ticks
advanced within the last `detect_s`): a beat thread needs the GIL, and a busy rank on a loaded machine (a long
garbage collection or C call, time-sliced with everything else) can hold it for seconds while it works; such a child
is hung only past BUSY_FACTOR x the bound. A stopped process (SIGSTOP: state T in /proc) is hung after `detect_s`
whatever the load (collectives/procstate.py reads what the kernel says of a child).
The supervisor can signal a rank's process (`Job.pid`: stop and resume it), start a replacement for a member
(`Job.spawn`; each generation then names every member's process, `Job.incarnation`) and hear what children
`notify()` it. With `supervisor.elastic` the children are members of a `collectives.elastic.ElasticGroup`
(generation 0 = every rank, published before they start): `fn` gets that ElasticGroup, not a plain group.
`timeout=None` is no limit on the whole launch (each collective wait is still bounded by `group_timeout`).
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

from . import cleanup, flight, forking
from .procstate import (BUSY_FACTOR, CpuProgress, exit_code_after, is_stopped as _stopped_state, pidfd,
                        zombie_exit_code)
from .auth import ENV_SECRET, job_secret, new_job_secret
from .errors import LaunchError


@dataclass
class RankFailure:
    """What a rank left behind when it failed: its exception type and traceback, or the signal that killed it."""

    rank: int
    error: str
    traceback: str = ""
    exitcode: int | None = None


STOPPED = 128 + signal.SIGTERM      # a rank's exit code when the launcher stopped it
MAX_PROCS = 4                       # heartbeat slots per rank: the rank and up to 3 replacements
STARTUP_S = 120.0                   # a child that has not beaten yet (importing, under spawn) is hung only after this
LAG_WINDOW_S = 10.0                 # the parent's own poll lateness is remembered this long (Job.lag_s)
LAG_FACTOR = 2.0                    # a beat is late only past detect_s + LAG_FACTOR * lag_s (module docstring)
DRAIN_BATCH = 64                    # messages read from one live pipe per wake-up: a rank that writes as fast as
                                    # the parent reads must not keep it from its watch (or from the other pipes)

_NOTIFY: Any = None                 # in a child: its _Outbox, for notify()


def notify(payload: Any) -> bool:
    """From inside a launched child: send `payload` (plain data) to the launcher's supervisor. False outside one."""
    if _NOTIFY is None:
        return False
    _NOTIFY.put("msg", payload)
    return True


class _Outbox:
    """A child's own pipe to the launcher. Not a shared multiprocessing.Queue: a rank SIGKILLed while it held the
    queue's write lock would block every other rank's writes (and so the whole job) forever."""

    def __init__(self, conn: Any, rank: int, slot: int) -> None:
        import threading
        self.conn, self.rank, self.slot, self.lock = conn, rank, slot, threading.Lock()

    def put(self, status: str, value: Any, tb: str = "") -> None:
        with self.lock:
            self.conn.send((self.rank, status, value, tb, self.slot))


class Supervisor(Protocol):
    """What `launch(supervisor=...)` asks; every method runs in the parent, between polls (no threads)."""

    heartbeat_s: float
    detect_s: float
    elastic: bool

    def started(self, job: "Job") -> None: ...
    def failed(self, job: "Job", rank: int, how: str, hung: bool) -> bool: ...   # True: the job goes on
    def message(self, job: "Job", rank: int, payload: Any) -> None: ...
    def tick(self, job: "Job") -> None: ...


def _beat(hb: Any, slot: int, every: float) -> None:
    """The heartbeat thread; it also ends this process if the launcher (its parent) is gone, so no rank outlives
    a killed launcher."""
    parent = os.getppid()
    while True:
        hb[slot] = time.monotonic()
        if os.getppid() != parent:
            os._exit(1)
        time.sleep(every)


def _stopped(signum: int, frame: Any) -> None:
    """SIGTERM from the launcher: unwind quietly (finally blocks close the group, its ipc dir and segments)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(STOPPED)


def _child(rank: int, world_size: int, store_path: str, backend: str, fn: Callable, args: tuple, q: Any,
           options: dict, release: Any, hb: Any = None, slot: int = 0) -> None:
    # Ctrl-C reaches the whole process group; the launcher (the parent) owns it and stops the ranks with SIGTERM,
    # so a Ctrl-C prints one line from the parent, not a traceback per rank
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _stopped)
    forking.release()                   # what the launcher held while starting us is ours to handle now
    if hb is not None:                  # beat from the first instant: a slow import is not a hang
        import threading
        hb[slot] = time.monotonic()
        threading.Thread(target=_beat, args=(hb, slot, options.pop("heartbeat_s")), daemon=True,
                         name="pslab-heartbeat").start()
    import torch
    torch.set_num_threads(1)
    stacks = open(options.pop("stacks_path"), "w")            # launch() asks a hung rank for its stacks
    flight.set_identity(f"rank{rank}", options.pop("flight_dir"))   # ... and for its flight record (flight.py)
    flight.install_signal()
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True, chain=True)
    secret = options.pop("secret")
    elastic = options.pop("elastic", False)
    global _NOTIFY
    q = _NOTIFY = _Outbox(q, rank, slot)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       ENV_SECRET: secret, cleanup.ENV: os.path.dirname(store_path)})
    if os.path.isdir("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")     # gloo (backend="torch") on loopback too
    group = None
    try:
        import torch.distributed as dist
        from .init import init_process_group
        gt = options.pop("group_timeout")
        launch_timeout = options.pop("launch_timeout")
        store = dist.FileStore(store_path, -1)
        store.set_timeout(timedelta(seconds=gt))
        if elastic:            # a member of the job's elastic group: fn drives generations (collectives/elastic.py)
            from .elastic import ElasticGroup
            group = ElasticGroup(backend, rank, store, secret=secret, timeout=gt, incarnation=slot % MAX_PROCS,
                                 **options)
            group.join()
        else:
            group = init_process_group(backend, rank=rank, world_size=world_size, store=store, timeout=gt,
                                       secret=secret, **options)
        flight.RECORDER.group_index(group)   # a member that never calls on it is still known as one
        result = fn(group, *args)
        flight.dump("finished")      # a rank that ended early is evidence too: what it last called
        q.put("ok", result)
        # torch tensors in `result` travel as shared storage that the parent maps from this process:
        # stay alive until the parent has taken every result
        release.wait(launch_timeout)
    except BaseException as e:  # report everything, including KeyboardInterrupt, then exit non-zero
        if isinstance(e, SystemExit) and e.code == STOPPED:
            raise                        # the launcher is stopping us: nothing to report
        flight.dump(f"failed: {type(e).__name__}: {e}")
        q.put("err", f"{type(e).__name__}: {e}", traceback.format_exc())
        raise SystemExit(1)
    finally:
        if group is not None:
            try:
                group.destroy()
            except Exception:
                pass


def _hung_stacks(procs: dict[int, Any], stacks_dir: str) -> str:
    """Ask hung ranks for every thread's Python stack (faulthandler on SIGUSR1; the same signal writes their flight
    record, flight.py) and return them as text."""
    for p in procs.values():
        if p.is_alive() and p.pid is not None:
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except OSError:
                pass
    time.sleep(0.5)
    out = []
    for r in procs:
        try:
            text = open(os.path.join(stacks_dir, f"rank{r}.txt")).read().strip()
        except OSError:
            text = ""
        out.append(f"--- stacks of rank {r} ---\n{text or '(none: the rank did not answer)'}")
    return "\n".join(out)


def launch(fn: Callable[..., Any], world_size: int, backend: str = "zmq", args: tuple = (),
           timeout: float | None = 60.0, *, group_timeout: float | None = None, return_exceptions: bool = False,
           start_method: str = "forkserver", secret: str | None = None, supervisor: Supervisor | None = None,
           flight_dir: str | None = None, **group_options: Any) -> list[Any]:
    """Run `fn(group, *args)` in `world_size` local processes; return the per-rank results in rank order.

    fn must be importable by the children (a module-level function). `group_timeout` bounds every single wait
    inside a collective (default: `timeout`, else 300 s); `timeout` bounds the whole launch (None: no limit).
    `secret`: the job's secret (default: this process's PSLAB_JOB_SECRET / _FILE if set, else a fresh one).
    `supervisor`: watch heartbeats and decide per failure (module docstring); a rank it let go yields a
    `RankFailure`, a member it replaced yields the replacement's result. `flight_dir`: where each rank writes its
    flight record (flight.py) at its end, on a failed collective and when asked (default: the job's temporary
    directory, read for the verdict of a timed-out launch). What the ranks leave behind -- ipc
    directories, shared-memory segments, even of a killed rank -- is swept when the launch ends (cleanup.py)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    job = Job(fn, world_size, backend, args, timeout, group_timeout=group_timeout, start_method=start_method,
              secret=secret, supervisor=supervisor, group_options=group_options, flight_dir=flight_dir)
    return job.run(return_exceptions)


class Job:
    """The processes of one `launch`: started, watched, and always reaped (see `launch`)."""

    def __init__(self, fn: Callable[..., Any], world_size: int, backend: str, args: tuple, timeout: float | None,
                 *, group_timeout: float | None, start_method: str, secret: str | None,
                 supervisor: Supervisor | None, group_options: dict[str, Any], flight_dir: str | None = None) -> None:
        self.fn, self.world_size, self.backend, self.args, self.timeout = fn, world_size, backend, args, timeout
        self.supervisor = supervisor
        # forkserver: one server imports torch once; each rank is then a cheap fork of it
        self.ctx = (forking.forkserver_context((getattr(fn, "__module__", "") or "",)) if start_method == "forkserver"
                    else mp.get_context(start_method))
        self.conns: dict[Any, int] = {}                  # read end of each child's pipe -> its rank
        self.pidfds: dict[int, Any] = {}                 # pidfd of each child's process -> that Process
        self.dead: dict[Any, float] = {}                 # Process -> monotonic time its pidfd said it exited
        self.statuses: dict[Any, int | None] = {}       # Process -> exit code read from /proc while a zombie
        gt = group_timeout or timeout or 300.0
        self.options = dict(group_options, group_timeout=gt, secret=secret or job_secret() or new_job_secret())
        self.flight_dir = flight_dir or ""           # "": the job dir's (made by run(), swept with it)
        if supervisor is not None:
            self.options["heartbeat_s"] = supervisor.heartbeat_s
            self.options["elastic"] = bool(supervisor.elastic)
        self.hb = self.ctx.Array("d", world_size * MAX_PROCS, lock=False) if supervisor is not None else None
        self.release = self.ctx.Event()
        self.job_dir = ""                                # made by run(), inside its try: always swept
        self.store_path = ""
        self.procs: dict[int, Any] = {}                  # rank (member) -> its current process
        self.spawned: dict[int, int] = {r: 0 for r in range(world_size)}   # processes started per rank
        self.history: dict[int, list[str]] = {}   # per rank: why each of its processes ended (failures)
        self.all_procs: list[Any] = []
        self.results: dict[int, Any] = {}
        self.gone: set[int] = set()                      # ranks the supervisor let go (dead or hung)
        self._inbox: list[tuple] = []
        self._store: Any = None
        self._lags: list[tuple[float, float]] = []      # (monotonic time, how late a poll woke), last LAG_WINDOW_S
        self._cpu = CpuProgress()                          # when each child's CPU time last grew (procstate)

    # ------------------------------------------------------------------ what a supervisor may do
    @property
    def store(self) -> Any:
        """The job's rendezvous store (a FileStore), e.g. to publish an elastic membership."""
        if self._store is None:
            import torch.distributed as dist
            self._store = dist.FileStore(self.store_path, -1)
        return self._store

    @property
    def secret(self) -> str:
        return self.options["secret"]

    def incarnation(self, rank: int) -> int:
        """Which process of `rank` is its current one: 0 the first, n its n-th replacement (`spawn`)."""
        return max(self.spawned[rank] - 1, 0)

    def pid(self, rank: int) -> int | None:
        """The pid of rank's current process (a replacement's, once one is started); None if it is not running."""
        p = self.procs.get(rank)
        return None if p is None or p.pid is None or p.exitcode is not None else p.pid

    def _slot(self, rank: int) -> int:
        return rank * MAX_PROCS + self.spawned[rank] - 1

    def lag_s(self) -> float:
        """How late this parent's polls woke up at worst over the last LAG_WINDOW_S seconds (its measure of load)."""
        cut = time.monotonic() - LAG_WINDOW_S
        self._lags = [x for x in self._lags if x[0] >= cut]
        return max((lag for _, lag in self._lags), default=0.0)

    def hang_bound_s(self, detect_s: float) -> float:
        """A silent heartbeat is a hang past this many seconds: detect_s, widened by the measured load."""
        return detect_s + LAG_FACTOR * self.lag_s()

    def heartbeat_age(self, rank: int) -> float:
        """Seconds since rank's current process last beat (supervised launches only); 0 while it starts (before its
        first beat: a spawned child imports its modules first), up to STARTUP_S."""
        beat = self.hb[self._slot(rank)]
        if beat < 0:                         # not beating yet: -(its start time)
            return max(0.0, time.monotonic() + beat - STARTUP_S)
        return time.monotonic() - beat

    def spawn(self, rank: int, extra_args: tuple = ()) -> None:
        """Start a replacement process for `rank` (its previous one must be gone or let go): fn(group, *args,
        *extra_args). Its result replaces the rank's failure."""
        if self.spawned[rank] >= MAX_PROCS:
            why = "; ".join(f"#{n}: {e}" for n, e in enumerate(self.history.get(rank, [])))
            raise LaunchError(f"rank {rank} was replaced {MAX_PROCS - 1} times already; not starting another "
                              f"(its processes ended: {why})")
        self.gone.discard(rank)
        self.results.pop(rank, None)
        self._start(rank, self.args + tuple(extra_args))

    # ------------------------------------------------------------------ internals
    def _start(self, r: int, args: tuple) -> None:
        n = self.spawned[r]
        slot = r * MAX_PROCS + n
        if self.hb is not None:
            self.hb[slot] = -time.monotonic()     # started, not beating yet (see heartbeat_age)
        opts = dict(self.options, launch_timeout=self.timeout or 1e9,
                    stacks_path=os.path.join(self.job_dir, f"rank{r}.txt" if n == 0 else f"rank{r}.{n}.txt"))
        read, write = self.ctx.Pipe(duplex=False)
        p = self.ctx.Process(target=_child, args=(r, self.world_size, self.store_path, self.backend, self.fn, args,
                                                  write, opts, self.release, self.hb, slot),
                             daemon=True, name=f"pslab-rank{r}" if n == 0 else f"pslab-rank{r}.{n}")
        self.spawned[r] = n + 1
        self.procs[r] = p
        self.all_procs.append(p)
        # a SIGINT/SIGTERM that reaches a child before _child installs its handlers would run the parent's
        # (forking.py): held until then; p is recorded above, so stop() finds it once its pid is set, whatever
        # interrupts this start
        try:
            forking.start(p, self.ctx.get_start_method())
        finally:
            write.close()              # only the child writes (and whatever inherited it: EOF is no death notice)
            self.conns[read] = r
        fd = pidfd(p.pid)
        if fd is not None:
            self.pidfds[fd] = p
            if p.exitcode is not None:     # it exited before the pidfd was opened (the pid may be reused already)
                self._reaped(fd)

    def verdict(self) -> str:
        """What the ranks' flight records say went wrong (diagnose.py), as '; diagnosis: ...', or ''."""
        from .diagnose import diagnose_dir
        try:
            lines = diagnose_dir(self.flight_dir).problems
        except Exception:           # a verdict is a help, never a second failure
            return ""
        return f"; diagnosis: {' | '.join(lines)}" if lines else ""

    def _fail(self, r: int, failure: RankFailure, hung: bool, return_exceptions: bool) -> None:
        """A rank died, hung or raised: the supervisor decides whether the job goes on."""
        sup = self.supervisor
        self.history.setdefault(r, []).append(str(failure.error)[:160])    # (named if it is replaced too often)
        if sup is not None:
            self.gone.add(r)                 # let go (a replacement, if the supervisor spawns one, undoes this)
            self.results[r] = failure
            if sup.failed(self, r, failure.error, hung):
                return
            self.gone.discard(r)
            self.results.pop(r, None)
        if return_exceptions:
            self.results[r] = failure
            return
        if failure.traceback:
            raise LaunchError(f"rank {r} failed: {failure.error}{self.verdict()}\n--- traceback of rank {r} ---\n"
                              f"{failure.traceback}")
        raise LaunchError(f"rank {r} {failure.error}{self.verdict()}")

    def _receive(self, timeout: float = 0.05) -> tuple | None:
        """The next message of any child within `timeout` s, or None; a closed pipe is dropped, and a child's exit
        (its pidfd became readable) is noted in `dead` after what it wrote has been read."""
        if not self._inbox:
            waitables = list(self.conns) + list(self.pidfds)
            t0 = time.monotonic()
            ready = mp.connection.wait(waitables, timeout=timeout) if waitables else time.sleep(timeout)
            if not ready:                              # it slept the whole timeout: how late did it wake?
                now = time.monotonic()
                late = now - t0 - timeout
                if late > 0.01:
                    self._lags.append((now, late))
            for c in ready or ():
                if isinstance(c, int):
                    self._reaped(c)
                    continue
                self._drain(c)
        return self._inbox.pop(0) if self._inbox else None

    def _drain(self, c: Any, dead: bool = False) -> None:
        """Read the messages waiting in pipe `c`, at most DRAIN_BATCH of a live writer (the rest wait for the next
        wake-up, after the watch); drop the pipe at its end of file. `dead`: its writer is dead, so read all it
        wrote; a message it did not finish writing never will be (another process may hold the write end: no end
        of file either): read without blocking, and a torn message ends the pipe (BlockingIOError), not a hang."""
        try:
            if dead:
                os.set_blocking(c.fileno(), False)
            n = 0
            while (dead or n < DRAIN_BATCH) and c.poll():
                self._inbox.append(c.recv())
                n += 1
        except (EOFError, OSError):
            self.conns.pop(c, None)
            c.close()

    def _close_pipes_of(self, rank: int) -> None:
        """Read what rank's dead current process wrote, then close its pipe (a dead process writes no more)."""
        for c, r in list(self.conns.items()):
            if r == rank:
                self._drain(c, dead=True)
                if c in self.conns:
                    self.conns.pop(c)
                    c.close()

    def _reaped(self, fd: int) -> None:
        """The process behind pidfd `fd` exited: read what it wrote before it died, then note it as dead. Its pipe
        is closed too (a dead process writes nothing more; an inherited write end must not keep it open)."""
        p = self.pidfds.pop(fd)
        os.close(fd)
        self.dead.setdefault(p, time.monotonic())
        self.statuses.setdefault(p, zombie_exit_code(p.pid))     # before the forkserver reaps it (and the pid goes)
        for r in [r for r, q in self.procs.items() if q is p]:
            self._close_pipes_of(r)

    def _look_for_deaths(self) -> None:
        """Note every child whose pidfd is readable now (no wait)."""
        if self.pidfds:
            for fd in mp.connection.wait(list(self.pidfds), timeout=0):
                self._reaped(fd)

    def _unread(self, rank: int) -> bool:
        """Whether a message of `rank` may still be waiting (its pipe not yet drained to EOF)."""
        return any(r == rank for r in self.conns.values()) or any(m[0] == rank for m in self._inbox)

    def _pending(self) -> list[int]:
        return [r for r in range(self.world_size) if r not in self.results]

    def run(self, return_exceptions: bool) -> list[Any]:
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        sup = self.supervisor
        try:
            self.job_dir = cleanup.make_dir("pslab-job-")   # 0700: the store, the stacks, the ranks' ipc dirs, shm
            self.store_path = os.path.join(self.job_dir, "store")
            self.flight_dir = self.options["flight_dir"] = self.flight_dir or os.path.join(self.job_dir, "flight")
            if sup is not None:
                sup.started(self)           # e.g. publish generation 0 before anyone joins
            for r in range(self.world_size):
                self._start(r, self.args)
            watched = 0.0
            while self._pending():
                msg = self._receive()
                if msg is None or time.monotonic() - watched > 0.05:   # even while messages keep coming
                    watched = time.monotonic()
                    # a backlog of messages keeps _receive from waiting on the pidfds: ask the kernel here too
                    self._look_for_deaths()
                    # (the sender of the message in hand is not judged: its report is read right below)
                    self._watch(return_exceptions, exclude=None if msg is None else msg[0])
                    if sup is not None:
                        sup.tick(self)
                    if deadline is not None and time.monotonic() > deadline:
                        running = [r for r in self._pending() if r not in self.gone]
                        stacks = _hung_stacks({r: self.procs[r] for r in running}, self.job_dir)
                        raise LaunchError(f"launch timed out after {self.timeout:g}s; ranks {running} had not "
                                          f"finished{self.verdict()}\n{stacks}")
                    if msg is None:
                        continue
                rank, status, value, tb, slot = msg
                if status == "msg":
                    if sup is not None:
                        sup.message(self, rank, value)
                elif rank in self.gone or slot != self._slot(rank):
                    continue                 # a let-go process woke up (SIGCONT) and reported: it is out of the job
                elif status == "ok":
                    self.results[rank] = value
                else:
                    # the supervisor's verdict first: a rank that died is named before a survivor's error, which
                    # may only be the consequence ("a peer of this group failed")
                    self._look_for_deaths()
                    self._watch(return_exceptions, exclude=rank)
                    watched = time.monotonic()
                    if rank in self.gone or slot != self._slot(rank) or rank in self.results:
                        continue
                    self._fail(rank, RankFailure(rank, value, tb, self.procs[rank].exitcode), False,
                               return_exceptions)
            self.release.set()
            for r, p in self.procs.items():
                if r not in self.gone:           # a let-go rank (stopped, say) is ended below, not waited for
                    p.join(timeout=5.0 if deadline is None else max(0.1, min(5.0, deadline - time.monotonic())))
        finally:
            self.release.set()
            for p in self.all_procs:
                if p.is_alive():
                    if p.pid is not None:
                        try:
                            os.kill(p.pid, signal.SIGCONT)     # a stopped rank cannot handle SIGTERM
                        except OSError:
                            pass
                    p.terminate()
            for p in self.all_procs:
                if p.pid is None:            # never started
                    continue
                p.join(timeout=2)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=2)
            for c in self.conns:
                c.close()
            for fd in self.pidfds:
                os.close(fd)
            self.pidfds.clear()
            self._store = None               # the parent's FileStore handle, before its directory goes
            if self.job_dir:
                cleanup.sweep(self.job_dir)  # also what killed ranks could not remove (collectives/cleanup.py)
        return [self.results[r] for r in range(self.world_size)]

    def _watch(self, return_exceptions: bool, exclude: int | None = None) -> None:
        """Name ranks that died without reporting (SIGKILL, segfault) or whose heartbeat stopped (SIGSTOP, hang)."""
        for r in self._pending():
            if r in self.gone or r == exclude:
                continue
            p = self.procs[r]
            died = p in self.dead or p.exitcode is not None
            if died:                             # what it wrote is all there is: read it, close its pipe
                self._close_pipes_of(r)
            if died and not self._unread(r):
                code = p.exitcode
                if code is None:                 # the kernel said it exited: its status as a zombie, or the
                    code = self.statuses.get(p)  # forkserver's report (which follows its waitpid)
                if code is None:
                    code = exit_code_after(p, self.dead.get(p, time.monotonic()))
                if code == 0:
                    continue                     # a clean exit with its result on the way (or none: see run())
                how = ("exited (its status was not reported)" if code is None
                       else f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}")
                self._fail(r, RankFailure(r, f"died ({how}) before reporting a result", exitcode=code),
                           False, return_exceptions)
            elif self.supervisor is not None and not died:
                age = self.heartbeat_age(r)
                detect_s = self.supervisor.detect_s
                bound = self.hang_bound_s(detect_s)
                busy = self._cpu.busy(p.pid, detect_s)   # (sampled every watch: it must see the ticks move)
                if age > detect_s and (_stopped_state(p.pid) or
                                       age > (BUSY_FACTOR * bound if busy else bound)):
                    self._fail(r, RankFailure(r, f"hung: no heartbeat for {age:.1f} s"), True, return_exceptions)

