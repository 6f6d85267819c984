"""Bytes per training step by kind of communication: what the backends counted, next to the textbook formula.

Kinds (each is one process group's traffic, or the PS client's payload), summed over all ranks, bytes *sent* per
step; S_r = bytes of the parameters rank r holds, D/T/P the dp/tp/pp degrees, b the per-worker batch:

    dp gradient sync      ring all-reduce of each rank's gradients      Σ_r 2(D−1)/D · S_r
    dp parameter average  local-sgd:H / diloco:H: the parameters (or θ_outer − θ_i) all-reduced after every H-th
                          step and the last, per step                    ⌈n/H⌉/n · Σ_r 2(D−1)/D · S_r
    zero RS + AG          ZeRO 1/2: reduce-scatter + all-gather          Σ_r 2(D−1)/D · S_r    (stage 3: 3(D−1)/D)
    tp activations        Megatron f/g: per attention and per MLP region (2L of them) one all-reduce forward (g)
                          and one backward (f) of the activation A = b·S·d·4 B; under a pipeline, per micro-batch
                          (a_i = A·b_i/b, the rule chosen by a_i's size); checkpointing replays g in backward
                                                                         D·T · 2L · (2 | 3) · Σ_i AR_T(a_i)
                          an MoE model: each of a rank's E/ep experts is a split MLP too, its all-reduces of the
                          (ep·b_i sequences, capacity C, d) expert buffer; under ep, D·ep tp groups on b/ep sequences
                                                  + D·ep·T · L_moe · (E/ep) · (2 | 3) · Σ_i AR_T(ep·b_i·C·d·4 B)
                          sequence parallel: 2 all-gathers / reduce-scatters per region forward, 2 backward (+2
                          recomputed), the same bytes, + the replicated parameters' gradients summed over tp (R
                          bytes; per stage, R_s, under a pipeline) and the loss
                                                                   D·T · (2L·(4 | 6)·(T−1)/T·A + Σ_s AR_T(R_s) + AR_T(8 B))
    pp boundaries         each boundary: m activations forward, m gradients backward (A_k: activation at cut k);
                          with tp every tp rank of a stage sends to its peer of the next: all of A_k, or its S/T
                          slice under sequence parallelism
                                                                         D · (T | 1) · Σ_k 2 · A_k
    cp ring + grads       ring attention: per layer 2(C−1) K/V blocks forward, 2(C−1) + 2C backward (block
                          b·(S/C)·d·4 B), then the gradients averaged over cp and the loss summed; under tp × cp
                          every tp rank runs its heads' ring (blocks of d/T) and averages its own slots, and tp's
                          all-reduces act on the S/C tokens (A/C, D·C·T ranks)
                                                                  D·C·T · (L · ring + AR_C(R + (M−R)/T) + AR_C(8 B))
                          under ps-*, cp rank 0 alone talks to the shards and broadcasts the slots it read (M_r, its
                          share: R + (M−R)/T) with 12 B of clock, rewind and dropped flag over cp
                                                                                  + D·T·(C−1)·(M_r + 12)
    ep all-to-all + grads expert parallelism over ep ranks: per MoE layer dispatch + combine forward and backward,
                          each an all-to-all of the (b/ep sequences, experts, capacity, d) buffer; then the
                          replicated (non-expert) parameters' gradients and the loss summed over ep (R + 4 bytes)
                                                            D·ep · (4·L·(ep−1)/ep·(b/ep)·experts·C·d·4 + AR_ep(R + 4))
                          checkpointing replays dispatch and combine (6 all-to-alls per layer); under tp, D·ep·T
                          ranks, each summing its shards of the split non-expert tensors
    ps push + pull        push the gradient, pull the weights            Σ_r 2 · S_r

pslab's zmq all-reduce sends a tensor of at most 32 KiB in one direct exchange ((N−1)·S per rank instead of the
ring's 2(N−1)/N·S): the modelled figure uses the rule the backend applies, and the formula text says which. gloo
(backend torch) runs a ring all-reduce at every size; its reduce-scatters and all-gathers are pslab's rings over
gloo's p2p sends (collectives/torch_group.py), (N−1)/N·S like the zmq backend's.

Measured: the zmq backend counts each tensor slice it sends (frames, shared-memory slots and segments alike); a PS
client the tensor payload its transport pushed (frames, or its shared segment) and read back (frames, the shard's
segment or its pull arena), which the shards count too (stats counters push_bytes / pull_bytes); the
torch backend's figure is what the kernel counted on gloo's TCP connections (collectives/sockmeter.py), which
includes gloo's 48-byte header per message (12(N−1) of them per all-reduce, for instance): on small tensors it
exceeds the payload formula by that framing, on 4 MiB by < 0.1 %. NCCL's traffic cannot be observed from the
process: its measured column says so (`measured_per_step` None) instead of a number.
"""

