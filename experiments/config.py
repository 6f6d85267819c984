"""Run configuration: dataclasses, read from TOML (`tomllib`), overridden by `--set section.key=value`.

    [workload]    name, batch_size, seed
    [train]       strategy, workers (the data-parallel degree), steps (per worker), shards, backend, optimizer, lr,
                  lr_rule, backup_abort, momentum, betas, staleness_lr, staleness_rule, dc_asgd, dc_lambda, dc_adaptive,
                  eval_every, base_step_s, timeout_s,
                  target_acc, compress, error_feedback
    [workload]    (text-*) seq_len; (text-moe only) experts, top_k, capacity_factor, aux_weight
    [parallel]    tp, sp, cp, ep, pp, micro_batches, schedule, virtual_stages, stage_ms, zero,
                  activation_checkpointing, overlap, bucket_kb  (ParallelConfig)
    [stragglers]  factors = {"1" = 4.0}, transient_prob, transient_factor, delay, delay_mean_s, delay_sigma
    [faults]      on_failure, detect_s, heartbeat_s, commit_every, checkpoint_every, shard_checkpoint_every, events
                  (experiments/faults/spec.py)
    [simulate]    enabled, compute_s, latency_intra_s, latency_inter_s, bandwidth_intra_Bps,
                  bandwidth_inter_Bps, workers_per_host, timing_only
    [topology]    hosts, gpus_per_host, placement, intra_latency_us, intra_bandwidth_GBps, inter_latency_us,
                  inter_bandwidth_GBps: real runs on emulated hosts (collectives/topology.py); hosts = 0: none
    [outer]       optimizer, lr, momentum: DiLoCo's outer step (diloco:<H>; parallelism/local_sgd.py)
    [logging]     tensorboard
    [trace]       enabled, max_events: a timeline of every rank and shard (collectives/trace.py; pslab trace)

Every value is validated here; a bad one raises ConfigError naming the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pslab.experiments.errors import ConfigError
from pslab.experiments.faults.spec import FaultsConfig
from pslab.experiments.strategies.spec import LR_RULES, Strategy, parse_strategy
from pslab.experiments.stragglers import StragglerConfig

OPTIMIZERS = ("sgd", "momentum", "adam")
STALENESS_RULES = ("gradient", "mean")   # ps.optim.STALENESS_RULES
BACKENDS = ("zmq", "torch")
SCHEDULES = ("gpipe", "1f1b")


@dataclass
class WorkloadConfig:
    name: str = "digits-mlp"
    batch_size: int = 32
    seed: int = 0
    seq_len: int = 0                 # language-model workloads (text-*): tokens per sample; 0: the workload's (32)
    # the mixture-of-experts workload (text-moe) only:
    experts: int = 4                 # experts per MoE layer (parallel.ep must divide it)
    top_k: int = 1                   # 1 | 2: experts each token is sent to
    capacity_factor: float = 1.25    # capacity per (sequence, expert) = min(ceil(capacity_factor·top_k·S/experts), S)
    aux_weight: float = 0.01         # the Switch load-balancing loss' weight alpha

    MOE_KEYS = ("experts", "top_k", "capacity_factor", "aux_weight")

    def overrides(self) -> dict[str, Any]:
        """What this section changes in the named workload (the MoE settings, the sequence length), for
        `get_workload(name, workers, batch_size, seed, **overrides)`."""
        out: dict[str, Any] = {k: getattr(self, k) for k in self.MOE_KEYS} if self.name == "text-moe" else {}
        if self.seq_len:
            out["context"] = self.seq_len
        return out


@dataclass
class TrainConfig:
    strategy: str = "ps-asp"
    workers: int = 4
    steps: int = 100          # clocks (updates) per worker
    shards: int = 1
    backend: str = "zmq"      # allreduce backend: zmq | torch
    optimizer: str = "sgd"
    lr: float = 0.1           # learning rate per gradient (see lr_rule)
    backup_abort: bool = False  # ps-bsp-backup: a straggler gives up a gradient whose clock is already committed
    lr_rule: str = "linear"   # linear | sqrt | none: a step averaging G gradients uses lr x G | lr x sqrt(G) | lr
                              # (G = workers for local/allreduce/ps-bsp/ps-ssp-agg, 1 for ps-asp/ps-ssp)
    momentum: float = 0.9
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    staleness_lr: bool = False  # staleness-aware lr (Zhang et al. 2016): each gradient's rate is lr / max(tau, 1)
    staleness_rule: str = "gradient"  # gradient | mean: per-gradient lr / max(tau_k, 1) (the paper's; Adam: the
                                      # step at their mean) | the earlier step lr / mean tau, kept for comparison
    dc_asgd: bool = False       # delay-compensated ASGD (Zheng et al. 2017) on the PS
    dc_lambda: float = 0.04     # its compensation strength
    dc_adaptive: bool = False
    eval_every: int = 20        # evaluate test accuracy every this many global updates
    base_step_s: float = 0.0    # real runs: pad each step's compute to at least this many seconds
    timeout_s: float = 300.0    # one request / one collective wait (failures are detected sooner: [faults] detect_s)
    run_limit_s: float = 0.0    # the whole run's wall-clock limit; 0: none (progress is watched, not the clock)
    target_acc: float | None = None  # simulator: stop once an evaluation reaches this test accuracy (0..1]; every
                                     # run: time_to_target_s / updates_to_target in the summary
    compress: str = "none"      # none | topk:<fraction> | sign | powersgd:<rank> (allreduce: parallelism/compress.py;
                                # ps-*: the push, topk or sign: ps/compression.py)
    error_feedback: bool = True # keep what a compressor did not send and add it to the next gradient


@dataclass
class ParallelConfig:
    """How each data-parallel worker's model is split (`parallelism` engines). A run starts
    train.workers x tp x pp x cp x ep processes: `train.workers` is the data-parallel degree D, each worker a group of
    tp x pp x cp x ep ranks. Engine choice: zero > 0 -> ZeRO; pp > 1 -> pipeline (with tp > 1: each stage split
    over tp, dp x tp x pp); cp > 1 -> context parallel; ep > 1 -> expert parallel; tp > 1 -> tensor parallel
    (sp: + sequence parallel); else data parallel. _PARALLEL_RULES lists the combinations refused."""

    tp: int = 1                      # tensor-parallel degree: splits attention heads and MLP width (text-transformer)
    sp: bool = False                 # tp > 1: sequence parallelism (Korthikanti et al.): LayerNorm on sequence shards,
                                     # all-gather / reduce-scatter in place of TP's all-reduces
    cp: int = 1                      # context parallelism: the sequence split over cp ranks, ring attention
                                     # (text-transformer; the sequence length must be divisible by 2 x cp)
    ep: int = 1                      # expert parallelism: the experts of each MoE layer over ep ranks, all-to-all
                                     # dispatch (workload text-moe; workload.experts divisible by ep)
    pp: int = 1                      # pipeline stages: the model's layers cut into pp consecutive stages
    micro_batches: int = 4           # pp > 1: micro-batches per step (each worker's batch split into this many)
    schedule: str = "1f1b"           # pp > 1: gpipe | 1f1b
    virtual_stages: int = 1          # pp > 1, 1f1b: model chunks per stage; v > 1 is interleaved 1F1B (bubble
                                     # (p-1)/(v·m+p-1), (p·v-1)/(p-1) x the boundary traffic; micro_batches a multiple
                                     # of pp)
    stage_ms: float = 0.0            # pp > 1: pad each stage's forward of a micro-batch to this many ms (backward:
                                     # twice that), the formula's equal stage times; 0: off (the stages' own times)
    zero: int = 0                    # ZeRO stage 0 | 1 | 2 | 3 over the data-parallel group (allreduce only); 2-3
                                     # also over tp shards; 1 with tp, pp, cp or ep: the distributed optimizer
                                     # over each model-parallel rank's dp group
    activation_checkpointing: bool = False  # recompute each block in backward (every engine but ZeRO's)
    overlap: bool = False            # allreduce: bucketed all-reduce from autograd hooks, overlapped with backward
                                     # (DDP; pp > 1: the last micro-batch's); false: one flat all-reduce after it
    bucket_kb: int = 25600           # overlap = true (data parallel): gradient bucket size in KiB (DDP's
                                     # bucket_cap_mb = 25); a small model fits one bucket, which cannot overlap

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp * self.ep

    @property
    def slot_groups(self) -> int:
        """Shard sets a parameter server needs: one per (pp, ep, tp) coordinate (the cp ranks share one)."""
        return self.tp * self.pp * self.ep

    @property
    def distributed_optimizer(self) -> bool:
        """ZeRO-1 on a split model (zero = 1 with tp, pp, cp or ep), and ZeRO-2 in a pipeline (zero = 2 with pp):
        parallelism/distributed_optimizer.py, not ZeroEngine (which runs every stage over dp alone, and stages 2-3
        over dp x tp and dp x cp)."""
        return (self.zero == 1 and self.model_parallel > 1) or (self.zero == 2 and self.pp > 1)

    def unsplit(self) -> "ParallelConfig":
        """The same settings for the unsplit model (what `local`, the single-process reference, trains)."""
        return ParallelConfig(activation_checkpointing=self.activation_checkpointing)

    def describe(self) -> str:
        """A short tag for labels, e.g. "tp=2" or "pp=2/1f1b/m4"; "" for plain data parallelism."""
        parts = []
        if self.tp > 1:
            parts.append(f"tp={self.tp}" + ("+sp" if self.sp else ""))
        for ax in ("cp", "ep"):
            if getattr(self, ax) > 1:
                parts.append(f"{ax}={getattr(self, ax)}")
        if self.pp > 1:
            parts.append(f"pp={self.pp}/{self.schedule}/m{self.micro_batches}"
                         + (f"/v{self.virtual_stages}" if self.virtual_stages > 1 else "")
                         + (f"/{self.stage_ms:g}ms" if self.stage_ms else ""))
        if self.zero:
            parts.append(f"zero={self.zero}")
        if self.activation_checkpointing:
            parts.append("ckpt")
        if self.overlap:
            parts.append("overlap")
        return ",".join(parts)


@dataclass
class SimulateConfig:
    enabled: bool = False
    compute_s: float = 0.010           # virtual compute time of one step (before straggler factors)
    latency_intra_s: float = 50e-6
    latency_inter_s: float = 500e-6
    bandwidth_intra_Bps: float = 10e9
    bandwidth_inter_Bps: float = 1.25e9  # 10 Gbit/s
    workers_per_host: int = 8            # shards live on host 0
    timing_only: bool = False            # no gradients, no optimizer: gate, versions, staleness, time (sim/timing.py)


PLACEMENTS = ("packed", "spread")


@dataclass
class TopologyConfig:
    """Real runs on emulated hosts: the zmq transport delays each message by its link's latency + bytes/bandwidth
    (collectives/topology.py) and counts bytes per link class. hosts x gpus_per_host must be the run's world size
    (train.workers x the model-parallel degree); allreduce or ps-*, zmq only. Under ps-* the shards live on host
    shard_host: a rank's requests to them and their replies cross its link to that host (ps/link_delay.py)."""

    hosts: int = 0                   # emulated hosts; 0: no topology (every link as fast as this machine's)
    gpus_per_host: int = 0           # ranks ("GPUs") per host
    placement: str = "packed"        # packed: rank r on host r // gpus_per_host (torchrun's; tp stays inside a host)
                                     # spread: rank r on host r % hosts (consecutive ranks, a tp group, across hosts)
                                     # or an axis order, innermost first, e.g. "tp,dp,pp": hosts filled tp first,
                                     # then dp, pp outermost (pp crosses hosts); every split axis listed
    intra_latency_us: float = 0.0    # a link inside a host (NVLink's role): latency in microseconds
    intra_bandwidth_GBps: float = 0.0   # ... its bandwidth in GB/s (1e9 bytes/s); 0: unlimited
    inter_latency_us: float = 0.0    # a link between hosts (InfiniBand's role): latency in microseconds
    inter_bandwidth_GBps: float = 0.0   # ... its bandwidth in GB/s; 0: unlimited
    shard_host: int = 0              # ps-*: the emulated host the parameter server's shards run on (0..hosts-1)

    @property
    def enabled(self) -> bool:
        return self.hosts > 0

    def order(self) -> list[str] | None:
        """The axis order of an explicit placement ("tp,dp,pp" -> ["tp", "dp", "pp"]), None for packed / spread."""
        if self.placement in PLACEMENTS:
            return None
        return [a.strip() for a in self.placement.split(",") if a.strip()]

    def build(self, parallel: "ParallelConfig | None" = None, workers: int = 1) -> Any:
        """The `collectives.topology.Topology` of this section, or None when hosts = 0; an axis-order placement
        needs the run's degrees (`parallel`, `workers` = dp) to place each rank."""
        if not self.enabled:
            return None
        from pslab.collectives.topology import Topology
        bw = lambda g: g * 1e9 if g > 0 else math.inf       # noqa: E731
        placement, host_of = self.placement, None
        if self.order() is not None:
            from pslab.parallelism.mesh import MeshLayout
            p = parallel or ParallelConfig()
            mesh = MeshLayout(dp=workers, pp=p.pp, tp=p.tp, cp=p.cp, ep=p.ep)
            placement, host_of = "explicit", tuple(mesh.hosts_by_order(self.order(), self.gpus_per_host))
        return Topology(self.hosts, self.gpus_per_host, intra_latency_s=self.intra_latency_us * 1e-6,
                        intra_bandwidth_Bps=bw(self.intra_bandwidth_GBps),
                        inter_latency_s=self.inter_latency_us * 1e-6,
                        inter_bandwidth_Bps=bw(self.inter_bandwidth_GBps), placement=placement, host_of=host_of)

    def describe(self) -> str:
        """e.g. "2x2 packed, intra 2 GB/s + 20 µs, inter 0.05 GB/s + 1000 µs"."""
        bw = lambda g: f"{g:g} GB/s" if g > 0 else "unlimited"      # noqa: E731
        return (f"{self.hosts}x{self.gpus_per_host} {self.placement}, intra {bw(self.intra_bandwidth_GBps)} + "
                f"{self.intra_latency_us:g} µs, inter {bw(self.inter_bandwidth_GBps)} + {self.inter_latency_us:g} µs")


