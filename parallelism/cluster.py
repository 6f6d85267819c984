"""A cluster as the planner sees it: nodes of GPUs, their memory and compute, and two classes of link.

    Cluster(name, gpus_per_node, nodes, gpu_memory_bytes, peak_flops, efficiency,
            intra_bandwidth_Bps, intra_latency_s, inter_bandwidth_Bps, inter_latency_s, step_overhead_s)

Compute: a GPU runs the model's matmuls at `efficiency · peak_flops` (dense, at the training precision; the
efficiency is what `pslab plan --calibrate` measures here, and a stated assumption for the presets). Overlap:
gradient communication (dp, ZeRO) can hide behind `overlap_fraction` of the compute — backward's 2/3 where a copy
engine runs it beside the kernels; here, where ranks share the CPU cores, calibration measures it (often 0).
Fixed costs (calibrated; 0 in the presets): `step_overhead_s` per step (the loop, the optimizer),
`micro_batch_overhead_s` per micro-batch's pass through the model (Python, launches: a pipeline pays it m times),
`message_cpu_s` per message (its software, send and receive). Shared cores: a calibrated cluster says how many CPU
cores its ranks share (`shared_cores`; its rate and fixed costs are then one core's), and the step model replays
the step with the ranks taking turns on them (step_replay.py).

Links (the article's point: an order of magnitude between them): a collective inside a node runs over the intra
link (NVLink / NVSwitch), one whose group spans nodes is limited by the inter link (InfiniBand / Ethernet: one NIC
per GPU on the presets' nodes). Each link is α-β: a message of B bytes takes latency + B / bandwidth, with the
bandwidth *per GPU, per direction* — the figure a ring all-reduce's 2(N−1)/N·S / bandwidth uses.

    preset            GPUs/node  memory  peak (dense bf16)  intra (per GPU, one way)   inter (per GPU, one way)
    dgx-a100-80gb     8          80 GB   312 TFLOP/s        NVLink 3: 300 GB/s, 3 µs   HDR IB 200 Gb/s: 25 GB/s, 5 µs
    dgx-h100          8          80 GB   989 TFLOP/s        NVLink 4: 450 GB/s, 3 µs   NDR IB 400 Gb/s: 50 GB/s, 5 µs
    hgx-h200          8          141 GB  989 TFLOP/s        NVLink 4: 450 GB/s, 3 µs   NDR IB 400 Gb/s: 50 GB/s, 5 µs

(NVIDIA's data sheets: A100 SXM4 312 TFLOP/s bf16 dense, NVLink 3 600 GB/s bidirectional; H100/H200 SXM5 989
TFLOP/s bf16 dense, NVLink 4 900 GB/s bidirectional — the article's "~900 GB/s"; DGX A100 has 8 HDR and DGX H100 8
NDR compute NICs, one per GPU.) The presets' efficiency 0.5 is an assumption until calibrated; `nodes` is a default
that `pslab plan --nodes` overrides.

Files: `Cluster.to_json()` / `Cluster.from_json(text)` (plain JSON, validated field by field; a calibration file is
one of these).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from pslab.collectives import jsonfields

LINKS = ("intra", "inter")


class ClusterError(ValueError):
    """A cluster description that cannot be used (one line: which field, what it must be)."""


@dataclass(frozen=True)
class Cluster:
    """Nodes x GPUs; per-GPU memory (bytes), peak FLOP/s and achieved fraction; per-GPU link speeds (bytes/s, s)."""

    name: str
    gpus_per_node: int
    nodes: int
    gpu_memory_bytes: float
    peak_flops: float
    efficiency: float = 0.5
    intra_bandwidth_Bps: float = math.inf
    intra_latency_s: float = 0.0
    inter_bandwidth_Bps: float = math.inf
    inter_latency_s: float = 0.0
    step_overhead_s: float = 0.0     # a fixed cost per step (framework, optimizer): calibrated; 0 in the presets
    overlap_fraction: float = 2 / 3  # share of compute that overlappable (dp/ZeRO) communication hides behind:
    #                                  backward's 2/3 on a GPU with a free copy engine; calibrated here
    micro_batch_overhead_s: float = 0.0  # fixed seconds of one micro-batch's forward + backward through the whole
    #                                  model beyond its FLOPs (Python, kernel launches): calibrated; 0 in the presets
    message_cpu_s: float = 0.0       # the software share of a message's latency (send + receive): under shared
    #                                  cores it takes turns like compute; calibrated; 0 in the presets
    shared_cores: int = 0            # CPU cores all the ranks share (an emulated cluster on one machine: the step
    #                                  is replayed, step_replay.py); 0: every rank has its own device

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ClusterError(f"cluster name must be a non-empty string, got {self.name!r}")
        for k in ("gpus_per_node", "nodes"):
            v = getattr(self, k)
            if type(v) is not int or v < 1:
                raise ClusterError(f"cluster {k} must be an integer >= 1, got {v!r}")
        for k in ("gpu_memory_bytes", "peak_flops", "intra_bandwidth_Bps", "inter_bandwidth_Bps"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v <= 0:
                raise ClusterError(f"cluster {k} must be a number > 0, got {v!r}")
        for k in ("intra_latency_s", "inter_latency_s", "step_overhead_s", "micro_batch_overhead_s",
                  "message_cpu_s"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ClusterError(f"cluster {k} must be a finite number >= 0, got {v!r}")
        c = self.shared_cores
        if type(c) is not int or c < 0:
            raise ClusterError(f"cluster shared_cores must be an integer >= 0 (0: a device per rank), got {c!r}")
        f = self.overlap_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not (0 <= f <= 1):
            raise ClusterError(f"cluster overlap_fraction must be in [0, 1], got {f!r}")
        e = self.efficiency
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not (0 < e <= 1):
            raise ClusterError(f"cluster efficiency must be in (0, 1], got {e!r}")

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def flops(self) -> float:
        """Achieved FLOP/s per GPU: efficiency · peak."""
        return self.efficiency * self.peak_flops

    def link(self, kind: str) -> tuple[float, float]:
        """(latency s, bandwidth bytes/s) of a link class, "intra" or "inter"."""
        if kind not in LINKS:
            raise ClusterError(f"link must be one of {', '.join(LINKS)}, got {kind!r}")
        return getattr(self, f"{kind}_latency_s"), getattr(self, f"{kind}_bandwidth_Bps")

    def with_(self, **changes: Any) -> "Cluster":
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def to_json(self) -> str:
        return jsonfields.dumps(self, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Cluster":
        d = jsonfields.loads(cls, text, "cluster", ClusterError)
        try:
            return cls(**d)
        except TypeError as e:
            raise ClusterError(f"cluster file: {e}") from None


GB = 1e9
PRESETS: dict[str, Cluster] = {
    "dgx-a100-80gb": Cluster("dgx-a100-80gb", 8, 1, 80 * GB, 312e12, 0.5, 300 * GB, 3e-6, 25 * GB, 5e-6),
    "dgx-h100": Cluster("dgx-h100", 8, 1, 80 * GB, 989e12, 0.5, 450 * GB, 3e-6, 50 * GB, 5e-6),
    "hgx-h200": Cluster("hgx-h200", 8, 1, 141 * GB, 989e12, 0.5, 450 * GB, 3e-6, 50 * GB, 5e-6),
}


def preset(name: str, nodes: int | None = None) -> Cluster:
    """A preset by name, optionally with another node count."""
    if name not in PRESETS:
        raise ClusterError(f"unknown cluster {name!r}; presets: {', '.join(PRESETS)} (or a JSON file from --calibrate)")
    c = PRESETS[name]
    return c if nodes is None else c.with_(nodes=nodes)
