"""Why one GPU is not enough: the memory wall and the compute wall.

Memory (the article: "weights 2 + grads 2 + Adam's fp32 moments 8 ... ~12–16 bytes per parameter before a single
activation; a 70B model needs on the order of a terabyte"): an Adam step of a real model here, fp32 on CPU, holds
4 (weights) + 4 (grads) + 8 (exp_avg, exp_avg_sq) = 16 bytes per parameter — counted from the tensors' storage —
and the same model in mixed precision (2 + 2 + 12 with the fp32 master copy: ZeRO's K = 12) for 70·10⁹ parameters
is 1.12 TB, 14 GPUs of 80 GB for the state alone (`parallelism.memory_model.estimate`).

Compute ("one GPU would take years"): training costs ≈ 6·N·D floating-point operations (N parameters, D tokens or
samples: 2 per parameter per sample forward, 4 backward). torch's FlopCounterMode counts one real step's matmul
FLOPs; theory is 6·N·B minus the first layer's input gradient nobody needs (2·N₁·B); the step's time is then
≈ FLOPs / rate with this CPU's measured matmul rate. The same arithmetic for a 70B model on 15·10¹² tokens and one
H100 (989 TFLOP/s dense bf16 at 40 % utilisation) gives centuries — modelled, and said so.
"""

from __future__ import annotations

import statistics
import time

from .core import Context, Figure, Modelled, Outcome, Step

H100_FLOPS = 989e12          # dense bf16, NVIDIA H100 SXM datasheet
MFU = 0.40                   # a good large run's model-FLOPs utilisation
LLAMA_TOKENS = 15e12         # Llama 3's pre-training tokens
SECONDS_PER_YEAR = 365.25 * 86400