@dataclass
class OuterConfig:
    """DiLoCo's outer optimizer (train.strategy = "diloco:<H>"), stepping θ_outer on the averaged pseudo-gradient
    every H inner steps. Defaults: Douillard et al. 2023 (Nesterov momentum 0.9, lr 0.7)."""

    optimizer: str = "nesterov"      # nesterov | sgd (heavy-ball momentum; momentum = 0: plain SGD)
    lr: float = 0.7                  # outer lr = 1 with sgd and momentum 0: DiLoCo is Local SGD
    momentum: float = 0.9            # in [0, 1); nesterov needs > 0


@dataclass
class LoggingConfig:
    """Where else a run's records go, beside its run directory."""

    tensorboard: bool = False        # true: RUN_DIR/tensorboard/ with the per-update scalars after the run
                                     # (results/tensorboard.py; needs the tensorboard package)


@dataclass
class TraceConfig:
    """A timeline of every rank and shard (collectives/trace.py): RUN_DIR/trace/, merged into RUN_DIR/trace.json
    (Perfetto, chrome://tracing) with its analysis by `pslab trace RUN_DIR`; also `pslab run --trace`."""

    enabled: bool = False            # true: record spans (forward/backward, each collective and p2p, PS push/pull,
                                     # gate waits, padding); off: nothing is recorded (no cost)
    max_events: int = 200_000        # per process; events past it are counted, not kept


