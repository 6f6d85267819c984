"""Consistency gates on the sans-IO shard, driven by a small discrete-event loop with a deliberately slow worker.

Checked at every read: a worker working at clock c has c <= min_w clock_w + s (the SSP bound), the read contains
every update stamped <= c - s - 1 (checked on the parameter values), eager SSP reads its own writes, and ASP
never waits.
"""

from __future__ import annotations

import heapq

import numpy as np
import pytest

from pslab.ps.consistency import ASP, BSP, SSP, BackupBSP, policy_from_string
from pslab.ps.errors import ClockError, ConfigError, ProtocolError
from pslab.ps.shard import ShardState


def grad_of(w: int, c: int) -> np.ndarray:
    # distinct, exactly representable per (worker, clock): sums and means of these are exact in float64
    return np.full(3, float(2 ** (w + 1) * (c + 1)), np.float64)


def simulate(policy: str, k: int = 3, clocks: int = 12, slow: float = 3.5, s: int | None = None):
    """Run k workers (worker k-1 is `slow` times slower) for `clocks` clocks in virtual time; check invariants."""
    st = ShardState({"w": np.zeros(3, np.float64)}, "sgd:lr=1", policy, num_workers=k)
    bound = st.policy.bound()
    duration = [1.0] * (k - 1) + [slow]
    events: list[tuple[float, int, str]] = [(0.0, w, "read") for w in range(k)]
    heapq.heapify(events)
    parked: list[tuple[float, int]] = []
    reads: dict[int, tuple[int, int]] = {}
    pushed: list[tuple[int, int]] = []          # (worker, clock) in push order
    log = []

    def try_read(now: float, w: int) -> bool:
        c = st.clocks[w]
        if not st.may_read(w, c, now):
            return False
        r = st.read(w, c, now)
        if bound is not None:
            assert c <= min(st.clocks) + bound, (c, st.clocks)
        value = -r.params["w"].numpy()[0]
        if st.policy.aggregate:
            expect = sum(np.mean([grad_of(v, cc)[0] for v in range(k)]) for cc in range(r.version))
            assert r.version >= c - (bound or 0)           # contains every update stamped <= c - s - 1
        else:                                               # eager: everything pushed so far, own writes included
            expect = sum(grad_of(v, cc)[0] for v, cc in pushed)
            assert all((w, cc) in pushed for cc in range(c))
            if bound is not None:
                assert all((v, cc) in pushed for v in range(k) for cc in range(c - bound))
        assert value == expect
        reads[w] = (c, r.version)
        log.append((now, w, c, r.version))
        heapq.heappush(events, (now + duration[w], w, "push"))
        return True

    while events:
        now, w, what = heapq.heappop(events)
        if what == "read":
            if st.clocks[w] >= clocks:
                continue
            if not try_read(now, w):
                parked.append((now, w))
        else:
            c, v = reads[w]
            st.push(w, c, v, {"w": grad_of(w, c)}, now)
            pushed.append((w, c))
            if bound is not None:
                assert max(st.clocks) <= min(st.clocks) + bound + 1
            heapq.heappush(events, (now, w, "read"))
            still = []
            for t0, pw in parked:
                if not try_read(now, pw):
                    still.append((t0, pw))
            parked = still
    assert not parked
    return st, log


@pytest.mark.parametrize("s", [0, 1, 3])
@pytest.mark.parametrize("variant", ["ssp", "ssp-agg"])
def test_ssp_bound_and_read_guarantee_with_slow_worker(s, variant):
    """SSP(s), both variants: the bound and the read guarantee hold at every read; the fast workers do wait for
    the slow one. Staleness in versions: <= s for ssp-agg (one version per clock), <= (K-1)(2s+1) for Ho's ssp."""
    st, log = simulate(f"{variant}:{s}", s=s)
    assert st.clocks == [12, 12, 12]
    fast_wait = sum(st.stats.waits[0]) + sum(st.stats.waits[1])
    assert fast_wait > 0                                 # the gate really held them back
    taus = [tau for _, _, tau, _ in st.stats.series]
    assert max(taus) <= (s if variant == "ssp-agg" else 2 * (2 * s + 1))
    if variant == "ssp" and s > 0:
        assert max(taus) > s                             # versions are pushes: the eager bound is really looser


@pytest.mark.parametrize("s", [0, 2])
def test_eager_ssp_reads_own_writes(s):
    """ssp:s (Ho et al.) applies every push at once: reads include the reader's own writes and all writes <= c-s-1
    (checked value by value inside `simulate`), one version per push."""
    st, _ = simulate(f"ssp:{s}", s=s)
    assert st.version == 36
    assert not st.policy.aggregate


