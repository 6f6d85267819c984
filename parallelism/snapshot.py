"""Engine snapshots: a rank's state as *pieces* of the full model's logical tensors, so any layout can be re-cut.

Every engine holds, per full-model parameter name n (shape S), one piece of it — a selection of its elements:

    whole                  the full tensor                      data parallel, a pipeline stage, tp replicas,
                                                                ZeRO 0 (and ZeRO 1–2's full module copy)
    index (dim, idx)       full.index_select(dim, idx)          tensor parallel (the Parameter's `_tp_index`)
    flat  [a, b)           full.reshape(-1)[a:b]                ZeRO 1–3's chunk `chunk_bounds(numel, N)[r]`
    index_flat (dim, idx,  full.index_select(dim, idx)          the distributed optimizer's chunk of a tp shard
                [a, b))      .reshape(-1)[a:b]                  (distributed_optimizer.py: ZeRO-1 with tp, pp)

and, for its optimizer, the torch.optim state of that piece: tensors shaped like the piece ("sliced": momentum,
Adam's moments — they are re-cut exactly like the parameter) and per-parameter scalars ("scalar": Adam's step,
equal on every piece of n). A snapshot is (tensors, meta): tensors "<k>/param", "<k>/index", "<k>/opt/<key>",
"rng/torch|numpy|python"; meta a JSON-able map {"format", "engine", "pieces": [{name, shape, sel, sliced,
scalar}], "rng"}. Nothing is pickled: RNG states are tensors and ints.

Restoring a target piece (name, sel) of this rank, from the pieces of any number of snapshots (ranks):

    1. a source piece with the same name and the same selection   -> copied as it is (bitwise: same layout)
    2. otherwise the full tensor is assembled from all source pieces of n (whole: taken; index: index_copy_;
       flat: concatenated), every element covered exactly once, and the target's selection cut from it

so dp 4 -> 2, ZeRO 3 shards at N=4 -> N=2, tp 2 -> 1 and 1 -> 2, pipeline stages re-cut, even ZeRO <-> DP are
all the same operation. What cannot be re-cut is refused (`SnapshotError`): another model (names, shapes) or
another optimizer (its state keys). The learning rate and every other param_group setting come from the new run's
optimizer, never from the snapshot (so the lr rule at a new world size applies).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from .engine import EngineError, Replica
from .expert import is_expert
from .snapshot_check import FORMAT, SnapshotError, _fail, check_snapshot
from .tensor import tp_index
from .zero import ZeroReplica

Snapshot = tuple[dict[str, torch.Tensor], dict[str, Any]]


@dataclass
class Target:
    """Where this rank keeps one piece: the tensor to read/write and the optimizer state's key (None: no state)."""

    name: str
    shape: tuple[int, ...]                 # the full tensor's shape
    sel: dict[str, Any]                    # {"kind": "whole"} | {"kind": "index", "dim"} | {"kind": "flat", ...}
    index: torch.Tensor | None
    param: torch.Tensor
    opt_param: torch.Tensor | None


def engine_kind(replica: Replica) -> str:
    """A short name of the replica's engine, recorded in snapshots and manifests."""
    if isinstance(replica, ZeroReplica):
        return f"zero{replica.stage}"
    return type(replica).__name__.removesuffix("Replica").lower() or "local"


def _optimizer(replica: Replica, strategy: Any) -> torch.optim.Optimizer | None:
    if isinstance(replica, ZeroReplica):
        return replica.optimizer
    return getattr(strategy, "optimizer", None)


def _placed(slot_name: str, shape: Any, idx: Any) -> tuple[tuple[int, ...], dict[str, Any], torch.Tensor | None]:
    """(full shape, selection, index) of a piece of `shape` named `slot_name`: whole, or with the tp index `idx` a
    tp shard ("#tp{t}/{T}" in the name says T, the factor along the index's dim)."""
    if idx is None:
        return tuple(shape), {"kind": "whole"}, None
    dim, index = idx
    full = list(shape)
    full[dim] *= int(slot_name.rsplit("/", 1)[1]) if "#tp" in slot_name else 1
    return tuple(full), {"kind": "index", "dim": int(dim)}, index