@dataclass
class RunConfig:
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    simulate: SimulateConfig = field(default_factory=SimulateConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    trace: TraceConfig = field(default_factory=TraceConfig)

    @property
    def strategy(self) -> Strategy:
        return parse_strategy(self.train.strategy)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["stragglers"]["factors"] = {str(k): v for k, v in self.stragglers.factors.items()}
        return d

    def validate(self) -> "RunConfig":
        from pslab.experiments.workloads import WORKLOADS
        t, w = self.train, self.workload
        if w.name not in WORKLOADS and ":" not in w.name:     # 'file.py:fn': a user workload, checked when loaded
            raise ConfigError(f"workload.name: unknown workload {w.name!r}; choose one of: {', '.join(WORKLOADS)}, "
                              "or your own as 'my_file.py:make_workload' (experiments/workloads/user.py)")
        _positive("workload.batch_size", w.batch_size)
        s = self.strategy  # raises on unknown strategy / negative staleness
        _positive("train.workers", t.workers)
        _positive("train.steps", t.steps)
        _positive("train.shards", t.shards)
        _positive("train.eval_every", t.eval_every)
        _positive("trace.max_events", self.trace.max_events)
        _positive("parallel.bucket_kb", self.parallel.bucket_kb)
        if t.backend not in BACKENDS:
            raise ConfigError(f"train.backend must be one of {', '.join(BACKENDS)}, got {t.backend!r}")
        if t.optimizer not in OPTIMIZERS:
            raise ConfigError(f"train.optimizer must be one of {', '.join(OPTIMIZERS)}, got {t.optimizer!r}")
        if not (t.lr > 0 and math.isfinite(t.lr)):
            raise ConfigError(f"train.lr must be a finite number > 0, got {t.lr}")
        if t.backup_abort and self.strategy.kind != "ps-bsp-backup":
            raise ConfigError(f"train.backup_abort applies to backup workers (ps-bsp-backup:<b>), not {self.strategy}")
        if t.lr_rule not in LR_RULES:
            raise ConfigError(f"train.lr_rule must be one of {', '.join(LR_RULES)} (linear: a step that averages G "
                              f"gradients uses G x lr), got {t.lr_rule!r}")
        if t.staleness_rule not in STALENESS_RULES:
            raise ConfigError(f"train.staleness_rule must be one of {', '.join(STALENESS_RULES)} (gradient: each "
                              f"gradient's lr is lr / max(tau, 1)), got {t.staleness_rule!r}")
        if not 0 <= t.momentum < 1:
            raise ConfigError(f"train.momentum must be in [0, 1), got {t.momentum}")
        if len(t.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in t.betas):
            raise ConfigError(f"train.betas must be two numbers in [0, 1), e.g. [0.9, 0.999], got {t.betas!r}")
        if not (t.dc_lambda >= 0 and math.isfinite(t.dc_lambda)):
            raise ConfigError(f"train.dc_lambda must be a finite number >= 0, got {t.dc_lambda}")
        if not (t.timeout_s > 0 and math.isfinite(t.timeout_s)):
            raise ConfigError(f"train.timeout_s must be a finite number of seconds > 0, got {t.timeout_s}")
        if not (t.run_limit_s >= 0 and math.isfinite(t.run_limit_s)):
            raise ConfigError(f"train.run_limit_s must be a number of seconds >= 0 (0: no limit), got {t.run_limit_s}")
        if not (0 <= t.base_step_s <= 3600):
            raise ConfigError(f"train.base_step_s must be between 0 and 3600 seconds, got {t.base_step_s}")
        if w.seed < 0:
            raise ConfigError(f"workload.seed must be >= 0, got {w.seed}")
        if isinstance(w.seq_len, bool) or not isinstance(w.seq_len, int) or not 0 <= w.seq_len <= 4096:
            raise ConfigError(f"workload.seq_len must be an integer in 1..4096 tokens (0: the workload's own), "
                              f"got {w.seq_len!r}")
        if w.seq_len and not w.name.startswith("text-"):
            raise ConfigError(f"workload.seq_len sets a language model's context; workload {w.name!r} is none: use "
                              "text-transformer or text-moe")
        if s.kind == "ps-bsp-backup" and s.backup is not None and s.backup >= t.workers:
            raise ConfigError(f"strategy {s.label}: needs more workers than backups (train.workers = {t.workers})")
        self.stragglers.factors = {_worker_key(k): float(v) for k, v in self.stragglers.factors.items()}
        self.stragglers.validate(t.workers)
        from pslab.experiments.combinations import validate_moe, validate_parallel, validate_topology
        validate_parallel(self.parallel, s, self.workload.batch_size, self.simulate.enabled)
        validate_moe(w, self.parallel)
        self.faults.validate(t.workers, t.shards, s.kind, t.steps)
        split = self.parallel.model_parallel > 1 or self.parallel.zero > 0
        if split and self.faults.policy(s.kind, split) != "abort":
            raise ConfigError(f"faults.on_failure = {self.faults.on_failure}: a run that splits the model "
                              f"({self.parallel.describe()}) cannot re-cut it around a lost rank; use abort (or auto) "
                              "and resume from an engine checkpoint (faults.checkpoint_every, pslab run --resume)")
        m = self.simulate
        for k in ("compute_s", "latency_intra_s", "latency_inter_s"):
            if getattr(m, k) < 0:
                raise ConfigError(f"simulate.{k} must be >= 0")
        for k in ("bandwidth_intra_Bps", "bandwidth_inter_Bps", "workers_per_host"):
            if not getattr(m, k) > 0:
                raise ConfigError(f"simulate.{k} must be > 0")
        ta = t.target_acc
        if ta is not None and (isinstance(ta, bool) or not isinstance(ta, (int, float)) or not 0 < ta <= 1):
            raise ConfigError(f"train.target_acc must be a test accuracy in (0, 1], e.g. 0.9, got {ta!r}")
        if ta is not None and m.timing_only:
            raise ConfigError("train.target_acc needs trained weights to evaluate: a timing-only simulation "
                              "(simulate.timing_only) computes no gradients; drop one of them")
        validate_topology(self)
        self._validate_compress(s)
        self._validate_periodic(s)
        return self

    def _validate_compress(self, s: Strategy) -> None:
        """train.compress: a known compressor, where it runs (allreduce's gradient sync or a ps-* push, plain data
        parallelism)."""
        from pslab.parallelism.compress import check_compress
        t, p = self.train, self.parallel
        try:
            t.compress = check_compress(t.compress)
        except ValueError as e:
            raise ConfigError(f"train.{e}") from None
        if not isinstance(t.error_feedback, bool):
            raise ConfigError(f"train.error_feedback must be true or false, got {t.error_feedback!r}")
        if t.compress == "none":
            if not t.error_feedback:
                raise ConfigError("train.error_feedback = false applies to a compressor: set train.compress too "
                                  "(topk:<fraction>, sign or powersgd:<rank>)")
            return
        if s.uses_ps and not s.ps_periodic:        # the push to the shards (ps/compression.py)
            from pslab.ps.compression import parse
            try:
                parse(t.compress)
            except ValueError as e:
                raise ConfigError(f"train.{e}") from None
        elif s.kind != "allreduce":
            raise ConfigError(f"train.compress = {t.compress!r} compresses each step's gradients: it needs "
                              f"train.strategy = allreduce or a per-step parameter-server strategy (ps-asp, ps-bsp, "
                              f"ps-ssp:<s>, ...), not {s.label}")
        if p.model_parallel > 1 or p.zero or p.overlap:
            raise ConfigError(f"train.compress = {t.compress!r} runs on plain data parallelism for now: drop "
                              f"[parallel] ({p.describe()})")
        if self.simulate.timing_only:
            raise ConfigError(f"train.compress = {t.compress!r} compresses the gradients, which a timing-only "
                              "simulation does not compute: drop --timing-only (a plain --simulate runs it)")
        f = self.faults
        if f.events:
            raise ConfigError(f"train.compress = {t.compress!r} keeps a residual per worker, which the failure "
                              "recovery does not carry yet: drop faults.events (faults.checkpoint_every and "
                              "--resume keep it)")

    def _validate_periodic(self, s: Strategy) -> None:
        """[outer] and what local-sgd / diloco do not run with yet (one line each)."""
        from pslab.parallelism.local_sgd import OUTER_OPTIMIZERS
        o = self.outer
        if o.optimizer not in OUTER_OPTIMIZERS:
            raise ConfigError(f"outer.optimizer must be one of {', '.join(OUTER_OPTIMIZERS)}, got {o.optimizer!r}")
        if isinstance(o.lr, bool) or not isinstance(o.lr, (int, float)) or not (o.lr > 0 and math.isfinite(o.lr)):
            raise ConfigError(f"outer.lr must be a finite number > 0, got {o.lr!r}")
        if isinstance(o.momentum, bool) or not isinstance(o.momentum, (int, float)) or not 0 <= o.momentum < 1:
            raise ConfigError(f"outer.momentum must be in [0, 1), got {o.momentum!r}")
        if o.optimizer == "nesterov" and o.momentum == 0:
            raise ConfigError("outer.optimizer = nesterov needs outer.momentum > 0 (for plain SGD use "
                              "outer.optimizer = sgd with momentum 0)")
        if not (s.periodic or s.ps_periodic):
            return
        f = self.faults
        if f.events or f.checkpoint_every or f.shard_checkpoint_every or f.policy(s.kind) != "abort":
            raise ConfigError(f"{s.label} keeps per-worker parameters and optimizer state between averages, which "
                              "the failure and checkpoint machinery does not save yet: drop faults.events and "
                              "faults.checkpoint_every, use faults.on_failure = abort (or auto), or use allreduce")
        p = self.parallel
        if s.ps_periodic and (p.model_parallel > 1 or p.zero or p.overlap):
            raise ConfigError(f"{s.label} runs on plain data parallelism for now: drop [parallel] ({p.describe()}); "
                              "local-sgd / diloco run on split models")


def _worker_key(k: Any) -> int:
    try:
        return int(k)
    except (TypeError, ValueError):
        raise ConfigError(f"stragglers.factors: keys are worker numbers, got {k!r}") from None


def _positive(key: str, v: Any) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ConfigError(f"{key} must be a positive integer, got {v!r}")


def _coerce(key: str, value: Any, current: Any) -> Any:
    """Check a value against the type of the default it replaces."""
    if isinstance(current, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
    elif isinstance(current, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
    elif isinstance(current, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        value = float(value)
    elif isinstance(current, str):
        if not isinstance(value, str):
            value = str(value)
    elif isinstance(current, dict) and not isinstance(value, dict):
        raise ConfigError(f"{key} must be a table, e.g. {{\"1\" = 4.0}}, got {value!r}")
    elif isinstance(current, list) and not isinstance(value, list):
        raise ConfigError(f"{key} must be a list, got {value!r}")
    return value


def apply(cfg: RunConfig, data: dict[str, Any], where: str = "config") -> RunConfig:
    for section, values in data.items():
        sub = getattr(cfg, section, None) if section in {f.name for f in dataclasses.fields(cfg)} else None
        if sub is None:
            raise ConfigError(f"{where}: unknown section [{section}]; sections are: "
                              f"{', '.join(f.name for f in dataclasses.fields(cfg))}")
        if not isinstance(values, dict):
            raise ConfigError(f"{where}: [{section}] must be a table")
        known = {f.name for f in dataclasses.fields(sub)}
        for key, value in values.items():
            if section == "train" and key == "engine":
                raise ConfigError(f"{where}: train.engine was replaced by the [parallel] section: use "
                                  "parallel.overlap = true for the bucketed, overlapped data-parallel engine "
                                  "(and parallel.tp / pp / zero for the others)")
            if key not in known:
                raise ConfigError(f"{where}: unknown key {section}.{key}; keys of [{section}]: {', '.join(sorted(known))}")
            setattr(sub, key, _coerce(f"{section}.{key}", value, getattr(sub, key)))
    return cfg


def parse_override(text: str) -> dict[str, Any]:
    """'train.workers=8' -> {'train': {'workers': 8}}; the value is read as TOML, else taken as a string."""
    key, eq, raw = text.partition("=")
    key = key.strip()
    if not eq or key.count(".") != 1:
        raise ConfigError(f"--set expects section.key=value (e.g. train.strategy=ps-ssp:2), got {text!r}")
    section, name = key.split(".")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return {section: {name: value}}


def example_configs() -> dict[str, Path]:
    """The example configs shipped with pslab, by file name: package data (experiments/configs/*.toml), read through
    importlib.resources so an installed wheel finds them as a checkout does."""
    from importlib.resources import files
    return {p.name: Path(str(p)) for p in files("pslab.experiments").joinpath("configs").iterdir()
            if p.name.endswith(".toml")}


def example_config(name: str) -> Path:
    """One shipped example config: 'compare_default.toml' (or without '.toml')."""
    shipped = example_configs()
    key = name if name.endswith(".toml") else name + ".toml"
    if key not in shipped:
        raise ConfigError(f"no example config {name!r}: pslab ships {', '.join(sorted(shipped))}")
    return shipped[key]


def resolve_config_path(path: str | Path) -> Path:
    """`path` if it is a file; else a shipped example named as in the docs — `experiments/configs/3d.toml` from a
    folder that is not a checkout (an installed pslab), or the bare name `3d.toml` / `3d`."""
    p = Path(path)
    if p.is_file():
        return p
    name = p.name if p.name.endswith(".toml") else p.name + ".toml"
    shipped = example_configs()
    if p.parent in (Path("."), Path("experiments/configs")) and name in shipped:
        return shipped[name]
    raise ConfigError(f"config file not found: {p} (the shipped examples: {', '.join(sorted(shipped))})")


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                base: RunConfig | None = None) -> RunConfig:
    cfg = base if base is not None else RunConfig()
    if path is not None:
        p = resolve_config_path(path)
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: not valid TOML: {e}") from None
        apply(cfg, data, str(p))
    for o in overrides:
        apply(cfg, parse_override(o), f"--set {o}")
    return cfg.validate()


def to_toml(d: dict[str, Any]) -> str:
    """Write the resolved config back as TOML (tables of scalars, lists and one level of inline tables)."""
    def val(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(val(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f'"{k}" = {val(x)}' for k, x in v.items()) + "}"
        raise TypeError(type(v))
    out = []
    for section, values in d.items():
        out.append(f"[{section}]")
        out += [f"{k} = {val(v)}" for k, v in values.items() if v is not None]   # None: the default
        out.append("")
    return "\n".join(out)


def config_from_dict(d: dict[str, Any]) -> RunConfig:
    """Rebuild a RunConfig from `to_dict()` output (e.g. in a child process or from a run's config.toml)."""
    return apply(RunConfig(), d).validate()
