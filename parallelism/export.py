"""Export: reassemble the full single-process model from the pieces the ranks of one model replica hold.

Every dp coordinate holds an identical copy of the model, spread over its *model-parallel group*
(`mesh.group("mp")`: the pp × tp ranks with that dp coordinate). So one group is enough — dp coordinate 0's — and
its members send their pieces to its rank 0, which is the mesh's rank 0 (dp = pp = tp = 0):

    state = gather_full_state(replica, mesh)     # on every rank, at the same point (e.g. after strategy.step)
    if state is not None:                        # the mesh's rank 0 only
        model = model_factory()
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(state[n])                  # then evaluate test accuracy, or torch.save(state, …)

The pieces, as `replica.slots()` lists them (full-model names, checkpoint wrappers already unwrapped):

    whole tensors    data parallel, a pipeline stage's parameters, tensors tensor parallelism replicates (LayerNorm,
                     embeddings, row-parallel biases; sent by tp coordinate 0 only, the other tp ranks hold copies)
    experts          expert parallelism: each ep rank sends its own experts (`_ep_expert`), ep rank 0 the replicas
    tp shards        slot name "…#tp{t}/{T}": the Parameter's `_tp_index = (dim, indices)` (`tensor.py`) says which
                     indices along dim of the full tensor it holds; the root index_copy_'s each shard into place
    ZeRO             stages 0–2 keep full parameters in `replica.module` on every rank (local, nothing moves);
                     stage 3 all-gathers them over dp with `replica.full_parameters()`

Wire format, from each non-root member of the group to group rank 0, members in group-rank order (no pickle):

    tag T      int64[2]       JSON byte length, number of flat tensors that follow
    tag T+1    uint8[len]     JSON list of {"name", "shape", "dtype", "dim", "index"} (dim, index null: whole tensor)
    tag T+2+k  dtype_k[n_k]   the values of all entries of the k-th dtype (sorted by name), concatenated in order

with T = 1 << 21, clear of the pipeline's tags (2i, 2i+1 and 1 << 20 + i). The bytes are logged in `replica.log`
under site "export".
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import torch

from .checkpointing import unwrap_name
from .comm import Comm
from .engine import EngineError, ParamSlot, Replica
from .expert import is_expert
from .mesh import DeviceMesh
from .tensor import tp_index
from .zero import ZeroReplica

_TAG = 1 << 21
_TP_SUFFIX = re.compile(r"#tp(\d+)/(\d+)$")   # TensorParallelEngine's shard suffix: part t of T
_SITE = "export"
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16)}

Piece = tuple[dict[str, Any], torch.Tensor]   # (JSON entry, its tensor)


def gather_full_state(replica: Replica, mesh: DeviceMesh) -> dict[str, torch.Tensor] | None:
    """The full model's parameters {name: tensor} on the mesh's rank 0 (dp = pp = tp = 0); None on every other rank.

    Names and shapes are those of `model_factory().named_parameters()`, in the model's order for the engines here
    (an nn.Sequential's by child index, else first-seen order over the group's ranks); the tensors are fresh copies
    (detached, full shape).

    A collective. Non-ZeRO replicas (data, tensor, pipeline parallel and their dp × tp, dp × pp combinations): every
    rank of dp coordinate 0's model-parallel group must call it, the same number of times and at the same point
    (they run in lockstep inside a step anyway); a rank with dp coordinate ≠ 0 may call it too and gets None at
    once, without communicating — so a training loop can simply call it on every rank. ZeRO replicas (any stage):
    every dp rank must call it, since stage 3 all-gathers the parameter shards over dp (stages 0–2 are local).
    Raises EngineError if the replica was not built on this mesh or its pieces do not add up to whole tensors."""
    _check_mesh(replica, mesh)
    root = mesh.rank == mesh.layout.rank_of(0, 0, 0)
    if isinstance(replica, ZeroReplica) and mesh.size("tp") == 1:
        return _gather_zero(replica, root)
    # ZeRO over dp × tp: each tp rank's shards made whole (stage 3: every dp rank takes part), assembled like tp's
    slots = _zero_tp_slots(replica) if isinstance(replica, ZeroReplica) else replica.slots()
    if mesh.coord("dp") != 0:
        return None
    mp = Comm(mesh.group("mp"), replica.log)
    pieces = [] if mesh.coord("cp") else local_pieces(   # cp ranks > 0 hold copies of cp rank 0's (context.py)
        slots, send_replicated=mesh.coord("tp") == 0, ep_first=mesh.coord("ep") == 0)
    if mp.rank != 0:
        _send_pieces(mp, pieces)
        return None
    per_rank = [pieces] + [_recv_pieces(mp, src) for src in range(1, mp.size)]
    return _model_order(assemble([p for rank_pieces in per_rank for p in rank_pieces]))


def _model_order(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An nn.Sequential's parameters ordered by their top-level child index (interleaved pipeline ranks hold
    children 0, 2, … and 1, 3, …); any other naming is left in first-seen order."""
    heads = [n.split(".", 1)[0] for n in state]
    if not all(h.isdigit() for h in heads):
        return state
    return dict(sorted(state.items(), key=lambda kv: int(kv[0].split(".", 1)[0])))


