"""Ring attention: forward and backward equal full attention; the ring sends the formula's bytes; zig-zag balances
the causal work (and the contiguous split does not)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pslab import collectives
from pslab.parallelism.comm import Comm
from pslab.parallelism.ring_attention import (LayoutError, attention_memory, block_counts, local_positions,
                                        ring_attention, ring_bytes)

from tests.parallelism.par_helpers import plain

B, H, HD = 2, 2, 4
CASES = {2: [(12, True, "zigzag"), (12, False, "zigzag"), (8, True, "contiguous")],
         4: [(24, True, "zigzag"), (16, False, "zigzag"), (16, True, "contiguous")]}


def _ring_worker(group, cases):
    """Per case: full attention (F.scaled_dot_product_attention over the whole sequence, on every rank) and this
    rank's ring attention on its chunks; returns both, sliced to this rank's positions, and the ring's p2p bytes."""
    torch.set_num_threads(1)
    comm = Comm(group)
    out = []
    for i, (seq, causal, layout) in enumerate(cases):
        g = torch.Generator().manual_seed(100 + i)
        q, k, v, dout = (torch.randn(B, H, seq, HD, generator=g, dtype=torch.float64).float() for _ in range(4))
        full = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*full, is_causal=causal)
        ref.backward(dout)
        pos = local_positions(comm.rank, comm.size, seq, layout)
        loc = [t[:, :, pos].clone().requires_grad_(True) for t in (q, k, v)]
        got = ring_attention(*loc, comm, causal=causal, layout=layout, site=f"case{i}")
        got.backward(dout[:, :, pos])
        out.append({"ref": [ref.detach()[:, :, pos]] + [t.grad[:, :, pos] for t in full],
                    "got": [got.detach()] + [t.grad for t in loc]})
    return plain({"cases": out, "p2p": comm.log.by_site("p2p")})


@pytest.mark.parametrize("backend", ["zmq", "torch"])
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_equals_full_attention(backend, cp):
    """out, dq, dk, dv of every rank's chunks equal full attention's rows (float32, atol 2e-6), causal and not,
    zig-zag and contiguous, S = 12 and 24 (not powers of two); each rank's ring sends exactly `ring_bytes`."""
    res = collectives.launch(_ring_worker, cp, backend=backend, args=(CASES[cp],), timeout=120)
    for rank, r in enumerate(res):
        for (seq, causal, layout), case in zip(CASES[cp], r["cases"]):
            for what, a, b in zip(("out", "dq", "dk", "dv"), case["got"], case["ref"]):
                torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), rtol=1e-5, atol=2e-6,
                                           msg=lambda m: f"rank {rank} S={seq} causal={causal} {layout} {what}: {m}")
        want = {f"case{i}": ring_bytes(B, seq, H * HD, cp)["total"] for i, (seq, _, _) in enumerate(CASES[cp])}
        assert r["p2p"] == want


def _blocks_from_mask(cp: int, layout: str, seq: int) -> list[int]:
    """Independent count: c×c tiles of the full causal mask (rows at a rank's positions) with any allowed entry."""
    c = seq // (2 * cp)
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    out = []
    for r in range(cp):
        rows = mask[local_positions(r, cp, seq, layout)]
        tiles = rows.reshape(2, c, 2 * cp, c).any(dim=3).any(dim=1)
        out.append(int(tiles.sum()))
    return out


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_zigzag_balances_causal_work(cp):
    """Zig-zag: the per-rank block computations differ by at most one (here: 2C+1 each); the counts equal the
    tiles of the causal mask that are not fully masked. Non-causal: 4C blocks everywhere."""
    counts = block_counts(cp, "zigzag", causal=True)
    assert max(counts) - min(counts) <= 1
    assert counts == _blocks_from_mask(cp, "zigzag", 4 * cp)
    assert sum(counts) == 2 * cp * (2 * cp + 1) // 2          # the lower triangle of 2C × 2C chunk tiles
    assert block_counts(cp, "zigzag", causal=False) == [4 * cp] * cp


@pytest.mark.parametrize("cp", [2, 4])
def test_contiguous_order_is_unbalanced(cp):
    """Negative control: the naive contiguous split gives the last rank 4C−1 blocks and the first 3."""
    counts = block_counts(cp, "contiguous", causal=True)
    assert counts == _blocks_from_mask(cp, "contiguous", 4 * cp)
    assert max(counts) - min(counts) > 1 and counts == [4 * i + 3 for i in range(cp)]


def test_layout_checks():
    """S must cut into 2C chunks; unknown layouts are refused; with C = 1 nothing is sent."""
    with pytest.raises(LayoutError, match="divisible by 4"):
        local_positions(0, 2, 10)
    with pytest.raises(LayoutError, match="unknown context-parallel layout"):
        block_counts(2, "striped")
    assert ring_bytes(2, 8, 16, 1)["total"] == 0
    assert sorted(torch.cat([local_positions(r, 3, 12) for r in range(3)]).tolist()) == list(range(12))
    q = torch.zeros(1, 1, 4, 2, dtype=torch.bfloat16)     # the online softmax needs float32 or float64
    with pytest.raises(LayoutError, match="float32 or float64"):
        ring_attention(q, q, q, type("OneRank", (), {"size": 1, "rank": 0})())


def _memory_worker(group, seq):
    torch.set_num_threads(1)
    from pslab.parallelism.checkpointing import ActivationMeter
    comm = Comm(group)
    pos = local_positions(comm.rank, comm.size, seq)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(B, seq, 3 * H * HD, generator=g)[:, pos].requires_grad_(True)
    with ActivationMeter() as meter:
        x = qkv * 1.0                  # a non-leaf, as the qkv projection's output is
        q, k, v = (t.view(B, -1, H, HD).transpose(1, 2) for t in x.split(H * HD, dim=-1))
        ring_attention(q, k, v, comm).sum().backward()
    return meter.peak


def test_saved_bytes_match_formula():
    """ActivationMeter around one ring attention forward+backward (cp = 2): q, k, v (one qkv storage), out and the
    log-sum-exp — `attention_memory(...)["ring_saved"]`, no scores or probabilities."""
    peaks = collectives.launch(_memory_worker, 2, backend="zmq", args=(16,), timeout=60)
    assert peaks == [attention_memory(B, 16, H * HD, H, 2)["ring_saved"]] * 2
