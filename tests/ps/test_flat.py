"""pslab.ps.flat: a shard's parameters in one buffer per dtype, and runs of adjacent (dst, src) tensors merged into one flat
pair. Checked against per-tensor references: values bitwise, bytes outside the tensors untouched, no merge across
dtypes, storages or gaps, the cached grouping never reused for tensors that moved; and, end to end, that a client's
push arena puts a shard's whole tensors back to back so the shard checks and steps them with ONE run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pslab.ps import flat, shm_path
from pslab.ps.client import connect
from pslab.ps.shard import ShardState

PARAMS = {"w[0:700]": torch.randn(700), "b": torch.randn(30), "a": torch.randn(10, 3), "h": torch.randn(5).half(),
          "w[700:1000]": torch.randn(300)}


def test_pack_keeps_values_and_lays_whole_tensors_first_by_name_then_pieces():
    packed = flat.pack(PARAMS)
    assert list(packed) == list(PARAMS)                                       # the dict keeps its order
    for k, t in PARAMS.items():
        assert packed[k].dtype == t.dtype and packed[k].shape == t.shape and torch.equal(packed[k], t)
    f32 = [k for k in flat.order(PARAMS) if PARAMS[k].dtype == torch.float32]
    assert f32 == ["a", "b", "w[0:700]", "w[700:1000]"]
    base = packed["a"].data_ptr()
    offs = [packed[k].data_ptr() - base for k in f32]
    assert offs == [0, 30 * 4, 60 * 4, 760 * 4]                               # back to back, one storage
    assert len({packed[k].untyped_storage().data_ptr() for k in f32}) == 1
    assert packed["h"].untyped_storage().data_ptr() != packed["a"].untyped_storage().data_ptr()


def test_pack_holds_no_base_so_a_repack_frees_the_old_buffer():
    packed = flat.pack(PARAMS)
    assert all(t._base is None for t in packed.values())
    first = packed["a"].untyped_storage().data_ptr()
    flat.repack(packed)
    assert packed["a"]._base is None and packed["a"].untyped_storage().data_ptr() != first


def _steps_like_torch_sgd(dtypes, sizes: dict[str, int], seed: int, steps: int, runs) -> None:
    """Gradients lying back to back (as in a push arena) make `runs(sizes)` runs, and the shard's step equals
    torch.optim.SGD's per-tensor step bit for bit at every step."""
    g = torch.Generator().manual_seed(seed)
    for dt in dtypes:
        init = {k: torch.randn(n, generator=g).to(dt) for k, n in sizes.items()}
        st = ShardState(init, "sgd:lr=0.1")
        ref = [torch.nn.Parameter(t.clone()) for t in init.values()]
        opt = torch.optim.SGD(ref, lr=0.1, foreach=False)
        offs = np.cumsum([0, *sizes.values()])
        for t in range(steps):
            seg = torch.randn(int(offs[-1]), generator=g).to(dt)
            grads = {k: seg[offs[i]:offs[i + 1]] for i, k in enumerate(sizes)}
            assert len(st.fused(grads)) == runs(sizes)
            st.push(0, t, t, grads)
            for p, gr in zip(ref, grads.values()):
                p.grad = gr.clone()
            opt.step()
            for k, p in zip(sizes, ref):
                assert torch.equal(st.params[k], p.detach()), (dt, t, k)


def test_half_precision_is_never_merged_and_steps_like_torch_sgd():
    """torch rounds the vector body and the scalar tail of float16/bfloat16 add_ differently, so merging would move
    bits: those dtypes stay one tensor per pair (adjacent, yet nothing merged), and the shard's step equals
    torch.optim.SGD's bitwise."""
    _steps_like_torch_sgd((torch.float16, torch.bfloat16), {"a": 7, "b": 13, "c": 1001, "d": 5}, seed=3, steps=4,
                          runs=len)


def test_runs_merge_only_what_is_adjacent_on_both_sides_and_give_the_per_tensor_bits():
    params = flat.pack({k: v for k, v in PARAMS.items() if v.dtype == torch.float32})
    keys = list(params)                                                       # w[0:700], b, a, w[700:1000]
    seg = torch.randn(4000)
    # in the segment: a, b back to back (as in the buffer), then a gap, then w[0:700], w[700:1000] NOT in order
    at = {"a": 0, "b": 30, "w[700:1000]": 100, "w[0:700]": 2000}
    grads = {k: seg[at[k]:at[k] + params[k].numel()] for k in keys}
    pairs = flat.runs([params[k] for k in keys], [grads[k] for k in keys])
    assert sorted(d.numel() for d, _ in pairs) == [60, 300, 700]              # a+b merged; the pieces are not
    ref = {k: params[k].clone() for k in keys}
    before = seg.clone()
    for d, g in pairs:
        d.add_(g, alpha=-0.37)
    for k in keys:
        ref[k].add_(grads[k].reshape(ref[k].shape), alpha=-0.37)
        assert torch.equal(params[k], ref[k]), k
    assert torch.equal(seg, before)                                           # sources only read


