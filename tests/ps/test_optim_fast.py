"""Plain SGD's fast path (ServerOptimizer applies param.add_(g, alpha=-lr) itself, without torch.optim's per-step
wrappers) is bitwise torch.optim.SGD, for every float dtype and with the staleness-aware rate."""

from __future__ import annotations

import pytest
import torch

from pslab.ps.optim import Contribution, ServerOptimizer, optimizer_from_string


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("spec", ["sgd:lr=0.05", "sgd:lr=0.05,staleness_lr=1"])
def test_plain_sgd_fast_path_is_bitwise_torch_sgd(dtype, spec):
    g = torch.Generator().manual_seed(0)
    init = {"w": torch.randn(37, 11, generator=g).to(dtype), "b": torch.randn(5, generator=g).to(dtype)}
    opt = ServerOptimizer(optimizer_from_string(spec), {k: v.clone() for k, v in init.items()})
    assert opt._plain
    ref = {k: v.clone() for k, v in init.items()}
    torch_opt = torch.optim.SGD(list(ref.values()), lr=0.05, foreach=False)
    for step in range(6):
        grads = {k: torch.randn(v.shape, generator=g).to(dtype) for k, v in init.items()}
        tau = step % 3
        lr = opt.step([Contribution(grads, tau)])
        assert lr == (0.05 / max(tau, 1) if "staleness" in spec else 0.05)     # eta / max(tau, 1) per gradient
        for group in torch_opt.param_groups:
            group["lr"] = lr
        for k, p in ref.items():
            p.grad = grads[k]
        torch_opt.step()
        for k in init:
            assert torch.equal(opt.params[k], ref[k]), (step, k)
    assert not torch.equal(opt.params["w"], init["w"])
    assert opt.state_tensors()[0] == {}                     # no state, as torch.optim.SGD keeps none