def _check_mesh(replica: Replica, mesh: DeviceMesh) -> None:
    want, got = tuple(mesh.group("dp").ranks), tuple(replica.dp.group.ranks)
    if want != got:
        raise EngineError(f"gather_full_state: the replica's dp group has ranks {got} but this mesh's is {want}; "
                          f"pass the DeviceMesh the replica was built on")


def _zero_tp_slots(replica: ZeroReplica) -> list[ParamSlot]:
    """A ZeRO replica over tp shards: each parameter whole on this tp rank (stage 3 all-gathers it over dp), named
    and indexed as tensor parallelism names its shards, so `local_pieces` places them."""
    from .tensor import TP_INDEX_ATTR
    full = replica.full_parameters()
    out = []
    for n, p in replica.named:
        t = full[n]
        if tp_index(p) is not None:
            setattr(t, TP_INDEX_ATTR, tp_index(p))
        out.append(ParamSlot(replica.name_of(unwrap_name(n), p), t, replica.rank))
    return out


def _gather_zero(replica: ZeroReplica, root: bool) -> dict[str, torch.Tensor] | None:
    full: dict[str, torch.Tensor] = {}
    if replica.stage == 3 or root:
        full = replica.full_parameters()          # stage 3: all-gather over dp, every dp rank takes part
    if not root:
        return None
    return {unwrap_name(n): full[n] if n in full else p.detach().clone()   # (parameters that need no grad)
            for n, p in replica.module.named_parameters()}


