"""Communication of one training step, modelled: bytes per kind and link, and the seconds each costs a rank.

    step_comm(shape, layout, cluster, placement="packed", algorithm="ring", act_bytes=2, grad_bytes=2,
              overlap=False, steps=None) -> [CommTerm(kind, link, bytes, seconds, overlappable, formula), ...]

bytes: sent per training step, summed over all ranks (what `experiments/results/bytes.py` calls a kind's bytes);
seconds: what this communication adds to one rank's critical path per step (the slowest group of the kind), α-β on
the link the group spans: a message of B bytes costs α + B/β (cluster.link("intra" | "inter")).

Where ranks sit (packed | spread) and what each collective costs on its group: `comm_cost.py`.

Groups whose members sit on nodes in the same pattern (and on the same stage) cost the same: each is computed once
(`Placement.group_classes`). Notation: b micro-batch, s sequence, h hidden, L layers, V vocabulary, m micro-batches
per step (layout.micro_batches, default p), D/T/P/C/E the dp/tp/pp/cp/ep degrees, v = layout.virtual_stages (model
chunks per pipeline stage, interleaved 1F1B), A = b·(s/C)·h·act_bytes (one micro-batch's activation on one rank),
Ψ_k the parameters of a rank of pipeline stage k, g = grad_bytes, N the group's size, S a tensor's bytes.

Textbook rules (algorithm "ring", NCCL-like):

    tp activations   Megatron f/g (Shoeybi et al. 2019): per layer and micro-batch 2 all-reduces of A forward, 2
                     backward; full recompute runs the forward's 2 again (Korthikanti et al. 2022); sequence
                     parallelism: all-gathers + reduce-scatters, the same bytes. Σ = D·C·E·T·L·m·(4|6)·2(T−1)/T·A
    pp boundaries    per boundary and micro-batch the activation forward and its gradient back; each tp/cp/ep rank
                     of a stage sends its own A (under sp its S/T slice, A/T: Korthikanti et al.):
                     Σ = D·C·E·T·(P−1)·m·2·A; a rank's time: the messages it sends, each on the link it
                     crosses (comm_cost.py) — m·(α + A/β) per cut it borders: m for the first and last stage, 2m
                     for an inner one; interleaved 1F1B (v chunks per stage): P·v − 1 cuts,
                     Σ = D·C·E·T·(P·v−1)·m·2·A, up to 2v·m messages a rank
    dp gradient sync all-reduce of Ψ_k·g over the D ranks (hierarchical across nodes): Σ_ranks 2(D−1)/D·Ψ_k·g
    zero RS + AG     ZeRO 1: reduce-scatter of the gradients + all-gather of the parameters, Σ 2(D−1)/D·Ψ_k·g per
                     step; with m micro-batches of gradient accumulation ZeRO 2 reduce-scatters after each one:
                     (m+1)(D−1)/D; ZeRO 3 also all-gathers the parameters for each micro-batch's forward and
                     backward: 3m(D−1)/D (Rajbhandari et al. 2020; DeepSpeed, FSDP)
    cp ring + grads  ring attention per layer and micro-batch: K, V forward 2(C−1) blocks, backward 2(C−1) + 2C
                     blocks of b·(s/C)·h·act_bytes (ring_attention.ring_bytes: 6C − 4 blocks in 3C − 2 messages
                     around the cp ring); + the gradients summed over cp
    ep all-to-all    the Shape has no experts: every layer's MLP taken as a top-1 MoE with capacity factor 1; per
                     layer and micro-batch 4 all-to-alls (dispatch, combine, forward and backward) of A, (E−1)/E·A
                     each; + the gradients summed over ep
    Stages: memory_model.stage_layers (L/P layers each, the embeddings on the first, the head on the last).

algorithm "pslab" — what pslab's zmq backend and engines send (so that for pslab's fp32 runs, act_bytes =
grad_bytes = 4, the bytes per kind EQUAL the engines' measured ones; tests/experiments/test_engine_runs.py):

    all-reduce       S <= 32 KiB (collectives.zmq_group.SMALL_BYTES): one direct exchange, (N−1)·S per rank;
                     else hierarchical where it applies (any group, not only dp), else the ring
    stages           pipeline.split_stages: the L + 2 parameterised children [Embed, Block × L, Head] cut by
                     chunk_bounds(L + 2, P) (interleaved: by chunk_bounds(L + 2, P·v), rank k holding chunks
                     k, k + P, …; a micro-batch crosses P·v − 1 cuts, rank P−1 sending on to rank 0)
    dp gradient sync one flat all-reduce of the stage's gradients (engine.allreduce_grads), or with overlap (the
                     data-parallel and pipeline engines) one per DDP bucket (data.py: ≤ 25 MiB, parameters in
                     reverse order; a pipeline stage's in its last micro-batch's backward)
    zero RS + AG     packed ring collectives (zero.py, `zero_packed`): a reduce-scatter per unit (a module's own
                     parameters; ZeRO-1: per 25 MiB bucket of units), an all-gather of all parameters (ZeRO 1-2) or
                     two per unit (ZeRO-3); a unit's buffer D·Σ_p ⌈n_p/D⌉ elements. ZeRO-2 in a pipeline is the
                     distributed optimizer's stage 2: per slot, a reduce-scatter after each of the m micro-batches'
                     backward and one all-gather
    tp + sp          + the replicated parameters' gradients all-reduced over tp (R bytes, per stage) and the loss
                     (8 B, the last stage's tp ranks), once per step (sequence.py, pipeline.py)
    pp boundaries    + the loss broadcast from the last stage (4 B, 8 B under sp; direct: (P−1)·4 per pipeline)
                     every step, and
                     once per run a 64-byte shape header per boundary (pipeline.py: int64 × 8)
    cp ring + grads  + the loss all-reduced over cp (8 B)
    one-off bytes (the shape headers; the hierarchical all-reduce's set-up barrier, 1 byte to every peer) count
    only when `steps` is given: spread over that many steps, as a run's summary reports them.
    seconds          every ring pass's latency hop by hop, with its closing acknowledgement (collectives/ring.py:
                     one more latency before a member may reuse its buffers; `comm_cost.pass_latency`): 2 members
                     across a slow link pay 2 latencies per reduce-scatter, not 1 (`pslab plan --check` measured it
                     in latency-bound ZeRO-3 and sequence-parallel layouts)

dp/zero gradient terms are `overlappable` (they may hide behind backward compute: step_model decides how much).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pslab.collectives.group import chunk_bounds
from pslab.collectives.zmq_group import SMALL_BYTES

from .cluster import Cluster
from .comm_cost import (PLACEMENTS, CommModelError, Cost, Placement, _slowest, all_reduce, all_to_all, ring,  # noqa: F401
                        setup_barrier)
from .memory_model import Layout, Shape, stage_layers

ALGORITHMS = ("ring", "pslab")
KINDS = ("dp gradient sync", "zero RS + AG", "tp activations", "pp boundaries", "cp ring + grads",
         "ep all-to-all + grads")
BUCKET_BYTES = 25 << 20        # parallelism/data.py DEFAULT_BUCKET_BYTES
HEADER_BYTES = 8 * 8           # pipeline.py: a shape header is _MAX_DIMS + 2 int64


@dataclass(frozen=True)
class CommTerm:
    kind: str            # one of KINDS (experiments/results/bytes.py's names)
    link: str            # "intra" | "inter": the link class the bytes cross
    bytes: float         # bytes sent per training step, summed over all ranks
    seconds: float       # time on one rank's critical path per step (α-β on that link)
    overlappable: bool   # dp / zero gradient communication: may hide behind backward compute
    formula: str
    wire_seconds: float = 0.0   # of `seconds`, the bytes' B/β (the rest is latency: each message's α)

    def as_dict(self) -> dict:
        return asdict(self)


# ---- the model's parameters, as the engines hold them --------------------------------------------------------

def layer_tensors(shape: Shape, t: int = 1) -> list[int]:
    """Elements of one Block's parameters in registration order (ln1, qkv, proj, ln2, fc1, fc2; weight, bias),
    the column-parallel ones (qkv, proj.weight, fc1, fc2.weight) split by t."""
    h = shape.hidden
    return [h, h, 3 * h * h // t, 3 * h // t, h * h // t, h, h, h, 4 * h * h // t, 4 * h // t, 4 * h * h // t, h]


def stage_units(shape: Shape, layout: Layout, stage: int) -> list[int]:
    """The engines' units [Embed, Block × L, Head] (0 .. L+1) one rank of `stage` holds: pipeline.rank_chunks, the
    L + 2 units cut by chunk_bounds(L + 2, P·v), chunks stage, stage + P, … (v = 1: chunk_bounds(L + 2, P))."""
    return [u for units in _chunk_units(shape, layout, stage) for u in units]


def _chunk_units(shape: Shape, layout: Layout, stage: int) -> list[range]:
    """The units of each of a rank's chunks (one without interleaving)."""
    p, v = layout.pp, layout.virtual_stages
    return [range(a, b) for a, b in chunk_bounds(shape.layers + 2, p * v)[stage::p]]


