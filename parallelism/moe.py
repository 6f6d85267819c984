"""Mixture of experts: a router sends each token to k of E expert MLPs (single-process reference layer).

Sparsely-gated MoE (Shazeer et al. 2017), with GShard's groups, capacity and top-2 rule (Lepikhin et al. 2020) and
Switch's load-balancing loss (Fedus et al. 2021). For the tokens x_t (width d) of one *group*:

    logits = x · W_rᵀ  (d → E, no bias)      p_t = softmax(logits_t)           (router probabilities)
    top-k experts e_1(t), e_2(t) by p_t (k = 1 or 2; ties as torch.topk breaks them)
    combine weight  w_1 = p_t[e_1]                                   k = 1 (Switch)
                    w_j = p_t[e_j] / (p_t[e_1] + p_t[e_2])           k = 2 (GShard's renormalisation over the two)
    y_t = Σ_j [ (t, e_j) admitted ] · w_j · Expert_{e_j}(x_t)      (a dropped assignment contributes 0; the
                                                                   block's residual connection carries the token)

Groups (GShard's G): a forward's B samples are cut into `groups` equal groups of contiguous samples (B % G == 0),
T = B·S/G tokens each — or, with `group_samples` = n set, into groups of n samples (G = B/n: any batch divisible by
n works, e.g. n = 1 for per-sequence capacity); routing, capacity and the aux loss are per group. Capacity per
(group, expert):

    C = min(ceil(capacity_factor · k · T / E), T)        (an expert takes each token at most once)

Admission order (GShard): first every token's top-1 choice in token order (sample-major, then position), then every
top-2 choice in token order; an expert takes assignments until it holds C, the rest are dropped for that expert.
So slot pos(t, e_j) = (# earlier assignments to e_j in that order) and (t, e_j) is admitted iff pos < C. (GShard's
random second-expert dispatch is not used: top-2 is deterministic here.)

Dispatch / combine: admitted tokens are copied into a buffer of shape (G, E, C, d) at [g, e, pos] (empty slots are
zero and never read back), expert e maps buffer[:, e] → its outputs, and the combine gathers each admitted
assignment's output row times w_j and sums it into its token. `expert.py` puts an all-to-all on each side of the
expert computation and changes nothing else, so expert parallelism is this layer, exactly.

Aux loss (Switch eq. 4), per group, averaged over the G groups:

    aux = α · E · Σ_e f_e · P_e      f_e = (1/T) #{t : e_1(t) = e}     P_e = (1/T) Σ_t p_t[e]

f_e carries no gradient, P_e does (it is what pushes the router towards balance). The layer stores the aux loss of
its last forward (`last_aux`); a model's training loss is `task_loss + moe_aux_loss(model)` (the sum over its MoE
layers), while `lm_loss(model(x), y)` alone still evaluates the task. Per forward the layer also records
`last_stats` = {"routed": (E,) top-k assignments per expert before dropping, "dropped": (E,) of those dropped} and
accumulates them until `pop_stats()`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .models import MLP


class MoEConfigError(ValueError):
    """An MoE layer's settings (top_k, capacity factor, groups) do not fit its input; the message says what to do."""


def capacity(tokens_per_group: int, experts: int, top_k: int = 1, capacity_factor: float = 1.0) -> int:
    """GShard's expert capacity C = min(ceil(capacity_factor · k · T / E), T) (rounded to 1e-9 first, so 1.1·… =
    x.0000001 does not become x + 1): an expert can receive each of the group's T tokens at most once, so a larger
    C would only pad the dispatch buffer."""
    if capacity_factor <= 0 or tokens_per_group < 1 or experts < 1:
        raise MoEConfigError(f"capacity needs capacity_factor > 0, tokens and experts >= 1; got {capacity_factor}, "
                             f"{tokens_per_group}, {experts}")
    return min(tokens_per_group, max(1, math.ceil(round(capacity_factor * top_k * tokens_per_group / experts, 9))))


