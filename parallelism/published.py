"""Published runs against the planner: Narayanan et al. 2021's Table 1 (`PUBLISHED`), each row's own layout and the
planner's best, predicted on the A100 preset with one efficiency for all rows (`compare_published`,
`pslab plan --published`)."""

from __future__ import annotations

from dataclasses import dataclass

from .cluster import Cluster
from .memory_model import Shape
from .planner import describe, plan


@dataclass(frozen=True)
class Published:
    """One row of Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
    Megatron-LM", SC'21, arXiv:2104.04473), Table 1: GPT models on Selene (DGX A100 80 GB nodes, 8 GPUs each, 8
    HDR InfiniBand NICs per node), sequence 2048, vocabulary 51200, mixed precision; achieved TFLOP/s per GPU by
    their eq. (3), end to end (data loading, optimizer and logging included)."""

    name: str
    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float            # achieved teraFLOP/s per GPU (of 312 peak)

    def shape(self, micro_batch: int = 1) -> Shape:
        return Shape(self.layers, self.hidden, self.heads, 2048, 51200, micro_batch)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


PUBLISHED: dict[str, Published] = {r.name: r for r in (
    Published("gpt-1.7b", 1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    Published("gpt-3.6b", 3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    Published("gpt-7.5b", 7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    Published("gpt-18b", 18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    Published("gpt-39b", 39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    Published("gpt-76b", 76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    Published("gpt-145b", 145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    Published("gpt-310b", 310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    Published("gpt-530b", 529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    Published("gpt-1t", 1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)}
PAPER_CLUSTER = "dgx-a100-80gb"


def compare_published(row: Published, cluster: Cluster | None = None, *, progress: bool = False) -> dict:
    """The planner against one published run, all predicted on `cluster` (default the A100 preset with the run's
    nodes): the paper's layout (its tp, pp, dp; ZeRO 0, no SP, full recompute, 1F1B, as Megatron-LM ran then;
    micro-batch size the fastest of 1-8 that fits), the planner's best with those same knobs ("planner_megatron":
    free tp, pp, dp, b), and its best with every knob ("planner_best"). TFLOP/s per GPU = the prediction's own
    (eq. (3)'s FLOPs of its recompute mode / step / GPUs: for full recompute the paper's count)."""
    from .cluster import preset
    cluster = cluster or preset(PAPER_CLUSTER, nodes=max(1, -(-row.gpus // 8)))
    shape = row.shape()
    knobs = dict(zero=(0,), recompute=("full",), sp=False)          # Megatron-LM's in 2021
    own = plan(shape, cluster, row.batch, gpus=row.gpus, where=lambda lay: lay.tp == row.tp and lay.pp == row.pp,
               **knobs)
    megatron = plan(shape, cluster, row.batch, gpus=row.gpus, **knobs)
    best = plan(shape, cluster, row.batch, gpus=row.gpus, progress=progress)
    out = {"model": row.name, "params_b": row.params_b, "gpus": row.gpus, "batch": row.batch,
           "paper": {"tp": row.tp, "pp": row.pp, "dp": row.dp, "tflops_per_gpu": row.tflops},
           "efficiency": cluster.efficiency, "peak_tflops": cluster.peak_flops / 1e12,
           "paper_layout": None, "planner_best": None, "enumerated": best.enumerated, "feasible": len(best)}
    if own:
        p = own[0]
        out["paper_layout"] = {"layout": describe(p), "tflops_per_gpu": p.tflops_per_gpu,
                               "step_s": p.step_s, "memory_bytes": p.memory_bytes}
    for key, ranked in (("planner_megatron", megatron), ("planner_best", best)):
        if ranked:
            p = ranked[0]
            out[key] = {"layout": describe(p), "tp": p.layout.tp, "pp": p.layout.pp, "dp": p.layout.dp,
                        "tflops_per_gpu": p.tflops_per_gpu, "step_s": p.step_s, "memory_bytes": p.memory_bytes,
                        "tp_inside_node": p.layout.tp <= cluster.gpus_per_node}
        else:
            out[key] = None
    return out
