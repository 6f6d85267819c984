"""Pipeline parallelism: an nn.Sequential cut into p stages on the p ranks of the pp group, run by one executor.

The executor takes a schedule (`schedule.py`: GPipe, 1F1B or interleaved 1F1B, pure data) and, for its stage's
action list, does (interleaved: for the action's chunk, virtual stage c = chunk·p + s, whose neighbours c ± 1 sit on
ranks s ± 1 mod p; "first" and "last" below are virtual stages 0 and p·v − 1)

    F i:  receive activation i from stage s−1 (stage 0: micro-batch i of x), run the stage, send to s+1
          (last stage: loss_i = loss_fn(out, y_i) · b_i/B, so Σ loss_i is the full-batch mean)
    B i:  receive ∂L/∂out_i from s+1 (last stage: loss_i.backward()), backpropagate, send ∂L/∂in_i to s−1

The cut: the model's own `pp_cuts` (child indices where stages 1 … n−1 begin) if it declares them, else its
parameterised children spread evenly (`split_stages`). A batch may be a tensor or a (nested) tuple / dict of them
(a user's workload): it is cut into micro-batches along dim 0 (`split_batch`), stage 0 runs on micro-batch i's
inputs, the last stage's loss_fn reads micro-batch i of the whole batch, and what crosses a cut is one tensor.

Sends are non-blocking (waited at the end of the step) and receives are tagged (2(c·m+i) forward, +1 backward, c the
sender's virtual stage), so no schedule whose replay (`schedule.simulate`) finishes can deadlock; the first time a
micro-batch shape crosses a cut, the sender sends a small shape header before the activation so the receiver can
allocate its buffer; gradients of all micro-batches accumulate in .grad. Only boundary activations and their
gradients cross ranks: p2p bytes per step = 2·Σ_cuts (activation bytes), nothing inside a stage.

Measured per step: each action's compute span (time spent waiting in recv is idle), from which the bubble
fraction 1 − busy/(p·makespan) is compared with (p−1)/(v·m+p−1); and the peak number of (chunk,) micro-batches
whose activations the stage holds (GPipe: m; 1F1B: ≤ p; interleaved: min(2(p−s−1) + (v−1)p + 1, v·m)). `stage_time=(t_f, t_b)` pads every action to fixed durations,
the "equal stage times" assumption of the formula.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Callable

import torch
from torch import nn

from pslab.collectives import chunk_bounds, trace

from .checkpointing import unwrap_name
from .comm import Comm, CommLog
from .engine import EngineError, ModelFactory, ParamSlot, add_back_grads, take_grads
from .mesh import DeviceMesh
from .moe import moe_aux_loss, moe_layers
from .schedule import Action, PipelineSchedule, make_schedule


_SHAPE_TAG = 1 << 20      # tags of the one-off shape headers (activations use 2i, gradients 2i+1)
_MAX_DIMS = 6
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]


PP_CUTS_ATTR = "pp_cuts"   # a model's own stage cut: the child indices where stages 1, 2, ... begin (see split_stages)


def backward_from(out: torch.Tensor, grad: torch.Tensor, extra: torch.Tensor | None = None) -> None:
    """Backpropagate ∂L/∂out = `grad` (and a scalar `extra`'s own gradient, a MoE stage's aux loss) into the graph:
    torch.autograd.backward((out, extra), (grad, 1)) straight on autograd's engine, without that function's Python
    checks -- whose first call imports sympy (~1 s a process) -- or a (out·grad).sum() node (~0.1 ms a micro-batch
    at 16 x 512). `grad` comes from the next stage's buffer of out's own shape."""
    tensors, grads = ((out,), (grad,)) if extra is None else ((out, extra), (grad, torch.ones_like(extra)))
    try:
        run = torch.autograd.variable.Variable._execution_engine.run_backward
    except AttributeError:                              # (a torch without it: the public call)
        torch.autograd.backward(tensors, grads)
        return
    run(tensors, grads, False, False, (), allow_unreachable=True, accumulate_grad=True)


def split_stages(model: nn.Sequential, stages: int) -> list[tuple[int, int]]:
    """[start, end) child indices of each stage: the model's own `pp_cuts` (the child indices where stages 1 … n−1
    begin, as torch.distributed.pipelining's split points) if it declares them; else parameterised children spread
    evenly, others join their left."""
    if not isinstance(model, nn.Sequential):
        raise EngineError(f"pipeline parallelism cuts an nn.Sequential into stages; got {type(model).__name__}")
    cuts = getattr(model, PP_CUTS_ATTR, None)
    if cuts is not None:
        starts = [0] + check_pp_cuts(model, cuts, stages)
        return list(zip(starts, starts[1:] + [len(model)]))
    heavy = [i for i, c in enumerate(model) if any(True for _ in c.parameters())]
    if len(heavy) < stages:
        raise EngineError(f"cannot cut a model with {len(heavy)} parameterised layers into {stages} stages; "
                          f"use fewer stages or a deeper model")
    starts = [0] + [heavy[a] for a, _ in chunk_bounds(len(heavy), stages)[1:]]
    return list(zip(starts, starts[1:] + [len(model)]))


def check_pp_cuts(model: nn.Sequential, cuts: object, stages: int) -> list[int]:
    """The model's declared cut, validated: `stages` − 1 increasing child indices in 1 … len(model) − 1, each stage
    holding a parameter. EngineError with a one-line reason otherwise."""
    n = len(model)
    if not isinstance(cuts, (list, tuple)) or not all(isinstance(c, int) and not isinstance(c, bool) for c in cuts):
        raise EngineError(f"the model's {PP_CUTS_ATTR} must be a list of child indices where stages 1, 2, ... begin, "
                          f"got {cuts!r}")
    if len(cuts) != stages - 1:
        raise EngineError(f"the model's {PP_CUTS_ATTR} {list(cuts)} cuts it into {len(cuts) + 1} stages, but the "
                          f"layout asks for {stages} (parallel.pp x virtual_stages): declare {stages - 1} cut(s)")
    if list(cuts) != sorted(set(cuts)) or (cuts and (cuts[0] < 1 or cuts[-1] > n - 1)):
        raise EngineError(f"the model's {PP_CUTS_ATTR} {list(cuts)} must be increasing child indices in 1..{n - 1} "
                          f"(its nn.Sequential has {n} children)")
    starts = [0, *cuts, n]
    for k, (a, b) in enumerate(zip(starts, starts[1:])):
        if not any(True for i in range(a, b) for _ in model[i].parameters()):
            raise EngineError(f"the model's {PP_CUTS_ATTR} {list(cuts)} leaves stage {k} (children {a}..{b - 1}) "
                              "without a parameter: move a cut")
    return list(cuts)


def split_batch(batch: Any, m: int) -> list[Any]:
    """`batch` (a tensor, or a tuple / list / dict of them, nested) cut into m micro-batches along dim 0, as
    torch.tensor_split cuts a tensor; anything that is not a tensor is repeated in every micro-batch."""
    if isinstance(batch, torch.Tensor):
        return list(torch.tensor_split(batch, m))
    if isinstance(batch, (tuple, list)):
        parts = [split_batch(v, m) for v in batch]
        return [type(batch)(p[i] for p in parts) for i in range(m)]
    if isinstance(batch, dict):
        parts = {k: split_batch(v, m) for k, v in batch.items()}
        return [{k: p[i] for k, p in parts.items()} for i in range(m)]
    return [batch] * m


def _signature(b: Any) -> Any:
    """The shapes and dtypes of a (nested) batch's tensors; other leaves by their type."""
    if isinstance(b, torch.Tensor):
        return (tuple(b.shape), b.dtype)
    if isinstance(b, dict):
        return tuple((k, _signature(v)) for k, v in b.items())
    if isinstance(b, (tuple, list)):
        return tuple(_signature(v) for v in b)
    return type(b).__name__