def local_pieces(slots: list[ParamSlot], send_replicated: bool = True, ep_first: bool = True) -> list[Piece]:
    """This rank's pieces of the full model: tp shards (placed by their `_tp_index`) and whole tensors (only if
    `send_replicated`: tp coordinate 0 sends them, the other tp ranks hold identical copies). Under expert
    parallelism an expert's pieces live on its ep rank only, everything else is sent by ep coordinate 0
    (`ep_first`): the other ep ranks hold identical copies."""
    out: list[Piece] = []
    for s in slots:
        if not ep_first and not is_expert(s.param):
            continue
        p = s.param.detach()
        dtype = str(p.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise EngineError(f"gather_full_state moves floating-point parameters ({', '.join(_DTYPES)}); "
                              f"slot {s.name} is {p.dtype}")
        idx = tp_index(s.param)
        if idx is not None:
            dim, index = idx
            if index.numel() != p.shape[dim]:
                raise EngineError(f"slot {s.name}: its _tp_index lists {index.numel()} indices along dim {dim} but "
                                  f"the shard has {p.shape[dim]}; was the tensor resized after from_full?")
            m = _TP_SUFFIX.search(s.name)
            part, parts = (int(m.group(1)), int(m.group(2))) if m else (0, 1)
            entry = {"name": s.name.split("#", 1)[0], "dim": int(dim), "index": index.tolist(), "part": part,
                     "parts": parts}
        elif "#" in s.name:
            raise EngineError(f"slot {s.name} is a shard without a _tp_index, so it cannot be put in place; build "
                              f"tensor-parallel layers with ColumnParallelLinear/RowParallelLinear.from_full")
        elif send_replicated:
            entry = {"name": s.name, "dim": None, "index": None}
        else:
            continue
        entry.update(shape=list(p.shape), dtype=dtype)
        out.append((entry, p))
    return out


def _layout(entries: list[dict[str, Any]]) -> list[tuple[str, list[int], int]]:
    """Flat tensors of a message: (dtype, entry positions, total elements) per dtype with elements, by dtype name."""
    out = []
    for dtype in sorted({e["dtype"] for e in entries}):
        pos = [i for i, e in enumerate(entries) if e["dtype"] == dtype]
        total = sum(math.prod(entries[i]["shape"]) for i in pos)
        if total:
            out.append((dtype, pos, total))
    return out


def _send_pieces(mp: Comm, pieces: list[Piece]) -> None:
    entries = [e for e, _ in pieces]
    blob = json.dumps(entries, separators=(",", ":")).encode()
    layout = _layout(entries)
    mp.isend(torch.tensor([len(blob), len(layout)], dtype=torch.int64), 0, _TAG, site=_SITE).wait()
    mp.isend(torch.frombuffer(bytearray(blob), dtype=torch.uint8), 0, _TAG + 1, site=_SITE).wait()
    for k, (_, pos, _) in enumerate(layout):
        flat = torch.cat([pieces[i][1].reshape(-1) for i in pos])
        mp.isend(flat, 0, _TAG + 2 + k, site=_SITE).wait()


def _recv_pieces(mp: Comm, src: int) -> list[Piece]:
    hdr = mp.recv(torch.zeros(2, dtype=torch.int64), src, _TAG)
    blob = mp.recv(torch.zeros(int(hdr[0]), dtype=torch.uint8), src, _TAG + 1)
    entries = json.loads(bytes(blob.numpy()).decode())
    layout = _layout(entries)
    if len(layout) != int(hdr[1]):
        raise EngineError(f"gather_full_state: rank {mp.group.ranks[src]} announced {int(hdr[1])} flat tensors but "
                          f"its entries need {len(layout)}; do all ranks run the same pslab version?")
    tensors: list[torch.Tensor] = [torch.zeros(e["shape"], dtype=_DTYPES[e["dtype"]]) for e in entries]
    for k, (dtype, pos, total) in enumerate(layout):
        flat = mp.recv(torch.empty(total, dtype=_DTYPES[dtype]), src, _TAG + 2 + k)
        off = 0
        for i in pos:
            n = tensors[i].numel()
            tensors[i] = flat[off:off + n].view(entries[i]["shape"])
            off += n
    return list(zip(entries, tensors))


def assemble(pieces: list[Piece]) -> dict[str, torch.Tensor]:
    """Whole tensors as they are (the first copy of a name wins) and tp shards put in place along their dim, in
    first-seen order. Raises EngineError if a name is both, a shard of its T is missing, or the shards' indices do not
    partition the full dim."""
    whole: dict[str, torch.Tensor] = {}
    shards: dict[str, list[dict[str, Any]]] = {}
    order: list[str] = []
    for e, t in pieces:
        n = e["name"]
        if n not in whole and n not in shards:
            order.append(n)
        if (e["dim"] is None and n in shards) or (e["dim"] is not None and n in whole):
            raise EngineError(f"gather_full_state: {n} arrived both whole and as tensor-parallel shards")
        if e["dim"] is None:
            whole.setdefault(n, t.detach().clone())
        else:
            shards.setdefault(n, []).append({**e, "index": torch.as_tensor(e["index"], dtype=torch.long), "t": t})
    return {n: whole[n] if n in whole else _place(n, shards[n]) for n in order}


def _place(name: str, parts: list[dict[str, Any]]) -> torch.Tensor:
    dims, of = {e["dim"] for e in parts}, {e["parts"] for e in parts}
    if len(dims) != 1 or len(of) != 1:
        raise EngineError(f"gather_full_state: the shards of {name} disagree on their split (dims {sorted(dims)}, "
                          f"tp sizes {sorted(of)})")
    dim, want = dims.pop(), of.pop()
    got = sorted(e["part"] for e in parts)
    if got != list(range(want)):
        raise EngineError(f"gather_full_state: {name} is split over {want} tensor-parallel ranks but shards "
                          f"{got} arrived; every rank of the model-parallel group must call gather_full_state")
    size = sum(e["index"].numel() for e in parts)
    shape = list(parts[0]["t"].shape)
    shape[dim] = size
    full = torch.zeros(shape, dtype=parts[0]["t"].dtype)
    seen = torch.zeros(size, dtype=torch.long)
    for idx, t in ((e["index"], e["t"]) for e in parts):
        fits = t.dim() == len(shape) and all(a == b for i, (a, b) in enumerate(zip(t.shape, shape)) if i != dim)
        if not fits or (idx.numel() and not (0 <= int(idx.min()) and int(idx.max()) < size)):
            raise EngineError(f"gather_full_state: a shard of {name} of shape {tuple(t.shape)} does not fit a full "
                              f"tensor of shape {tuple(shape)}")
        full.index_copy_(dim, idx, t.detach())
        seen.index_add_(0, idx, torch.ones_like(idx))
    if not bool((seen == 1).all()):
        raise EngineError(f"gather_full_state: the shards of {name} cover {int((seen > 0).sum())} of {size} "
                          f"indices along dim {dim}, {int((seen > 1).sum())} more than once; their _tp_index "
                          f"must partition the full tensor")
    return full