def _unit_tensors(shape: Shape, t: int, u: int) -> list[int]:
    """Elements of the parameters of unit u of [Embed, Block × L, Head] on one tp rank."""
    h = shape.hidden
    if u == 0:
        return [shape.vocab * h, shape.seq * h]
    return [h, h, shape.vocab * h, shape.vocab] if u == shape.layers + 1 else layer_tensors(shape, t)


def chunk_tensors(shape: Shape, layout: Layout, stage: int) -> list[list[int]]:
    """Per model chunk of a rank of `stage` (one without interleaving), its parameters' elements (pslab's cut)."""
    return [[n for u in units for n in _unit_tensors(shape, layout.tp, u)]
            for units in _chunk_units(shape, layout, stage)]


def stage_tensors(shape: Shape, layout: Layout, stage: int, algorithm: str) -> list[int]:
    """Elements of the parameters one rank of `stage` holds, in registration order."""
    t, p = layout.tp, layout.pp
    if algorithm == "pslab":
        return [n for u in stage_units(shape, layout, stage) for n in _unit_tensors(shape, t, u)]
    n = stage_layers(shape.layers, p, stage)
    return ((_unit_tensors(shape, t, 0) if stage == 0 else []) + layer_tensors(shape, t) * n
            + (_unit_tensors(shape, t, shape.layers + 1) if stage == p - 1 else []))