def batch_rows(batch: Any) -> int:
    """Examples in `batch`: dim 0 of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    for v in (batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else ()):
        try:
            return batch_rows(v)
        except EngineError:
            pass
    raise EngineError(f"a pipeline batch must hold a tensor (its micro-batches are cut along dim 0); got "
                      f"{type(batch).__name__}")


def stage_module(model: nn.Sequential, bounds: tuple[int, int] | list[tuple[int, int]]) -> nn.Sequential:
    """The children in `bounds` (one [start, end), or a rank's chunks), keeping their indices as names (so
    parameter names match the full model)."""
    spans = [bounds] if isinstance(bounds, tuple) else bounds
    return nn.Sequential(OrderedDict((str(i), model[i]) for a, b in spans for i in range(a, b)))


def rank_chunks(model: nn.Sequential, stages: int, virtual_stages: int = 1) -> list[list[tuple[int, int]]]:
    """Per pipeline rank s, its chunks' [start, end): of a v·p-way cut, chunks s, s+p, …, s+(v−1)p."""
    bounds = split_stages(model, stages * virtual_stages)
    return [bounds[s::stages] for s in range(stages)]


def rank_stages(model: nn.Sequential, stages: int, virtual_stages: int = 1) -> list[nn.Sequential]:
    """Per pipeline rank, the module of all its chunks (`stage_module` of `rank_chunks`)."""
    return [stage_module(model, chunks) for chunks in rank_chunks(model, stages, virtual_stages)]