def _chunk(sel: dict[str, Any], a: int, b: int) -> dict[str, Any]:
    """The selection of elements [a, b) of a piece's flat view: of a whole tensor, or of a tp shard."""
    return {"kind": "flat", "start": a, "stop": b} if sel["kind"] == "whole" else \
        {**sel, "kind": "index_flat", "start": a, "stop": b}


def targets(replica: Replica, strategy: Any) -> list[Target]:
    """This rank's pieces, in a fixed order (ZeRO 1–2: the full module copy before the owned chunk)."""
    out: list[Target] = []
    from .distributed_optimizer import DistributedOptimizerStrategy
    chunked = isinstance(strategy, DistributedOptimizerStrategy)
    if chunked and len(strategy.shards) != len(replica.slots()):
        raise SnapshotError("the distributed optimizer is not attached to this replica: attach it before a snapshot")
    if isinstance(replica, ZeroReplica):
        for n, p in replica.named:       # (over dp × tp: a tp shard, and chunks of it)
            shape, sel, index = _placed(replica.name_of(n, p), replica.shapes[n], tp_index(p))
            if replica.stage == 0:
                out.append(Target(n, shape, sel, index, p, p))
                continue
            if replica.stage in (1, 2):
                out.append(Target(n, shape, sel, index, p, None))
            out.append(Target(n, shape, _chunk(sel, *replica.bounds[n]), index, replica.shards[n], replica.shards[n]))
        return out
    for k, s in enumerate(replica.slots()):
        name = s.name.split("#", 1)[0]
        shape, sel, index = _placed(s.name, s.param.shape, tp_index(s.param))
        if not chunked:
            out.append(Target(name, shape, sel, index, s.param, s.param))
            continue
        # the distributed optimizer: the slot itself (rebuilt from the chunks), then this dp rank's chunk of it
        out.append(Target(name, shape, sel, index, s.param, None))
        out.append(Target(name, shape, _chunk(sel, *strategy.bounds[k]), index, strategy.shards[k],
                          strategy.shards[k]))
    return out


def _stored(t: Target, mesh: Any) -> bool:
    """Whether a checkpoint must store this piece (False: an identical copy is stored by another rank)."""
    if mesh.coord("cp") != 0:      # context parallelism (context.py) replicates every parameter on each cp rank
        return False
    if mesh.coord("ep") != 0 and not is_expert(t.param):     # expert parallelism: ep rank 0 stores the replicas
        return False
    if t.sel["kind"] == "index_flat":                         # the distributed optimizer's chunk of a tp shard
        return True
    if t.sel["kind"] == "flat":        # (a chunk of a tensor tp replicates: tp rank 0's chunks cover it)
        return mesh.coord("tp") == 0
    if t.opt_param is None:            # ZeRO 1–2's full copy, the distributed optimizer's slots: chunks are stored
        return False
    return mesh.coord("dp") == 0 and (t.sel["kind"] == "index" or mesh.coord("tp") == 0)


