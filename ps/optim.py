"""Server-side optimizers: SGD, momentum, Adam (torch.optim's own update rules), staleness-aware learning rate and
delay-compensated ASGD. The optimizer state lives on the shard that owns the parameters.

One optimizer step consumes a list of contributions (gradient g_k computed on version v_k, staleness tau_k, and the
weights w_bak,k the worker read). Under ASP / eager SSP a step has one contribution; under BSP / SSP it has the K of
one clock, averaged: g = (1/K) sum_k g~_k, so BSP equals local training on the concatenated K*b batch.

Staleness-aware learning rate (Zhang, Gupta, Lian, Liu, IJCAI 2016), `staleness_lr`: each gradient gets its own rate,

    theta <- theta - (1/K) sum_k alpha(tau_k) g~_k,   alpha(tau) = alpha0 / max(tau, 1)    (staleness_rule="gradient")

(tau = 0 and tau = 1 both give alpha0). SGD and momentum run at alpha0 on the weighted average
g = (1/K) sum_k g~_k / max(tau_k, 1): for SGD exactly the per-gradient rates, for momentum the per-gradient rates
entering the buffer (weight decay, computed on the current weights, is not scaled). One plain-SGD contribution takes
lr = alpha0 / max(tau, 1) instead (the same update, on the bitwise torch.optim.SGD fast path). Adam normalises its
update by sqrt(v), so a constant gradient scale barely changes it: there the step runs at the mean of the
per-gradient rates, (1/K) sum_k alpha0 / max(tau_k, 1), which for one gradient is the paper's alpha0 / tau.
staleness_rule="mean" keeps the earlier rule for comparison: the step's lr is alpha0 / <tau> (<tau> the mean staleness
of the step, alpha0 when <tau> = 0); it is not the paper's, and it raises the lr above alpha0 when 0 < <tau> < 1.

Delay compensation (DC-ASGD, Zheng et al., ICML 2017), applied to each gradient before the base optimizer (and before
the staleness weight):

    g~ = g + lambda * g (.) g (.) (w_now - w_bak)                      constant lambda
    lambda_t = lambda0 / sqrt(MS_t + eps),  MS_t = m MS_{t-1} + (1-m) g (.) g     adaptive, elementwise

With every tau <= 1 the staleness-aware rate is alpha0, and with lambda = 0 the compensated gradient is g, so both
reduce exactly to the plain update.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from .errors import ConfigError

OPTIMIZERS = ("sgd", "momentum", "adam")
STALENESS_RULES = ("gradient", "mean")   # per-gradient alpha0 / max(tau_k, 1) (Zhang et al.) | alpha0 / mean tau


@dataclass(frozen=True)
class OptimizerSpec:
    """What optimizer the shards run. `dc_lambda=None` disables DC-ASGD (0.0 runs its code path with lambda = 0);
    `staleness_rule` says how `staleness_lr` sets the rate (see the module docstring)."""

    name: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.9
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    nesterov: bool = False
    staleness_lr: bool = False
    staleness_rule: str = "gradient"
    dc_lambda: float | None = None
    dc_adaptive: bool = False
    dc_decay: float = 0.95
    dc_eps: float = 1e-7

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ConfigError(f"unknown optimizer {self.name!r}; expected one of {', '.join(OPTIMIZERS)}")
        if not (isinstance(self.lr, (int, float)) and 0 < self.lr < float("inf")):
            raise ConfigError(f"learning rate must be a finite number > 0, got {self.lr!r}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"momentum must be in [0, 1), got {self.momentum!r}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"betas must be two numbers in [0, 1), e.g. 0.9/0.999, got {self.betas!r}")
        if not 0 < self.eps < 1 or not 0 <= self.weight_decay < float("inf"):
            raise ConfigError(f"eps must be in (0, 1) and weight_decay a finite number >= 0, got eps={self.eps!r}, "
                              f"weight_decay={self.weight_decay!r}")
        if self.staleness_rule not in STALENESS_RULES:
            raise ConfigError(f"staleness_rule must be one of {', '.join(STALENESS_RULES)}, "
                              f"got {self.staleness_rule!r}")
        if self.dc_lambda is not None and self.dc_lambda < 0:
            raise ConfigError(f"DC-ASGD lambda must be >= 0, got {self.dc_lambda!r}")
        if not 0 <= self.dc_decay < 1:
            raise ConfigError(f"DC-ASGD mean-square decay must be in [0, 1), got {self.dc_decay!r}")

    @property
    def delay_compensated(self) -> bool:
        return self.dc_lambda is not None

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["betas"] = list(self.betas)
        return d

    def to_string(self) -> str:
        """The shortest `optimizer_from_string` form: the name, lr, and every option that differs from its default,
        e.g. "adam:lr=0.001" or "sgd:lr=0.1,staleness_lr=1"; `optimizer_from_string(s.to_string()) == s`."""
        parts = []
        defaults = OptimizerSpec().to_dict()
        for k, v in self.to_dict().items():
            if k == "name" or v is None or (k != "lr" and v == defaults[k]):
                continue
            if k == "betas":
                v = "/".join(str(b) for b in v)
            parts.append(f"{k}={int(v) if isinstance(v, bool) else v}")
        return f"{self.name}:{','.join(parts)}"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "OptimizerSpec":
        known = {f.name for f in fields(cls)}
        bad = set(d) - known
        if bad:
            raise ConfigError(f"unknown optimizer option(s) {sorted(bad)}; known: {sorted(known)}")
        d = dict(d)
        if "betas" in d:
            d["betas"] = tuple(float(b) for b in d["betas"])
        return cls(**d)


def optimizer_from_string(text: str | OptimizerSpec) -> OptimizerSpec:
    """Parse "sgd:lr=0.1", "momentum:lr=0.1,momentum=0.9", "adam:lr=1e-3,betas=0.9/0.999,dc_lambda=0.04",
    "sgd:lr=0.1,staleness_lr=1,staleness_rule=mean"."""
    if isinstance(text, OptimizerSpec):
        return text
    name, _, rest = str(text).strip().partition(":")
    kw: dict[str, Any] = {"name": name.lower()}
    types = {f.name: f.type for f in fields(OptimizerSpec)}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, val = item.partition("=")
        key = key.strip()
        if not eq or key not in types or key == "name":
            raise ConfigError(f"bad optimizer option {item!r} in {text!r}; write key=value with key one of "
                              f"{sorted(k for k in types if k != 'name')}")
        try:
            if key == "betas":
                kw[key] = tuple(float(x) for x in val.split("/"))
            elif key in ("nesterov", "staleness_lr", "dc_adaptive"):
                kw[key] = val.strip().lower() in ("1", "true", "yes", "on")
            elif key == "staleness_rule":
                kw[key] = val.strip().lower()
            else:
                kw[key] = float(val)
        except ValueError:
            raise ConfigError(f"optimizer option {key!r} needs a number, got {val!r}") from None
    return OptimizerSpec(**kw)


@dataclass
class Contribution:
    """One worker's gradient for one step: grads {key: array}, its staleness, and (DC only) the weights it read."""

    grads: Mapping[str, Any]
    tau: int = 0
    backup: Mapping[str, torch.Tensor] | None = None
    runs: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None   # the same, as (param, grad) runs (ps.flat)


