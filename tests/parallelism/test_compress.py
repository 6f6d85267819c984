"""Gradient compressors with error feedback (parallelism/compress.py), in one process: D workers are threads
over an in-memory dp group (the arithmetic, not the transport; real runs are tests/experiments/test_compress_runs).

topk:1.0 and powersgd at full rank equal the plain mean (rel 1e-6); error feedback's invariant — what was sent
plus the residual equals the sum of the gradients — holds exactly in float64; without error feedback top-k keeps
dropping the same coordinates; sign sends the mean |M| times the signs; PowerSGD matches an independent
reference written here from Vogels et al.'s Algorithm 1 (torch's powerSGD_hook runs only inside DDP's bucket
machinery, so the test checks against the paper instead); bad strings are one line."""

from __future__ import annotations

import threading

import pytest
import torch

from pslab.parallelism.compress import PowerSGD, Sign, TopK, check_compress, lockstep, make_compressor



def _run(make, grads_per_worker, steps=1):
    """Each worker's compressor over `steps` steps of its gradients, the D workers driven together
    (compress.lockstep); returns (per worker: the means, the compressor), and the bytes per rank of the last step."""
    D = len(grads_per_worker)
    comps = [make() for _ in range(D)]
    means = [[] for _ in range(D)]
    sent = 0
    for t in range(steps):
        outs, sent, _ = lockstep([comps[r].steps(grads_per_worker[r][t], D) for r in range(D)])
        for r in range(D):
            means[r].append(outs[r])
    return [(means[r], comps[r], sent) for r in range(D)]


class _ThreadComm:
    """Rank `rank` of D threads meeting at a barrier: the Comm calls `Compressor.mean` makes on a real group."""

    def __init__(self, bar, slots, rank):
        self.bar, self.slots, self.rank, self.size = bar, slots, rank, len(slots)

    def _exchange(self, t):
        self.slots[self.rank] = t.clone()
        self.bar.wait()
        got = list(self.slots)
        self.bar.wait()
        return got

    def all_reduce(self, t, op="sum", site=""):
        got = self._exchange(t)
        t.copy_(sum(got[1:], got[0].clone()))

    def all_gather(self, out, inp, site=""):
        out.copy_(torch.cat([x.reshape(-1) for x in self._exchange(inp)]))


@pytest.mark.parametrize("kind", ["topk:0.2", "sign", "powersgd:2"])
def test_mean_over_a_group_equals_the_lockstep_driver(kind):
    """`mean(dp, g)` — what a real run calls, here on 3 threads meeting at a barrier — and `lockstep` — what the
    simulator calls — run the same generator: the same means and residuals, bit for bit, over 3 steps."""
    D, T = 3, 3
    grads = _grads(D, T)
    comps = [make_compressor(kind) for _ in range(D)]
    bar, slots, out = threading.Barrier(D, timeout=30), [None] * D, [None] * D

    def work(r):
        comm = _ThreadComm(bar, slots, r)
        out[r] = [comps[r].mean(comm, grads[r][t]) for t in range(T)]
    ts = [threading.Thread(target=work, args=(r,)) for r in range(D)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    ref = _run(lambda: make_compressor(kind), grads, steps=T)
    for r in range(D):
        for t in range(T):
            assert all(torch.equal(a, b) for a, b in zip(out[r][t], ref[r][0][t])), (r, t)
        assert all(torch.equal(a, b) for a, b in zip(comps[r].residual, ref[r][1].residual))


def _grads(D, steps, shapes=((6, 5), (5,), (4, 3, 2)), dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[[torch.randn(*s, generator=gen, dtype=dtype) for s in shapes] for _ in range(steps)] for _ in range(D)]


def _mean(grads, t):
    D = len(grads)
    return [sum(grads[r][t][i] for r in range(D)) / D for i in range(len(grads[0][t]))]


def _rel(a, b):
    return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b))