@dataclass
class Routing:
    """The routing of one forward over G groups of T tokens: every (token, choice j) assignment."""

    probs: torch.Tensor     # (G, T, E) router softmax
    experts: torch.Tensor   # (G, T, k) chosen experts, choice order
    weights: torch.Tensor   # (G, T, k) combine weights (differentiable)
    pos: torch.Tensor       # (G, T, k) slot in the expert's buffer (admission order)
    kept: torch.Tensor      # (G, T, k) admitted (pos < C)
    capacity: int
    aux: torch.Tensor       # scalar Switch aux loss (α included), mean over groups
    slot: torch.Tensor      # (A,) flat index g·E·C + e·C + pos of each admitted assignment
    token: torch.Tensor     # (A,) flat index g·T + t of its token
    gate: torch.Tensor      # (A,) its combine weight

    @property
    def routed(self) -> torch.Tensor:
        """(E,) assignments per expert before dropping."""
        return torch.bincount(self.experts.reshape(-1), minlength=self.probs.shape[-1])

    @property
    def dropped(self) -> torch.Tensor:
        """(E,) assignments over capacity, per expert."""
        return torch.bincount(self.experts[~self.kept], minlength=self.probs.shape[-1])


def route(xg: torch.Tensor, router_weight: torch.Tensor, top_k: int, capacity_factor: float,
          aux_weight: float) -> Routing:
    """Route the tokens xg (G, T, d) with router weight (E, d): top-k, GShard capacity and admission, aux loss."""
    G, T, _ = xg.shape
    E = router_weight.shape[0]
    if top_k not in (1, 2) or top_k > E:
        raise MoEConfigError(f"top_k must be 1 or 2 (and <= experts = {E}), got {top_k}")
    probs = F.linear(xg, router_weight).softmax(dim=-1)
    gate, experts = probs.topk(top_k, dim=-1)
    weights = gate / gate.sum(dim=-1, keepdim=True) if top_k == 2 else gate
    C = capacity(T, E, top_k, capacity_factor)
    onehot = F.one_hot(experts, E)                                  # (G, T, k, E)
    in_order = onehot.transpose(1, 2).reshape(G, top_k * T, E)      # all top-1 choices, then all top-2 choices
    pos = ((in_order.cumsum(dim=1) - 1) * in_order).sum(-1)         # (G, k·T): earlier assignments to that expert
    pos = pos.view(G, top_k, T).transpose(1, 2)                     # (G, T, k)
    kept = pos < C
    f = F.one_hot(experts[..., 0], E).to(probs.dtype).mean(dim=1)   # (G, E) fraction of top-1 choices, no grad
    aux = aux_weight * E * (f * probs.mean(dim=1)).sum(dim=-1).mean()
    g = torch.arange(G).view(G, 1, 1).expand_as(experts)
    t = torch.arange(T).view(1, T, 1).expand_as(experts)
    slot = ((g * E + experts) * C + pos)[kept]
    return Routing(probs, experts, weights, pos, kept, C, aux, slot, (g * T + t)[kept], weights[kept])


def dispatch(xg: torch.Tensor, r: Routing) -> torch.Tensor:
    """The (G, E, C, d) expert input buffer: admitted tokens at [g, e, pos], zeros elsewhere."""
    G, T, d = xg.shape
    E, C = r.probs.shape[-1], r.capacity
    buf = xg.new_zeros(G * E * C, d).index_copy(0, r.slot, xg.reshape(G * T, d).index_select(0, r.token))
    return buf.view(G, E, C, d)


def combine(out: torch.Tensor, r: Routing, tokens: int) -> torch.Tensor:
    """y (G·T, d): each admitted assignment's expert output row times its weight, summed into its token."""
    d = out.shape[-1]
    rows = out.reshape(-1, d).index_select(0, r.slot) * r.gate.unsqueeze(-1)
    return out.new_zeros(tokens, d).index_add(0, r.token, rows)


