"""Model factories. Each takes the dataset and a seed and returns a freshly, deterministically initialised module.

- `logreg`: softmax regression, y = softmax(W x + b).
- `mlp`: Linear-ReLU stacks (`depth` hidden layers of `width`): the "shallow" (1 layer) and "deep" (4 layers) models
  of the staleness sweep.
- `cnn`: two 3x3 conv layers with max-pooling and a linear head, for 28x28 MNIST.
- `bag_of_words`: a linear bag-of-words classifier over a 99,700-word vocabulary (sparse embedding gradients).
- `mlr`, `mlp_he`: the literature-standard models (multinomial logistic regression; a ReLU MLP with `depth` hidden
  layers) with He/Kaiming-normal init (`he_init_`): every weight matrix W ~ N(0, 2 / fan_in), every bias 0
  (He et al. 2015; keeps the variance of ReLU activations constant with depth). The other factories keep their
  original U(+-1/sqrt(fan_in)) init (`_init_`) so existing workloads stay bit-for-bit the same.
- `transformer`: a tiny causal transformer language model (token + position embedding, `layers` pre-norm blocks of
  multi-head self-attention and a 4x MLP, linear head) as an nn.Sequential of `parallelism.models` blocks, so the
  tensor engine can split its heads and MLP width and the pipeline engine can cut it between blocks.
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


def he_init_(module: nn.Module, seed: int) -> nn.Module:
    """He/Kaiming-normal init from one generator seeded with `seed`: W ~ N(0, std^2), std = sqrt(2 / fan_in), for
    every parameter with >= 2 dimensions (fan_in = inputs per output unit); biases 0."""
    g = _seeded(seed)
    with torch.no_grad():
        for _, p in module.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, math.sqrt(2.0 / p[0].numel()), generator=g)
            else:
                p.zero_()
    return module


def mlr(in_dim: int, num_classes: int, seed: int) -> nn.Module:
    """Multinomial logistic regression: logits = W x + b (softmax in the loss), He-normal W."""
    return he_init_(nn.Linear(in_dim, num_classes), seed)


def _mlp_layers(in_dim: int, num_classes: int, width: int, depth: int) -> nn.Sequential:
    """`depth` hidden layers Linear(width)-ReLU and a linear head (initialised by the caller)."""
    layers: list[nn.Module] = []
    d = in_dim
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.ReLU()]
        d = width
    layers.append(nn.Linear(d, num_classes))
    return nn.Sequential(*layers)


def mlp_he(in_dim: int, num_classes: int, seed: int, width: int = 64, depth: int = 1) -> nn.Module:
    """`depth` hidden layers Linear(width)-ReLU and a linear head, He-normal init."""
    return he_init_(_mlp_layers(in_dim, num_classes, width, depth), seed)


def logreg(in_dim: int, num_classes: int, seed: int) -> nn.Module:
    return _init_(nn.Linear(in_dim, num_classes), seed)


def mlp(in_dim: int, num_classes: int, seed: int, width: int = 64, depth: int = 1) -> nn.Module:
    return _init_(_mlp_layers(in_dim, num_classes, width, depth), seed)


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


class BagOfWords(nn.Module):
    """A fastText-style linear classifier: logits = mean of the sample's token embedding rows (one row of
    `classes` weights per vocabulary word) + bias. The embedding's gradient is sparse: a step touches only the rows
    of the sample's tokens (what made parameter servers the tool for such models)."""

    def __init__(self, vocab: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(vocab, classes, mode="mean", sparse=True)
        self.bias = nn.Parameter(torch.zeros(classes))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids) + self.bias


def bag_of_words(in_dim: int, num_classes: int, seed: int) -> nn.Module:
    """in_dim is the number of tokens per sample; the vocabulary is the dataset's (`data.VOCAB`)."""
    from .data import VOCAB
    return _init_(BagOfWords(VOCAB, num_classes), seed)


def transformer(in_dim: int, num_classes: int, seed: int, dim: int = 32, heads: int = 4, layers: int = 2) -> nn.Module:
    """A tiny causal transformer LM built from `parallelism.models` blocks: nn.Sequential [Embed, Block x layers,
    Head], each Block holding an `Attention` (fused qkv, `heads` heads) and an `MLP` (dim -> 4 dim -> dim), so the
    tensor-parallel engine can split heads and MLP width and the pipeline engine can cut between blocks.
    in_dim is the context length (a sample is a window of token ids); num_classes is the vocabulary size."""
    from pslab.parallelism.models import tiny_transformer
    return _init_(tiny_transformer(vocab=num_classes, d=dim, heads=heads, layers=layers, seq=in_dim, seed=seed), seed)


def moe_transformer(in_dim: int, num_classes: int, seed: int, dim: int = 32, heads: int = 4, layers: int = 2,
                    experts: int = 4, top_k: int = 1, capacity_factor: float = 1.25,
                    aux_weight: float = 0.01) -> nn.Module:
    """`transformer` with a mixture-of-experts feed-forward in every block (`parallelism.moe.MoE`: a softmax router,
    top-k of `experts` experts each dim -> 4 dim -> dim, GShard capacity with token dropping, the Switch aux loss
    weighted `aux_weight`). Routing groups are single sequences (capacity per (sequence, expert)
    = min(ceil(capacity_factor · top_k · S / experts), S)), so routing does not depend on how a batch is split over workers or
    expert-parallel ranks: `local`, allreduce and ps-* route every token the same way."""
    from pslab.parallelism.models import tiny_moe_transformer
    return _init_(tiny_moe_transformer(vocab=num_classes, d=dim, heads=heads, layers=layers, seq=in_dim, experts=experts,
                                       top_k=top_k, capacity_factor=capacity_factor, aux_weight=aux_weight, seed=seed,
                                       group_samples=1), seed)
