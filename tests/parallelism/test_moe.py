"""The single-process MoE layer (parallelism/moe.py) against obviously-correct per-token loops written here."""

from __future__ import annotations

import math

import pytest
import torch

from pslab.parallelism.models import lm_loss, tiny_moe_transformer
from pslab.parallelism.moe import MoE, MoEConfigError, capacity, moe_aux_loss, moe_layers

D, E = 8, 4


def loop_moe(layer: MoE, x: torch.Tensor):
    """The MoE rule token by token: per group, router softmax by hand, top-k by sorting, admission in GShard order
    (every token's first choice in token order, then every second choice) up to C per expert, combine weights
    p_e (k = 1) or p_e / (p_1 + p_2) (k = 2). Returns (y, kept[g][t][j], dropped per expert, aux)."""
    B, S, d = x.shape
    G, k = (B // layer.group_samples if layer.group_samples else layer.groups), layer.top_k
    tokens = x.reshape(G, -1, d)
    T = tokens.shape[1]
    C = math.ceil(layer.capacity_factor * k * T / E - 1e-9)
    W = layer.router.weight.detach()
    y = torch.zeros(G, T, d)
    kept = [[[False] * k for _ in range(T)] for _ in range(G)]
    dropped = [0] * E
    aux = 0.0
    for g in range(G):
        probs, choice = [], []
        for t in range(T):
            logit = [float(sum(W[e, i] * tokens[g, t, i] for i in range(d))) for e in range(E)]
            z = [math.exp(v - max(logit)) for v in logit]
            p = [v / sum(z) for v in z]
            probs.append(p)
            choice.append(sorted(range(E), key=lambda e: -p[e])[:k])
        count = [0] * E
        for j in range(k):
            for t in range(T):
                e = choice[t][j]
                if count[e] < C:
                    count[e] += 1
                    kept[g][t][j] = True
                else:
                    dropped[e] += 1
        for t in range(T):
            norm = sum(probs[t][e] for e in choice[t]) if k == 2 else 1.0
            for j, e in enumerate(choice[t]):
                if kept[g][t][j]:
                    y[g, t] += probs[t][e] / norm * layer.experts[e](tokens[g, t:t + 1]).detach()[0]
        f = [sum(1 for t in range(T) if choice[t][0] == e) / T for e in range(E)]
        P = [sum(probs[t][e] for t in range(T)) / T for e in range(E)]
        aux += layer.aux_weight * E * sum(fe * pe for fe, pe in zip(f, P)) / G
    return y.view(B, S, d), kept, dropped, aux


def _layer_and_input(k: int, cf: float, groups: int, seed: int = 0, group_samples: int | None = None):
    torch.manual_seed(seed)
    layer = MoE(D, E, top_k=k, capacity_factor=cf, groups=groups, aux_weight=0.1, group_samples=group_samples)
    return layer, torch.randn(4, 6, D)


def test_capacity_formula():
    """C = ceil(cf · k · T / E), with 1.1·100/10 = 11.000000000000002 counted as 11, not 12."""
    assert capacity(12, 4, 2, 1.25) == 8          # 7.5 -> 8
    assert capacity(10, 4, 1, 1.0) == 3           # 2.5 -> 3
    assert capacity(8, 4, 1, 1.0) == 2
    assert capacity(100, 10, 1, 1.1) == 11
    assert capacity(24, 4, 2, 2.0) == 24          # cf = E/k: every token fits
    assert capacity(32, 2, 2, 1.25) == 32         # 40, capped: an expert receives each token at most once
    assert capacity(32, 4, 1, 1e9) == 32
    with pytest.raises(MoEConfigError):
        capacity(8, 4, 1, 0.0)


@pytest.mark.parametrize("k,cf,groups,gs", [(1, 0.5, 2, None), (2, 0.5, 2, None), (2, 1.0, 4, None),
                                           (1, 1.0, 1, None), (2, 2.0, 2, None), (2, 1.0, 1, 1)])
def test_layer_matches_loop_rule(k, cf, groups, gs):
    """Forward output, the admitted (token, choice) set, dropped counts and the aux loss equal the loop rule — under
    heavy dropping (cf 0.5), mild dropping and none (cf = E/k: C = T); also with per-sequence groups (gs = 1)."""
    layer, x = _layer_and_input(k, cf, groups, group_samples=gs)
    y = layer(x)
    want_y, want_kept, want_dropped, want_aux = loop_moe(layer, x)
    r = layer.last_routing
    assert r.kept.tolist() == want_kept
    assert layer.last_stats["dropped"].tolist() == want_dropped
    assert layer.last_stats["routed"].sum() == k * x.shape[0] * x.shape[1]
    if cf < 1.0:
        assert sum(want_dropped) > 0
    if cf * k >= E:
        assert sum(want_dropped) == 0
    torch.testing.assert_close(y.detach(), want_y, rtol=1e-5, atol=1e-6)
    assert abs(float(layer.last_aux.detach()) - want_aux) < 1e-6


def test_aux_loss_gradient_flows_through_mean_probabilities():
    """The aux loss's router gradient is that of α·E·Σ f_e·P_e with f_e constant (Switch): an independent torch
    computation of the formula gives the same gradient."""
    layer, x = _layer_and_input(2, 1.0, 2)
    layer(x)
    layer.last_aux.backward()
    got = layer.router.weight.grad.clone()
    W = layer.router.weight.detach().clone().requires_grad_(True)
    total = 0
    for g in x.reshape(2, -1, D):
        p = torch.softmax(g @ W.t(), dim=-1)
        f = torch.stack([(p.argmax(-1) == e).float().mean() for e in range(E)])
        total = total + layer.aux_weight * E * (f * p.mean(0)).sum() / 2
    total.backward()
    torch.testing.assert_close(got, W.grad, rtol=1e-5, atol=1e-7)


def test_stats_accumulate_and_reset():
    """pop_stats sums last_stats over forwards since the last call, then starts again from zero."""
    layer, x = _layer_and_input(1, 0.5, 2)
    layer(x)
    first = {k: v.clone() for k, v in layer.last_stats.items()}
    layer(x * 2)
    acc = layer.pop_stats()
    assert (acc["routed"] == first["routed"] + layer.last_stats["routed"]).all()
    assert (acc["dropped"] == first["dropped"] + layer.last_stats["dropped"]).all()
    assert layer.pop_stats()["routed"].sum() == 0


def test_model_loss_paths():
    """tiny_moe_transformer returns logits (lm_loss alone evaluates it); moe_aux_loss adds each layer's aux; the
    experts are d → 4d → d MLPs with full-model names."""
    model = tiny_moe_transformer(vocab=16, d=16, heads=4, layers=2, seq=6, experts=4, top_k=2, groups=2)
    x, y = torch.randint(0, 16, (4, 6)), torch.randint(0, 16, (4, 6))
    logits = model(x)
    assert logits.shape == (4, 6, 16) and torch.isfinite(lm_loss(logits, y))
    layers = moe_layers(model)
    assert [n for n, _ in layers] == ["1.mlp", "2.mlp"]
    assert float(moe_aux_loss(model).detach()) == pytest.approx(sum(float(m.last_aux.detach()) for _, m in layers))
    names = dict(model.named_parameters())
    assert names["1.mlp.experts.3.fc1.weight"].shape == (64, 16) and names["2.mlp.router.weight"].shape == (4, 16)


def test_bad_settings_are_refused():
    with pytest.raises(MoEConfigError, match="top_k"):
        MoE(D, E, top_k=3)
    layer = MoE(D, E, groups=3)
    with pytest.raises(MoEConfigError, match="groups"):
        layer(torch.randn(4, 6, D))
    with pytest.raises(MoEConfigError, match="group_samples"):
        MoE(D, E, group_samples=3)(torch.randn(4, 6, D))
