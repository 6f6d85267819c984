"""Small reference models the engines are tested and demonstrated on (single-process definitions).

- `mlp(sizes)`: Linear/Tanh stack as an nn.Sequential (cuttable into pipeline stages by layer).
- `TinyTransformer`: a pre-LayerNorm GPT-style decoder as an nn.Sequential [Embed, Block × L, Head] whose blocks
  hold an `Attention` (fused qkv, heads) and an `MLP` (d → 4d → d); `tensor.py` swaps those two for their
  Megatron tensor-parallel versions. `lm_loss` is token-level cross entropy for its (B, S, V) logits.
- `tiny_moe_transformer`: the same with an MoE feed-forward (`moe.py`) in place of each block's MLP.
Every factory seeds torch itself, so each rank builds bit-identical initial weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def mlp(sizes: list[int] | tuple[int, ...], seed: int = 0, act: type[nn.Module] = nn.Tanh,
        bias: bool = True) -> nn.Sequential:
    """Linear(sizes[0]→sizes[1]), act, …, Linear(→sizes[-1]) (bias=False: weights only)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b, bias=bias))
        if i < len(sizes) - 2:
            layers.append(act())
    return nn.Sequential(*layers)


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        if d % heads:
            raise ValueError(f"model width {d} is not divisible by {heads} heads")
        self.d, self.heads = d, heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split(self.d, dim=-1)
        hd = self.d // self.heads
        q, k, v = (t.view(b, s, self.heads, hd).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, self.d))


class NaiveAttention(Attention):
    """`Attention` with the scores materialised (a math kernel): the softmax probabilities, B·H·S² numbers, are kept
    for backward — what a flash-style kernel avoids (`ring_attention.measure_attention_memory` counts both)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split(self.d, dim=-1)
        hd = self.d // self.heads
        q, k, v = (t.view(b, s, self.heads, hd).transpose(1, 2) for t in (q, k, v))
        causal = torch.full((s, s), float("-inf")).triu(1)      # added: an add saves nothing for backward
        p = ((q @ k.transpose(-2, -1)) * (1 / math.sqrt(hd)) + causal).softmax(-1)
        return self.proj((p @ v).transpose(1, 2).reshape(b, s, self.d))


class MLP(nn.Module):
    def __init__(self, d: int, hidden: int | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, hidden or 4 * d)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden or 4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embed(nn.Module):
    def __init__(self, vocab: int, d: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1]))


class Head(nn.Module):
    def __init__(self, d: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.out = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def tiny_transformer(vocab: int = 32, d: int = 32, heads: int = 4, layers: int = 2, seq: int = 8,
                     seed: int = 0) -> nn.Sequential:
    """[Embed, Block × layers, Head] — logits of shape (B, S, vocab)."""
    torch.manual_seed(seed)
    return nn.Sequential(Embed(vocab, d, seq), *[Block(d, heads) for _ in range(layers)], Head(d, vocab))


def tiny_moe_transformer(vocab: int = 32, d: int = 32, heads: int = 4, layers: int = 2, seq: int = 8,
                         experts: int = 4, top_k: int = 1, capacity_factor: float = 1.25, groups: int = 1,
                         aux_weight: float = 0.01, seed: int = 0, group_samples: int | None = None) -> nn.Sequential:
    """`tiny_transformer` whose blocks' MLP is an MoE feed-forward (`moe.py`: E experts, each d → 4d → d).
    Training loss: lm_loss(logits, y) + moe.moe_aux_loss(model); `groups` token groups per forward batch (or groups
    of `group_samples` samples each, e.g. 1: capacity per sequence)."""
    from .moe import MoE   # moe.py builds its experts from this file's MLP
    torch.manual_seed(seed)
    blocks = []
    for _ in range(layers):
        b = Block(d, heads)
        b.mlp = MoE(d, experts, top_k, capacity_factor, groups, aux_weight, group_samples=group_samples)
        blocks.append(b)
    return nn.Sequential(Embed(vocab, d, seq), *blocks, Head(d, vocab))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over all tokens (works for (B, V) and (B, S, V) logits)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
