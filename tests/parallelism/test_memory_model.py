"""`parallelism.memory_model` against published numbers (the article, ZeRO, Korthikanti et al.) and against
single-process measurements of the tiny transformer (parameter count, checkpointed activations)."""

from __future__ import annotations

import pytest
import torch

from pslab.parallelism.checkpointing import measure
from pslab.parallelism.memory_model import (Layout, MemoryModelError, Shape, estimate, layer_activation_bytes_16,
                                      rank_params, tiny_checkpointed_activation_bytes)
from pslab.parallelism.models import lm_loss, tiny_transformer
from pslab.parallelism.sequence import model_activation_bytes, paper_layer_bytes

torch.set_num_threads(1)


@pytest.mark.parametrize("precision", ["mixed", "fp32"])
def test_article_70b_is_16_bytes_per_param_and_1_12_tb(precision):
    e = estimate(Layout(), precision, params=70e9)
    assert e.total / 70e9 == 16
    assert e.total == pytest.approx(1.12e12)           # "on the order of a terabyte" before activations
    assert e.total > 141e9                             # no single 80-140 GB GPU holds it


@pytest.mark.parametrize("stage, gb", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.88)])
def test_zero_paper_fig1_psi_7_5b_k12_nd64(stage, gb):
    e = estimate(Layout(dp=64, zero=stage), "mixed", params=7.5e9)
    assert round(e.total / 1e9, 3 if gb < 10 else 1) == pytest.approx(gb, abs=0.01)


def test_korthikanti_gpt3_175b_per_layer():
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h                                     # 25,165,824; 5as/h = 80 for GPT-3
    assert layer_activation_bytes_16(s, b, h, a) == sbh * (34 + 80)
    assert layer_activation_bytes_16(s, b, h, a, t) == sbh * (10 + 3 + 10)
    assert layer_activation_bytes_16(s, b, h, a, t, sp=True) == sbh * 114 / 8
    assert layer_activation_bytes_16(s, b, h, a, t, sp=True, recompute="selective") == sbh * 34 / 8
    assert layer_activation_bytes_16(s, b, h, a, t, recompute="full") == 2 * sbh
    for sp in (False, True):                            # the same table, written independently in sequence.py
        assert layer_activation_bytes_16(s, b, h, a, t, sp) == pytest.approx(paper_layer_bytes(s, b, h, a, t, sp))
    # the paper's headline: SP + selective recompute cut activation memory ~5x against TP alone (23 -> 4.25 sbh)
    assert layer_activation_bytes_16(s, b, h, a, t) / layer_activation_bytes_16(s, b, h, a, t, True, "selective") > 5


def test_1f1b_first_stage_holds_p_microbatches_so_all_layers():
    shape = Shape(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200)
    lay = Layout(tp=8, pp=8, sp=True, recompute="selective", micro_batches=64)
    e = estimate(lay, "mixed", shape=shape, stage=0)
    assert e.get("activations") == pytest.approx(96 * 2048 * 12288 * 34 / 8)     # sbhL·34/t, ~10.3 GB
    assert lay.in_flight(0) == 8 and lay.in_flight(7) == 1
    assert Layout(pp=4, micro_batches=6, schedule="gpipe").in_flight(3) == 6


def test_shape_params_match_tiny_transformer_and_tp_divides_layer_weights():
    model = tiny_transformer(vocab=16, d=16, heads=4, layers=3, seq=6)
    shape = Shape(layers=3, hidden=16, heads=4, seq=6, vocab=16)
    assert shape.params() == sum(p.numel() for p in model.parameters())
    h = 16
    repl = shape.embed_params() + shape.head_params() + 3 * 6 * h
    assert rank_params(shape, Layout(tp=2)) == repl + 3 * (12 * h * h + 7 * h) / 2
    assert rank_params(None, Layout(tp=2, pp=4, ep=8), params=80.0, expert_params=64.0) == 16 / 8 + 64 / 64


@pytest.mark.parametrize("batch, seq, d, heads, layers, vocab", [(4, 8, 16, 4, 2, 16), (2, 12, 32, 4, 3, 40)])
def test_tiny_formulas_match_activation_meter(batch, seq, d, heads, layers, vocab):
    def factory():
        return tiny_transformer(vocab=vocab, d=d, heads=heads, layers=layers, seq=seq)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g)
    got = measure(factory, x, y, loss_fn=lm_loss, repeats=1)
    assert got["peak_bytes_plain"] == model_activation_bytes(batch, seq, d, heads, layers, vocab)
    assert got["peak_bytes_checkpointed"] == tiny_checkpointed_activation_bytes(batch, seq, d, heads, layers, vocab)


@pytest.mark.parametrize("kw, fragment", [
    (dict(zero=5), "--zero"), (dict(dp=0), "--dp"), (dict(sp=True), "--tp > 1"), (dict(recompute="most"), "none"),
])
def test_bad_layouts_raise_one_line(kw, fragment):
    with pytest.raises(MemoryModelError, match=fragment):
        Layout(**kw)


def test_bad_models_raise():
    with pytest.raises(MemoryModelError, match="divide"):
        estimate(Layout(tp=3), shape=Shape(2, 32, 4, 8, 16))
    with pytest.raises(MemoryModelError, match="exceeds"):
        estimate(Layout(pp=3), shape=Shape(2, 32, 4, 8, 16))
    with pytest.raises(MemoryModelError, match="precision"):
        estimate(Layout(), "fp8", params=1e9)
