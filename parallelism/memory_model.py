"""Bytes per GPU of a training layout, modelled: model state (ZeRO) + saved activations (Korthikanti et al.).

Model state (Rajbhandari et al. 2020, "ZeRO", §3 and Fig. 1; the formula itself is `zero_memory.zero_bytes_per_rank`,
called here, not repeated): Ψ parameters on this rank, bytes per parameter (p, g, K) of the precision recipe:

    fp32        4 + 4 + 8  = 16 B/param   fp32 weights and grads, Adam exp_avg + exp_avg_sq (no master copy)
    mixed       2 + 2 + 12 = 16 B/param   bf16/fp16 weights and grads, fp32 master + two Adam moments (ZeRO's K = 12;
                                          the article's "~12–16 bytes per parameter")
    bf16-pure   2 + 2 + 4  =  8 B/param   everything in bf16, Adam moments included (no master copy)
    fp32-sgd    4 + 4 + 4  = 12 B/param   SGD with momentum          fp32-sgd0: 4 + 4 + 0 (plain SGD)

    stage 0 (p+g+K)Ψ,  1: (p+g)Ψ + KΨ/N_d,  2: pΨ + (g+K)Ψ/N_d,  3: (p+g+K)Ψ/N_d          (ZeRO, N_d = dp degree)

Ψ on a rank: tensor parallelism divides the layers' weight matrices by t (Megatron, Shoeybi et al. 2019; the
LayerNorms, the row-parallel biases, the embeddings and the head stay replicated here, as in `tensor.py`), pipeline
parallelism gives a stage L/p layers (the first stage also the embeddings, the last the head: Narayanan et al. 2021),
expert parallelism divides the experts' parameters by e. Given only a parameter count, Ψ_rank = Ψ_dense/(t·p) +
Ψ_experts/(t·p·e).

Activations per layer saved for backward (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", §4 and Table 2; 16-bit activations, s sequence, b micro-batch, h hidden, a heads, t tp degree):

    no parallelism             sbh(34 + 5as/h)
    tensor parallel            sbh(10 + 24/t + 5as/(ht))
    tensor + sequence parallel sbh/t · (34 + 5as/h)
    selective recompute        sbh(10 + 24/t)   with SP: sbh · 34/t       (the 5as²b attention scores recomputed)
    full recompute             2sbh             with SP: 2sbh/t           (only the layer input kept)

plus the output layer (§4.3): LayerNorm input and linear input 4sbh (/t with SP) and the fp32 logits 4sbv/t. Other
activation widths e scale the 16-bit figures by e/2 (fp32: ×2; the masks' 1-byte terms scale with them: an
approximation). Context parallelism (ring attention) puts s/c tokens on each rank: s → s/c. Pipelines: with 1F1B
stage k holds min(p − k, m) micro-batches in flight (Narayanan et al. 2021), GPipe all m; the first stage of 1F1B
holds p micro-batches of L/p layers = L layers' worth, however many stages. Interleaved 1F1B (v chunks of L/(pv)
layers per stage) holds min(2(p−k−1) + (v−1)p + 1, v·m) chunk-micro-batches on stage k (its warm-up, schedule.py),
i.e. that / v stage-micro-batches: p + (p−1)/v on the first stage, (1 + (p−1)/(pv)) times 1F1B's (Korthikanti et
al. 2022, §4.2.3).

For pslab's own fp32 `tiny_transformer` (no dropout, fused attention) the exact counts are
`parallelism.sequence.model_activation_bytes` (dp, tp, tp + sp) and, derived here:

    checkpointed blocks  embed + max((L+1)·e·sbh + max(loss, recomputed head), L·e·sbh + recomputed block)
                         (`tiny_checkpointed_activation_bytes`: only block and head inputs stay saved)
    pipeline stage k     in_flight · (positions on stage 0 + n_k · layer − e·sbh on k > 0 [the received input is a
                         leaf, not metered] + head on the last stage) [the received gradient is handed to autograd's
                         engine, not saved: `pipeline.backward_from`]
                         + the whole batch's ids / targets once (`tiny_stage_activation_bytes`)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .mesh import MeshLayout
from .zero_memory import StateBytes, zero_bytes_per_rank

PRECISIONS: dict[str, tuple[tuple[int, int, int], int]] = {   # name: ((p, g, K), activation bytes per element)
    "fp32": ((4, 4, 8), 4),
    "mixed": ((2, 2, 12), 2),
    "bf16-pure": ((2, 2, 4), 2),
    "fp32-sgd": ((4, 4, 4), 4),
    "fp32-sgd0": ((4, 4, 0), 4),
}
RECOMPUTE = ("none", "selective", "full")
ZERO_SRC = "Rajbhandari et al. 2020 (ZeRO) §3"
ACT_SRC = "Korthikanti et al. 2022 §4, Table 2"


class MemoryModelError(ValueError):
    """An impossible shape or layout; the message says what to change."""


@dataclass(frozen=True)
class Shape:
    """A GPT-style transformer: L layers, hidden h, a heads, sequence s, vocabulary v, micro-batch b (ffn = 4h)."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    micro_batch: int = 1

    def layer_params(self) -> tuple[int, int]:
        """(split by TP, replicated) parameters of one layer: qkv 3h²+3h, proj h², fc1 4h²+4h, fc2 4h²;
        replicated: two LayerNorms 4h, the row-parallel biases 2h (total 12h² + 13h)."""
        h = self.hidden
        return 12 * h * h + 7 * h, 6 * h

    def embed_params(self) -> int:
        return self.vocab * self.hidden + self.seq * self.hidden        # token + learned position embeddings

    def head_params(self) -> int:
        return 2 * self.hidden + self.hidden * self.vocab + self.vocab   # final LayerNorm + untied output linear

    def params(self) -> int:
        return self.embed_params() + self.layers * sum(self.layer_params()) + self.head_params()