def capture(replica: Replica, strategy: Any, mesh: Any = None) -> Snapshot:
    """This rank's state: its parameter pieces and their optimizer state (clones) and the RNG states, as
    (tensors, JSON-able meta). With `mesh`: only what a checkpoint must store (replicas of another rank's pieces,
    e.g. dp coordinates > 0 of data parallelism, are left out). Call between steps."""
    opt = _optimizer(replica, strategy)
    tensors: dict[str, torch.Tensor] = {}
    pieces: list[dict[str, Any]] = []
    for t in targets(replica, strategy):
        if mesh is not None and not _stored(t, mesh):
            continue
        k = len(pieces)
        tensors[f"{k}/param"] = t.param.detach().clone()
        if t.index is not None:
            tensors[f"{k}/index"] = t.index.clone()
        sliced, scalar = [], []
        state = opt.state.get(t.opt_param, {}) if opt is not None and t.opt_param is not None else {}
        for key, v in sorted(state.items()):
            if isinstance(v, torch.Tensor) and v.shape == t.param.shape and v.dim() > 0:
                sliced.append(key)
                tensors[f"{k}/opt/{key}"] = v.detach().clone()
            elif isinstance(v, torch.Tensor):
                scalar.append([key, "tensor"])
                tensors[f"{k}/opt/{key}"] = v.detach().clone()
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                scalar.append([key, type(v).__name__])
                tensors[f"{k}/opt/{key}"] = torch.tensor(v, dtype=torch.float64 if isinstance(v, float)
                                                         else torch.int64)
            elif v is not None:
                raise SnapshotError(f"optimizer state {key!r} of {t.name} is a {type(v).__name__}; snapshots hold "
                                    "tensors and numbers only")
        pieces.append({"name": t.name, "shape": list(t.shape), "sel": dict(t.sel), "sliced": sliced,
                       "scalar": scalar})
    own = getattr(strategy, "local_state", None)          # this rank's own state (a compressor's residual)
    local = own() if own is not None else {}
    for name, v in local.items():
        tensors[f"local/{name}"] = v.detach().clone()
    rng = _capture_rng(tensors)
    return tensors, {"format": FORMAT, "engine": engine_kind(replica), "pieces": pieces, "rng": rng,
                     "local": sorted(local)}


def local_of(sources: list[Snapshot], rank: int | None, where: str = "snapshot") -> dict[str, torch.Tensor]:
    """The per-rank state ("local/<name>") to restore on `rank`: its own when the sources are one snapshot per
    rank of the same world (`rank` given), otherwise the element-wise mean over every source. (A residual of error
    feedback is what a worker still owes the mean of the D workers' updates, (1/D)·Σ_i e_i; giving each of D' new
    workers the mean residual keeps exactly that owed: (1/D')·Σ_j ē = (1/D)·Σ_i e_i.)"""
    per = []
    for i, (tensors, meta) in enumerate(sources):
        names = meta.get("local", [])
        if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            raise _fail(f"{where} {i}", "local must list names")
        missing = [n for n in names if not isinstance(tensors.get(f"local/{n}"), torch.Tensor)]
        if missing:
            raise _fail(f"{where} {i}", f"local state {missing[0]!r} is listed but missing")
        per.append({n: tensors[f"local/{n}"] for n in names})
    if not per:
        return {}
    if rank is not None and 0 <= rank < len(per):
        return dict(per[rank])
    if any(p.keys() != per[0].keys() or any(p[n].shape != per[0][n].shape for n in p) for p in per):
        raise _fail(where, "the ranks' local states differ in names or shapes: they cannot be merged")
    return {n: torch.stack([p[n] for p in per]).mean(0) if per[0][n].is_floating_point() else per[0][n]
            for n in per[0]}


def restore_into(replica: Replica, strategy: Any, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]
                 ) -> None:
    """Put a `capture` of this rank back (same layout: bitwise), RNG states included. Local, no communication."""
    load_pieces(replica, strategy, [(dict(tensors), dict(meta))], rng_from=0, local_from=0)


# ---- restoring from pieces -------------------------------------------------------------------------------------

