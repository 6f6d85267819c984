"""Compressed pushes (ps/compression.py): what the shard decodes is what the worker counted as sent, error feedback
loses nothing, topk:1.0 is the whole gradient, a refused push moves neither the clock nor the residual, and every
malformed compressed push is one ProtocolError / ShapeError that changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

from pslab import ps
from pslab.ps import compression
from pslab.ps.errors import ConfigError, NonFiniteGradientError, ProtocolError, PSError, ShapeError

PARAMS = {"w": np.zeros((12, 9), np.float32), "b": np.zeros(5, np.float32)}


def _grads(rng: np.random.Generator, like: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in like.items()}


@pytest.mark.parametrize("form", ["topk:0.1", "topk:0.5", "sign"])
def test_error_feedback_loses_nothing_float64(form):
    """Σ_t decode(C(M_t)) + e_T = Σ_t g_t (float64, to rounding): the shard's view of each push is the worker's
    C(M_t), and what was not sent waits in the residual."""
    rng = np.random.default_rng(0)
    layout = {"a": (40, np.dtype(np.float64)), "b": (7, np.dtype(np.float64))}
    comp = compression.PushCompressor(compression.parse(form))
    total = {k: np.zeros(n) for k, (n, _) in layout.items()}
    sent = {k: np.zeros(n) for k, (n, _) in layout.items()}
    for _ in range(6):
        g = {k: rng.standard_normal(n) for k, (n, _) in layout.items()}
        meta, tensors, residual = comp.encode(0, g)
        got = compression.decode(meta, tensors, layout)
        for k in g:
            total[k] += g[k]
            sent[k] += got[k]
            m = g[k] + (comp.residual[0][k] if 0 in comp.residual else 0)
            assert np.allclose(got[k] + residual[k], m, rtol=0, atol=1e-12)     # C(M) + e' = M
        comp.commit(0, residual)
    for k in total:
        assert np.allclose(sent[k] + comp.residual[0][k], total[k], rtol=1e-12, atol=1e-12)
    if form.startswith("topk"):
        meta, tensors, _ = comp.encode(0, {k: np.zeros(n) for k, (n, _) in layout.items()})
        assert tensors["topk.i"].size == compression.parse(form).k(47)


def test_without_error_feedback_nothing_is_kept():
    comp = compression.PushCompressor(compression.parse("topk:0.1"), error_feedback=False)
    _, _, residual = comp.encode(0, {"a": np.arange(20.0)})
    comp.commit(0, residual)
    assert comp.residual == {}


@pytest.fixture
def servers():
    with ps.start_servers(num_shards=2, num_workers=1, policy="asp", optimizer="sgd:lr=1.0",
                          start_method="fork") as s:
        yield s


def _train(addresses, compress, pushes, refuse_at=None):
    """Push `pushes` (a list of gradient dicts) from a fresh client; the push at index refuse_at is sent with a NaN
    value the shard refuses (after the client encoded it). Returns (final params, the client's residuals)."""
    c = ps.connect(addresses, worker=0, params=PARAMS, compress=compress)
    try:
        c.init(PARAMS).result(30)
        for i, g in enumerate(pushes):
            if i == refuse_at:
                real = c._compressor.encode

                def poisoned(shard, pieces):
                    meta, tensors, residual = real(shard, pieces)
                    v = tensors.get("topk.v", tensors.get("sign.scale"))
                    v[0] = np.nan
                    return meta, tensors, residual
                c._compressor.encode = poisoned
                with pytest.raises(NonFiniteGradientError):
                    c.push(g).result(30)
                c._compressor.encode = real
                continue
            acks = c.push(g).result(30)
            assert all(a["status"] == "applied" for a in acks)
        return c.pull().result(30).params, {s: dict(r) for s, r in c._compressor.residual.items()}
    finally:
        c.close()


def test_full_topk_is_the_whole_gradient_bitwise(servers):
    rng = np.random.default_rng(1)
    pushes = [_grads(rng, PARAMS) for _ in range(3)]
    got, _ = _train(servers.addresses, "topk:1.0", pushes)
    want = {k: np.zeros_like(v) for k, v in PARAMS.items()}
    for g in pushes:
        for k in want:
            want[k] = want[k] - g[k]                   # sgd lr 1 from zero, as the shard steps
    for k in want:
        assert np.array_equal(got[k], want[k]), k


@pytest.mark.parametrize("form", ["topk:0.2", "sign"])
def test_a_push_the_shard_refuses_moves_no_clock_and_no_residual(form):
    """A compressed push the shard refuses (a NaN value, NonFiniteGradientError): the same client pushes on, and
    the parameters and residuals equal a run that never sent it."""
    rng = np.random.default_rng(2)
    pushes = [_grads(rng, PARAMS) for _ in range(4)]
    with ps.start_servers(num_shards=2, num_workers=1, policy="asp", optimizer="sgd:lr=1.0",
                          start_method="fork") as a, \
            ps.start_servers(num_shards=2, num_workers=1, policy="asp", optimizer="sgd:lr=1.0",
                             start_method="fork") as b:
        refused, res_refused = _train(a.addresses, form, pushes, refuse_at=2)
        straight, res_straight = _train(b.addresses, form, pushes[:2] + pushes[3:])
    for k in PARAMS:
        assert np.array_equal(refused[k], straight[k]), k
    assert res_refused.keys() == res_straight.keys()
    for s in res_refused:
        for k in res_refused[s]:
            assert np.array_equal(res_refused[s][k], res_straight[s][k]), (s, k)


def test_a_nan_is_refused_before_it_hides_in_the_residual(servers):
    c = ps.connect(servers.addresses, worker=0, params=PARAMS, compress="topk:0.1")
    try:
        c.init(PARAMS).result(30)
        g = {k: np.ones(v.shape, np.float32) for k, v in PARAMS.items()}
        g["w"][3, 3] = np.nan                          # (never among the top 10 %: it would only hide)
        with pytest.raises(NonFiniteGradientError, match="compressed push is refused whole"):
            c.push(g).result(30)
        assert c._compressor.residual == {} and c.clocks == [0, 0]
        g["w"][3, 3] = 1.0
        c.push(g).result(30)
        assert c.clocks == [1, 1]
    finally:
        c.close()


def test_the_wire_carries_the_compressed_bytes(servers):
    c = ps.connect(servers.addresses, worker=0, params=PARAMS, compress="topk:0.1")
    try:
        c.init(PARAMS).result(30)
        c.push(_grads(np.random.default_rng(3), PARAMS)).result(30)
        sizes = [[k.numel for k in c.partition.keys_of(i)] for i in range(2)]
        want = sum(compression.parse("topk:0.1").payload_bytes(z) for z in sizes)
        assert c.wire.snapshot()["by_op"]["push"]["sent"] == want
    finally:
        c.close()


LAYOUT = {"a": (20, np.dtype(np.float32)), "b": (3, np.dtype(np.float32))}


def _good(form: str) -> tuple[dict, dict]:
    meta, tensors, _ = compression.PushCompressor(compression.parse(form)).encode(
        0, {"a": np.linspace(-1, 1, 20, dtype=np.float32), "b": np.ones(3, np.float32)})
    return meta, tensors


T, S = "topk:0.2", "sign"


@pytest.mark.parametrize("form, break_it, error", [
    (T, lambda m, t: m.update(compress="zip"), ProtocolError),
    (T, lambda m, t: m.update(keys=["a"]), ProtocolError),
    (T, lambda m, t: m.update(keys=["a", "a", "b"]), ProtocolError),
    (T, lambda m, t: m.update(keys="ab"), ProtocolError),
    (T, lambda m, t: m.update(keys=[0, "b"]), ProtocolError),
    (T, lambda m, t: m.update(keys=None), ProtocolError),
    (T, lambda m, t: t.update({"topk.i": t["topk.i"].astype(np.int64)}), ShapeError),
    (T, lambda m, t: t.update({"topk.v": t["topk.v"].astype(np.float64)}), ShapeError),
    (T, lambda m, t: t.update({"topk.v": t["topk.v"][:-1]}), ShapeError),
    (T, lambda m, t: t.update({"topk.i": t["topk.i"][::-1].copy()}), ProtocolError),
    (T, lambda m, t: t.update({"topk.i": np.array([0, 0, 1], np.int32), "topk.v": np.ones(3, np.float32)}),
     ProtocolError),
    (T, lambda m, t: t.update({"topk.i": np.array([1, 23], np.int32), "topk.v": np.ones(2, np.float32)}),
     ProtocolError),
    (T, lambda m, t: t.update({"topk.i": np.array([-1, 2], np.int32), "topk.v": np.ones(2, np.float32)}),
     ProtocolError),
    (T, lambda m, t: t.update({"topk.i": np.arange(24, dtype=np.int32), "topk.v": np.ones(24, np.float32)}),
     ShapeError),
    (T, lambda m, t: t.update({"extra": np.ones(1, np.float32)}), ProtocolError),
    (T, lambda m, t: t.pop("topk.v"), ProtocolError),
    (S, lambda m, t: t.update(a=t["a"][:-1]), ShapeError),
    (S, lambda m, t: t.update(a=t["a"].astype(np.int8)), ShapeError),
    (S, lambda m, t: t.update({"sign.scale": t["sign.scale"][:1]}), ShapeError),
    (S, lambda m, t: t.update({"sign.scale": np.array([-1, 1], np.float32)}), ProtocolError),
    (S, lambda m, t: t.pop("b"), ProtocolError),
])
def test_a_malformed_compressed_push_is_one_error(form, break_it, error):
    meta, tensors = _good(form)
    break_it(meta, tensors)
    with pytest.raises(error) as e:
        compression.decode(meta, tensors, LAYOUT)
    assert "\n" not in str(e.value)


def test_non_finite_values_decode_as_such_for_the_shard_to_refuse():
    for form, key in (("topk:0.2", "topk.v"), ("sign", "sign.scale")):
        meta, tensors = _good(form)
        tensors[key][0] = np.nan
        assert any(np.isnan(g).any() for g in compression.decode(meta, tensors, LAYOUT).values()), form


def test_a_malformed_push_through_the_wire_changes_nothing(servers):
    """Sent to a real shard: an error reply, no clock moved, and the next well-formed push is applied."""
    c = ps.connect(servers.addresses, worker=0, params=PARAMS, compress="topk:0.5")
    try:
        c.init(PARAMS).result(30)
        real = c._compressor.encode
        c._compressor.encode = lambda s, p: (lambda m, t, r: (m, dict(t, **{"topk.i": t["topk.i"][::-1].copy()}),
                                                              r))(*real(s, p))
        with pytest.raises(ProtocolError, match="strictly increasing"):
            c.push(_grads(np.random.default_rng(4), PARAMS)).result(30)
        c._compressor.encode = real
        assert c.stats().result(30)[0]["version"] == 0
        acks = c.push(_grads(np.random.default_rng(4), PARAMS)).result(30)
        assert [a["status"] for a in acks] == ["applied", "applied"]
    finally:
        c.close()


@pytest.mark.parametrize("text, fragment", [
    ("powersgd:2", "PowerSGD all-reduces its low-rank factors"),
    ("topk:0", "in (0, 1]"),
    ("topk:1.5", "in (0, 1]"),
    ("zip", "none, topk:<fraction> or sign"),
])
def test_a_bad_compress_is_one_line(text, fragment):
    with pytest.raises(ConfigError) as e:
        compression.parse(text)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_one_compressed_push_at_a_time(servers):
    c = ps.connect(servers.addresses, worker=0, params=PARAMS, compress="sign")
    try:
        c.init(PARAMS).result(30)
        g = _grads(np.random.default_rng(5), PARAMS)
        first = c.push(g)
        with pytest.raises(PSError, match="still in flight"):
            c.push(g)
        first.result(30)
        c.push(g).result(30)
    finally:
        c.close()