class PipelineReplica:
    """This rank's stage, its schedule and the executor.

    stage: the rank's layers (an nn.Sequential named by full-model child indices); chunk_bounds (interleaved 1F1B,
    v > 1): the [start, end) child indices of its v model chunks, virtual stages s, s+p, …, s+(v−1)p.
    sp (the tp group, when the stage runs under sequence parallelism): the last stage scores its S/T tokens,
    L_t/T per micro-batch; the replicated parameters' partial gradients (`replicated`) are summed over tp once,
    after the last backward; the reported loss is summed over tp. name_of: a slot's name (tp shards: "#tp{t}/{T}").
    cp (the cp group, when the stage's attention runs on its ring, `context.py`): every micro-batch is cut to the
    rank's zig-zag tokens (first stage: x and its global positions; last stage: y), the gradients are averaged over
    cp once after the last backward, and the reported loss is the mean over cp.
    moe (the model has mixture-of-experts layers): each stage adds its MoE layers' load-balancing loss of every
    micro-batch (× b_i/B) to that micro-batch's backward on the stage, and the reported loss is summed over the
    stages (an all-reduce over pp instead of the last stage's broadcast). ep (the ep group, `expert.py`): the rank
    takes sample chunk ep.rank of the worker's batch (then its micro-batches), back-propagates L_r/ep, and sums its
    non-expert gradients (and the loss) over ep after the last backward."""

    def __init__(self, stage: nn.Sequential, pp: Comm, dp: Comm, rank: int, schedule: str = "1f1b",
                 micro_batches: int = 4, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 stage_time: tuple[float, float] | None = None, report_loss: bool = True,
                 measure: bool = False, sp: Comm | None = None, replicated: list[torch.Tensor] | None = None,
                 name_of: Callable[[str, torch.Tensor], str] | None = None,
                 chunk_bounds: list[tuple[int, int]] | None = None, cp: Comm | None = None,
                 cp_layout: str = "zigzag", moe: bool = False, ep: Comm | None = None) -> None:
        self.stage, self.pp, self.dp, self.log, self.rank = stage, pp, dp, dp.log, rank
        self.sp, self.replicated = sp, replicated or []
        self.cp, self.cp_layout = (cp, cp_layout) if cp is not None and cp.size > 1 else (None, cp_layout)
        self.moe, self.ep = moe, (ep if ep is not None and ep.size > 1 else None)
        self.name_of = name_of or (lambda name, p: name)
        self.reducers: dict[int, Any] = {}    # overlapped dp sync per chunk, armed before the chunk's last backward
        self.s, self.p = pp.rank, pp.size
        self.schedule_name, self.micro_batches = schedule, micro_batches
        self.v = len(chunk_bounds) if chunk_bounds else 1
        self.schedule: PipelineSchedule = make_schedule(schedule, self.p, micro_batches, self.v)
        # the chunks run the stage's (possibly tp-split, checkpoint-wrapped) children, looked up by name
        self.chunks = [stage] if not chunk_bounds else [
            nn.Sequential(OrderedDict((str(i), stage._modules[str(i)]) for i in range(a, b))) for a, b in chunk_bounds]
        self.moe_chunks = {k for k, ch in enumerate(self.chunks) if moe_layers(ch)} if moe else set()
        self.loss_fn = loss_fn or torch.nn.functional.cross_entropy
        self.stage_time, self.report_loss, self.measure = stage_time, report_loss, measure
        self._shapes: dict[tuple, tuple[torch.Size, torch.dtype]] = {}
        self._sent_shapes: set[tuple] = set()
        self.spans: list[tuple[Action, float, float]] = []
        self.step_start = 0.0
        self.peak_in_flight = 0
        self.after_backward: Callable[[], None] | None = None   # called after each backward action

    # ---- boundary shapes: sent once per (cut, new micro-batch shape) as a small header message -------------------
    def _tag(self, c: int, i: int, backward: bool = False) -> int:
        """Tag of what virtual stage c sends for micro-batch i: 2(c·m+i) forward, +1 backward."""
        return 2 * (c * self.micro_batches + i) + int(backward)

    def _send_shape(self, key: tuple, out: torch.Tensor, c: int, i: int) -> None:
        if key in self._sent_shapes:
            return
        self._sent_shapes.add(key)
        if out.dim() > _MAX_DIMS:
            raise EngineError(f"stage {self.s} output has {out.dim()} dims; at most {_MAX_DIMS} can cross a stage")
        hdr = torch.zeros(_MAX_DIMS + 2, dtype=torch.int64)
        hdr[0], hdr[1] = out.dim(), _DTYPES.index(out.dtype)
        hdr[2:2 + out.dim()] = torch.tensor(out.shape)
        self.pp.isend(hdr, (self.s + 1) % self.p, tag=_SHAPE_TAG + self._tag(c, i), site="shapes").wait()

    def _recv_shape(self, key: tuple, c: int, i: int) -> tuple[torch.Size, torch.dtype]:
        if key not in self._shapes:
            hdr = self.pp.recv(torch.zeros(_MAX_DIMS + 2, dtype=torch.int64), (self.s - 1) % self.p,
                               tag=_SHAPE_TAG + self._tag(c - 1, i))
            nd = int(hdr[0])
            self._shapes[key] = (torch.Size(hdr[2:2 + nd].tolist()), _DTYPES[int(hdr[1])])
        return self._shapes[key]

    def _pad(self, phase: str, t0: float) -> float:
        """Stretch the compute that started at t0 to the fixed stage time (÷ v per chunk), if any; return the end."""
        if self.stage_time is not None:
            left = self.stage_time[0 if phase == "F" else 1] / self.v - (time.perf_counter() - t0)
            if left > 0:
                time.sleep(left)
        return time.perf_counter()

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> float:
        m, s, p = self.micro_batches, self.s, self.p
        last = p * self.v - 1                              # the virtual stage that scores the loss
        total = batch_rows(x)                              # the worker's batch: loss_i · b_i/total sums to its mean
        if self.ep is not None:                            # this ep rank's sample chunk (expert.py)
            n = self.ep.size
            if x.shape[0] % n:
                raise EngineError(f"a worker batch of {x.shape[0]} samples cannot be split over ep = {n} ranks; "
                                  "use a batch size divisible by ep")
            x, y = torch.tensor_split(x, n)[self.ep.rank], torch.tensor_split(y, n)[self.ep.rank]
        n_rows = batch_rows(x)                             # (this ep rank's chunk under ep)
        if n_rows < m:
            raise EngineError(f"batch of {n_rows} cannot be split into {m} micro-batches")
        xs, ys = split_batch(x, m), split_batch(y, m)     # (a user's batch: a tuple or dict of tensors)
        rows = [batch_rows(b) for b in xs]
        if self.cp is not None:                          # this cp rank's tokens; L = Σ_r L_r / C via the grads
            xs, ys = self._cp_tokens(x.shape[1], xs, ys)
        sp = self.sp
        if sp is not None:                               # (of the cp rank's S/C tokens under cp)
            from .sequence import sequence_bounds
            a, b = sequence_bounds(ys[0].shape[1], sp)
            ys = tuple(t[:, a:b] for t in ys)           # the last stage scores this tp rank's tokens
            total *= sp.size                             # L = Σ_t L_t / T
            earlier = take_grads(self.replicated)
        if self.ep is not None:
            from .expert import is_expert
            replicas = [q for q in self.stage.parameters() if not is_expert(q)]
            before_ep = take_grads(replicas)
        aux_sum = torch.zeros(())
        held: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        sends: list[Any] = []
        losses: list[torch.Tensor] = []
        self.spans, self.peak_in_flight = [], 0
        actions = self.schedule.for_stage(s)
        final_b = {a.chunk: n for n, a in enumerate(actions) if a.phase == "B"}   # each chunk's last backward
        if self.measure:
            self.pp.group.barrier()
        self.step_start = time.perf_counter()
        for n, a in enumerate(actions):
            i, k = a.micro, a.chunk
            c = a.virtual(p)
            if k in self.reducers and n == final_b[k]:
                self.reducers[k].prepare_forward()   # arm the dp all-reduce hooks for this chunk's last backward
            if a.phase == "F":
                if c == 0:
                    inp = xs[i]
                else:
                    shape, dtype = self._recv_shape((c, self._shape_key(i, xs)), c, i)
                    inp = self.pp.recv(torch.empty(shape, dtype=dtype), (s - 1) % p,
                                       tag=self._tag(c - 1, i)).requires_grad_()
                t0 = time.perf_counter()
                out = self.chunks[k](inp)
                aux = None
                if k in self.moe_chunks:                  # this chunk's MoE layers' aux loss of this micro-batch
                    aux = moe_aux_loss(self.chunks[k]) * (rows[i] / total)
                    aux_sum = aux_sum + aux.detach()
                if c == last:
                    out = self.loss_fn(out, ys[i]) * (rows[i] / total)
                    losses.append(out.detach())
                t1 = self._pad(a.phase, t0)
                if c < last:
                    if not isinstance(out, torch.Tensor):
                        raise EngineError(f"pipeline stage {c}'s output is a {type(out).__name__}; one tensor "
                                          "crosses a stage cut: cut the model where a child returns a tensor")
                    self._send_shape((c, self._shape_key(i, xs)), out, c, i)
                    sends.append(self.pp.isend(out.detach().contiguous(), (s + 1) % p, tag=self._tag(c, i),
                                               site=f"stage {s} -> {(s + 1) % p}"))
                held[(k, i)] = (inp, out, aux)
                self.peak_in_flight = max(self.peak_in_flight, len(held))
            else:
                inp, out, aux = held.pop((k, i))
                if c == last:
                    t0 = time.perf_counter()
                    (out if aux is None else out + aux).backward()
                else:
                    grad = self.pp.recv(torch.empty_like(out), (s + 1) % p, tag=self._tag(c + 1, i, True))
                    t0 = time.perf_counter()
                    backward_from(out, grad, aux)
                t1 = self._pad(a.phase, t0)
                if c > 0:
                    sends.append(self.pp.isend(inp.grad.contiguous(), (s - 1) % p, tag=self._tag(c, i, True),
                                               site=f"stage {s} -> {(s - 1) % p}"))
                if self.after_backward is not None:       # ZeRO-2 (distributed_optimizer.py): this micro-batch's
                    self.after_backward()                 # gradients reduce-scattered over dp now, then freed
            self.spans.append((a, t0 - self.step_start, t1 - self.step_start))
            trace.complete(a.phase, "compute", t0, t1, stage=s, micro=i, chunk=k)   # (when a run is traced)
        with trace.waiting("sends"):
            for w in sends:
                w.wait()
        for r in self.reducers.values():
            r.finish()                             # (parameters this step gave no gradient: reduced as zeros)
        loss = torch.stack(losses).sum() if losses else torch.zeros(())
        if self.moe:
            loss = loss + aux_sum                          # this stage's part of the reported loss
        if self.ep is not None:                            # the replicated gradients (and the loss) summed over ep
            from .expert import sum_over_ep
            loss = torch.tensor(sum_over_ep(self.ep, replicas, loss))
            add_back_grads(replicas, before_ep)
        if self.cp is not None:
            from .context import average_grads_in_place
            average_grads_in_place(self.cp, self.slots(), site="cp grads")   # mean over cp: ∇ of the full loss
            loss = loss.reshape(1).to(torch.float64)
            if s == p - 1:
                self.cp.all_reduce(loss, "sum", site="cp loss")
                loss /= self.cp.size
        if sp is not None:
            from .sequence import LOSS_SITE, sum_partial_grads
            sum_partial_grads(self.replicated, sp)
            add_back_grads(self.replicated, earlier)
            loss = loss.reshape(1).to(torch.float64)        # float64, as SequenceParallelReplica's
            if s == p - 1:
                sp.all_reduce(loss, "sum", site=LOSS_SITE)
        if self.report_loss and p > 1:
            loss = loss.reshape(1).clone()
            if self.moe:                                   # every stage holds a part (its aux losses)
                self.pp.all_reduce(loss, "sum", site="loss (report)")
            else:
                self.pp.broadcast(loss, p - 1, site="loss (report)")
        return float(loss.sum())

    def moe_stats(self) -> dict[str, dict[str, torch.Tensor]]:
        """Per MoE layer of this stage: assignments routed / dropped per expert over its own tokens (then reset)."""
        return {name: mod.pop_stats() for name, mod in moe_layers(self.stage)}

    def _cp_tokens(self, seq: int, xs: tuple[torch.Tensor, ...], ys: tuple[torch.Tensor, ...]) -> tuple[tuple, tuple]:
        """The micro-batches at this cp rank's zig-zag tokens; the stage's embeddings get their global positions."""
        from .context import set_positions, token_positions
        pos = token_positions(self.cp, seq, self.cp_layout)
        set_positions(self.stage, pos)
        return tuple(t[:, pos] for t in xs), tuple(t[:, pos] for t in ys)

    @staticmethod
    def _shape_key(i: int, xs: Any) -> tuple:
        """What decides the shape crossing a cut: micro-batch i's tensors' shapes and dtypes."""
        return _signature(xs[i])

    def enable_overlapped_sync(self) -> None:
        """Used by AllReduceStrategy(overlap=True): the dp all-reduce runs in buckets from autograd hooks during
        each chunk's last backward (the last micro-batch's: every earlier one only accumulates), as picotron and
        Megatron fire it, overlapping that backward instead of following the whole step (interleaved: one reducer
        per chunk, each done before the next chunk's starts). A stage split over tp gets one bucket (so nothing
        overlaps): its backward's own collectives and a bucket thread's would share the transport, which is not
        for two threads at once."""
        if not self.reducers and self.dp.size > 1:      # (one data-parallel replica: nothing to reduce)
            from .data import DEFAULT_BUCKET_BYTES, GradReducer
            from .tensor import SHARD_ATTR
            split = (any(getattr(q, SHARD_ATTR, False) for q in self.stage.parameters()) or self.sp is not None
                     or self.cp is not None or self.ep is not None)     # (cp's ring, ep's all-to-alls: the same)
            for k, chunk in enumerate(self.chunks):
                self.reducers[k] = GradReducer(chunk, self.dp, (1 << 62) if split else DEFAULT_BUCKET_BYTES)
                self.reducers[k].require_sync = True

    def close(self) -> None:
        for r in self.reducers.values():
            r.close()

    def slots(self) -> list[ParamSlot]:
        return [ParamSlot(self.name_of(unwrap_name(n), prm), prm, self.rank)
                for n, prm in self.stage.named_parameters()]


