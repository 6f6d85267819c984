"""Ring attention (Liu et al. 2023; zig-zag order as in Megatron-CP / ring-flash-attn): exact attention over a
sequence split across the C ranks of the cp group, with K/V blocks passed around the ring.

Layout. The sequence of length S is cut into 2C chunks of c = S/(2C) tokens. Rank i holds two of them, its *local*
sequence of S_l = 2c tokens (q, k, v of shape (B, H, S_l, hd), the two chunks concatenated in order):

    zigzag       chunks i and 2C−1−i        (balanced causal work: early and late tokens on every rank)
    contiguous   chunks 2i and 2i+1         (the naive split; kept as the negative control)

Forward, on rank i (next = i+1, prev = i−1 mod C). The K/V block held at step t came from rank j = i−t:

    for t in 0 … C−1:
        if t < C−1: isend (K, V) to next                        # overlaps the block computation below
        for every local q-chunk a, every chunk b of the held block:
            b > a (causal): skip                                 # fully above the diagonal
            s = q_a k_bᵀ/√hd  (b = a: causal mask inside the block)
            (O_a, L_a) ← merge((O_a, L_a), (softmax(s)·v_b, logsumexp(s)))
        if t < C−1: recv (K, V) from prev
    merge: L' = logaddexp(L, l),  O' = e^(L−L')·O + e^(l−L')·o   (the online softmax, in log-sum-exp form)

The first step uses the rank's own block, which holds every local q-chunk's diagonal, so each row's L is finite
after step 0. Non-causal attention is the same ring with no skipping and no mask.

Backward: hand-written, flash-attention style (a torch.autograd.Function; not autograd through the blocks). Saved
for backward per rank: q, k, v, out (4 · B·S_l·d values) and L (B·H·S_l) — no scores or probabilities; each block's
scores are recomputed from q, k and the final L. (out is stored as (B, S_l, H, hd) and returned transposed, so the
model's transpose(1, 2).reshape before proj is a view and proj saves that same storage, as with PyTorch's SDPA.)

    p = exp(s − L_a),  dv_b += pᵀ·do_a,  ds = p ⊙ (do_a·v_bᵀ − D_a),  D_a = rowsum(do_a ⊙ o_a)
    dq_a += ds·k_b/√hd,  dk_b += dsᵀ·q_a/√hd

(K, V) travel the ring again (C−1 passes) together with their (dK, dV) accumulators, which take one more pass (C in
all) to come home to the block's owner. Bytes sent per rank per layer and step, with one block = B·S_l·d·elt:

    forward   2(C−1) blocks            backward   2(C−1) + 2C blocks           (`ring_bytes`)

Work: `block_counts` counts the (q-chunk, kv-chunk) pairs each rank computes. Causal zig-zag: 2C+1 on every rank
(chunk i sees i+1 chunks, chunk 2C−1−i sees 2C−i); contiguous: 4i+3, so the last rank does 4C−1 and the first 3.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from pslab.collectives import trace
from .comm import Comm

LAYOUTS = ("zigzag", "contiguous")
_TAG = 1 << 22            # clear of the pipeline's (2i, 2i+1, 1 << 20 + i) and export's (1 << 21 + k) tags
_FWD_KV, _BWD_KV, _BWD_DKV = 0, 1, 2


class LayoutError(ValueError):
    """An unknown chunk layout, or a sequence that does not cut into 2C equal chunks."""


def chunks_of(rank: int, cp: int, layout: str = "zigzag") -> tuple[int, int]:
    """The two global chunk indices (of 2·cp chunks) rank `rank` holds, in local order."""
    if layout == "zigzag":
        return rank, 2 * cp - 1 - rank
    if layout == "contiguous":
        return 2 * rank, 2 * rank + 1
    raise LayoutError(f"unknown context-parallel layout {layout!r}; use one of {', '.join(LAYOUTS)}")


def local_positions(rank: int, cp: int, seq: int, layout: str = "zigzag") -> torch.Tensor:
    """Global token positions of rank `rank`'s local sequence (LongTensor of length seq/cp)."""
    if seq % (2 * cp):
        raise LayoutError(f"sequence length {seq} does not cut into 2·cp = {2 * cp} equal chunks; choose S "
                          f"divisible by {2 * cp}")
    c = seq // (2 * cp)
    return torch.cat([torch.arange(a * c, (a + 1) * c) for a in chunks_of(rank, cp, layout)])


