"""Gradient compression with error feedback: send less per step instead of less often (`train.compress`).

Each worker i holds a residual e_i (zero at the start). At every step it compresses M_i = g_i + e_i, sends the
compressed form, keeps what was not sent, e_i ← M_i − C(M_i), and every worker decodes everyone's C(M_j) and
averages them into the gradient the optimizer steps with:

    ĝ = (1/D) Σ_j C(M_j)            so   Σ_t C(M_i,t) + e_i,T = Σ_t g_i,t       (nothing is lost, only delayed)

the invariant of error feedback (Seide et al. 2014, Stich et al. 2018, Karimireddy et al. 2019): a biased
compressor without it (`train.error_feedback = false`) drops the same coordinates again and again. Compressors:

    topk:ρ       the k = ⌈ρ·n⌉ largest |M| of the flat gradient (Lin et al. 2018, DGC without its momentum
                 correction): k int32 indices + k float32 values, all-gathered    (D−1) · 8k B per rank
    sign         EF-signSGD (Karimireddy et al. 2019): C(M) = (‖M‖₁/n)·sign(M) per tensor: one bit per
                 coordinate, packed, + a float32 scale per tensor, all-gathered  (D−1) · Σ_t (⌈n_t/8⌉ + 4) B
    powersgd:r   PowerSGD (Vogels et al. 2019), rank r, per tensor reshaped to (rows, cols) = (shape[0], −1):
                 P = M Q, all-reduce P (mean), orthonormalise P, Q = Mᵀ P, all-reduce Q (mean), Ĉ = P Qᵀ
                 (Q warm-started from the last step; the first from a seed every worker shares). A tensor that
                 would not shrink (r·(rows + cols) ≥ rows·cols, biases) is all-reduced whole, as torch's
                 powerSGD_hook does. Its residual is e_i = M_i − Ĉ (the local gradient minus the shared
                 approximation)                     Σ_t AR(r·(rows_t + cols_t)·4 B) + AR(uncompressed)

Exactness (tests/parallelism/test_compress.py): topk:1.0 sends every coordinate and equals the all-reduce to
float rounding; powersgd at full rank r = min(rows, cols) spans M̄'s columns, so P Pᵀ M̄ = M̄ (rel 1e-6);
the error-feedback invariant holds exactly in float64.
"""

from __future__ import annotations

import math
import re
from typing import Generator, Sequence

import torch

from .comm import Comm
from .engine import EngineError

Request = tuple[str, torch.Tensor]              # ("all_reduce" | "all_gather", tensor): one collective
Steps = Generator[Request, torch.Tensor, list[torch.Tensor]]
_FORM = re.compile(r"^(none|sign|topk:(?P<rho>[0-9.eE+-]+)|powersgd:(?P<rank>\d+))$")


def check_compress(text: str) -> str:
    """The compressor string, validated: none | topk:ρ (0 < ρ ≤ 1) | sign | powersgd:r (r ≥ 1). ValueError with
    one line otherwise."""
    m = _FORM.match(str(text).strip().lower())
    if m is None:
        raise ValueError(f"compress must be none, topk:<fraction>, sign or powersgd:<rank>, got {text!r}")
    if m["rho"] is not None:
        try:
            rho = float(m["rho"])
        except ValueError:
            rho = -1.0
        if not 0 < rho <= 1:
            raise ValueError(f"compress topk:<fraction> keeps that fraction of the coordinates, in (0, 1]; got {text!r}")
    if m["rank"] is not None and int(m["rank"]) < 1:
        raise ValueError(f"compress powersgd:<rank> needs a rank >= 1, got {text!r}")
    return str(text).strip().lower()


