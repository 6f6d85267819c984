"""Mixture-of-experts runs: how the router spread the tokens over the experts, and what the capacity dropped.

Each MoE layer routes every token to its top-k experts; expert e admits at most C = ceil(cf · k · S / E)
assignments per sequence (GShard's capacity, `parallelism.moe.capacity`), the rest are dropped (the token's
residual carries it). A balanced router gives each expert k·T/E of the T tokens; the Switch auxiliary loss
α · E · Σ_e f_e · P_e pushes towards that. Counts are over the training forwards of every rank (evaluations are not
counted), summed over ranks: `loop._moe_stats` reports each process's own tokens; a resumed run counts the steps it
ran itself (from its checkpoint's step on: "steps").

    summary["moe"] = {"capacity": C, "layers": {name: {"routed": [per expert], "dropped": [per expert]}},
                      "routed": total assignments, "dropped": total dropped, "drop_fraction",
                      "sequences": per layer, "steps": the steps counted (per worker)}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pslab.experiments.config import RunConfig
from pslab.experiments.workloads import Workload


def moe_summary(cfg: RunConfig, wl: Workload, results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The expert load of the run (sum over ranks), or None for a model without MoE layers."""
    layers: dict[str, dict[str, list[int]]] = {}
    for r in results:
        for name, st in (r.get("moe") or {}).items():
            acc = layers.setdefault(name, {k: [0] * len(v) for k, v in st.items()})
            for k, v in st.items():
                acc[k] = [a + int(b) for a, b in zip(acc[k], v)]
    if not layers:
        return None
    from pslab.parallelism.moe import capacity
    w = cfg.workload
    S = int(wl.batch(0, 0)[0].shape[-1])
    routed = sum(sum(st["routed"]) for st in layers.values())
    dropped = sum(sum(st["dropped"]) for st in layers.values())
    per_layer = sum(next(iter(layers.values()))["routed"])
    return {"capacity": capacity(S, w.experts, w.top_k, w.capacity_factor), "sequence": S, "experts": w.experts,
            "top_k": w.top_k, "capacity_factor": w.capacity_factor, "layers": layers, "routed": routed,
            "dropped": dropped, "drop_fraction": dropped / routed if routed else 0.0,
            "sequences": per_layer // (w.top_k * S),           # per layer: routed = sequences x top_k x S
            "steps": max(int(r.get("steps") or 0) for r in results)}


def plot_expert_load(runs: list[dict[str, Any]], out: Path) -> Path | None:
    """A row per run, a panel per MoE layer: assignments per expert, admitted (solid) and dropped (hatched), with
    the balanced load (k x tokens / experts) and the most an expert can admit (capacity x sequences); None if no run
    has MoE layers."""
    from pslab.experiments.results.plots import run_label, save_figure
    import matplotlib.pyplot as plt
    if not any(((r.get("summary") or {}).get("moe") or {}).get("layers") for r in runs):
        return None
    moe_runs = [r for r in runs if ((r.get("summary") or {}).get("moe") or {}).get("layers")]
    rows, cols = len(moe_runs), max(len(r["summary"]["moe"]["layers"]) for r in moe_runs)   # a row per run
    fig, axes = plt.subplots(rows, cols, figsize=(3.3 * cols, 2.7 * rows), squeeze=False)
    for i, r in enumerate(moe_runs):
        m = r["summary"]["moe"]
        for j in range(cols):
            ax = axes[i][j]
            if j >= len(m["layers"]):
                ax.axis("off")
                continue
            name, st = list(m["layers"].items())[j]
            E = len(st["routed"])
            admitted = [a - d for a, d in zip(st["routed"], st["dropped"])]
            xs = list(range(E))
            ax.bar(xs, admitted, color="tab:blue", label="admitted")
            ax.bar(xs, st["dropped"], bottom=admitted, color="white", edgecolor="tab:red", hatch="///",
                   label="dropped (over capacity)")
            ax.axhline(sum(st["routed"]) / E, color="grey", ls="--", lw=1, label="balanced: k x tokens / experts")
            if m.get("sequences"):
                ax.axhline(m["capacity"] * m["sequences"], color="tab:red", ls=":", lw=1,
                           label="capacity x sequences")
            ax.set_xticks(xs)
            ax.set_xlabel("expert", fontsize=7)
            ax.set_ylabel("token assignments", fontsize=7)
            steps = f", {m['steps']} steps" if m.get("steps") else ""
            ax.set_title(f"{run_label(r)}\nlayer {name}: capacity {m['capacity']} per sequence{steps}", fontsize=7)
            ax.tick_params(labelsize=6)
            top = max(st["routed"] + [m["capacity"] * m.get("sequences", 0), 1])
            ax.set_ylim(0, 1.35 * top)       # room for the legend above the bars
            ax.legend(fontsize=5.5, loc="upper center", ncol=2, frameon=False)
    return save_figure(fig, Path(out) / "expert_load.png", "Expert load: tokens routed per expert, dropped above "
                       "capacity", 9)
