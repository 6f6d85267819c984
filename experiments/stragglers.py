"""Stragglers and delays: one model of how long worker w's step t takes, used by real runs and by the simulator.

    step_time(w, t, base) = base * factor_w * transient(w, t) + delay(w, t)

- factor_w: a per-worker slowdown factor (default 1; "one straggler" = one worker with factor > 1);
- transient(w, t) = `transient_factor` with probability `transient_prob`, else 1 (a temporary slowdown, e.g. a
  noisy neighbour);
- delay(w, t): an extra random delay, `none`, `exponential` with mean `delay_mean_s`, or `lognormal` with median
  `delay_mean_s` and shape `delay_sigma` (heavy tail).

All randomness comes from a generator seeded with (seed, w, t), so the same run gets the same delays whether it is
real or simulated, and regardless of the order in which workers ask. A real run measures its compute time c and
sleeps step_time(w, t, max(c, base_step_s)) - c; the simulator advances virtual time by step_time(w, t, compute_s).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pslab.experiments.errors import ConfigError

DELAYS = ("none", "exponential", "lognormal")


@dataclass
class StragglerConfig:
    factors: dict[int, float] = field(default_factory=dict)  # worker -> slowdown factor
    transient_prob: float = 0.0
    transient_factor: float = 1.0
    delay: str = "none"
    delay_mean_s: float = 0.0
    delay_sigma: float = 1.0

    def validate(self, workers: int) -> None:
        for w, f in self.factors.items():
            if not 0 <= int(w) < workers:
                raise ConfigError(f"stragglers.factors: worker {w} out of range 0..{workers - 1}")
            if not 0 < f <= 1000:
                raise ConfigError(f"stragglers.factors: worker {w} factor must be in (0, 1000], got {f}")
        if not 0.0 <= self.transient_prob <= 1.0:
            raise ConfigError(f"stragglers.transient_prob must be in [0, 1], got {self.transient_prob}")
        if not 0 < self.transient_factor <= 1000:
            raise ConfigError(f"stragglers.transient_factor must be in (0, 1000], got {self.transient_factor}")
        if self.delay not in DELAYS:
            raise ConfigError(f"stragglers.delay must be one of {', '.join(DELAYS)}, got {self.delay!r}")
        if not (0 <= self.delay_mean_s <= 3600) or not (0 < self.delay_sigma <= 10):
            raise ConfigError("stragglers.delay_mean_s must be in [0, 3600] s and stragglers.delay_sigma in (0, 10]")

    @property
    def active(self) -> bool:
        return bool(self.factors) or self.transient_prob > 0 or (self.delay != "none" and self.delay_mean_s > 0)


class StragglerModel:
    def __init__(self, cfg: StragglerConfig, seed: int):
        self.cfg, self.seed = cfg, int(seed)

    def factor(self, worker: int) -> float:
        return float(self.cfg.factors.get(worker, self.cfg.factors.get(str(worker), 1.0)))  # type: ignore[arg-type]

    def step_time(self, worker: int, step: int, base_s: float) -> float:
        """Seconds that worker `worker`'s step `step` takes when its undisturbed compute takes `base_s`."""
        c = self.cfg
        if not c.active:
            return float(base_s)          # no draws needed: the same value the general path gives
        rng = np.random.default_rng([self.seed, 0x57A6, worker, step])
        u, v = rng.random(), rng.standard_normal()  # always draw both: draws don't depend on the config branch
        t = base_s * self.factor(worker)
        if c.transient_prob > 0 and u < c.transient_prob:
            t *= c.transient_factor
        if c.delay == "exponential" and c.delay_mean_s > 0:
            t += -c.delay_mean_s * np.log1p(-rng.random())
        elif c.delay == "lognormal" and c.delay_mean_s > 0:
            t += c.delay_mean_s * float(np.exp(c.delay_sigma * v))
        return float(t)
