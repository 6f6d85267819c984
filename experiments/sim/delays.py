"""Delay distributions for the staleness emulator (`dai.py`): how many steps behind each gradient is computed.

One parameter s >= 0 per distribution; s = 0 means no staleness under every one of them:

    uniform      r ~ U{0, ..., s}                          mean s/2       Dai et al. 2019 (the default)
    constant     r = s                                     mean s         x_{t+1} = x_t - eta grad F(x_{t-s})
    geometric    r = G - 1, G ~ Geometric(1/M), M = s + 1  mean s = M-1   P(r = l) = (1 - q) q^l, q = 1 - 1/M
    exponential  r = floor(E + 1/2), E ~ Exponential(s)    mean e^{1/2s} / (e^{1/s} - 1) ~ s - 1/(24 s)

The geometric law is the one of Mitliagkas et al. 2016 ("Asynchrony begets momentum"): with M asynchronous workers
and exponential compute times, a gradient is r updates stale with P(r = l) = (1 - q) q^l, q = 1 - 1/M — exactly
the queueing law of the PS simulator, whose ASP mean staleness is K - 1; so geometric with s means "M = s + 1
workers". `exponential` is a continuous delay rounded to the nearest step (its mass at 0 is 1 - e^{-1/2s}, not
1 - q: a different shape with almost the same mean).

The unbounded laws are cut at `max_delay`, the smallest L with P(r > L) <= 1e-9 (a drawn r > L reads the oldest
kept version; at 1e-9 per draw this never happens in practice); the emulator also caps r at the step number t (a
gradient cannot be older than the initial weights: version max(t - r, 0)).

Draws come from `numpy.random.default_rng` seeded with (seed, 0xDA1, s) for `uniform` — the emulator's original
stream, so one worker with uniform delays is bit-for-bit the single-stream emulator — and with
(seed, 0xDA1, kind code, round(1000 s)) for the others; with K workers, step t draws r_{t,0}, ..., r_{t,K-1} in
worker order (independent delays).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from pslab.experiments.errors import ConfigError

DELAYS = ("uniform", "constant", "geometric", "exponential")
_CODES = {"constant": 1, "geometric": 2, "exponential": 3}
TAIL = 1e-9                 # the unbounded laws are cut where P(r > max_delay) <= TAIL


@dataclass(frozen=True)
class DelayModel:
    """A delay distribution: `kind` (one of DELAYS) and its parameter `s` (the bound, the constant, or the mean)."""

    kind: str = "uniform"
    s: float = 0

    def __post_init__(self) -> None:
        if self.kind not in DELAYS:
            raise ConfigError(f"unknown delay distribution {self.kind!r}; choose one of: {', '.join(DELAYS)}")
        if not (isinstance(self.s, (int, float)) and math.isfinite(self.s) and self.s >= 0):
            raise ConfigError(f"staleness s must be a finite number >= 0, got {self.s!r}")
        if self.kind in ("uniform", "constant") and self.s != int(self.s):
            raise ConfigError(f"{self.kind} delays need an integer s (steps), got {self.s!r}")

    @property
    def q(self) -> float:
        """geometric: the ratio q = s / (s + 1) = 1 - 1/M of P(r = l) = (1 - q) q^l (Mitliagkas's momentum)."""
        return self.s / (self.s + 1.0)

    @property
    def mean(self) -> float:
        """E[r] (before the cap at t)."""
        s = float(self.s)
        if self.kind == "uniform":
            return s / 2
        if self.kind == "exponential" and s > 0:
            return math.exp(1 / (2 * s)) / math.expm1(1 / s)
        return s

    @property
    def max_delay(self) -> int:
        """The largest delay drawn: s for uniform/constant; for the unbounded laws the smallest L with
        P(r > L) <= TAIL."""
        s = float(self.s)
        if self.kind in ("uniform", "constant") or s == 0:
            return int(s)
        if self.kind == "geometric":     # P(r > L) = q^(L+1)
            return max(0, math.ceil(math.log(TAIL) / math.log(self.q)) - 1)
        return max(0, math.ceil(-s * math.log(TAIL) - 0.5))   # P(round(E) > L) = exp(-(L + 1/2) / s)

    def pmf(self, r: int) -> float:
        """P(delay = r) of the uncut law."""
        s = float(self.s)
        if r < 0:
            return 0.0
        if self.kind == "uniform":
            return 1.0 / (s + 1) if r <= s else 0.0
        if self.kind == "constant" or s == 0:
            return 1.0 if r == s else 0.0
        if self.kind == "geometric":
            return (1 - self.q) * self.q ** r
        lo = max(r - 0.5, 0.0)
        return math.exp(-lo / s) - math.exp(-(r + 0.5) / s)

    def sampler(self, seed: int) -> Callable[[], int]:
        """A function returning the next delay of this run's stream (see the module docstring for the seeding)."""
        s, cap = self.s, self.max_delay
        if self.kind == "constant":
            d = int(s)
            return lambda: d
        if self.kind == "uniform":
            rng = np.random.default_rng([seed, 0xDA1, int(s)])
            hi = int(s) + 1
            return lambda: int(rng.integers(0, hi))
        rng = np.random.default_rng([seed, 0xDA1, _CODES[self.kind], int(round(1000 * s))])
        if self.kind == "geometric":
            p = 1.0 / (s + 1.0)
            return lambda: min(int(rng.geometric(p)) - 1, cap)
        return lambda: min(int(math.floor(rng.exponential(s) + 0.5)), cap)

    def describe(self) -> str:
        """For labels: 'U{0..4}', 'constant 4', 'geometric mean 3 (M = 4)', 'exponential mean 4'."""
        s = f"{self.s:g}"
        if self.kind == "uniform":
            return f"U{{0..{s}}}"
        if self.kind == "geometric":
            return f"geometric mean {s} (M = {self.s + 1:g})"
        return f"{self.kind} {'mean ' if self.kind == 'exponential' else ''}{s}"


def delay_model(kind: str | DelayModel, s: float) -> DelayModel:
    """DelayModel(kind, s), or `kind` itself when it already is one."""
    return kind if isinstance(kind, DelayModel) else DelayModel(str(kind), s)