class PipelineEngine:
    """Cut the factory's nn.Sequential over the mesh's pp axis, then split each stage over tp (`compose.py`: the
    steps and their order); replicas of a stage's slots are averaged over dp.

    sequence_parallel: the stage's LayerNorm regions run on S/T tokens and each cut carries the (B, S/T, d) slice.
    virtual_stages v > 1: interleaved 1F1B, each rank holding v chunks of a v·p-way cut (schedule.py)."""

    def __init__(self, schedule: str = "1f1b", micro_batches: int = 4, loss_fn: Any = None,
                 stage_time: tuple[float, float] | None = None, checkpoint_activations: bool = False,
                 report_loss: bool = True, measure: bool = False, log: CommLog | None = None,
                 sequence_parallel: bool = False, regather: bool = False, virtual_stages: int = 1) -> None:
        self.kw = dict(schedule=schedule, micro_batches=micro_batches, loss_fn=loss_fn, stage_time=stage_time,
                       report_loss=report_loss, measure=measure)
        self.virtual_stages = virtual_stages
        self.checkpoint_activations = checkpoint_activations
        self.sequence_parallel, self.regather = sequence_parallel, regather
        self.log = log

    def build(self, model_factory: ModelFactory, mesh: DeviceMesh) -> PipelineReplica:
        from .compose import compose
        c = compose(model_factory, mesh, self.log if self.log is not None else CommLog(), self.sequence_parallel,
                    self.regather, self.checkpoint_activations, virtual_stages=self.virtual_stages)
        if not isinstance(c.module, nn.Sequential):
            raise EngineError(f"pipeline parallelism cuts an nn.Sequential into stages; got {type(c.module).__name__}")
        kw = dict(self.kw)
        if c.sequence_parallel and kw["loss_fn"] is None:
            from .models import lm_loss
            kw["loss_fn"] = lm_loss
        return PipelineReplica(c.module, c.pp, c.dp, c.rank, sp=c.tp if c.sequence_parallel else None,
                               replicated=c.replicated, name_of=c.name_of, chunk_bounds=c.chunk_bounds, cp=c.cp,
                               moe=c.moe, ep=c.ep, **kw)