@pytest.mark.parametrize("make", [lambda: TopK(1.0), lambda: PowerSGD(6), lambda: PowerSGD(64)],
                         ids=["topk:1.0", "powersgd:6", "powersgd:64"])
def test_full_compressors_equal_the_plain_mean(make):
    grads = _grads(3, 2)
    res = _run(make, grads, steps=2)
    for r in range(3):
        for t in range(2):
            assert _rel(res[r][0][t], _mean(grads, t)) < 1e-6
    assert all(float(e.abs().max()) < 1e-5 for e in res[0][1].residual)     # nothing left behind


@pytest.mark.parametrize("make", [lambda: TopK(0.1), lambda: Sign(), lambda: PowerSGD(1)],
                         ids=["topk:0.1", "sign", "powersgd:1"])
def test_error_feedback_loses_nothing(make):
    """What the workers decoded (D × the mean they stepped with), summed over the steps, plus every worker's
    residual equals the sum of all gradients — exactly, in float64: nothing is lost, only delayed. Every worker
    steps with the same mean."""
    D, T = 3, 5
    grads = _grads(D, T, dtype=torch.float64)
    res = _run(make, grads, steps=T)
    held = 0.0
    for i in range(3):
        decoded = D * sum(res[0][0][t][i] for t in range(T))
        residuals = sum(res[r][1].residual[i] for r in range(D))
        total = sum(grads[r][t][i] for r in range(D) for t in range(T))
        assert float((decoded + residuals - total).abs().max()) < 1e-12 * float(total.abs().max() + 1)
        held = max(held, float(residuals.abs().max()))
    assert held > 1e-3                                     # (a lossy compressor: something was held back)
    for r in range(D):
        for t in range(T):
            assert all(torch.equal(a, b) for a, b in zip(res[r][0][t], res[0][0][t]))


def test_without_error_feedback_topk_keeps_dropping_the_same_coordinates():
    """A constant gradient whose small coordinates never make the top-k: without error feedback their mean
    update stays 0 for ever; with it the residual grows until they are sent."""
    g = [torch.tensor([10.0, 9.0, 0.5, 0.4])]
    grads = [[g] * 30]
    never = _run(lambda: TopK(0.5, error_feedback=False), grads, steps=30)[0][0]
    assert all(float(m[0][2]) == 0 and float(m[0][3]) == 0 for m in never)
    fed = _run(lambda: TopK(0.5), grads, steps=30)[0][0]
    assert sum(float(m[0][2]) for m in fed) > 0 and sum(float(m[0][3]) for m in fed) > 0


def test_sign_sends_the_mean_magnitude_times_the_signs():
    grads = [[[torch.tensor([3.0, -1.0, 2.0, -2.0, 0.5, 0.0, -0.5, 1.0, 4.0])]]]
    (means, c, sent), = _run(lambda: Sign(error_feedback=False), grads)
    x = grads[0][0][0]
    want = x.abs().mean() * torch.where(x >= 0, 1.0, -1.0)
    assert torch.allclose(means[0][0], want)
    assert sent == 0                               # one worker: the all-gather sends to nobody


def _reference_powersgd(mats, qs):
    """Vogels et al. 2019, Algorithm 1, one step for D workers' (rows, cols) matrices and the shared Q."""
    D = len(mats)
    P = sum(m @ qs for m in mats) / D
    P, _ = torch.linalg.qr(P)
    Q = sum(m.T @ P for m in mats) / D
    return P @ Q.T, Q


def test_powersgd_is_the_papers_algorithm_with_warm_start():
    grads = _grads(2, 3, shapes=((8, 6),), dtype=torch.float64, seed=3)
    res = _run(lambda: PowerSGD(2, error_feedback=True, seed=7), grads, steps=3)
    gen = torch.Generator().manual_seed(7 * 1_000_003 + 0)
    Q = torch.randn(6, 2, generator=gen, dtype=torch.float64)
    e = [torch.zeros(8, 6, dtype=torch.float64) for _ in range(2)]
    for t in range(3):
        M = [grads[r][t][0] + e[r] for r in range(2)]
        approx, Q = _reference_powersgd(M, Q)
        e = [M[r] - approx for r in range(2)]
        for r in range(2):
            assert torch.allclose(res[r][0][t][0], approx, rtol=1e-10, atol=1e-12)


