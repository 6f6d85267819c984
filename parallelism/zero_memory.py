"""ZeRO's per-rank model-state memory, the textbook formulas (Rajbhandari et al., 2020, §3 and Fig. 1).

Ψ parameters, N data-parallel ranks. Bytes per element: p for parameters, g for gradients, K for optimizer state.
The paper's mixed-precision Adam case has p = g = 2 (fp16) and K = 12 (fp32 master weights, momentum, variance):

    stage 0 (plain DP)                 (2 + 2 + K)Ψ
    stage 1 (optimizer state sharded)  4Ψ + KΨ/N
    stage 2 (+ gradients sharded)      2Ψ + (2 + K)Ψ/N
    stage 3 (+ parameters sharded)     (4 + K)Ψ/N

In general: (p+g+K)Ψ, (p+g)Ψ + KΨ/N, pΨ + (g+K)Ψ/N, (p+g+K)Ψ/N.

**The fp32 case pslab runs on CPU**: p = g = 4 and K = 8 for Adam (exp_avg and exp_avg_sq, 4 bytes each; no master
copy because the weights already are fp32), K = 4 for SGD with momentum, K = 0 for plain SGD. So fp32 Adam is
16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N.
"""

from __future__ import annotations

from dataclasses import dataclass

MIXED_PRECISION_ADAM = (2, 2, 12)   # (p, g, K) of the paper
FP32_ADAM = (4, 4, 8)
FP32_SGD_MOMENTUM = (4, 4, 4)
FP32_SGD = (4, 4, 0)


@dataclass(frozen=True)
class StateBytes:
    """Bytes of model state held by one rank."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict[str, float]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer, "total": self.total}


def zero_bytes_per_rank(stage: int, psi: int, world_size: int,
                        bytes_per: tuple[int, int, int] = FP32_ADAM) -> StateBytes:
    """The ZeRO formula for `stage` (0..3): bytes of params, grads, optimizer state on one of N ranks."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    p, g, k = bytes_per
    n = world_size
    shard = {0: (False, False, False), 1: (False, False, True), 2: (False, True, True), 3: (True, True, True)}[stage]
    return StateBytes(params=p * psi / (n if shard[0] else 1),
                      grads=g * psi / (n if shard[1] else 1),
                      optimizer=k * psi / (n if shard[2] else 1))


def optimizer_bytes_per(optimizer: str, momentum: float = 0.0) -> tuple[int, int, int]:
    """(p, g, K) for fp32 training with the named optimizer ('adam', 'adamw' or 'sgd')."""
    name = optimizer.lower()
    if name in ("adam", "adamw"):
        return FP32_ADAM
    if name == "sgd":
        return FP32_SGD_MOMENTUM if momentum else FP32_SGD
    raise ValueError(f"no ZeRO byte model for optimizer {optimizer!r}; use 'adam', 'adamw' or 'sgd'")