class MoEBase(nn.Module):
    """Route → dispatch → `run_experts` → combine, with stats and the stored aux loss; subclasses own the experts

    Attributes a subclass sets: router (nn.Linear d → E, no bias), num_experts, top_k, capacity_factor, groups (per
    forward of this module), group_samples (None, or samples per group: overrides groups), aux_weight."""

    router: nn.Linear

    def _init_state(self) -> None:
        self.last_aux: torch.Tensor | None = None
        self.last_stats: dict[str, torch.Tensor] | None = None
        self.last_routing: Routing | None = None
        self._acc = {"routed": torch.zeros(self.num_experts, dtype=torch.long),
                     "dropped": torch.zeros(self.num_experts, dtype=torch.long)}

    def run_experts(self, buf: torch.Tensor) -> torch.Tensor:
        """(G, E, C, d) expert inputs → (G, E, C, d) expert outputs."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, d = x.shape[0], x.shape[-1]
        n = self.group_samples
        if n is not None and B % n:
            raise MoEConfigError(f"a batch of {B} samples cannot be cut into token groups of {n} samples; "
                                 f"choose a batch size divisible by group_samples")
        if n is None and B % self.groups:
            raise MoEConfigError(f"a batch of {B} samples cannot be cut into {self.groups} equal token groups; "
                                 f"choose a batch size divisible by groups")
        xg = x.reshape(B // n if n is not None else self.groups, -1, d)
        r = route(xg, self.router.weight, self.top_k, self.capacity_factor, self.aux_weight)
        self.last_aux, self.last_routing = r.aux, r
        self.last_stats = {"routed": r.routed, "dropped": r.dropped}
        if torch.is_grad_enabled():         # training forwards only: an evaluation (no_grad) is not counted
            for k, v in self.last_stats.items():
                self._acc[k] += v
        y = combine(self.run_experts(dispatch(xg, r)), r, xg.shape[0] * xg.shape[1])
        return y.view_as(x)

    def pop_stats(self) -> dict[str, torch.Tensor]:
        """Assignments routed / dropped per expert accumulated since the last call (then reset)."""
        out = {k: v.clone() for k, v in self._acc.items()}
        for v in self._acc.values():
            v.zero_()
        return out


class MoE(MoEBase):
    """The single-process MoE feed-forward: router d → E and E expert MLPs d → hidden → d (default 4d)."""

    def __init__(self, d: int, experts: int, top_k: int = 1, capacity_factor: float = 1.25, groups: int = 1,
                 aux_weight: float = 0.01, hidden: int | None = None, group_samples: int | None = None) -> None:
        super().__init__()
        if top_k not in (1, 2) or top_k > experts:
            raise MoEConfigError(f"top_k must be 1 or 2 (and <= experts = {experts}), got {top_k}")
        if capacity_factor <= 0 or groups < 1 or (group_samples is not None and group_samples < 1):
            raise MoEConfigError(f"capacity_factor must be > 0, groups and group_samples >= 1; got {capacity_factor},"
                                 f" {groups}, {group_samples}")
        self.num_experts, self.top_k, self.capacity_factor = experts, top_k, capacity_factor
        self.groups, self.group_samples, self.aux_weight = groups, group_samples, aux_weight
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList([MLP(d, hidden) for _ in range(experts)])
        self._init_state()

    def run_experts(self, buf: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.experts[e](buf[:, e]) for e in range(self.num_experts)], dim=1)


def moe_layers(model: nn.Module) -> list[tuple[str, MoEBase]]:
    """The model's MoE layers (name, module), in module order; names are the single-process model's (a checkpoint
    wrapper's ".module" component left out)."""
    return [(n.replace(".module.", "."), m) for n, m in model.named_modules() if isinstance(m, MoEBase)]


def moe_aux_loss(model: nn.Module) -> torch.Tensor:
    """Σ over the model's MoE layers of the aux loss of their last forward (0 if none): add it to the task loss."""
    auxes = [m.last_aux for _, m in moe_layers(model) if m.last_aux is not None]
    return torch.stack(auxes).sum() if auxes else torch.zeros(())