def load_pieces(replica: Replica, strategy: Any, sources: list[Snapshot], rng_from: int | None = None,
                where: str = "snapshot", local_from: int | None = None) -> None:
    """Fill this rank's targets from the pieces of `sources` (one snapshot per old rank), re-cutting where the
    layouts differ (module docstring); restore the RNG states of sources[rng_from] if given, and the strategy's
    per-rank state (`local_of`: sources[local_from]'s, or the mean over the sources when None). SnapshotError if
    the sources do not fit."""
    checked = [check_snapshot(t, m, f"{where} {i}") for i, (t, m) in enumerate(sources)]
    by_name: dict[str, list[tuple[dict[str, Any], dict[str, torch.Tensor]]]] = {}
    for pieces in checked:
        for p in pieces:
            by_name.setdefault(p["name"], []).append((p, p["tensors"]))
    opt = _optimizer(replica, strategy)
    full_cache: dict[tuple[str, str], torch.Tensor] = {}
    writes: list[tuple[torch.Tensor, torch.Tensor]] = []
    states: list[tuple[torch.Tensor, dict[str, Any]]] = []
    for t in targets(replica, strategy):
        have = by_name.get(t.name)
        if not have:
            raise SnapshotError(f"{where}: no piece of parameter {t.name} (another model, or a shard is missing)")
        for p, _ in have:
            if tuple(p["shape"]) != t.shape:
                raise SnapshotError(f"{where}: parameter {t.name} has shape {tuple(p['shape'])} there, "
                                    f"{t.shape} in this model: it was written by another model")
        writes.append((t.param, _piece(t, have, "param", full_cache, where)))
        stateful = [(p, pt) for p, pt in have if p["sliced"] or p["scalar"]]   # (ZeRO 1-2's full copy has none)
        if t.opt_param is None or opt is None or not stateful:
            continue
        keys = {(tuple(p["sliced"]), tuple(map(tuple, p["scalar"]))) for p, _ in stateful}
        if len(keys) != 1:
            raise SnapshotError(f"{where}: the pieces of {t.name} disagree on their optimizer state "
                                f"({len(keys)} different key sets): written by another optimizer?")
        state: dict[str, Any] = {}
        for key in stateful[0][0]["sliced"]:
            state[key] = _piece(t, stateful, f"opt/{key}", full_cache, where).clone()
        for key, kind in stateful[0][0]["scalar"]:
            v = stateful[0][1][f"opt/{key}"]
            state[key] = v.clone() if kind == "tensor" else (float(v) if kind == "float" else int(v))
        states.append((t.opt_param, state))
    with torch.no_grad():          # nothing is written before every target was found and checked
        for dst, src in writes:
            if dst.shape != src.shape or dst.dtype != src.dtype:
                raise SnapshotError(f"{where}: a piece of shape {tuple(src.shape)} {src.dtype} does not fit this "
                                    f"rank's {tuple(dst.shape)} {dst.dtype}")
        for dst, src in writes:
            dst.copy_(src)
    if opt is not None:
        for param, state in states:
            opt.state[param] = state
    put = getattr(strategy, "load_local_state", None)
    if put is not None:
        try:
            put(local_of(sources, local_from, where), replica)
        except EngineError as e:
            raise SnapshotError(f"{where}: {e}") from None
    if rng_from is not None:
        _restore_rng(sources[rng_from][0], sources[rng_from][1].get("rng"), where)


def _same_sel(p: dict[str, Any], pt: dict[str, torch.Tensor], t: Target) -> bool:
    if p["sel"] != t.sel:
        return False
    return t.index is None or torch.equal(pt["index"], t.index.to(torch.long))


def _piece(t: Target, have: list[tuple[dict[str, Any], dict[str, torch.Tensor]]], what: str,
           cache: dict[tuple[str, str], torch.Tensor], where: str) -> torch.Tensor:
    """Target t's selection of tensor `what` ("param" or "opt/<key>") of its parameter."""
    for p, pt in have:
        if _same_sel(p, pt, t):
            return pt[what]
    if (t.name, what) not in cache:
        cache[(t.name, what)] = assemble(t.name, t.shape, [(p["sel"], pt.get("index"), pt[what]) for p, pt in have],
                                         where)
    full = cache[(t.name, what)]
    if t.sel["kind"] == "whole":
        return full
    if t.sel["kind"] == "flat":
        return full.reshape(-1)[t.sel["start"]:t.sel["stop"]]
    piece = full.index_select(t.sel["dim"], t.index.to(torch.long))
    if t.sel["kind"] == "index_flat":
        return piece.reshape(-1)[t.sel["start"]:t.sel["stop"]]
    return piece