class Compressor:
    """ĝ = mean over dp of each worker's compressed g + e (module docstring); `error_feedback` keeps e."""

    def __init__(self, error_feedback: bool = True) -> None:
        self.error_feedback = error_feedback
        self.residual: list[torch.Tensor] | None = None

    def mean(self, dp: Comm, grads: list[torch.Tensor], site: str = "grads") -> list[torch.Tensor]:
        """The compressed mean of `grads` (this worker's) over dp; updates the residual."""
        run = self.steps(grads, dp.size)
        request = next(run)
        while True:
            kind, t = request
            if kind == "all_reduce":
                dp.all_reduce(t, "sum", site=site)
                got = t
            else:
                got = torch.empty(dp.size * t.numel(), dtype=t.dtype)
                dp.all_gather(got, t, site=site)
            try:
                request = run.send(got)
            except StopIteration as done:
                return done.value

    def state(self) -> dict[str, torch.Tensor]:
        """This worker's own state for a checkpoint: the residual ("residual/<i>", per gradient) and what the
        compressor warm-starts from (PowerSGD: "q/<i>"); empty before the first step."""
        return {f"residual/{i}": e for i, e in enumerate(self.residual or [])} if self.error_feedback else {}

    def load_state(self, state: dict[str, torch.Tensor], like: list[torch.Tensor]) -> None:
        """Put a `state()` back for gradients shaped like `like` (EngineError, one line, if it does not fit)."""
        res = {k: v for k, v in state.items() if k.startswith("residual/")}
        if not res:
            self.residual = None
            return
        if sorted(res) != sorted(f"residual/{i}" for i in range(len(like))):
            raise EngineError(f"the checkpoint holds {len(res)} residuals for {len(like)} gradients: written by "
                              "another model")
        out = []
        for i, t in enumerate(like):
            e = res[f"residual/{i}"]
            if tuple(e.shape) != tuple(t.shape) or e.dtype != t.dtype:
                raise EngineError(f"residual {i} is {tuple(e.shape)} {e.dtype} in the checkpoint, the gradient "
                                  f"{tuple(t.shape)} {t.dtype}: written by another model")
            out.append(e.clone())
        self.residual = out

    def steps(self, grads: list[torch.Tensor], size: int) -> Steps:
        """The compressed mean as a generator over a group of `size` (sans-IO): it yields each collective it needs,
        ("all_reduce", t) for the sum of t over the group or ("all_gather", t) for the members' t concatenated in
        rank order, is sent the result, and returns the mean; it updates the residual. `mean` drives it over a real
        group; `lockstep` drives D of them in one thread (the simulator)."""
        if self.residual is None:
            self.residual = [torch.zeros_like(g) for g in grads]
        m = [g + e for g, e in zip(grads, self.residual)] if self.error_feedback else [g.clone() for g in grads]
        out, kept = yield from self._mean(m, size)
        if self.error_feedback:
            self.residual = [a - b for a, b in zip(m, kept)]
        return out

    def _mean(self, m: list[torch.Tensor], size: int) -> Generator[Request, torch.Tensor,
                                                                   tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """(the mean over the group, what of this worker's m counts as sent: m minus its new residual)."""
        raise NotImplementedError


def _flat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _unflat(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, off = [], 0
    for t in like:
        out.append(flat[off:off + t.numel()].view_as(t).clone())
        off += t.numel()
    return out


class TopK(Compressor):
    """The k = ⌈ρ·n⌉ largest-magnitude coordinates of the flat gradient: (indices, values) all-gathered."""

    def __init__(self, rho: float, error_feedback: bool = True) -> None:
        super().__init__(error_feedback)
        self.rho = rho

    def k(self, n: int) -> int:
        return max(1, min(n, math.ceil(self.rho * n)))

    def _mean(self, m: list[torch.Tensor], size: int) -> Generator[Request, torch.Tensor,
                                                                   tuple[list[torch.Tensor], list[torch.Tensor]]]:
        flat = _flat(m)
        n, dt = flat.numel(), flat.dtype
        k = self.k(n)
        idx = torch.topk(flat.abs(), k, sorted=False).indices if k < n else torch.arange(n)
        sent = torch.zeros_like(flat)
        sent[idx] = flat[idx]
        bits = flat[idx].contiguous().view(torch.int32)   # one message: the values' bits, then the indices
        w = bits.numel()                                  # (k float32 values: k words; float64: 2k)
        buf = torch.cat([bits, idx.to(torch.int32)])
        everyone = yield ("all_gather", buf)
        total = torch.zeros(n, dtype=dt)
        for part in everyone.view(size, -1):
            total.index_add_(0, part[w:].to(torch.int64), part[:w].view(dt))
        total.mul_(1.0 / size)
        return _unflat(total, m), _unflat(sent, m)


class Sign(Compressor):
    """EF-signSGD: per tensor, the mean |M| as its scale and one bit per coordinate, all-gathered."""

    def _mean(self, m: list[torch.Tensor], size: int) -> Generator[Request, torch.Tensor,
                                                                   tuple[list[torch.Tensor], list[torch.Tensor]]]:
        sizes = [t.numel() for t in m]
        packed = [math.ceil(n / 8) for n in sizes]
        per = sum(packed) + 4 * len(m)
        buf = torch.empty(per, dtype=torch.uint8)
        sent, off = [], 0
        for t, n, nb in zip(m, sizes, packed):
            scale = t.abs().sum() / max(n, 1)
            bits = (t.reshape(-1) >= 0).to(torch.uint8)
            bits = torch.nn.functional.pad(bits, (0, nb * 8 - n)).view(-1, 8)
            buf[off:off + nb] = (bits << torch.arange(8, dtype=torch.uint8)).sum(1).to(torch.uint8)
            off += nb
            buf[off:off + 4] = torch.tensor([float(scale)], dtype=torch.float32).view(torch.uint8)
            off += 4
            sent.append(_decode_sign(buf[off - 4 - nb:off], n, t))
        everyone = yield ("all_gather", buf)
        out = [torch.zeros_like(t) for t in m]
        for j in range(size):
            off = j * per
            for i, (t, n, nb) in enumerate(zip(m, sizes, packed)):
                out[i] += _decode_sign(everyone[off:off + nb + 4], n, t)
                off += nb + 4
        return [o / size for o in out], sent


def _decode_sign(chunk: torch.Tensor, n: int, like: torch.Tensor) -> torch.Tensor:
    """scale·(±1) of one tensor's packed bits (nb bytes) and float32 scale (4 bytes)."""
    nb = chunk.numel() - 4
    bits = (chunk[:nb, None] >> torch.arange(8, dtype=torch.uint8)) & 1
    signs = bits.reshape(-1)[:n].to(like.dtype) * 2 - 1
    scale = chunk[nb:].clone().view(torch.float32).to(like.dtype)
    return (signs * scale).view_as(like)


class PowerSGD(Compressor):
    """Rank-r PowerSGD per tensor (module docstring): two all-reduces of the factors, Q warm-started."""

    def __init__(self, rank: int, error_feedback: bool = True, seed: int = 0) -> None:
        super().__init__(error_feedback)
        self.rank, self.seed = rank, seed
        self.qs: dict[int, torch.Tensor] = {}

    def state(self) -> dict[str, torch.Tensor]:
        """The residual and, shared by every worker but needed to continue bitwise, the warm-start Qs."""
        return {**super().state(), **{f"q/{i}": q for i, q in self.qs.items()}}

    def load_state(self, state: dict[str, torch.Tensor], like: list[torch.Tensor]) -> None:
        super().load_state(state, like)
        qs = {}
        for k, q in state.items():
            if k.startswith("q/"):
                i = int(k[2:]) if k[2:].isdigit() else -1
                if not 0 <= i < len(like) or q.dim() != 2 or q.shape[0] != like[i].numel() // like[i].shape[0]:
                    raise EngineError(f"PowerSGD factor {k} of shape {tuple(q.shape)} does not fit this model")
                qs[i] = q.clone()
        self.qs = qs

    def compressible(self, t: torch.Tensor) -> bool:
        rows, cols = (t.shape[0], t.numel() // t.shape[0]) if t.dim() >= 2 else (1, t.numel())
        r = min(self.rank, rows, cols)
        return t.dim() >= 2 and r * (rows + cols) < rows * cols

    def _mean(self, m: list[torch.Tensor], size: int) -> Generator[Request, torch.Tensor,
                                                                   tuple[list[torch.Tensor], list[torch.Tensor]]]:
        D = size
        low = [i for i, t in enumerate(m) if self.compressible(t)]
        whole = [i for i in range(len(m)) if i not in low]
        out: list[torch.Tensor] = list(m)                  # every entry replaced below
        if whole:                                           # uncompressed: one flat all-reduce, kept exactly
            flat = _flat([m[i] for i in whole])
            flat = yield ("all_reduce", flat)
            for i, t in zip(whole, _unflat(flat / D, [m[i] for i in whole])):
                out[i] = t
        mats = {i: m[i].reshape(m[i].shape[0], -1) for i in low}
        if low:
            for i in low:
                if i not in self.qs:
                    g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)    # the same Q on every worker
                    rows, cols = mats[i].shape
                    self.qs[i] = torch.randn(cols, min(self.rank, rows, cols), generator=g, dtype=m[i].dtype)
            ps = [mats[i] @ self.qs[i] for i in low]
            flat = _flat(ps)
            flat = yield ("all_reduce", flat)
            ps = [orthonormal(p) for p in _unflat(flat / D, ps)]
            qs = [mats[i].T @ p for i, p in zip(low, ps)]
            flat = _flat(qs)
            flat = yield ("all_reduce", flat)
            qs = _unflat(flat / D, qs)
            for i, p, q in zip(low, ps, qs):
                self.qs[i] = q                               # warm start: next step's Q
                out[i] = (p @ q.T).view_as(m[i])
        kept = [m[k] if k in whole else out[k] for k in range(len(m))]   # a whole tensor leaves no residual
        return out, kept


def orthonormal(p: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of p's columns (Gram–Schmidt by QR): every worker holds the same all-reduced p, so
    the same basis."""
    return torch.linalg.qr(p).Q


def make_compressor(text: str, error_feedback: bool = True, seed: int = 0) -> Compressor | None:
    """The compressor a `train.compress` string names (None for "none")."""
    text = check_compress(text)
    if text == "none":
        return None
    kind, _, arg = text.partition(":")
    if kind == "topk":
        return TopK(float(arg), error_feedback)
    if kind == "sign":
        return Sign(error_feedback)
    if kind == "powersgd":
        return PowerSGD(int(arg), error_feedback, seed)
    raise EngineError(f"unknown compressor {text!r}")      # (check_compress admits no other)


def lockstep(runs: Sequence[Steps], latency: float = 0.0, bandwidth: float = math.inf
             ) -> tuple[list[list[torch.Tensor]], int, float]:
    """Drive the `Compressor.steps` generators of D workers together, in one thread (the simulator's dp group):
    each collective combines the D requests in rank order — all_reduce: their sum; all_gather: their
    concatenation — and costs a rank the textbook ring on a link of `latency` s and `bandwidth` B/s:

        all_reduce of S bytes    2 (D − 1)/D · S bytes     2 (D − 1) · (latency + S/D / bandwidth) s
        all_gather of s bytes    (D − 1) · s bytes         (D − 1) · (latency + s / bandwidth) s

    Returns (each worker's mean, bytes per rank, seconds). The results are shared, read-only, among the workers."""
    D = len(runs)
    requests = [next(r) for r in runs]
    sent, seconds = 0, 0.0
    while True:
        kinds = {k for k, _ in requests}
        if len(kinds) != 1:
            raise EngineError(f"the workers' compressors disagree on the collective: {sorted(kinds)}")
        kind, ts = kinds.pop(), [t for _, t in requests]
        size = ts[0].numel() * ts[0].element_size()
        if kind == "all_reduce":
            got = ts[0].clone()
            for t in ts[1:]:
                got += t
            if D > 1:
                sent += int(round(2 * (D - 1) / D * size))
                seconds += 2 * (D - 1) * (latency + size / D / bandwidth)
        else:
            got = torch.cat([t.reshape(-1) for t in ts])
            if D > 1:
                sent += (D - 1) * size
                seconds += (D - 1) * (latency + size / bandwidth)
        outs, nxt = [], []
        for r in runs:
            try:
                nxt.append(r.send(got))
            except StopIteration as done:
                outs.append(done.value)
        if outs:
            if len(outs) != D:
                raise EngineError("the workers' compressors ended after different collectives")
            return outs, sent, seconds
        requests = nxt