def stage_blocks(shape: Shape, layout: Layout, stage: int, algorithm: str) -> int:
    if algorithm == "pslab":
        return sum(1 for u in stage_units(shape, layout, stage) if 0 < u <= shape.layers)
    return stage_layers(shape.layers, layout.pp, stage)


def replicated_tensors(shape: Shape, layout: Layout, stage: int, algorithm: str) -> int:
    """Elements of the parameters tensor parallelism leaves whole on a rank of `stage` (LayerNorms, the row-parallel
    biases, the embeddings, the head)."""
    if layout.tp == 1:
        return 0
    full = sum(stage_tensors(shape, layout, stage, algorithm))
    split = stage_blocks(shape, layout, stage, algorithm) * (12 * shape.hidden ** 2 + 7 * shape.hidden)
    return full - split // layout.tp


def zero_packed(shape: Shape, layout: Layout, stage: int, D: int, e: int, zero: int) -> tuple[list[int], list[int]]:
    """The elements of each packed reduce-scatter and all-gather pslab's ZeRO runs per step on a rank of `stage`
    (zero.py): a module owning parameters is a unit (Embed's two embeddings one each, every Linear and LayerNorm its
    weight and bias), its packed buffer D·Σ_p ⌈n_p/D⌉; reduce-scatters per unit (stage 1: per 25 MiB bucket of
    units in reverse order), all-gathers of all parameters at once (stages 1-2) or per unit, twice (stage 3)."""
    units: list[list[int]] = []
    for u in stage_units(shape, layout, stage):
        ts = _unit_tensors(shape, layout.tp, u)
        units += [[n] for n in ts] if u == 0 else [ts[i:i + 2] for i in range(0, len(ts), 2)]
    packed = [D * sum(-(-n // D) for n in unit) for unit in units]
    if zero == 1:
        rs: list[int] = []
        cur, size = [], 0                               # zero.py's buckets: whole units, at most 25 MiB of them
        for unit, n in zip(reversed(units), reversed(packed)):
            if cur and size + sum(unit) * e > BUCKET_BYTES:
                rs.append(sum(cur))
                cur, size = [], 0
            cur.append(n)
            size += sum(unit) * e
        rs += [sum(cur)] if cur else []
    else:
        rs = packed
    return rs, (packed * 2 if zero == 3 else [sum(packed)])


def buckets(tensors: list[int], e: int, bucket_bytes: int = BUCKET_BYTES) -> list[int]:
    """DDP buckets (data.py GradReducer): parameters in reverse order, a bucket closed before it would exceed
    bucket_bytes; elements per bucket."""
    out: list[int] = []
    cur = size = 0
    for n in reversed(tensors):
        if cur and size + n * e > bucket_bytes:
            out.append(cur)
            cur = size = 0
        cur += n
        size += n * e
    if cur:
        out.append(cur)
    return out


# ---- the kinds -----------------------------------------------------------------------------------------------

class _Kind:
    """One kind's cost: per group a Cost; bytes summed over the groups, seconds those of the slowest group."""

    def __init__(self, name: str, formula: str, overlappable: bool = False) -> None:
        self.name, self.formula, self.overlappable = name, formula, overlappable
        self.bytes = {"intra": 0.0, "inter": 0.0}
        self.secs = {"intra": 0.0, "inter": 0.0}
        self.wire = {"intra": 0.0, "inter": 0.0}

    def group(self, c: Cost, once: Cost | None = None, steps: int | None = None, times: int = 1) -> None:
        """Add `times` groups that each cost `c` per step (+ `once` per run, spread over `steps`)."""
        for k in self.bytes:
            self.bytes[k] += times * c.bytes[k] + (times * once.bytes[k] / steps if once is not None and steps else 0)
        if sum(c.secs.values()) > sum(self.secs.values()):
            self.secs, self.wire = dict(c.secs), dict(c.wire)

    def terms(self) -> list[CommTerm]:
        return [CommTerm(self.name, k, float(self.bytes[k]), self.secs[k], self.overlappable, self.formula,
                         self.wire[k]) for k in ("intra", "inter") if self.bytes[k] > 0 or self.secs[k] > 0]


def cut_elements(shape: Shape, lay: Layout) -> int:
    """Elements one rank sends over a pipeline cut per micro-batch: its activation b·(s/C)·h, under sequence
    parallelism the tp rank's S/T slice of it."""
    A = shape.micro_batch * (shape.seq // lay.cp) * shape.hidden
    return A // lay.tp if lay.sp and lay.tp > 1 else A


def _terms(shape: Shape, lay: Layout, pl: Placement, algorithm: str, act: int, g: int, overlap: bool,
           steps: int | None) -> list[CommTerm]:
    D, T, P, C, E = lay.dp, lay.tp, lay.pp, lay.cp, lay.ep
    pslab = algorithm == "pslab"
    small = SMALL_BYTES if pslab else 0
    m = lay.micro_batches or P
    b, s, h = shape.micro_batch, shape.seq // C, shape.hidden
    A = b * s * h                                    # elements of one micro-batch's activation on one rank
    stage = lambda grp: pl.coord(grp[0], "pp")       # noqa: E731
    psi = [sum(stage_tensors(shape, lay, k, algorithm)) for k in range(P)]
    out: list[CommTerm] = []

    def once(grp: list[int], c: Cost) -> Cost | None:
        """pslab's one-off bytes of a group: the set-up barrier of its first hierarchical all-reduce."""
        return setup_barrier(pl, grp) if pslab and c.hierarchical else None

    if T > 1:
        per_layer = 6 if lay.recompute == "full" else 4
        kind = _Kind("tp activations", f"D·C·E·T·L·m·{per_layer}·AR_T(A), A = b·(s/C)·h·{act} B = {A * act} B"
                     + (" as all-gathers + reduce-scatters (sp)" if lay.sp else "")
                     + (" + AR_T(R) + AR_T(8 B loss), once per step" if lay.sp and pslab else "")
                     + ("; AR: direct (T−1)·S for S <= 32 KiB, else ring" if pslab else "; AR: ring 2(T−1)/T·S"))
        for grp, times in pl.group_classes("tp"):
            k = stage(grp)
            n = stage_blocks(shape, lay, k, algorithm) * m * per_layer
            if lay.sp:
                c = Cost().add(ring(pl, grp, A, act, "ag", pslab), n).add(ring(pl, grp, A, act, "rs", pslab), n)
                if pslab:
                    c.add(all_reduce(pl, grp, replicated_tensors(shape, lay, k, algorithm), g, small, ack=pslab))
                    if k == P - 1:                         # the loss: scored on the last stage only
                        c.add(all_reduce(pl, grp, 1, 8, small, ack=pslab))
            else:
                c = Cost().add(all_reduce(pl, grp, A, act, small, hierarchical=pslab, ack=pslab), n)
            kind.group(c, once(grp, c), steps, times)
        out += kind.terms()

    if P > 1:
        V = lay.virtual_stages                        # interleaved: a micro-batch crosses P·V − 1 cuts, wrapping
        cut = cut_elements(shape, lay)
        loss_b = 8 if (lay.sp and T > 1) or C > 1 else 4   # (and the loss it reports is float64 under sp, cp)
        cuts = f"(P·v−1), v = {V}" if V > 1 else "(P−1)"
        kind = _Kind("pp boundaries", f"D·C·E·T·{cuts}·m·2·A{'/T' if cut != A else ''}, A = {A * act} B"
                     + (f" + (P−1)·{loss_b} B loss broadcast + 64 B shape header per cut once" if pslab else ""))
        for grp, times in pl.group_classes("pp"):
            c, header = Cost(), Cost()
            for k in range(P * V - 1):                # cut k: rank k mod P -> rank (k+1) mod P
                src, dst = grp[k % P], grp[(k + 1) % P]
                c.send(pl, src, dst, m * cut * act)
                c.send(pl, dst, src, m * cut * act)
                header.send(pl, src, dst, HEADER_BYTES)
            if pslab:
                for k in range(P - 1):
                    c.send(pl, grp[-1], grp[k], loss_b)
            # one rank's time: a middle stage sends m activations forward and m gradients back per cut it owns
            for k in range(P):
                t = Cost()
                fwd = sum(1 for c_ in range(k, P * V - 1, P))
                bwd = sum(1 for c_ in range(k, P * V, P) if c_ > 0)
                if fwd:
                    t.wait(pl, pl.link(grp[k], grp[(k + 1) % P]), m * fwd, m * fwd * cut * act)
                if bwd:
                    t.wait(pl, pl.link(grp[k], grp[(k - 1) % P]), m * bwd, m * bwd * cut * act)
                if sum(t.secs.values()) > sum(c.secs.values()):
                    c.secs, c.wire = t.secs, t.wire
            kind.group(c, header if pslab else None, steps, times)
        out += kind.terms()

    if D > 1 and lay.zero:
        k3 = 3 if lay.zero == 3 else 2
        # textbook, with m micro-batches of gradient accumulation (DeepSpeed / FSDP): ZeRO-1 keeps whole gradients
        # and reduce-scatters once per step; ZeRO-2 keeps only its gradient shard, so it reduce-scatters after every
        # micro-batch's backward; ZeRO-3 also all-gathers the parameters for every micro-batch's forward and backward
        dist2 = pslab and lay.zero == 2 and P > 1      # pslab's ZeRO-2 in a pipeline: the distributed optimizer,
        # per slot, a reduce-scatter after each micro-batch's backward and one all-gather (distributed_optimizer.py)
        n_rs, n_ag = {1: (1, 1), 2: (m, 1), 3: (m, 2 * m)}[lay.zero] if not pslab or dist2 else (1, k3 - 1)
        rule = f"{n_rs + n_ag}(D−1)/D" if not pslab or dist2 else f"{k3}(D−1)/D"
        kind = _Kind("zero RS + AG", f"Σ_ranks {rule}·Ψ_k·{g} B (ZeRO-{lay.zero}: reduce-scatter the gradients"
                     + (f" × {n_rs} micro-batches" if n_rs > 1 else "") + ", all-gather the parameters"
                     + (f" × {n_ag} (forward and backward of each micro-batch)" if n_ag > 1 and not pslab else "")
                     + (", twice" if lay.zero == 3 and pslab else "") + ")"
                     + ("; per slot, ring" if dist2 else "; packed per unit (a module's parameters), ring"
                        if pslab else ""), True)
        for grp, times in pl.group_classes("dp"):
            c = Cost()
            if dist2:
                for n in stage_tensors(shape, lay, stage(grp), algorithm):
                    c.add(ring(pl, grp, n, g, "rs", pslab), m).add(ring(pl, grp, n, g, "ag", pslab))
            elif pslab:
                rs, ag = zero_packed(shape, lay, stage(grp), D, g, lay.zero)
                for n in rs:
                    c.add(ring(pl, grp, n, g, "rs", pslab))
                for n in ag:
                    c.add(ring(pl, grp, n, g, "ag", pslab))
            else:
                c.add(ring(pl, grp, psi[stage(grp)], g, "rs", pslab), n_rs).add(
                    ring(pl, grp, psi[stage(grp)], g, "ag", pslab), n_ag)
            kind.group(c, times=times)
        out += kind.terms()
    elif D > 1:
        bucketed = pslab and overlap and C == E == 1 and (T == 1 or P > 1)   # the data and pipeline engines
        kind = _Kind("dp gradient sync", f"Σ_ranks AR_D(Ψ_k·{g} B)" + (" per DDP bucket (25 MiB)" if bucketed else "")
                     + ("; AR: direct (D−1)·S for S <= 32 KiB, hierarchical across nodes, else ring 2(D−1)/D·S"
                        if pslab else "; AR: ring 2(D−1)/D·S, hierarchical across nodes"), True)
        for grp, times in pl.group_classes("dp"):
            k = stage(grp)
            # the pipeline engine reduces each model chunk on its own (interleaved: v reducers), a tp-split stage's
            # chunk in one bucket (pipeline.enable_overlapped_sync)
            parts = ([n for ch in chunk_tensors(shape, lay, k) for n in ([sum(ch)] if T > 1 else buckets(ch, g))]
                     if bucketed else [psi[k]])
            c = Cost()
            for n in parts:
                c.add(all_reduce(pl, grp, n, g, small, ack=pslab))
            kind.group(c, once(grp, c), steps, times)
        out += kind.terms()

    if C > 1:
        block = b * s * (h // T) * act                # under tp × cp each tp rank's ring carries its heads' d/T
        kind = _Kind("cp ring + grads", f"D·C·T·(L·m·(6C−4 | 8C−6 with full recompute)·block + AR_C(Ψ_k·{g} B)"
                     + (" + AR_C(8 B loss)" if pslab else "") + f"), block = b·(s/C)·(h/T)·{act} B = {block} B",
                     False)
        blocks = 8 * C - 6 if lay.recompute == "full" else 6 * C - 4   # full recompute replays the forward ring
        for grp, times in pl.group_classes("cp"):
            k = stage(grp)
            layers = stage_blocks(shape, lay, k, algorithm) * m
            c = Cost()
            for i in range(C):
                c.send(pl, grp[i], grp[(i + 1) % C], layers * blocks * block)
            c.wait(pl, _slowest(pl.link(grp[i], grp[(i + 1) % C]) for i in range(C)), layers * blocks // 2,
                   layers * blocks * block)
            c.add(all_reduce(pl, grp, psi[k], g, small, ack=pslab))
            if pslab and k == P - 1:                   # the loss: scored on the last stage only
                c.add(all_reduce(pl, grp, 1, 8, small, ack=pslab))
            kind.group(c, once(grp, c), steps, times)
        out += kind.terms()

    if E > 1:
        kind = _Kind("ep all-to-all + grads", f"D·E·(4·L·m·(E−1)/E·A + AR_E(Ψ_k·{g} B)), A = {A * act} B (every MLP "
                     "a top-1 MoE with capacity factor 1: an approximation)")
        for grp, times in pl.group_classes("ep"):
            k = stage(grp)
            n = stage_blocks(shape, lay, k, algorithm) * m * 4
            c = Cost().add(all_to_all(pl, grp, A * act), n).add(all_reduce(pl, grp, psi[k], g, small, ack=pslab))
            kind.group(c, once(grp, c), steps, times)
        out += kind.terms()
    return out


def step_comm(shape: Shape, layout: Layout, cluster: Cluster, *, placement: str = "packed",
              algorithm: str = "ring", act_bytes: int = 2, grad_bytes: int = 2, overlap: bool = False,
              steps: int | None = None) -> list[CommTerm]:
    """The communication of one training step of `layout` on `cluster` (see the module docstring).
    overlap: the data-parallel engine's bucketed, overlapped gradient all-reduce (pslab: one all-reduce per bucket);
    steps: spread one-off bytes (pipeline shape headers, the hierarchical set-up barrier) over that many steps."""
    if algorithm not in ALGORITHMS:
        raise CommModelError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    if shape.seq % layout.cp:
        raise CommModelError(f"the sequence ({shape.seq}) must be divisible by --cp {layout.cp}")
    if shape.heads % layout.tp:
        raise CommModelError(f"--tp {layout.tp} must divide the {shape.heads} attention heads")
    if layout.pp > shape.layers + (2 if algorithm == "pslab" else 0):
        raise CommModelError(f"--pp {layout.pp} exceeds the {shape.layers} layers")
    if steps is not None and steps < 1:
        raise CommModelError(f"steps must be >= 1, got {steps}")
    return _terms(shape, layout, Placement(layout, cluster, placement), algorithm, act_bytes, grad_bytes, overlap,
                  steps)


def bytes_by_kind(terms: list[CommTerm]) -> dict[str, float]:
    """{kind: bytes per step, summed over links}."""
    out: dict[str, float] = {}
    for t in terms:
        out[t.kind] = out.get(t.kind, 0.0) + t.bytes
    return out


def bytes_by_link(terms: list[CommTerm]) -> dict[str, float]:
    """{"intra": bytes, "inter": bytes} per step over all kinds."""
    out = {"intra": 0.0, "inter": 0.0}
    for t in terms:
        out[t.link] += t.bytes
    return out
