"""Peak activation memory per rank: what `parallelism.checkpointing.ActivationMeter` measured in the run's first
steps (the high-water mark of tensors autograd saved for backward, parameters excluded), next to the formula.

Formulas (fp32, the tiny transformer with `lm_loss`, PyTorch's fused CPU attention, no dropout; per tp rank), from
`parallelism.sequence.model_activation_bytes` — Korthikanti et al. 2022's per-layer terms for our model:

    data parallel / local   t = 1:   L · sbh(16 + 48) + 16sb + 4asb, plus the embedding and the head
    tensor parallel         sbh(16 + 48/t) + 16sb + 4asb/t per layer: LayerNorm regions stay full size
    + sequence parallel     sbh(8 + 56/t) + 16sb/t + 4asb/t per layer: LayerNorm regions on S/t tokens
    context parallel        every saved activation on S/C tokens (ring attention keeps q, k, v, out and the
                            log-sum-exp of the rank's chunks): (M₁ − 4)/C + 4, M₁ the one-process figure, 4 B the loss
                            (tp × cp: M_t, the tensor-parallel rank's figure, in place of M₁)

Other engines (pipeline, ZeRO, experts) are measured only: their figure depends on the schedule or the routing.
"""

from __future__ import annotations

from typing import Any

from pslab.experiments.config import RunConfig
from pslab.experiments.workloads import Workload


def modelled(cfg: RunConfig, wl: Workload) -> tuple[int | None, str]:
    """(bytes per rank, formula) for layouts with a closed form here, else (None, why)."""
    from pslab.parallelism.models import Attention
    p = cfg.parallel
    if wl.task != "lm" or p.pp > 1 or p.zero or p.ep > 1 or p.activation_checkpointing or wl.name != "text-transformer":
        return None, "measured only (no closed form for this layout here)"
    model = wl.make_model()
    att = [m for m in model.modules() if isinstance(m, Attention)]
    x, _, _ = wl.batch(0, 0)
    b, s = x.shape
    d, heads, L, V = att[0].d, att[0].heads, len(att), wl.data.num_classes
    from pslab.parallelism.sequence import model_activation_bytes
    if p.cp > 1:                 # under tp × cp: the tp rank's figure (with sp: on S/T), on S/C tokens
        one = model_activation_bytes(b, s, d, heads, L, V, t=p.tp, sp=p.sp)
        m = "M_t" if p.tp > 1 else "M₁"
        who = f"one tp rank, t={p.tp}" + (" + sp" if p.sp else "") if p.tp > 1 else "one process"
        return (one - 4) // p.cp + 4, f"({m} − 4)/C + 4, {m} = {one} B ({who}, b={b}, S={s}, d={d}, L={L})"
    t = p.tp
    what = "tp + sp" if p.sp else "tp" if t > 1 else "one process"
    return (model_activation_bytes(b, s, d, heads, L, V, t=t, sp=p.sp),
            f"Korthikanti et al. per layer ({what}, t={t}), b={b}, S={s}, d={d}, a={heads}, L={L}, fp32")


def activation_memory(cfg: RunConfig, wl: Workload, results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """{"measured_peak_bytes" (max over ranks), "per_rank", "model_bytes", "formula"}; None if nothing was metered."""
    per_rank = [int(r.get("peak_activation_bytes") or 0) for r in results]
    if not any(per_rank):
        return None
    model, formula = modelled(cfg, wl)
    return {"measured_peak_bytes": max(per_rank), "per_rank": per_rank, "model_bytes": model, "formula": formula}
