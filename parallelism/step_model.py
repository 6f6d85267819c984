"""Time of one training step of a layout on a cluster, modelled: compute, pipeline bubble, exposed communication.

FLOPs (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
§5.1, eq. (3)): a GPT of l layers, hidden h, sequence s, vocabulary V, on a global batch of B sequences. One layer's
forward is 24Bsh² (qkv 6Bsh², projection 2Bsh², MLP 16Bsh²) + 4Bs²h (scores QKᵀ and their product with V); the
logit layer's 2BshV; backward costs twice the forward. Hence

    no recompute         F = 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))
    full recompute       F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))      eq. (3): the layers' forward runs twice
    selective recompute  F = 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)) + 4·B·s²·h·l
                             (Korthikanti et al. 2022: only the attention scores' forward, 4Bs²h per layer, again)

`model_flops(shape, B, recompute)` is that F (eq. (3) is the "full" row; the others follow from the same count);
the tflops_per_gpu of a prediction is F / step_s / gpus, the figure Narayanan et al.'s Table 1 reports.

`predict(shape, layout, cluster, global_batch)` — B = D·m·b (b = shape.micro_batch; m = layout.micro_batches, or
B/(D·b) when not given):

    compute_s   the busiest pipeline stage's share: F_k / (D·T·C·E) / cluster.flops, where F_k counts the stage's
                layers (and, on the last stage, the logit layer) with the recompute rule above (algorithm "pslab":
                pslab's stage cut, and its head replicated over tp unless sp), + m · micro_batch_overhead_s · the
                stage's units / (L + 2): a micro-batch's fixed cost (Python, launches; 0 in the presets)
    stage_s     compute_s + tp_s + pp_s: the tp activations' and pp boundaries' seconds, communication on the
                critical path (comm_model.step_comm; not overlapped)
    bubble_s    (p − 1)/(v·m) · stage_s (GPipe and 1F1B alike: p − 1 idle micro-batch slots of stage_s/m each, so
                the bubble is (p − 1)/(m + p − 1) of the pipeline's time; Narayanan et al. §2.2; interleaved 1F1B
                with v chunks per stage: slots of stage_s/(v·m), (p − 1)/(v·m + p − 1); its v-fold boundary
                traffic is in pp_s)
    exposed_comm_s  tp_s + pp_s + cp/ep seconds (not hidden) + the overlappable dp/zero gradient terms' dp_s:
                max(0, dp_s − f·compute_s) with overlap, f = cluster.overlap_fraction (2/3 in the presets: they
                run during backward, ≈ 2/3 of the compute; a pipeline's last backward is shorter: optimistic
                there; calibrated here, where ranks share cores), dp_s without
    step_s      compute_s + bubble_s + exposed_comm_s + cluster.step_overhead_s
                = stage_s · (v·m + p − 1)/(v·m) + cp/ep + exposed dp + overhead
    shared cores  when cluster.shared_cores > 0 (an emulated cluster on one machine's CPU cores: `pslab plan
                --calibrate`), step_s is replayed instead (step_replay.py: every rank's actions, their messages
                and the ranks taking turns on the cores) and bubble_s is what the replay adds to compute, exposed
                communication and overhead — contention and pipeline waits (negative where ranks overlap waits)
    memory      memory_model.estimate(layout, precision, shape=, stage=k), the max over the stages k; fits when
                it is <= cluster.gpu_memory_bytes
    tokens_per_s  B · s / step_s
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .cluster import Cluster
from .comm_model import CommTerm, cut_elements, stage_blocks, stage_units, step_comm
from .memory_model import PRECISIONS, Layout, MemoryModelError, Shape, estimate

OVERLAP_FRACTION = 2 / 3       # backward's share of compute: the presets' Cluster.overlap_fraction
CRITICAL_KINDS = ("tp activations", "pp boundaries")


class StepModelError(MemoryModelError):
    """A batch or layout the step model cannot describe (the message says what to change)."""


def _layer_flops(shape: Shape, batch: float, recompute: str) -> tuple[float, float]:
    """(FLOPs of one layer, FLOPs of the logit layer) for `batch` sequences, forward + backward (+ recompute)."""
    B, s, h, V = batch, shape.seq, shape.hidden, shape.vocab
    mm, att = 24 * B * s * h * h, 4 * B * s * s * h
    layer = 3 * (mm + att)
    if recompute == "full":
        layer += mm + att
    elif recompute == "selective":
        layer += att
    return layer, 6 * B * s * h * V


def model_flops(shape: Shape, global_batch: int, recompute: str = "none") -> float:
    """FLOPs of one training step on `global_batch` sequences (Narayanan et al. 2021 eq. (3); module docstring)."""
    if recompute not in ("none", "selective", "full"):
        raise StepModelError(f"recompute must be none, selective or full, got {recompute!r}")
    layer, logits = _layer_flops(shape, global_batch, recompute)
    return shape.layers * layer + logits


@dataclass
class Prediction:
    layout: Layout
    global_batch: int
    compute_s: float
    bubble_s: float
    comm: list[CommTerm] = field(default_factory=list)
    exposed_comm_s: float = 0.0
    overhead_s: float = 0.0
    step_s: float = 0.0
    memory_bytes: float = 0.0         # the max over pipeline stages
    fits: bool = True
    model_flops: float = 0.0
    tflops_per_gpu: float = 0.0
    tokens_per_s: float = 0.0

    def as_dict(self) -> dict:
        return {"layout": self.layout.describe(), "dp": self.layout.dp, "tp": self.layout.tp, "pp": self.layout.pp,
                "cp": self.layout.cp, "ep": self.layout.ep, "zero": self.layout.zero, "sp": self.layout.sp,
                "recompute": self.layout.recompute, "micro_batches": self.layout.micro_batches,
                "schedule": self.layout.schedule, "virtual_stages": self.layout.virtual_stages,
                "global_batch": self.global_batch, "compute_s": self.compute_s,
                "bubble_s": self.bubble_s, "exposed_comm_s": self.exposed_comm_s, "overhead_s": self.overhead_s,
                "step_s": self.step_s, "memory_bytes": self.memory_bytes, "fits": self.fits,
                "model_flops": self.model_flops, "tflops_per_gpu": self.tflops_per_gpu,
                "tokens_per_s": self.tokens_per_s, "comm": [t.as_dict() for t in self.comm]}


def resolve_micro_batches(shape: Shape, layout: Layout, global_batch: int) -> Layout:
    """The layout with m set: B = D·m·b (StepModelError when B is not a multiple of D·b, or m disagrees)."""
    db = layout.dp * shape.micro_batch
    if global_batch < 1 or global_batch % db:
        raise StepModelError(f"global batch {global_batch} must be a positive multiple of dp x micro-batch = {db}")
    m = global_batch // db
    if layout.micro_batches is not None and layout.micro_batches != m:
        raise StepModelError(f"global batch {global_batch} = dp {layout.dp} x m x micro-batch {shape.micro_batch} "
                             f"needs m = {m}, but the layout has micro_batches = {layout.micro_batches}")
    return replace(layout, micro_batches=m)


def stage_compute_all(shape: Shape, layout: Layout, cluster: Cluster, global_batch: int,
                      algorithm: str = "ring") -> list[float]:
    """Seconds of compute of one rank of each pipeline stage per step: its layers' FLOPs (and the logit layer's on
    the last stage) / (D·T·C·E) / cluster.flops, plus m times the stage's share of the fixed cost of a micro-batch's
    pass (cluster.micro_batch_overhead_s · its units / the model's L + 2 units [Embed, Block × L, Head]).
    algorithm "pslab": stages as pipeline.split_stages cuts them, and the head replicated over tp (tensor.py splits
    only attention and MLP; with sp it runs on s/T)."""
    lay = layout
    layer, logits = _layer_flops(shape, global_batch, lay.recompute)
    per_rank = lay.dp * lay.tp * lay.cp * lay.ep
    if algorithm == "pslab" and not lay.sp:
        logits *= lay.tp
    m, P = lay.micro_batches or 1, lay.pp
    out = []
    for k in range(P):
        blocks = stage_blocks(shape, lay, k, algorithm)
        units = blocks + (k == 0) + (k == P - 1)
        if algorithm == "pslab":
            units = len(stage_units(shape, lay, k))
        fixed = m * cluster.micro_batch_overhead_s * units / (shape.layers + 2)
        out.append((blocks * layer + (logits if k == P - 1 else 0)) / per_rank / cluster.flops + fixed)
    return out


def stage_compute_s(shape: Shape, layout: Layout, cluster: Cluster, global_batch: int,
                    algorithm: str = "ring") -> float:
    """Seconds of compute of one rank of the busiest pipeline stage per step (`stage_compute_all`'s max)."""
    return max(stage_compute_all(shape, layout, cluster, global_batch, algorithm))


def replay_step_s(shape: Shape, lay: Layout, cluster: Cluster, global_batch: int, comm: list[CommTerm],
                  placement: str, algorithm: str, act_bytes: int, dp_exposed: float) -> float:
    """The step replayed on `cluster.shared_cores` cores (step_replay.py): per class of pipeline groups one
    program per stage (the schedule's actions: cpu, tp waits, boundary messages α + A/β on the link each cut
    crosses), then the exposed dp/ZeRO/cp/ep seconds and the per-step overhead; the last rank's end."""
    from .comm_cost import Placement
    from .step_replay import cpu, pipeline_programs, replay, wait
    pl = Placement(lay, cluster, placement)
    P, V, m = lay.pp, lay.virtual_stages, lay.micro_batches or 1
    comp = stage_compute_all(shape, lay, cluster, global_batch, algorithm)
    share = {k: min(1.0, cluster.message_cpu_s / lat) if lat > 0 else 0.0 for k, (lat, _) in pl.links.items()}

    def split(terms: list[CommTerm], scale: float = 1.0) -> tuple[float, float]:
        """(cpu, wait) seconds of `terms`: the software share of each link's latencies is CPU."""
        c = sum((t.seconds - t.wire_seconds) * scale * share[t.link] for t in terms)
        return c, sum(t.seconds for t in terms) * scale - c
    tp_s = split([t for t in comm if t.kind == "tp activations"])
    rest = split([t for t in comm if t.kind not in CRITICAL_KINDS and not t.overlappable])
    hide = [t for t in comm if t.overlappable]
    total_hide = sum(t.seconds for t in hide)
    dp = split(hide, dp_exposed / total_hide if total_hide > 0 else 0.0)
    tail = [cpu(rest[0] + dp[0]), wait(rest[1] + dp[1]), cpu(cluster.step_overhead_s)]
    cut_bytes = cut_elements(shape, lay) * act_bytes
    programs: list = []
    weights: list[float] = []
    for i, (grp, times) in enumerate(pl.group_classes("pp")):
        cuts = []
        for c in range(P * V - 1):
            lat, bw = pl.links[pl.link(grp[c % P], grp[(c + 1) % P])]
            cuts.append(lat + cut_bytes / bw)
        programs += pipeline_programs(P, m, V, lay.schedule if P > 1 else "gpipe", comp, [tp_s] * P, cuts,
                                      [tail] * P, tag=i)
        weights += [float(times)] * P
    return max(replay(programs, cluster.shared_cores, weights))


def predict(shape: Shape, layout: Layout, cluster: Cluster, global_batch: int, *, precision: str = "mixed",
            placement: str = "packed", algorithm: str = "ring", overlap: bool = True,
            steps: int | None = None) -> Prediction:
    """Step time, throughput and memory of `layout` (see the module docstring for every formula). overlap: dp
    gradient sync during backward (and, for algorithm "pslab", the data-parallel engine's buckets); steps: passed to
    `step_comm` (one-off bytes spread over that many steps)."""
    if precision not in PRECISIONS:
        raise StepModelError(f"unknown precision {precision!r}; choose one of: {', '.join(PRECISIONS)}")
    lay = resolve_micro_batches(shape, layout, global_batch)
    (_, g, _), act = PRECISIONS[precision]
    comm = step_comm(shape, lay, cluster, placement=placement, algorithm=algorithm, act_bytes=act, grad_bytes=g,
                     overlap=overlap, steps=steps)
    compute = stage_compute_s(shape, lay, cluster, global_batch, algorithm)
    critical = sum(t.seconds for t in comm if t.kind in CRITICAL_KINDS)
    hideable = sum(t.seconds for t in comm if t.overlappable)
    rest = sum(t.seconds for t in comm if t.kind not in CRITICAL_KINDS and not t.overlappable)
    dp_exposed = max(0.0, hideable - cluster.overlap_fraction * compute) if overlap else hideable
    m, p, v = lay.micro_batches or 1, lay.pp, lay.virtual_stages
    stage = compute + critical
    bubble = (p - 1) / (v * m) * stage
    exposed = critical + rest + dp_exposed
    step = compute + bubble + exposed + cluster.step_overhead_s
    if cluster.shared_cores:          # ranks taking turns on shared cores: replayed; the rest of it is "bubble"
        step = replay_step_s(shape, lay, cluster, global_batch, comm, placement, algorithm, act, dp_exposed)
        bubble = step - compute - exposed - cluster.step_overhead_s
    mem = max(estimate(lay, precision, shape=shape, stage=k).total for k in range(p))
    F = model_flops(shape, global_batch, lay.recompute)
    return Prediction(layout=lay, global_batch=global_batch, compute_s=compute, bubble_s=bubble, comm=comm,
                      exposed_comm_s=exposed, overhead_s=cluster.step_overhead_s, step_s=step, memory_bytes=mem,
                      fits=mem <= cluster.gpu_memory_bytes, model_flops=F,
                      tflops_per_gpu=F / step / lay.gpus() / 1e12, tokens_per_s=global_batch * shape.seq / step)