def test_runs_never_merge_across_dtypes_storages_or_non_contiguous_sources():
    a, b = torch.zeros(8), torch.zeros(8)                                     # two storages
    buf = torch.zeros(16)
    dst = [buf[0:8], buf[8:16]]
    assert len(flat.runs(dst, [a, b])) == 2
    src = torch.arange(32.0)
    strided = [src[0:16:2], src[16:32:2]]                                     # adjacent in address, not contiguous
    pairs = flat.runs(dst, strided)
    assert len(pairs) == 2
    for d, s in pairs:
        d.copy_(s)
    assert torch.equal(buf, torch.cat(strided))
    mixed = flat.pack({"x": torch.zeros(4), "y": torch.zeros(4, dtype=torch.float64)})
    assert len(flat.runs(list(mixed.values()), [torch.ones(4), torch.ones(4, dtype=torch.float64)])) == 2
    with pytest.raises(ValueError):
        flat.runs(dst, [a])


def test_the_cached_grouping_is_not_reused_for_tensors_that_moved():
    params = flat.pack({"a": torch.zeros(10), "b": torch.zeros(10)})
    dsts = list(params.values())
    seg = torch.arange(100.0)
    cache = flat.RunCache()
    for lo_a, lo_b in [(0, 10), (0, 10), (50, 20), (0, 10), (30, 40)]:        # adjacent, again, moved, back, ...
        for p in dsts:
            p.zero_()
        for d, s in cache.get(dsts, [seg[lo_a:lo_a + 10], seg[lo_b:lo_b + 10]]):
            d.copy_(s)
        assert torch.equal(params["a"], seg[lo_a:lo_a + 10]) and torch.equal(params["b"], seg[lo_b:lo_b + 10])
    assert len(cache._plans) == 3


def test_unshare_gives_fresh_storage_in_the_same_layout_and_the_optimizer_keeps_its_tensors():
    st = ShardState({"a": np.ones(6, np.float32), "b": np.ones(4, np.float32)}, "momentum:lr=0.5,momentum=0.9")
    held = {k: p for k, p in st.params.items()}                               # a zero-copy reader's views
    old = {k: p.clone() for k, p in held.items()}
    view_a = st.params["a"].view(-1)
    st.unshare_params()
    assert all(st.params[k] is held[k] for k in held)                         # same objects (torch.optim holds them)
    assert st.params["b"].data_ptr() == st.params["a"].data_ptr() + 6 * 4      # still one buffer
    assert view_a.data_ptr() != st.params["a"].data_ptr()
    st.push(0, 0, 0, {"a": torch.ones(6), "b": torch.ones(4)})
    assert torch.equal(view_a, old["a"])                                      # the reader's values did not move
    assert torch.allclose(st.params["a"], old["a"] - 0.5)


def test_the_fused_step_equals_torch_sgd_bitwise():
    """float32 and float64 gradients lying back to back (as in a push arena) merge into one run; the step equals
    torch.optim.SGD's per-tensor step bit for bit (odd sizes: vector body and scalar tail both exercised)."""
    _steps_like_torch_sgd((torch.float32, torch.float64), {"a": 33, "b": 35, "c": 1003, "d": 1}, seed=0, steps=5,
                          runs=lambda sizes: 1)


@pytest.mark.skipif(not shm_path.shm.available(), reason="/dev/shm is not writable here")
@pytest.mark.parametrize("shards", [1, 2])
def test_a_shard_checks_and_steps_its_whole_tensors_as_one_run(thread_servers, monkeypatch, shards):
    shapes = {"fc1.weight": (40, 30), "fc1.bias": (40,), "fc2.weight": (10, 40), "fc2.bias": (10,)}
    rng = np.random.default_rng(1)
    init = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    servers = thread_servers(shards, num_workers=1, optimizer="sgd:lr=0.01")
    seen: list[tuple[int, int, int]] = []                  # (shard, run count, whole tensors on that shard)
    real = ShardState.fused

    def spy(self, grads):
        out = real(self, grads)
        whole = sum("[" not in k for k in grads)
        seen.append((self.shard_id, len(out), whole))
        return out
    monkeypatch.setattr(ShardState, "fused", spy)
    with connect(servers.addresses, 0, init, timeout=30, shm=True) as c:
        c.init(init).result(30)
        c.pull().result(30)
        bufs = c.grad_buffers()
        for k, v in init.items():
            bufs[k][...] = v * 0.1
        for _ in range(3):
            c.push_pull(bufs, copy=False).result(30)
    assert seen and len(seen) == 3 * shards
    for shard, n_runs, whole in seen:
        pieces = len(servers.servers[shard].state.params) - whole
        assert n_runs == min(whole, 1) + pieces, (shard, n_runs, whole, pieces)