def test_powersgd_leaves_a_bias_whole():
    c = PowerSGD(2)
    assert not c.compressible(torch.zeros(5)) and not c.compressible(torch.zeros(3, 2))
    assert c.compressible(torch.zeros(16, 16))


@pytest.mark.parametrize("text, fragment", [
    ("topk:0", "in (0, 1]"), ("topk:2", "in (0, 1]"), ("topk", "must be none, topk:<fraction>"),
    ("powersgd:0", "rank >= 1"), ("gzip", "must be none, topk:<fraction>, sign or powersgd:<rank>"),
])
def test_bad_strings_are_one_line(text, fragment):
    with pytest.raises(ValueError) as e:
        check_compress(text)
    assert fragment in str(e.value) and "\n" not in str(e.value)
    assert make_compressor("none") is None


@pytest.mark.parametrize("make", [lambda: TopK(0.1), lambda: Sign(), lambda: PowerSGD(2, seed=3)],
                         ids=["topk", "sign", "powersgd"])
def test_state_put_back_continues_bitwise_and_is_needed(make):
    """What a checkpoint keeps per worker (`state`: the residual, PowerSGD's warm-start Q) put into a fresh
    compressor (`load_state`) continues exactly as the original; a fresh one without it does not."""
    torch.manual_seed(0)
    D, shapes = 2, [(6, 5), (5,)]
    grads = [[[torch.randn(s, dtype=torch.float64) for s in shapes] for _ in range(4)] for _ in range(D)]
    comps = [make() for _ in range(D)]
    for t in range(2):
        lockstep([comps[r].steps(grads[r][t], D) for r in range(D)])
    like = [torch.empty(s, dtype=torch.float64) for s in shapes]
    restored, fresh = [make() for _ in range(D)], [make() for _ in range(D)]
    for r in range(D):
        restored[r].load_state({k: v.clone() for k, v in comps[r].state().items()}, like)
    a, _, _ = lockstep([comps[r].steps(grads[r][2], D) for r in range(D)])
    b, _, _ = lockstep([restored[r].steps(grads[r][2], D) for r in range(D)])
    c, _, _ = lockstep([fresh[r].steps(grads[r][2], D) for r in range(D)])
    assert all(torch.equal(x, y) for r in range(D) for x, y in zip(a[r], b[r]))
    assert not all(torch.equal(x, y) for r in range(D) for x, y in zip(a[r], c[r]))


def test_a_state_of_another_model_is_one_error():
    from pslab.parallelism.engine import EngineError
    c = TopK(0.5)
    lockstep([c.steps([torch.ones(4), torch.ones(3)], 1)])
    with pytest.raises(EngineError, match="another model"):
        TopK(0.5).load_state(c.state(), [torch.ones(4)])
    with pytest.raises(EngineError, match="another model"):
        TopK(0.5).load_state(c.state(), [torch.ones(4), torch.ones(2)])


def test_at_another_world_size_each_rank_gets_the_mean_residual():
    """snapshot.local_of: the same world gives each rank its own; another gives every rank the mean, which keeps
    what the D workers still owe the average, (1/D)·Σ e_i, for any new D'."""
    from pslab.parallelism.snapshot import local_of
    src = [({"local/residual/0": torch.tensor([float(i), 2.0 * i])}, {"local": ["residual/0"]}) for i in range(4)]
    assert torch.equal(local_of(src, 2)["residual/0"], torch.tensor([2.0, 4.0]))
    mean = local_of(src, None)["residual/0"]
    assert torch.equal(mean, torch.tensor([1.5, 3.0]))
    owed_before = sum(t["local/residual/0"] for t, _ in src) / 4
    assert torch.equal(sum([mean, mean]) / 2, owed_before)