def _np(t: Any) -> np.ndarray:
    return t.detach().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)


class ServerOptimizer:
    """Runs `spec` over a shard's flat parameter tensors (updated in place)."""

    def __init__(self, spec: OptimizerSpec, params: Mapping[str, torch.Tensor]) -> None:
        self.spec = spec
        self.keys = list(params)
        self.params = dict(params)
        plist = [self.params[k] for k in self.keys]
        if spec.name == "adam":
            self.torch_opt: torch.optim.Optimizer = torch.optim.Adam(
                plist, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay, foreach=False)
        else:
            momentum = spec.momentum if spec.name == "momentum" else 0.0
            self.torch_opt = torch.optim.SGD(plist, lr=spec.lr, momentum=momentum, weight_decay=spec.weight_decay,
                                             nesterov=spec.nesterov and momentum > 0, foreach=False)
        # plain SGD (no momentum, no weight decay, no DC): torch.optim.SGD's own update, param.add_(g, alpha=-lr)
        # (_single_tensor_sgd), applied without its per-step wrappers (hooks, grad mode, param-group walk:
        # ~0.3 ms a step, a third of a 1M-parameter push on the 2-core machine); it keeps no state either
        self._plain = spec.name == "sgd" and not spec.weight_decay and not spec.delay_compensated
        self._gbuf = {k: torch.empty_like(p) for k, p in self.params.items()}
        self._tmp = {k: torch.empty_like(p) for k, p in self.params.items()} if spec.delay_compensated else {}
        self.mean_square = ({k: torch.zeros_like(p) for k, p in self.params.items()}
                            if spec.delay_compensated and spec.dc_adaptive else {})
        self.steps = 0

    def learning_rate(self, taus: Sequence[int]) -> float:
        """The step's rate, for logging: alpha0 without `staleness_lr`; under the "gradient" rule the mean effective
        rate (1/K) sum_k alpha0 / max(tau_k, 1) (one gradient: alpha0 / max(tau, 1); Adam runs at exactly this);
        under the "mean" rule alpha0 / mean(tau) when the mean staleness is > 0."""
        alpha0 = self.spec.lr
        if not self.spec.staleness_lr or not taus:
            return alpha0
        if self.spec.staleness_rule == "mean":
            mean_tau = sum(taus) / len(taus)
            return alpha0 / mean_tau if mean_tau > 0 else alpha0
        rates = [alpha0 / max(int(t), 1) for t in taus]
        return rates[0] if all(r == rates[0] for r in rates) else math.fsum(rates) / len(rates)

    def _divisors(self, taus: Sequence[int]) -> list[int] | None:
        """max(tau_k, 1) per contribution when the "gradient" rule scales gradients (SGD, momentum), else None:
        no staleness_lr, the "mean" rule, Adam (its rate carries the rule), every tau <= 1 (weight 1), or one
        plain-SGD contribution (its lr alpha0 / max(tau, 1) is the same update)."""
        s = self.spec
        if not s.staleness_lr or s.staleness_rule != "gradient" or s.name == "adam":
            return None
        divisors = [max(int(t), 1) for t in taus]
        if all(d == 1 for d in divisors) or (len(divisors) == 1 and self._plain):
            return None
        return divisors

    def step(self, contributions: Sequence[Contribution]) -> float:
        """Average the (compensated, staleness-weighted) gradients and apply one step; returns `learning_rate(taus)`,
        the step's mean effective rate."""
        if not contributions:
            raise ValueError("an optimizer step needs at least one contribution")
        n = len(contributions)
        c = contributions[0]
        taus = [c.tau for c in contributions]
        divisors = self._divisors(taus)
        pairs = c.runs if n == 1 and self._plain else None          # one add_ per run of adjacent tensors (ps.flat)
        if pairs is None and n == 1 and self._plain and all(isinstance(c.grads[k], torch.Tensor) for k in self.keys):
            pairs = [(self.params[k], c.grads[k].reshape(self.params[k].shape)) for k in self.keys]
        if pairs is not None:                                        # fastest path: bitwise torch.optim.SGD's step
            lr = self.learning_rate(taus)                            # alpha0 / max(tau, 1) (or the "mean" rule's)
            with torch.no_grad():
                for p, g in pairs:
                    p.add_(g, alpha=-lr)
            self.steps += 1
            return lr
        if n == 1 and not self.spec.delay_compensated and divisors is None:   # fast path: reads the gradient in place
            with warnings.catch_warnings():                # received frames are read-only; torch.optim only reads
                warnings.simplefilter("ignore", UserWarning)
                for k in self.keys:
                    g = contributions[0].grads[k]
                    g = g if isinstance(g, torch.Tensor) else torch.from_numpy(np.asarray(g))
                    self.params[k].grad = g.reshape(self.params[k].shape)
            return self._apply(taus, scaled=False)
        for k in self.keys:
            g = self._gbuf[k]
            for i, c in enumerate(contributions):
                if i == 0:
                    t = g
                else:
                    t = self._tmp.get(k)
                    if t is None:
                        t = self._tmp[k] = torch.empty_like(g)
                t.numpy()[...] = _np(c.grads[k])
                if self.spec.delay_compensated:
                    self._compensate(k, t, c)                # compensate g_k on its own, then weight it
                if divisors is not None and divisors[i] != 1:
                    t.div_(divisors[i])
                if i > 0:
                    g.add_(t)
            if n > 1:
                g.div_(n)
            self.params[k].grad = g
        return self._apply(taus, scaled=divisors is not None)

    def _apply(self, taus: list[int], scaled: bool) -> float:
        """Run torch.optim's step at alpha0 when the gradients carry the staleness weights (`scaled`), else at
        `learning_rate(taus)`; returns `learning_rate(taus)`."""
        lr = self.learning_rate(taus)
        for group in self.torch_opt.param_groups:
            group["lr"] = self.spec.lr if scaled else lr
        try:
            self.torch_opt.step()
        finally:
            for p in self.params.values():
                p.grad = None
        self.steps += 1
        return lr

    def _compensate(self, k: str, g: torch.Tensor, c: Contribution) -> None:
        """g <- g + lambda (.) g (.) g (.) (w_now - w_bak), in place."""
        if c.backup is None:
            raise ValueError("DC-ASGD needs the weights the worker read (backup); the shard did not keep them")
        w = self.params[k]
        lam: float | torch.Tensor = float(self.spec.dc_lambda or 0.0)
        if self.spec.dc_adaptive:
            ms = self.mean_square[k]
            ms.mul_(self.spec.dc_decay).addcmul_(g, g, value=1.0 - self.spec.dc_decay)
            lam = lam / (ms + self.spec.dc_eps).sqrt()
        g.add_(lam * g * g * (w - c.backup[k]))

    # --- persistence ---
    def state_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Optimizer state as named tensors plus a small msgpack-able dict (step counts, spec)."""
        tensors: dict[str, torch.Tensor] = {}
        scalars: dict[str, Any] = {}
        for k in self.keys:
            for sname, v in self.torch_opt.state.get(self.params[k], {}).items():
                if isinstance(v, torch.Tensor):
                    tensors[f"{k}\x00{sname}"] = v.detach().reshape(-1) if v.dim() else v.detach().reshape(1)
                    scalars[f"{k}\x00{sname}"] = {"shape": list(v.shape)}
                else:
                    scalars[f"{k}\x00{sname}"] = {"value": v}
            if k in self.mean_square:
                tensors[f"{k}\x00dc_mean_square"] = self.mean_square[k]
        return tensors, {"state": scalars, "steps": self.steps, "spec": self.spec.to_dict()}

    def load_state_tensors(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        sd = self.torch_opt.state_dict()
        state: dict[int, dict[str, Any]] = {}
        for i, k in enumerate(self.keys):
            for full, info in meta.get("state", {}).items():
                key, _, sname = full.partition("\x00")
                if key != k:
                    continue
                if "value" in info:
                    state.setdefault(i, {})[sname] = info["value"]
                else:
                    state.setdefault(i, {})[sname] = torch.as_tensor(tensors[full]).reshape(info["shape"]).clone()
            if k in self.mean_square:
                self.mean_square[k].copy_(torch.as_tensor(tensors[f"{k}\x00dc_mean_square"]))
        sd["state"] = state
        self.torch_opt.load_state_dict(sd)
        self.steps = int(meta.get("steps", 0))


def build_optimizer(spec: OptimizerSpec | str, params: Mapping[str, torch.Tensor]) -> ServerOptimizer:
    return ServerOptimizer(optimizer_from_string(spec), params)


__all__ = ["OptimizerSpec", "optimizer_from_string", "Contribution", "ServerOptimizer", "build_optimizer",
           "OPTIMIZERS", "STALENESS_RULES", "replace"]