from __future__ import annotations

from typing import Any

import torch

from pslab.collectives.zmq_group import SMALL_BYTES
from pslab.experiments.config import RunConfig
from pslab.experiments.workloads import Workload
from pslab.parallelism.models import MLP, Attention

KIND_OF_AXIS = {"dp": "dp gradient sync", "tp": "tp activations", "pp": "pp boundaries", "ps": "ps push + pull",
                "cp": "cp ring + grads", "ep": "ep all-to-all + grads"}


def _gloo(cfg: RunConfig) -> bool:
    """Whether the run's groups are gloo's (backend torch): its all-reduce is a ring at every size."""
    return cfg.train.backend == "torch"


def _allreduce(nbytes: float, n: int, N: str, S: str, ring: bool = False) -> tuple[float, str]:
    """Bytes one rank sends to all-reduce `nbytes` over `n` ranks, and the rule in the names N and S (`ring`: gloo,
    a ring at every size)."""
    if n <= 1:
        return 0.0, "0"
    if nbytes <= SMALL_BYTES and not ring:
        return (n - 1) * nbytes, f"({N}−1)·{S}, direct exchange ({S} ≤ 32 KiB)"
    return 2 * (n - 1) / n * nbytes, f"2({N}−1)/{N}·{S}, ring"


def _activations(model: torch.nn.Module, wl: Workload) -> list[int]:
    """Bytes of the output of each top-level child of the model on one worker's batch (float tensors)."""
    x, _, _ = wl.batch(0, 0)
    out = []
    with torch.no_grad():
        for child in model.children():
            x = child(x)
            out.append(x.numel() * x.element_size())
    return out


def _split_ids(model: torch.nn.Module) -> set[int]:
    """ids of the parameters tensor parallelism splits: qkv, proj.weight, fc1, fc2.weight (experts' MLPs too); for
    a model with its own tp_plan, each colwise Linear's weight and bias and each rowwise Linear's weight."""
    plan = getattr(model, "tp_plan", None)
    if plan:
        lins = {name: (model.get_submodule(name), style) for name, style in plan.items()}
        return {id(t) for lin, style in lins.values()
                for t in ((lin.weight, lin.bias) if style == "colwise" else (lin.weight,)) if t is not None}
    split = set()
    for m in model.modules():
        if isinstance(m, Attention):
            split |= {id(m.qkv.weight), id(m.qkv.bias), id(m.proj.weight)}
        elif isinstance(m, MLP):
            split |= {id(m.fc1.weight), id(m.fc1.bias), id(m.fc2.weight)}
    return split