def _pairs(rank: int, src: int, cp: int, layout: str, causal: bool) -> list[tuple[int, int, bool]]:
    """(local q-chunk slot, kv-chunk slot in src's block, on the diagonal) for every block pair rank computes."""
    out = []
    for qa, a in enumerate(chunks_of(rank, cp, layout)):
        for kb, b in enumerate(chunks_of(src, cp, layout)):
            if causal and b > a:
                continue
            out.append((qa, kb, causal and a == b))
    return out


def block_counts(cp: int, layout: str = "zigzag", causal: bool = True) -> list[int]:
    """Per rank: how many (q-chunk, kv-chunk) block computations the ring runs over one attention call."""
    return [sum(len(_pairs(r, j, cp, layout, causal)) for j in range(cp)) for r in range(cp)]


def _block(q: torch.Tensor, k: torch.Tensor, scale: float, diag: bool) -> torch.Tensor:
    s = (q @ k.transpose(-2, -1)) * scale
    if diag:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, comm: Comm, causal: bool, layout: str, site: str):  # type: ignore[override]
        cp, rank = comm.size, comm.rank
        if q.shape[-2] % 2:
            raise LayoutError(f"the local sequence ({q.shape[-2]} tokens) must be two equal chunks")
        c, scale = q.shape[-2] // 2, 1.0 / math.sqrt(q.shape[-1])
        nxt, prv = (rank + 1) % cp, (rank - 1) % cp
        b, h, sl, hd = q.shape     # out laid out (B, S_l, H, hd): the caller's transpose(1, 2).reshape is a view
        out = q.new_zeros(b, sl, h, hd).transpose(1, 2)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        kv = torch.stack([k, v])                       # one contiguous message per pass
        for t in range(cp):
            work = comm.isend(kv, nxt, _TAG + 4 * t + _FWD_KV, site=site) if t < cp - 1 else None
            for qa, kb, diag in _pairs(rank, (rank - t) % cp, cp, layout, causal):
                qs, ks = slice(qa * c, (qa + 1) * c), slice(kb * c, (kb + 1) * c)
                s = _block(q[..., qs, :], kv[0, ..., ks, :], scale, diag)
                l_blk = torch.logsumexp(s, dim=-1)
                o_blk = torch.exp(s - l_blk.unsqueeze(-1)) @ kv[1, ..., ks, :]
                l_new = torch.logaddexp(lse[..., qs], l_blk)
                out[..., qs, :] = (torch.exp(lse[..., qs] - l_new).unsqueeze(-1) * out[..., qs, :]
                                   + torch.exp(l_blk - l_new).unsqueeze(-1) * o_blk)
                lse[..., qs] = l_new
            if work is not None:
                kv = comm.recv(torch.empty_like(kv), prv, _TAG + 4 * t + _FWD_KV)
                with trace.waiting("send of K,V"):
                    work.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.causal, ctx.layout, ctx.site = comm, causal, layout, site
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        comm, causal, layout, site = ctx.comm, ctx.causal, ctx.layout, ctx.site
        cp, rank = comm.size, comm.rank
        c, scale = q.shape[-2] // 2, 1.0 / math.sqrt(q.shape[-1])
        nxt, prv = (rank + 1) % cp, (rank - 1) % cp
        delta = (dout * out).sum(-1)                   # D = rowsum(dO ⊙ O)
        dq = torch.zeros_like(q, memory_format=torch.contiguous_format)
        kv = torch.stack([k, v])
        dkv = torch.zeros_like(kv)                     # the travelling block's (dK, dV) accumulator
        for t in range(cp):
            works = [comm.isend(kv, nxt, _TAG + 4 * t + _BWD_KV, site=site)] if t < cp - 1 else []
            for qa, kb, diag in _pairs(rank, (rank - t) % cp, cp, layout, causal):
                qs, ks = slice(qa * c, (qa + 1) * c), slice(kb * c, (kb + 1) * c)
                qb, kblk, vblk, do = q[..., qs, :], kv[0, ..., ks, :], kv[1, ..., ks, :], dout[..., qs, :]
                p = torch.exp(_block(qb, kblk, scale, diag) - lse[..., qs].unsqueeze(-1))
                dkv[1, ..., ks, :] += p.transpose(-2, -1) @ do
                ds = p * (do @ vblk.transpose(-2, -1) - delta[..., qs].unsqueeze(-1))
                dq[..., qs, :] += (ds @ kblk) * scale
                dkv[0, ..., ks, :] += (ds.transpose(-2, -1) @ qb) * scale
            if cp > 1:
                works.append(comm.isend(dkv, nxt, _TAG + 4 * t + _BWD_DKV, site=site))
                if t < cp - 1:
                    kv = comm.recv(torch.empty_like(kv), prv, _TAG + 4 * t + _BWD_KV)
                dkv = comm.recv(torch.empty_like(dkv), prv, _TAG + 4 * t + _BWD_DKV)
            with trace.waiting("sends"):
                for w in works:
                    w.wait()
        return dq, dkv[0], dkv[1], None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm, causal: bool = True,
                   layout: str = "zigzag", site: str = "ring") -> torch.Tensor:
    """Exact softmax attention of this rank's query chunks against the whole sequence, whose K/V chunks the cp ranks
    of `comm` hold in `layout` order. q, k, v: (B, H, S_local, hd), S_local = two equal chunks; returns (B, H,
    S_local, hd), equal to the matching rows of full attention. The ring's p2p bytes are logged under `site`."""
    chunks_of(0, comm.size, layout)          # validates the layout name
    if q.dtype not in (torch.float32, torch.float64) or not q.dtype == k.dtype == v.dtype:
        raise LayoutError(f"ring attention keeps its running output and log-sum-exp in the input dtype: use "
                          f"float32 or float64 q, k, v (got {q.dtype}, {k.dtype}, {v.dtype}); bf16/fp16 would "
                          "lose the online softmax's precision")
    return _RingAttention.apply(q, k, v, comm, causal, layout, site)