@dataclass(frozen=True)
class Layout(MeshLayout):
    """How one model is laid out: the mesh's degrees (dp, pp, tp, cp, ep: mesh.MeshLayout, whose coordinates and
    groups it shares), ZeRO stage, recompute, pipeline schedule."""

    zero: int = 0
    sp: bool = False
    recompute: str = "none"
    micro_batches: int | None = None    # per step (pipeline); None: p (the 1F1B steady state)
    schedule: str = "1f1b"
    virtual_stages: int = 1             # model chunks per pipeline stage (v > 1: interleaved 1F1B)

    def __post_init__(self) -> None:
        for k in ("dp", "tp", "pp", "cp", "ep"):
            if getattr(self, k) < 1:
                raise MemoryModelError(f"--{k} must be >= 1, got {getattr(self, k)}")
        if self.zero not in (0, 1, 2, 3):
            raise MemoryModelError(f"--zero must be 0, 1, 2 or 3, got {self.zero}")
        if self.recompute not in RECOMPUTE:
            raise MemoryModelError(f"--recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        if self.schedule not in ("1f1b", "gpipe"):
            raise MemoryModelError(f"--schedule must be 1f1b or gpipe, got {self.schedule!r}")
        if self.sp and self.tp == 1:
            raise MemoryModelError("sequence parallelism splits over the tp ranks: use --tp > 1 with --sp")
        v = self.virtual_stages
        if type(v) is not int or v < 1:
            raise MemoryModelError(f"--virtual-stages must be an integer >= 1, got {v!r}")
        if v > 1 and (self.pp == 1 or self.schedule != "1f1b"):
            raise MemoryModelError("--virtual-stages > 1 interleaves 1F1B: it needs --pp > 1 and --schedule 1f1b")
        if v > 1 and (self.micro_batches or self.pp) % self.pp:
            raise MemoryModelError(f"interleaved 1F1B runs micro-batches in groups of pp = {self.pp}: "
                                   f"--micro-batches must be a multiple of {self.pp}")

    def gpus(self) -> int:
        return self.world_size

    def describe(self) -> str:
        parts = [f"{k}={getattr(self, k)}" for k in ("dp", "tp", "pp", "cp", "ep") if getattr(self, k) > 1]
        parts += ["sp"] * self.sp + [f"zero{self.zero}"] * bool(self.zero)
        parts += [f"recompute={self.recompute}"] * (self.recompute != "none")
        parts += [f"v={self.virtual_stages}"] * (self.virtual_stages > 1)
        return " ".join(parts) or "1 GPU"

    def in_flight(self, stage: int = 0) -> float:
        """Micro-batches whose activations stage `stage` holds at once: 1F1B min(p − k, m), GPipe m; interleaved
        min(2(p−k−1) + (v−1)p + 1, v·m) / v (chunks of 1/v of a stage's layers; module docstring)."""
        m, p, v = self.micro_batches or self.pp, self.pp, self.virtual_stages
        if v > 1:
            return min(2 * (p - stage - 1) + (v - 1) * p + 1, v * m) / v
        return m if self.schedule == "gpipe" else min(self.pp - stage, m)


@dataclass
class Term:
    name: str
    bytes: float
    formula: str
    source: str


@dataclass
class Estimate:
    """Bytes per GPU (the given pipeline stage), term by term."""

    layout: Layout
    precision: str
    params: float                       # Ψ on this rank before ZeRO
    terms: list[Term] = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(t.bytes for t in self.terms)

    def get(self, name: str) -> float:
        return sum(t.bytes for t in self.terms if t.name == name)

    def as_dict(self) -> dict:
        return {"layout": self.layout.describe(), "precision": self.precision, "params_on_rank": self.params,
                "total_bytes": self.total,
                "terms": [{"term": t.name, "bytes": t.bytes, "formula": t.formula, "source": t.source}
                          for t in self.terms]}


def _precision(name: str) -> tuple[tuple[int, int, int], int]:
    if name not in PRECISIONS:
        raise MemoryModelError(f"unknown precision {name!r}; choose one of: {', '.join(PRECISIONS)}")
    return PRECISIONS[name]


def stage_layers(layers: int, pp: int, stage: int) -> int:
    """Layers on pipeline stage `stage` (the remainder on the first stages, as `chunk_bounds`)."""
    if pp > layers:
        raise MemoryModelError(f"--pp {pp} exceeds the {layers} layers: use pp <= {layers}")
    base, extra = divmod(layers, pp)
    return base + (1 if stage < extra else 0)


def rank_params(shape: Shape | None, layout: Layout, params: float = 0.0, expert_params: float = 0.0,
                stage: int = 0) -> float:
    """Ψ held by one rank of `stage` (see the module docstring): exact for a Shape, else Ψ/(t·p) (+ experts /e)."""
    t, p = layout.tp, layout.pp
    if shape is None:
        if expert_params > params:
            raise MemoryModelError(f"--expert-params ({expert_params:g}) exceeds --params ({params:g})")
        return (params - expert_params) / (t * p) + expert_params / (t * p * layout.ep)
    if shape.heads % t or shape.hidden % shape.heads:
        raise MemoryModelError(f"--tp {t} must divide the {shape.heads} heads, and the heads the hidden size "
                               f"{shape.hidden}")
    split, repl = shape.layer_params()
    n = stage_layers(shape.layers, p, stage) * (split / t + repl)
    if stage == 0:
        n += shape.embed_params()
    if stage == p - 1:
        n += shape.head_params()
    return n


def layer_activation_bytes_16(s: float, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                              recompute: str = "none") -> float:
    """Korthikanti et al.'s saved bytes of one layer, 16-bit (module docstring table)."""
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    attn = 0.0 if recompute == "selective" else 5 * a * s / h
    if sp:
        return sbh / t * (34 + attn)
    return sbh * (10 + 24 / t + attn / t)


def activation_terms(shape: Shape, layout: Layout, act_bytes: int = 2, stage: int = 0) -> list[Term]:
    """Saved activations of one rank of `stage`: layers (× in-flight micro-batches) and, on the last stage, the
    output layer; e-byte activations scale the 16-bit formulas by e/2; context parallelism: s → s/c."""
    lay = layout
    if shape.seq % lay.cp or (lay.sp and shape.seq % (lay.tp * lay.cp)):
        raise MemoryModelError(f"the sequence ({shape.seq}) must be divisible by cp (x tp with --sp)")
    s, b, h, a, t, v = shape.seq / lay.cp, shape.micro_batch, shape.hidden, shape.heads, lay.tp, shape.vocab
    k, scale = lay.in_flight(stage), act_bytes / 2
    n = stage_layers(shape.layers, lay.pp, stage)
    per = layer_activation_bytes_16(s, b, h, a, t, lay.sp, lay.recompute) * scale
    form = {"none": "sbh/t(34+5as/h)" if lay.sp else "sbh(10+24/t+5as/(ht))",
            "selective": "sbh·34/t" if lay.sp else "sbh(10+24/t)", "full": "2sbh/t" if lay.sp else "2sbh"}
    terms = [Term("activations", n * k * per, f"{n} layers × {k:g} micro-batches in flight × {form[lay.recompute]}"
                  + (f" × {scale:g}" if scale != 1 else "") + (f", s/c (c={lay.cp})" if lay.cp > 1 else ""),
                  ACT_SRC)]
    if stage == lay.pp - 1:
        out = (4 * s * b * h / (t if lay.sp else 1) + 4 * s * b * v / t) * scale
        terms.append(Term("activations (output layer)", out, "4sbh(/t with SP) + 4sbv/t", "Korthikanti et al. §4.3"))
    return terms


def estimate(layout: Layout, precision: str = "mixed", params: float | None = None, shape: Shape | None = None,
             expert_params: float = 0.0, stage: int = 0) -> Estimate:
    """Bytes per GPU of pipeline stage `stage` for a model given as `params` (state only) or as a `shape`."""
    if (params is None) == (shape is None):
        raise MemoryModelError("give the model as a parameter count or as a shape, not both / neither")
    if params is not None and params <= 0:
        raise MemoryModelError(f"--params must be > 0, got {params:g}")
    if not 0 <= stage < layout.pp:
        raise MemoryModelError(f"stage {stage} is outside the {layout.pp} pipeline stages")
    (p, g, k), act = _precision(precision)
    psi = rank_params(shape, layout, params or 0.0, expert_params, stage)
    st: StateBytes = zero_bytes_per_rank(layout.zero, psi, layout.dp, (p, g, k))   # type: ignore[arg-type]
    z, n = layout.zero, layout.dp
    div = f"/N_d (N_d={n})"
    est = Estimate(layout, precision, psi)
    est.terms = [Term("params", st.params, f"{p}Ψ" + (div if z >= 3 else ""), ZERO_SRC),
                 Term("grads", st.grads, f"{g}Ψ" + (div if z >= 2 else ""), ZERO_SRC),
                 Term("optimizer", st.optimizer, f"{k}Ψ" + (div if z >= 1 else "") + f" (K={k})", ZERO_SRC)]
    if shape is not None:
        est.terms += activation_terms(shape, layout, act, stage)
    return est


# ---- exact figures for pslab's fp32 tiny_transformer (what `pslab memory --measure` compares with) ------------

def tiny_checkpointed_activation_bytes(batch: int, seq: int, d: int, heads: int, layers: int, vocab: int,
                                       e: int = 4) -> int:
    """Peak saved bytes of one step of `tiny_transformer` + `lm_loss` with every block and the head checkpointed
    (`checkpointing.wrap_children`). Forward keeps the embedding's ids and positions, the L block inputs and the
    head input; then the loss saves its log-softmax, targets and weight. Backward frees the loss first, then
    recomputes the head (LN mean/rstd, the linear input), frees its input, and recomputes each block in turn (all
    its saved tensors except the input, the checkpoint's own): peak = embed + max((L+1)·e·sbh + max(loss, head),
    L·e·sbh + block)."""
    from .sequence import layer_activation_bytes
    sb, sbh = seq * batch, seq * batch * d
    embed = 8 * sb + 8 * seq
    loss = e * sb * vocab + 8 * sb + e
    head = 2 * e * sb + e * sbh
    block = layer_activation_bytes(seq, batch, d, heads, e=e) - e * sbh
    return embed + max((layers + 1) * e * sbh + max(loss, head), layers * e * sbh + block)


def tiny_chunked_activation_bytes(batch: int, seq: int, d: int, heads: int, layers: int, vocab: int, pp: int,
                                  micro_batches: int, virtual_stages: int, stage: int, e: int = 4, t: int = 1) -> int:
    """Peak saved bytes on pipeline rank `stage` of `tiny_transformer` under interleaved 1F1B: its chunks s, s+p, …
    of the v·p-way cut (`pipeline.split_stages`: [Embed, Block × L, Head]'s parameterised children spread evenly),
    each saving per micro-batch what a stage with its blocks saves (`tiny_stage_activation_bytes`' terms: the
    positions on chunk 0, the head's on the last chunk, less the received input elsewhere), replayed along the
    rank's schedule (`schedule.interleaved_1f1b`): a forward adds its chunk's bytes, a backward frees them (the
    received output gradient goes to autograd's engine unsaved: `pipeline.backward_from`); the token ids (chunk 0) and
    targets (the last chunk) count once while a micro-batch of their chunk is in flight (views of one storage)."""
    from pslab.collectives.group import chunk_bounds
    from .schedule import interleaved_1f1b
    from .sequence import model_activation_bytes, layer_activation_bytes
    p, m, v = pp, micro_batches, virtual_stages
    b = batch // m
    sbh = seq * b * d
    sizes = [hi - lo for lo, hi in chunk_bounds(layers + 2, p * v)]   # parameterised children per chunk
    last = p * v - 1

    def per(c: int) -> int:
        blocks = sizes[c] - (c == 0) - (c == last)
        out = blocks * layer_activation_bytes(seq, b, d, heads, t, e=e)
        out += 8 * seq if c == 0 else -e * sbh
        if c == last:
            out += model_activation_bytes(b, seq, d, heads, 0, vocab, e=e) - (8 * b * seq + 8 * seq) - 8 * b * seq
        return out
    ids = 8 * batch * seq                     # token ids (chunk 0) or targets (last chunk): one storage, held
    live = {0: 0, last: 0}                    # while any micro-batch of that chunk is in flight
    cur = peak = 0
    for a in interleaved_1f1b(p, m, v).for_stage(stage):
        c = a.virtual(p)
        if a.phase == "F":
            cur += per(c)
            live[c] = live.get(c, 0) + 1
            peak = max(peak, cur + ids * sum(1 for k in (0, last) if live[k]))
        else:
            cur -= per(c)
            live[c] -= 1
    return peak


def tiny_stage_activation_bytes(batch: int, seq: int, d: int, heads: int, layers: int, vocab: int, pp: int,
                                micro_batches: int, stage: int, schedule: str = "1f1b", e: int = 4,
                                t: int = 1, cp: int = 1) -> int:
    """Peak saved bytes on pipeline stage `stage` of `tiny_transformer` ([Embed, Block × L, Head] cut as
    `pipeline.split_stages`: the blocks spread evenly, Embed on stage 0, Head on the last), micro-batch b/m:
    in_flight × (what one micro-batch saves on the stage) + the token ids (stage 0) and targets (last stage)
    once: micro-batches are views of the whole batch, one storage. The received input of stages k > 0 is a leaf
    that requires grad: the meter skips it; the received output gradient goes to autograd's engine unsaved
    (`pipeline.backward_from`). t: the stage's blocks split over t tensor-parallel ranks (3D; the
    embedding and head replicated, `sequence.layer_activation_bytes`). cp: the stage's rank holds S/C tokens of
    each sequence (pp × cp): the same terms on S/C, but its token ids and targets are per-micro-batch copies (the
    cp rank's slice) and its positions one tensor for the step."""
    from .sequence import model_activation_bytes, layer_activation_bytes
    b = batch // micro_batches
    seq //= cp
    n = stage_layers(layers, pp, stage)
    sbh = seq * b * d
    per = n * layer_activation_bytes(seq, b, d, heads, t, e=e)
    once = 0
    if stage == 0:
        if cp == 1:
            per += 8 * seq               # positions, per micro-batch
            once += 8 * batch * seq      # token ids: views of the whole batch, one storage
        else:
            per += 8 * b * seq           # token ids: the cp slice of each micro-batch
            once += 8 * seq              # positions: the cp rank's, one tensor
    else:
        per -= e * sbh
    if stage == pp - 1:
        per += model_activation_bytes(b, seq, d, heads, 0, vocab, e=e) - (8 * b * seq + 8 * seq) - 8 * b * seq
        if cp == 1:
            once += 8 * batch * seq      # targets: views of the whole batch
        else:
            per += 8 * b * seq           # targets: the cp slice of each micro-batch
    k = micro_batches if schedule == "gpipe" else min(pp - stage, micro_batches)
    return k * per + once
