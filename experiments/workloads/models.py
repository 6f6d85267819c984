"""Model factories. Each takes the dataset and a seed and returns a freshly, deterministically initialised module.

- `logreg`: softmax regression, y = softmax(W x + b).
- `mlp`: Linear-ReLU stacks (`depth` hidden layers of `width`): the "shallow" (1 layer) and "deep" (4 layers) models
  of the staleness sweep.
- `cnn`: two 3x3 conv layers with max-pooling and a linear head, for 28x28 MNIST.
- `transformer`: a tiny causal transformer language model (token + position embedding, `layers` pre-norm blocks of
  multi-head self-attention and a 4x MLP, tied-free linear head); its blocks are a ModuleList so the tensor and
  pipeline engines can split it.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def _seeded(seed: int) -> torch.Generator:
    g = torch.Generator().manual_seed(int(seed))
    return g


def _init_(module: nn.Module, seed: int) -> nn.Module:
    """Re-initialise every parameter from one generator so the init depends only on the seed (not on global RNG)."""
    g = _seeded(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                fan_in = p[0].numel()
                p.uniform_(-1.0 / math.sqrt(fan_in), 1.0 / math.sqrt(fan_in), generator=g)
            elif name.endswith("weight"):  # norm scales
                p.fill_(1.0)
            else:
                p.zero_()
    return module


def logreg(in_dim: int, num_classes: int, seed: int) -> nn.Module:
    return _init_(nn.Linear(in_dim, num_classes), seed)


def mlp(in_dim: int, num_classes: int, seed: int, width: int = 64, depth: int = 1) -> nn.Module:
    layers: list[nn.Module] = []
    d = in_dim
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.ReLU()]
        d = width
    layers.append(nn.Linear(d, num_classes))
    return _init_(nn.Sequential(*layers), seed)


class SmallCNN(nn.Module):
    def __init__(self, num_classes: int = 10, channels: int = 8):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),          # 28 -> 14
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 14 -> 7
        )
        self.head = nn.Linear(2 * channels * 7 * 7, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(-1, 1, 28, 28)
        return self.head(self.features(x).flatten(1))


def cnn(in_dim: int, num_classes: int, seed: int) -> nn.Module:
    assert in_dim == 784, "the small CNN expects 28x28 images"
    return _init_(SmallCNN(num_classes), seed)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyTransformerLM(nn.Module):
    def __init__(self, vocab: int, context: int = 32, dim: int = 32, heads: int = 2, layers: int = 2):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def transformer(in_dim: int, num_classes: int, seed: int) -> nn.Module:
    """in_dim is the context length (a sample is a window of token ids); num_classes is the vocabulary size."""
    return _init_(TinyTransformerLM(num_classes, context=in_dim), seed)