def _replicated_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters tensor parallelism does not split: all but qkv, proj.weight, fc1, fc2.weight."""
    split = _split_ids(model)
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in split)


def _periodic(cfg: RunConfig, steps: int | None) -> tuple[int, int, int]:
    """(n steps, period H, syncs ⌈n/H⌉) of a periodic strategy: it syncs after every H-th step and after the last."""
    n = steps or cfg.train.steps
    H = int(cfg.strategy.period)
    return n, H, -(-n // H)


def modelled(cfg: RunConfig, wl: Workload, slot_bytes: list[int], steps: int | None = None,
             packed_bytes: list[int] | None = None) -> dict[str, tuple[float, str]]:
    """{kind: (bytes sent per step, summed over ranks; formula)} for this run's layout; `steps` (default
    train.steps): the steps the run took, over which one-off bytes (the pipeline's shape headers) are spread;
    `packed_bytes`: per rank, ZeRO's packed segment L (parallelism/zero_pack.py `Pack`; 0: not packed)."""
    p, D = cfg.parallel, cfg.train.workers
    out: dict[str, tuple[float, str]] = {}
    if cfg.strategy.ps_periodic:               # ps-local / ps-diloco: Δ pushed and θ read every H steps
        n, H, syncs = _periodic(cfg, steps)
        out["ps push + pull"] = (syncs / n * 2.0 * sum(slot_bytes),
                                 f"⌈n/H⌉/n · Σ_r 2·S_r (the pseudo-gradient pushed and θ read per H = {H} steps, and "
                                 f"after the last: {syncs} over n = {n} steps)")
    elif cfg.strategy.uses_ps and cfg.train.compress != "none":
        out["ps push + pull"] = _ps_compressed(cfg, wl, slot_bytes)
    elif cfg.strategy.uses_ps:
        out["ps push + pull"] = (2.0 * sum(slot_bytes), "Σ_r 2·S_r")
    elif cfg.strategy.periodic and D > 1:      # local-sgd / diloco: the parameters (or θ_outer − θ_i) every H steps
        n, H, syncs = _periodic(cfg, steps)
        parts = [_allreduce(s, D, "D", "S_r", _gloo(cfg)) for s in slot_bytes]
        out["dp parameter average"] = (syncs / n * sum(b for b, _ in parts),
                                       f"⌈n/H⌉/n · Σ_r {parts[0][1]} (one all-reduce of the parameters per H = {H} "
                                       f"steps, and after the last: {syncs} over n = {n} steps)")
    elif cfg.strategy.kind == "allreduce" and D > 1:
        if p.distributed_optimizer and p.zero == 2:    # ZeRO-2 in a pipeline: a reduce-scatter per micro-batch
            m = p.micro_batches
            out["zero RS + AG"] = ((m + 1) * (D - 1) / D * sum(slot_bytes),
                                   f"Σ_r (m+1)(D−1)/D·S_r, m = {m} (a reduce-scatter of each slot after each "
                                   "micro-batch's backward, one all-gather after the step)")
        elif p.distributed_optimizer:             # slot_bytes are whole slots, not ZeroEngine's shards
            out["zero RS + AG"] = (2 * (D - 1) / D * sum(slot_bytes),
                                   "Σ_r 2(D−1)/D·S_r (reduce-scatter + all-gather of each slot over dp)")
        elif p.zero and packed_bytes and all(packed_bytes):
            L = sum(packed_bytes)                # Σ_r L_r: every rank sends (D−1)·L per packed pass over all parameters
            k = 3 if p.zero == 3 else 2          # reduce-scatter, all-gather (stage 3: forward and backward)
            what = {1: "a packed reduce-scatter per bucket in backward, one packed all-gather of all parameters",
                    2: "a packed reduce-scatter per unit in backward, one packed all-gather of all parameters",
                    3: "a packed reduce-scatter per unit in backward, a packed all-gather per unit before forward "
                       "and backward"}[p.zero]
            out["zero RS + AG"] = (k * (D - 1) * L, f"Σ_r {k}(D−1)·L ({what}; L = Σ_p ⌈S_p/D⌉, each parameter's "
                                                    f"largest chunk)")
        elif p.zero:
            k = 3 if p.zero == 3 else 2
            out["zero RS + AG"] = (k * (D - 1) * sum(slot_bytes),
                                   f"Σ_r {k}(D−1)/D·S (S: the full model's bytes)")
        elif p.overlap and p.virtual_stages > 1:    # one overlapped reducer per model chunk (pipeline.py)
            from pslab.parallelism.pipeline import rank_chunks, stage_module
            model = wl.make_model()
            parts = [_allreduce(sum(q.numel() * q.element_size() for q in stage_module(model, [ch]).parameters()),
                                D, "D", "S_c", _gloo(cfg)) for chunks in rank_chunks(model, p.pp, p.virtual_stages) for ch in chunks]
            out["dp gradient sync"] = (D * sum(b for b, _ in parts),
                                       f"D · Σ_chunks {parts[0][1]} (a reducer per model chunk, S_c its bytes)")
        elif cfg.train.compress != "none":
            out["dp gradient sync"] = _compressed(cfg, wl, D)
        else:
            parts = [_allreduce(s, D, "D", "S_r", _gloo(cfg)) for s in slot_bytes]
            out["dp gradient sync"] = (sum(b for b, _ in parts), f"Σ_r {parts[0][1]}")
    model = wl.make_model() if (p.tp > 1 or p.pp > 1) else None
    acts = (_activations(model, wl) if model is not None and (p.pp > 1 or not getattr(model, "tp_plan", None))
            else [])                               # (a planned model's tp bytes are read off its own Linears)
    if p.tp > 1:
        out["tp activations"] = _tensor(cfg, wl, model, acts)
    if p.cp > 1:
        out["cp ring + grads"] = _context(cfg, wl, D)
    if p.ep > 1:
        out["ep all-to-all + grads"] = _experts(cfg, wl, D, p.ep)
    if p.pp > 1:
        out["pp boundaries"] = _pipeline(cfg, model, acts, steps or cfg.train.steps)
    return out


def _ps_compressed(cfg: RunConfig, wl: Workload, slot_bytes: list[int]) -> tuple[float, str]:
    """train.compress on a ps-* push (ps/compression.py): each rank pushes, per shard, top-k's k = ⌈ρ·n_s⌉ values
    and int32 indices of the shard's n_s elements (or sign's packed bits and a scale per key) and reads S_r whole."""
    from pslab.ps import compression, make_partition
    form = compression.parse(cfg.train.compress)
    params = {n: q.detach().numpy() for n, q in wl.make_model().named_parameters()}
    part = make_partition(params, cfg.train.shards)
    sizes = [[k.numel for k in part.keys_of(i)] for i in range(cfg.train.shards)]
    push = sum(form.payload_bytes(z) for z in sizes)
    what = (f"Σ_s ⌈ρ·n_s⌉·(4 + 4) B over the {cfg.train.shards} shard(s)" if form.kind == "topk" else
            "Σ_s Σ_keys (⌈n/8⌉ + 4) B (packed signs, a float32 scale per key)")
    return len(slot_bytes) * push + float(sum(slot_bytes)), f"Σ_r (P + S_r), P = {what} = {push} B"


def _compressed(cfg: RunConfig, wl: Workload, D: int) -> tuple[float, str]:
    """train.compress (parallelism/compress.py), D ranks each sending: top-k's k values + k int32 indices and
    sign's packed bits + a scale per tensor all-gathered ((D−1) copies of its own); PowerSGD's three all-reduces
    (the tensors it leaves whole, the P factors, the Q factors)."""
    from pslab.parallelism.compress import make_compressor
    shapes = [q.shape for q in wl.make_model().parameters()]
    sizes = [int(torch.Size(sh).numel()) for sh in shapes]
    c = make_compressor(cfg.train.compress)
    kind = cfg.train.compress.split(":")[0]
    if kind == "topk":
        k = c.k(sum(sizes))
        return D * (D - 1) * 8.0 * k, (f"D·(D−1)·k·(4 + 4) B, k = ⌈ρ·n⌉ = {k} of n = {sum(sizes)} (all-gathered "
                                         "float32 values and int32 indices)")
    if kind == "sign":
        per = sum(-(-n // 8) + 4 for n in sizes)
        return D * (D - 1) * float(per), (f"D·(D−1)·Σ_t (⌈n_t/8⌉ + 4) B = D·(D−1)·{per} B (all-gathered sign bits and a "
                                          "float32 scale per tensor)")
    whole = low_p = low_q = 0
    for sh, n in zip(shapes, sizes):
        t = torch.empty(sh, device="meta")
        if c.compressible(t):
            rows, cols = sh[0], n // sh[0]
            r = min(c.rank, rows, cols)
            low_p, low_q = low_p + 4 * rows * r, low_q + 4 * cols * r
        else:
            whole += 4 * n
    parts = [_allreduce(b, D, "D", name, _gloo(cfg)) for b, name in ((whole, "W"), (low_p, "P"), (low_q, "Q"))
             if b]
    return D * sum(b for b, _ in parts), (f"D · ({' + '.join(f for _, f in parts)}): the tensors left whole "
                                          f"(W = {whole} B), the P (Σ rows·r·4 = {low_p} B) and Q (Σ cols·r·4 = "
                                          f"{low_q} B) factors")


def _pipeline(cfg: RunConfig, model: torch.nn.Module, acts: list[int], steps: int) -> tuple[float, str]:
    """The cuts' activations and gradients, the loss the last stage broadcasts, the one-off shape headers."""
    from pslab.parallelism.comm_model import HEADER_BYTES
    from pslab.parallelism.pipeline import split_stages
    p, D, T, C = cfg.parallel, cfg.train.workers, cfg.parallel.tp, cfg.parallel.cp
    v = p.virtual_stages
    bounds = split_stages(model, p.pp * v)                 # interleaved: every cut of the v·P-way cut crosses ranks
    cuts = sum(acts[end - 1] for _, end in bounds[:-1])
    E = p.ep
    lines = D * T * C * E                                  # pipelines: one per (dp, tp, cp, ep) coordinate
    sp = p.sp and T > 1
    act = lines * 2.0 * cuts / (T if sp else 1) / C / E    # cp: a rank's cut holds its S/C tokens; ep: b/ep samples
    loss_b = 8 if sp or C > 1 else 4
    moe = cfg.workload.name == "text-moe"                  # every stage holds a part of the loss: all-reduced
    loss = p.pp * (p.pp - 1) * 4 if moe else (p.pp - 1) * loss_b
    shapes = len(set(_micro_sizes(cfg)))                   # a header per cut and new micro-batch shape, once a run
    extra = lines * (loss + (p.pp * v - 1) * HEADER_BYTES * shapes / steps)
    how = ("each tp rank sends its S/T slice (sequence parallel)" if sp else
           "every tp rank of a stage sends all of it to its peer of the next" if T > 1 else "")
    cut_n = "P·v−1" if v > 1 else "P−1"
    if v > 1:
        how += ("; " if how else "") + f"the P·v−1 cuts of v = {v} chunks per stage"
    lines_n = "·".join(["D"] + [ax for ax, n in (("T", T), ("C", C), ("E", E)) if n > 1])
    return (act + extra, f"{lines_n} pipelines · (Σ_cuts 2·A_cut{'/T' if sp else ''}{'/C' if C > 1 else ''}"
                         f"{'/E' if E > 1 else ''} (activation "
                         f"forward, gradient back{'; ' + how if how else ''}) "
                         + (f"+ P·(P−1)·4 B loss all-reduce (each stage adds its MoE aux losses) " if moe else
                            f"+ (P−1)·{loss_b} B loss broadcast ")
                         + f"+ ({cut_n})·{HEADER_BYTES} B × {shapes} shape header(s) / "
                         f"{steps} steps)")


def _micro_sizes(cfg: RunConfig) -> list[int]:
    """Examples per micro-batch of one rank (pp > 1: torch.tensor_split into m of the rank's 1/ep sample chunk
    under ep; else that chunk, the worker's batch without ep)."""
    b, p = cfg.workload.batch_size, cfg.parallel
    if p.pp == 1:
        return [b // p.ep]
    return [len(c) for c in torch.tensor_split(torch.arange(b // p.ep), p.micro_batches)]


def _tensor_plan(cfg: RunConfig, wl: Workload, model: torch.nn.Module) -> tuple[float, str]:
    """A model split by its own tp_plan: each rowwise Linear's g all-reduces its output forward (and again when
    activation checkpointing recomputes it), each colwise Linear's f all-reduces its input's gradient backward;
    the sizes are read off one forward of the full model on worker 0's first batch (hooks on the planned Linears)."""
    T, D, ac = cfg.parallel.tp, cfg.train.workers, cfg.parallel.activation_checkpointing
    sizes: dict[str, int] = {}
    hooks = []
    for name, style in model.tp_plan.items():
        def hook(mod: torch.nn.Module, args: tuple, out: torch.Tensor, name: str = name, style: str = style) -> None:
            t = args[0] if style == "colwise" else out
            if style == "rowwise" or t.requires_grad:     # f's backward runs only for an input that needs a grad
                sizes[name] = t.numel() * t.element_size()   # (not for the data itself, a first layer's input)
        hooks.append(model.get_submodule(name).register_forward_hook(hook))
    try:
        with torch.enable_grad():
            model(wl.batch(0, 0)[0])
    finally:
        for h in hooks:
            h.remove()
    per = {name: _allreduce(a, T, "T", "A_m", _gloo(cfg)) for name, a in sizes.items()}
    times = {name: (1 if style == "colwise" else (2 if ac else 1)) for name, style in model.tp_plan.items()}
    if not per:
        return 0.0, "0 (no planned Linear communicates)"
    total = D * T * sum(times[n] * per[n][0] for n in per)
    rule = next(iter(per.values()))[1]
    return total, (f"D·T ranks · Σ over the tp_plan's Linears m ({len(per)}) of {rule}: f backward on a colwise "
                   "input that needs a gradient, g forward on a rowwise output" + (" (twice: recomputed)" if ac else "")
                   + "; A_m = bytes of that activation on one batch")


def _tensor(cfg: RunConfig, wl: Workload, model: torch.nn.Module, acts: list[int]) -> tuple[float, str]:
    """Tensor parallelism: the activations' collectives (by pslab's blocks, or by the model's own tp_plan), and
    under ps-* tp rank 0's broadcast of the replicated tensors it pulled."""
    total, formula = (_tensor_plan(cfg, wl, model) if getattr(model, "tp_plan", None) else
                      _tensor_blocks(cfg, wl, model, acts))
    if cfg.strategy.uses_ps:      # tp rank 0 broadcasts the replicated tensors it pulled (strategies/ps.py; under
        total += cfg.train.workers * (cfg.parallel.tp - 1) * _replicated_bytes(model)   # cp: cp rank 0's tp group)
        formula += " + D·(T−1)·R (PS: tp rank 0 broadcasts the R bytes of replicated tensors)"
    return total, formula


def _tensor_blocks(cfg: RunConfig, wl: Workload, model: torch.nn.Module, acts: list[int]) -> tuple[float, str]:
    """Tensor (+ sequence) parallelism, also inside pipeline stages: every Attention and MLP region communicates
    per micro-batch (of a_i = A · b_i/b bytes), activation checkpointing replays its forward collectives."""
    p, D, T, C = cfg.parallel, cfg.train.workers, cfg.parallel.tp, cfg.parallel.cp
    D *= C * p.ep                  # tp × cp: D·C tp groups, each on its S/C tokens; tp × ep: D·ep, on b/ep sequences
    regions = sum(1 for n, m in model.named_modules() if isinstance(m, (Attention, MLP)) and ".experts." not in n)
    A = (acts[1] if len(acts) > 1 else acts[0]) / C
    b = cfg.workload.batch_size
    micro = [A * n / b for n in _micro_sizes(cfg)]
    experts, etext = _expert_mlps(cfg, model, wl.batch(0, 0)[0].shape[1], _micro_sizes(cfg), T,
                                  3 if p.activation_checkpointing else 2)
    ac = p.activation_checkpointing
    mtext = f" over {len(micro)} micro-batches (a_i = A·b_i/b)" if len(micro) > 1 else ""
    if p.sp:      # Korthikanti et al.: each all-reduce becomes an all-gather + a reduce-scatter
        per_region = 6 if ac else 4
        act = regions * per_region * (T - 1) / T * sum(micro)     # ring all-gathers and reduce-scatters
        grads, grule = 0.0, ""
        if p.pp > 1:          # each stage sums its own replicated parameters' gradients over tp
            from pslab.parallelism.pipeline import rank_stages
            for st in rank_stages(model, p.pp, p.virtual_stages):
                g, grule = _allreduce(_replicated_bytes(st), T, "T", "R_s", _gloo(cfg))
                grads += g
        else:
            grads, grule = _allreduce(_replicated_bytes(model), T, "T", "R", _gloo(cfg))
        loss, _ = _allreduce(8, T, "T", "8 B", _gloo(cfg))
        total = D * T * (act + grads + loss)
        formula = (f"D·T ranks · ({regions * per_region} all-gathers / reduce-scatters (2 forward, 2 backward"
                   + (", 2 recomputed" if ac else "") + f" per attention and MLP) · (T−1)/T·A{mtext}"
                   + " + the "
                   f"replicated gradients {grule}" + (" per stage" if p.pp > 1 else "") + " + loss); "
                   "A = b·S·d·4 B")
    else:
        per_region = 3 if ac else 2
        parts = [_allreduce(a, T, "T", "a_i" if mtext else "A", _gloo(cfg)) for a in micro]
        total = D * T * (regions * per_region * sum(x for x, _ in parts) + experts)
        formula = (f"D·{'C·' if C > 1 else ''}{'ep·' if p.ep > 1 else ''}T ranks · ({regions * per_region} "
                   "all-reduces (g forward, f backward" + (", g recomputed" if ac else "")
                   + f", per attention and MLP) · {parts[0][1]}{mtext}{etext}); "
                   + ("A = b·(S/C)·d·4 B" if C > 1 else "A = (b/ep)·S·d·4 B" if p.ep > 1 else "A = b·S·d·4 B"))
    return total, formula


def _moe_dims(cfg: RunConfig, model: torch.nn.Module, S: int) -> tuple[int, int, int]:
    """(MoE layers, capacity C per expert and sequence, width d) of the model (groups are single sequences)."""
    from pslab.parallelism.moe import capacity, moe_layers
    w = cfg.workload
    layers = [m for _, m in moe_layers(model)]
    d = layers[0].router.in_features if layers else 0
    return len(layers), capacity(S, w.experts, w.top_k, w.capacity_factor), d


def _expert_mlps(cfg: RunConfig, model: torch.nn.Module, S: int, sizes: list[int], T: int, per_region: int
                 ) -> tuple[float, str]:
    """Tensor parallelism splits each expert's MLP like a dense one: per MoE layer, each of a rank's E/ep experts
    all-reduces its (ep·n_i sequences, capacity C, d) output forward and input gradient backward (+ the recomputed
    forward) per micro-batch of n_i sequences. (bytes, formula text); (0, "") without MoE layers."""
    L, C, d = _moe_dims(cfg, model, S)
    if not L:
        return 0.0, ""
    w, p = cfg.workload, cfg.parallel
    parts = [_allreduce(p.ep * n * C * d * 4, T, "T", "e_i", _gloo(cfg)) for n in sizes]
    per_rank = L * (w.experts // p.ep) * per_region * sum(x for x, _ in parts)
    return per_rank, (f" + {L} MoE layers · {w.experts // p.ep} experts · {per_region} all-reduces · "
                      f"{parts[0][1]}, e_i = ep·b_i sequences · capacity {C} · d {d} · 4 B")


def _context(cfg: RunConfig, wl: Workload, D: int) -> tuple[float, str]:
    """Context parallelism (parallelism/context.py): the ring's K/V traffic, the cp gradient and loss averages;
    under tp × cp each tp rank runs the ring over its d/T of the heads and averages its own slots (R + (M−R)/T);
    under pp each stage's ranks average their stage's slots (the loss: the last stage's); activation checkpointing
    replays the forward ring in backward."""
    from pslab.parallelism.pipeline import rank_stages
    from pslab.parallelism.ring_attention import ring_bytes
    p = cfg.parallel
    C, T, ac = p.cp, p.tp, p.activation_checkpointing
    model = wl.make_model()
    x, _, _ = wl.batch(0, 0)
    att = [m for m in model.modules() if isinstance(m, Attention)]
    rb = ring_bytes(x.shape[0], x.shape[1], att[0].d // T, C) if att else {"total": 0, "forward": 0}
    ring = rb["total"] + (rb["forward"] if ac else 0)
    stages = rank_stages(model, p.pp, p.virtual_stages) if p.pp > 1 else [model]
    grads, held = 0.0, 0
    for st in stages:
        M = sum(q.numel() * q.element_size() for q in st.parameters())
        R = _replicated_bytes(st) if T > 1 else M
        g, rule = _allreduce(R + (M - R) // T, C, "C", ("(R + (M−R)/T)" if T > 1 else "M") + ("_s" if p.pp > 1 else ""),
                             _gloo(cfg))
        grads, held = grads + g, held + R + (M - R) // T
    loss, _ = _allreduce(8, C, "C", "8 B", _gloo(cfg))
    ranks = "D·C·T" if T > 1 else "D·C"
    total = D * C * T * (len(att) * ring + grads + loss)
    formula = (f"{ranks} ranks{' (of each stage)' if p.pp > 1 else ''} · ({len(att)} layers · ring {ring} B (K, V"
               f"{' of d/T' if T > 1 else ''}: 2(C−1) blocks forward, 2(C−1)+2C backward"
               f"{', 2(C−1) recomputed' if ac else ''}) + gradients {rule}{' per stage' if p.pp > 1 else ''} + loss "
               "(C−1)·8 B)")
    if cfg.strategy.uses_ps:     # cp rank 0 broadcasts every slot it read (+ clock, rewind, dropped: 12 B)
        total += D * T * (C - 1) * (held + 12 * len(stages))
        formula += (f" + D·{'T·' if T > 1 else ''}(C−1)·(M_r + 12 B) (PS: cp rank 0 broadcasts the {held} B of "
                    "slots it read to the other cp ranks" + (", per stage" if p.pp > 1 else "") + ")")
    return total, formula


def _experts(cfg: RunConfig, wl: Workload, D: int, ep: int) -> tuple[float, str]:
    """Expert parallelism (parallelism/expert.py): the all-to-alls of every MoE layer, the ep gradient sum."""
    from pslab.parallelism.expert import all_to_all_bytes_per_step
    model = wl.make_model()
    x, _, _ = wl.batch(0, 0)
    b, S = x.shape
    w = cfg.workload
    L, C, d = _moe_dims(cfg, model, S)
    a2a = all_to_all_bytes_per_step(b // ep, w.experts, C, d, ep, L, wire=True)
    P = cfg.parallel.pp
    if P > 1:              # each stage's ep ranks sum that stage's replicated gradients (and its part of the loss)
        from pslab.parallelism.pipeline import rank_stages
        stages = rank_stages(model, P, cfg.parallel.virtual_stages)
    else:
        stages = [model]
    T, ac = cfg.parallel.tp, cfg.parallel.activation_checkpointing
    if ac:                 # checkpointing replays the forward's dispatch and combine in backward: 6, not 4
        a2a = a2a * 6 / 4
    grads, R = 0.0, 0
    for st in stages:      # a tp rank holds 1/T of the split tensors (their shard) and the replicated ones whole
        split = _split_ids(st)
        R_s = sum(q.numel() * q.element_size() // (T if id(q) in split else 1)
                  for n, q in st.named_parameters() if ".experts." not in n)
        g, rule = _allreduce(R_s + 4, ep, "ep", "(R_s + 4)" if P > 1 else "(R + 4)", _gloo(cfg))
        grads, R = grads + g, R + R_s
    total = D * ep * T * (a2a + grads)
    formula = (f"D·ep{'·T' if T > 1 else ''} ranks{' (of all stages)' if P > 1 else ''} · ({L} MoE layers "
               f"· {6 if ac else 4} all-to-alls{' (2 recomputed)' if ac else ''} · "
               f"(ep−1)/ep · (b/ep sequences · {w.experts} experts · capacity {C} · d {d} · 4 B) + replicated "
               f"gradients and loss {rule}{' per stage' if P > 1 else ''}, R = {R} B"
               + (" (a tp rank's: its shards of the split tensors)" if T > 1 else "") + ")")
    if cfg.strategy.uses_ps:      # ep rank 0 broadcasts the replicated tensors it pulled (strategies/ps.py)
        total += D * (ep - 1) * R
        formula += " + D·(ep−1)·R (PS: ep rank 0 broadcasts the replicated tensors)"
    return total, formula


def bytes_by_kind(cfg: RunConfig, wl: Workload, results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Measured (backend-counted) and modelled bytes per step by kind, from the ranks' `train_worker` results;
    `measured_per_step` is None for a kind no backend could observe (NCCL)."""
    steps = max(1, max((r or {}).get("steps", 0) for r in results) if results else 1)
    measured: dict[str, float] = {}
    unobserved: dict[str, str] = {}

    def kind_of(axis: str) -> str:
        if axis == "dp" and cfg.strategy.periodic:
            return "dp parameter average"
        return "zero RS + AG" if axis == "dp" and cfg.parallel.zero else KIND_OF_AXIS[axis]
    sends: dict[str, int] = {}
    for r in results:
        for axis, b in ((r or {}).get("bytes_sent") or {}).items():
            measured[kind_of(axis)] = measured.get(kind_of(axis), 0.0) + b
        for axis, n in ((r or {}).get("sends") or {}).items():
            sends[kind_of(axis)] = sends.get(kind_of(axis), 0) + n
        for axis, why in ((r or {}).get("unobserved") or {}).items():       # {axis: why no byte was counted}
            unobserved[kind_of(axis)] = why or unobserved.get(kind_of(axis), "")
    model = modelled(cfg, wl, [int((r or {}).get("slot_bytes", 0)) for r in results], steps,
                     [int((r or {}).get("zero_packed_bytes", 0)) for r in results])
    out = {}
    for kind in list(dict.fromkeys(list(model) + list(measured))):
        m, f = model.get(kind, (None, ""))
        if m is None and not measured.get(kind):
            continue          # a group of size > 1 that carried nothing (e.g. dp under the PS: only barriers)
        if f and _gloo(cfg) and kind != "ps push + pull":   # (and an uneven all-gather: padded to the largest chunk)
            f += "; payload only: the measured count adds gloo's 48 B header per message"
        out[kind] = {"measured_per_step": None if kind in unobserved else measured.get(kind, 0.0) / steps,
                     "model_per_step": m, "formula": f, "sends_per_step": sends.get(kind, 0) / steps}
        if kind in unobserved:
            out[kind]["unobserved_why"] = unobserved[kind] or "the backend reports no bytes"
    return out