def test_eager_ssp0_at_lr_over_k_equals_bsp():
    """Each worker asks for its next read right after its push (push_pull); ssp:0 parks it until every worker has
    pushed the clock, so at lr eta/K it makes BSP(eta)'s steps for SGD: the K clock-c gradients are all computed on
    the same version. Control: ASP answers the read at once, and the trajectory differs."""
    K, clocks = 3, 5
    g = lambda w, c, x: (x * 0.5 + (w + 1) * 0.1 + c * 0.01).astype(np.float32)  # noqa: E731  (a linear "gradient")
    finals = {}
    for policy, lr in (("bsp", 0.3), ("ssp:0", 0.1), ("asp", 0.1)):
        st = ShardState({"w": np.ones(4, np.float32)}, f"sgd:lr={lr}", policy, num_workers=K)
        reads = {w: st.read(w, 0, 0.0) for w in range(K)}
        grads = {w: g(w, 0, reads[w].params["w"].numpy().copy()) for w in range(K)}
        for c in range(clocks):
            parked = []
            for w in range(K):
                st.push(w, c, reads[w].version, {"w": grads[w]}, 0.0)
                parked.append(w)
                for v in list(parked):             # serve every read the gate now allows, as the shard does
                    if st.may_read(v, c + 1, 0.0):
                        reads[v] = st.read(v, c + 1, 0.0)
                        grads[v] = g(v, c + 1, reads[v].params["w"].numpy().copy())
                        parked.remove(v)
            assert not parked
        finals[policy] = st.params["w"].numpy().copy()
    np.testing.assert_allclose(finals["ssp:0"], finals["bsp"], rtol=1e-6)
    assert np.abs(finals["asp"] - finals["bsp"]).max() > 1e-3   # control: without the gate the reads differ


def test_asp_never_waits_even_with_a_slow_worker():
    """ASP: may_read is always true, every recorded wait is 0, and fast workers finish far ahead of the slow one."""
    st, log = simulate("asp", clocks=12)
    assert all(x == 0 for ws in st.stats.waits.values() for x in ws)
    assert all(sum(ws) == 0 for ws in st.stats.waits.values())
    finish = {w: max(t for t, ww, _, _ in log if ww == w) for w in range(3)}
    assert finish[0] < finish[2] / 2


def test_ssp_allows_lead_up_to_s_but_not_more():
    """Direct gate check: with clocks [5, 2] and s = 3, worker 0 may read at 5; at 6 it must wait for worker 1."""
    st = ShardState({"w": np.zeros(2)}, "sgd:lr=1", "ssp:3", num_workers=2)
    st.clocks = [5, 2]
    assert st.may_read(0, 5)
    st.clocks = [6, 2]
    assert not st.may_read(0, 6, now=1.0)
    assert st.blocking_workers(6) == [1]
    with pytest.raises(ProtocolError, match="not allowed yet"):
        st.read(0, 6, now=1.0)
    st.clocks = [6, 3]
    r = st.read(0, 6, now=4.5)
    assert st.stats.waits[0][-1] == pytest.approx(3.5)    # waited from 1.0 to 4.5 on the gate
    assert r.clock == 6


def test_backup_workers_take_first_n_and_drop_late():
    """bsp-backup:1 with 3 workers: each clock commits the average of the first 2 gradients; the third is dropped
    and counted, and the straggler then joins the current clock."""
    st = ShardState({"w": np.zeros(1)}, "sgd:lr=1", "bsp-backup:1", num_workers=3)
    for w in range(3):
        st.read(w, 0)
    assert st.push(0, 0, 0, {"w": np.array([2.0])}).status == "buffered"
    assert st.push(1, 0, 0, {"w": np.array([4.0])}).status == "applied"
    assert st.params["w"].item() == -3.0 and st.version == 1
    assert st.may_read(0, 1) and st.may_read(1, 1)
    late = st.push(2, 0, 0, {"w": np.array([1000.0])})
    assert late.status == "dropped" and st.stats.dropped[2] == 1
    assert st.params["w"].item() == -3.0
    for w in (0, 1):
        st.read(w, 1)
        st.push(w, 1, 1, {"w": np.array([1.0])})
    assert st.version == 2
    assert not st.may_read(2, 3) if st.clocks[2] == 3 else True
    r = st.read(2, st.clocks[2])           # straggler at clock 1 is moved up to the committed clock 2
    assert r.clock == 2 and st.clocks[2] == 2


def test_clock_and_worker_validation_changes_nothing():
    """Pushes with a wrong clock, an unknown worker or a future read version are refused; nothing changes."""
    st = ShardState({"w": np.zeros(2, np.float32)}, "sgd:lr=1", "asp", num_workers=2)
    g = {"w": np.ones(2, np.float32)}
    for args in [(0, 1, 0, g), (2, 0, 0, g), (0, 0, 5, g), (-1, 0, 0, g)]:
        with pytest.raises(ProtocolError):
            st.push(*args)
    with pytest.raises(ClockError):
        st.push(0, 3, 0, g)
    assert st.version == 0 and st.clocks == [0, 0] and (st.params["w"].numpy() == 0).all()


def test_policy_strings():
    assert policy_from_string("asp") == ASP()
    assert policy_from_string("BSP") == BSP()
    assert policy_from_string("ssp:3") == SSP(3) == SSP(3, eager=True)
    assert policy_from_string("ssp-agg:2") == SSP(2, eager=False)
    assert policy_from_string("bsp-backup:1") == BackupBSP(1)
    assert policy_from_string("ssp:0").may_read(1, [1, 1], 0) and not policy_from_string("ssp:0").may_read(2, [2, 1], 0)
    for bad in ["ssp", "ssp:-1", "ssp:x", "hogwild", "bsp:2"]:
        with pytest.raises(ConfigError, match="unknown consistency policy"):
            policy_from_string(bad)