def memory_wall(ctx: Context) -> Outcome:
    import torch
    from pslab.parallelism.memory_model import Layout, estimate
    from pslab.parallelism.models import mlp

    torch.set_num_threads(1)
    widths = [64, 256, 256, 10] if ctx.quick else [784, 1024, 1024, 10]
    model = mlp(widths, seed=ctx.seed, act=torch.nn.ReLU)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, widths[0]), torch.randint(0, widths[-1], (32,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    weights = sum(p.untyped_storage().nbytes() for p in params)
    grads = sum(p.grad.untyped_storage().nbytes() for p in params if p.grad is not None)
    moments = sum(v.untyped_storage().nbytes() for s in opt.state.values() for k, v in s.items()
                  if k in ("exp_avg", "exp_avg_sq"))
    steps = sum(v.untyped_storage().nbytes() for s in opt.state.values() for k, v in s.items() if k == "step")
    per_param = (weights + grads + moments) / n
    big = 70e9
    est = estimate(Layout(), precision="mixed", params=big)
    state = est.get("params") + est.get("grads") + est.get("optimizer")
    gpus = state / 80e9
    return Outcome(
        figures=[
            Figure("fp32 Adam state per parameter", per_param, 16.0, "B/param", "=", 0.0,
                   f"storage of {len(params)} parameter tensors + their grads + exp_avg + exp_avg_sq ÷ {n:,} params; "
                   f"4 + 4 + 8 (fp32)"),
        ],
        modelled=[Modelled("70B model's state, mixed precision", state / 1e12, "TB",
                           "memory_model.estimate(params=70e9, 'mixed'): 70e9 × (2 + 2 + 12) B")],
        explanation=(
            f"Before a single activation, a model trained with Adam carries weights, gradients and two moments per "
            f"parameter: counted on a real {n:,}-parameter model after one Adam step, {per_param:g} bytes per "
            f"parameter — 4 + 4 + 8, everything in fp32 on this CPU. The article's mixed precision is 2 (bf16 "
            f"weights) + 2 (grads) + 8 (fp32 moments) = 12, and 16 again with the fp32 master copy of the weights "
            f"most recipes keep (2 + 2 + 12: the same total for another reason), so a 70B model needs "
            f"{state / 1e12:.2f} TB for its state alone — {gpus:.0f} GPUs of 80 GB before activations: memory, not "
            f"speed, is the first reason to distribute."),
        notes=[f"Adam's step counters add {steps} B (one per tensor), not counted per parameter"])


def compute_wall(ctx: Context) -> Outcome:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from pslab.parallelism.models import mlp

    torch.set_num_threads(1)
    widths, batch = [512, 1024, 1024, 1024, 512], 256      # quick too: the step is ~60 ms, small ones are Python
    model = mlp(widths, seed=ctx.seed, act=torch.nn.ReLU, bias=False)
    x = torch.randn(batch, widths[0])
    n = sum(p.numel() for p in model.parameters())
    first = widths[0] * widths[1]

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()

    counter = FlopCounterMode(display=False)
    with counter:
        step()
    flops = counter.get_total_flops()
    theory = 6 * n * batch - 2 * first * batch
    # this CPU's fp32 matmul rate on the step's own largest shape, timed alternately with the step: FLOP/s of one
    # thread's CPU time
    a, b = torch.randn(batch, widths[1]), torch.randn(widths[1], widths[2])
    a @ b
    step()
    mm_s, step_s = [], []
    clock = time.thread_time          # this thread's CPU time: the work's cost, whatever else runs on the machine
    for _ in range(5 if ctx.quick else 9):
        t0 = clock()
        a @ b
        mm_s.append(clock() - t0)
        t0 = clock()
        step()
        step_s.append(clock() - t0)
    rate = 2 * batch * widths[1] * widths[2] / statistics.median(mm_s)
    measured_s = statistics.median(step_s)
    big_flops = 6 * 70e9 * LLAMA_TOKENS
    years = big_flops / (H100_FLOPS * MFU) / SECONDS_PER_YEAR
    cpu_years = big_flops / rate / SECONDS_PER_YEAR
    return Outcome(
        figures=[
            Figure("FLOPs of one training step", flops, theory, "FLOP", "=", 0.0,
                   f"FlopCounterMode vs 6·N·B − 2·N₁·B (N={n:,}, B={batch}, first layer N₁={first:,})"),
            Figure("step time", measured_s * 1e3, flops / rate * 1e3, "ms", "=", 0.25,
                   f"measured median vs FLOPs ÷ this CPU's matmul rate on the step's shape ({rate / 1e9:.1f} "
                   f"GFLOP/s, one thread)", timed=True),
        ],
        modelled=[Modelled("70B × 15T tokens on this CPU", cpu_years, "years", "6·N·D ÷ the measured rate"),
                  Modelled("70B × 15T tokens on one H100", years, "years",
                           "6·N·D ÷ (989 TFLOP/s dense bf16 × 40 % utilisation)")],
        explanation=(
            f"Training costs about 6 FLOPs per parameter per sample (2 forward, 4 backward): torch's own counter, "
            f"summing the matmuls a real step dispatched, finds exactly 6·N·B less the first layer's input gradient, "
            f"which nobody needs (2·N₁·B). Time is FLOPs divided by a rate: this CPU does "
            f"{rate / 1e9:.1f} GFLOP/s on one thread, and the step takes about what that predicts. At that rate a "
            f"70B model on 15 trillion tokens would take {cpu_years:.2g} years; on one H100 at 40 % utilisation, "
            f"{years:.0f} years — the compute wall: a run that must end in weeks needs thousands of GPUs."),
        notes=["the 70B figures are the model's (no H100 here); the step time is measured against the rate measured "
               "on the step's own matmul shape, alternately with it",
               "a step also runs element-wise work (ReLU and its gradient, the loss) at memory speed: tolerance 25 %"])


STEPS = [
    Step("memory-wall", "Why one GPU is not enough", "Adam needs ~12–16 bytes per parameter before any activation: "
         "a 70B model needs about a terabyte", "pslab memory --params 70e9", memory_wall, 20),
    Step("compute-wall", "Why one GPU is not enough", "FLOPs scale with model and data size; past a size one GPU "
         "would take years", "pslab plan --model gpt-76b --top 3", compute_wall, 20),
]