# ---- formulas -----------------------------------------------------------------------------------------------

def ring_bytes(batch: int, seq: int, d: int, cp: int, elt: int = 4) -> dict[str, int]:
    """Bytes one rank sends per layer and training step: K, V blocks forward; K, V and their gradients backward."""
    block = batch * (seq // cp) * d * elt
    if cp == 1:
        return {"forward": 0, "backward": 0, "total": 0, "block": block}
    fwd, bwd = 2 * (cp - 1) * block, (2 * (cp - 1) + 2 * cp) * block
    return {"forward": fwd, "backward": bwd, "total": fwd + bwd, "block": block}


def attention_memory(batch: int, seq: int, d: int, heads: int, cp: int, elt: int = 4) -> dict[str, Any]:
    """Attention activations per rank and layer, in bytes.

    ring_saved     what ring attention saves for backward: q, k, v, out (4·B·(S/C)·d) + log-sum-exp (B·H·S/C)
    ring_transient one block's scores while it is computed, freed at once: B·H·c², c = S/(2C)
    autograd_ring  what autograd through the blocks would keep instead: probabilities of every computed pair
                   (causal: (number of pairs)·B·H·c², ≈ half of B·H·(S/C)·S) — not what `ring_attention` does
    full_naive     one process, probabilities kept: 4·B·S·d + B·H·S² (what a math-kernel attention saves)
    full_flash     one process, flash-style (PyTorch's CPU SDPA kernel): 4·B·S·d + B·H·S
    """
    sl, c = seq // cp, seq // (2 * cp)
    pairs = max(block_counts(cp, "zigzag", causal=True))
    return {
        "ring_saved": (4 * batch * sl * d + batch * heads * sl) * elt,
        "ring_transient": batch * heads * c * c * elt,
        "autograd_ring": (4 * batch * sl * d + pairs * batch * heads * c * c) * elt,
        "full_naive": (4 * batch * seq * d + batch * heads * seq * seq) * elt,
        "full_flash": (4 * batch * seq * d + batch * heads * seq) * elt,
    }


def measure_attention_memory(seqs: list[int], batch: int = 1, d: int = 32, heads: int = 8, seed: int = 0
                             ) -> list[dict[str, Any]]:
    """Saved-for-backward bytes of one attention layer at each sequence length, measured (autograd's saved-tensor
    hooks: `checkpointing.ActivationMeter`, each storage once) for the naive kernel (`models.NaiveAttention`) and the
    flash-style one (`models.Attention`, PyTorch's SDPA), next to `attention_memory`'s full_naive / full_flash; and
    the largest difference between their outputs (the same weights). fp32, one process."""
    from .checkpointing import ActivationMeter
    from .models import Attention, NaiveAttention
    rows = []
    for s in seqs:
        x = torch.randn(batch, s, d, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        saved, outs = {}, []
        for kind, cls in (("naive", NaiveAttention), ("flash", Attention)):
            torch.manual_seed(seed)                     # the same weights for both
            layer = cls(d, heads)
            with ActivationMeter() as meter:
                y = layer(x)
                y.sum().backward()
            saved[kind] = meter.peak
            outs.append(y.detach())
        model = attention_memory(batch, s, d, heads, 1)
        rows.append({"seq": s, "naive": saved["naive"], "flash": saved["flash"], "naive_model": model["full_naive"],
                     "flash_model": model["full_flash"], "max_diff": float((outs[0] - outs[1]).abs().max())})
    return rows