def assemble(name: str, shape: tuple[int, ...], parts: list[tuple[dict[str, Any], torch.Tensor | None, torch.Tensor]],
             where: str = "snapshot") -> torch.Tensor:
    """The full tensor of `name` from pieces (sel, index, values) of one kind; SnapshotError unless they cover
    every element exactly once (whole pieces: the first one is taken)."""
    for sel, _, v in parts:
        if sel["kind"] == "whole":
            return v
    if any(sel["kind"] == "index_flat" for sel, _, _ in parts):
        parts = _index_pieces(name, shape, parts, where)
    kinds = {sel["kind"] for sel, _, _ in parts}
    dims = {sel.get("dim") for sel, _, _ in parts}
    if len(kinds) != 1 or len(dims) != 1:
        raise SnapshotError(f"{where}: the pieces of {name} mix selections {sorted(kinds)}; cannot reassemble it")
    dtype = parts[0][2].dtype
    if kinds == {"flat"}:
        numel = math.prod(shape)
        flat = torch.empty(numel, dtype=dtype)
        seen = torch.zeros(numel, dtype=torch.int32)
        for sel, _, v in parts:
            flat[sel["start"]:sel["stop"]] = v
            seen[sel["start"]:sel["stop"]] += 1
        full, covered = flat.view(shape), seen
    else:
        dim = dims.pop()
        full = torch.empty(shape, dtype=dtype)
        covered = torch.zeros(shape[dim], dtype=torch.int32)
        for _, idx, v in parts:
            full.index_copy_(dim, idx, v)
            covered.index_add_(0, idx, torch.ones_like(idx, dtype=torch.int32))
    if not bool((covered == 1).all()):
        raise SnapshotError(f"{where}: the pieces of {name} cover {int((covered > 0).sum())} of {covered.numel()} "
                            f"positions ({int((covered > 1).sum())} twice): a shard is missing or from another "
                            "layout")
    return full


def _index_pieces(name: str, shape: tuple[int, ...], parts: list[tuple[dict[str, Any], torch.Tensor | None,
                  torch.Tensor]], where: str) -> list[tuple[dict[str, Any], torch.Tensor | None, torch.Tensor]]:
    """index_flat pieces (chunks of index pieces) joined into their index pieces; other pieces as they are."""
    groups: dict[tuple, list[tuple[dict[str, Any], torch.Tensor]]] = {}
    out: list[tuple[dict[str, Any], torch.Tensor | None, torch.Tensor]] = []
    indices: dict[tuple, torch.Tensor] = {}
    for sel, idx, v in parts:
        if sel["kind"] != "index_flat":
            out.append((sel, idx, v))
            continue
        key = (sel["dim"], tuple(idx.tolist()))
        indices[key] = idx
        groups.setdefault(key, []).append((sel, v))
    for (dim, _), chunks in groups.items():
        idx = indices[(dim, _)]
        piece_shape = list(shape)
        piece_shape[dim] = idx.numel()
        flat = assemble(f"{name} (tp piece)", tuple(piece_shape),
                        [({"kind": "flat", "start": sel["start"], "stop": sel["stop"]}, None, v) for sel, v in chunks],
                        where)
        out.append(({"kind": "index", "dim": dim}, idx, flat))
    return out


# ---- RNG states as tensors and ints ---------------------------------------------------------------------------------

def _capture_rng(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    tensors["rng/torch"] = torch.get_rng_state()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors["rng/numpy"] = torch.from_numpy(np.asarray(keys, dtype=np.int64).copy())
    version, internal, gauss_next = random.getstate()
    tensors["rng/python"] = torch.tensor(internal, dtype=torch.int64)
    return {"numpy": {"kind": str(kind), "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
            "python": {"version": int(version), "gauss_next": gauss_next}}


def _restore_rng(tensors: Mapping[str, torch.Tensor], rng: Any, where: str) -> None:
    if rng is None:
        return
    try:
        t, npk, py = tensors["rng/torch"], tensors["rng/numpy"], tensors["rng/python"]
        n, p = rng["numpy"], rng["python"]
        if t.dtype != torch.uint8 or npk.numel() != 624 or py.numel() != 625:
            raise ValueError("wrong sizes")
        torch.set_rng_state(t.clone())
        np.random.set_state((str(n["kind"]), npk.numpy().astype(np.uint32), int(n["pos"]), int(n["has_gauss"]),
                             float(n["cached"])))
        gauss = p["gauss_next"]
        random.setstate((int(p["version"]), tuple(int(v) for v in py.tolist()),
                         None if gauss is None else float(gauss)))
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise SnapshotError(f"{where}: the RNG states are malformed ({type(e).__name__}: {e})") from None
