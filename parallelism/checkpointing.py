"""Activation checkpointing: keep only block inputs in forward, recompute the block in backward.

Without it, backward needs every intermediate activation of every block: memory ∝ L·(activations per block).
With each of the L blocks checkpointed, forward keeps only the L block inputs and backward recomputes one block at a
time: memory ∝ L·(block input) + (activations of one block), for the price of one extra forward per block
(≈ +1/3 compute when backward costs 2 forwards).

`ActivationMeter` measures what autograd actually keeps: a saved-tensors hook counts the bytes of every activation
saved for backward (parameters excluded, shared storages counted once) and releases them when autograd frees them,
so `peak_bytes` is the high-water mark of saved activations over forward *and* backward (recomputation included).
Checkpointing uses torch.utils.checkpoint with use_reentrant=True: its forward runs under no_grad and saves only the
block input through the outer hook, and its recomputation saves through the same hook, so both are measured.

A block with mixture-of-experts layers also returns their load-balancing (aux) losses from the checkpointed
function: computed under no_grad they would be constants, returned they become outputs of the checkpoint whose
gradient, in backward, flows through the recomputed router like the block output's. The wrapper puts them back on
the layers (`last_aux`), where `moe.moe_aux_loss` reads them. Routing statistics count once: the no-grad forward
does not count, the recomputation does.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


_RECOMPUTE = threading.local()


def recomputing() -> bool:
    """Whether a checkpointed block is recomputing its forward in this thread now (inside backward): ZeRO-3 then
    keeps the units it gathers for their backward."""
    return getattr(_RECOMPUTE, "depth", 0) > 0


class CheckpointWrapper(torch.nn.Module):
    """Run `module` under activation checkpointing (recompute in backward). `forwards` counts the module's forward
    runs (2 per training step: the forward and its recomputation). Modules whose inputs are all integer tensors
    (token ids) run plainly: there is no input gradient to recompute through."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        self.forwards = 0
        from .moe import MoEBase
        self._moe = [m for m in module.modules() if isinstance(m, MoEBase)]

    def _run(self, *args: Any) -> Any:
        self.forwards += 1
        if not torch.is_grad_enabled():          # the first forward (reentrant checkpoint: under no_grad)
            return self.module(*args)
        _RECOMPUTE.depth = getattr(_RECOMPUTE, "depth", 0) + 1      # the recompute, inside backward
        try:
            return self.module(*args)
        finally:
            _RECOMPUTE.depth -= 1

    def _run_with_aux(self, *args: Any) -> tuple[torch.Tensor, ...]:
        out = self._run(*args)
        return (out, *[m.last_aux for m in self._moe])

    def forward(self, *args: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.module(*args)
        if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            # reentrant checkpoint only differentiates through inputs that require grad: promote float inputs
            args = tuple(a.detach().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point()
                         else a for a in args)
            if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
                return self.module(*args)   # integer inputs (token ids): nothing to gain, run it plainly
        if self._moe:               # the aux losses leave as outputs, so their gradient reaches the router
            out, *auxes = checkpoint(self._run_with_aux, *args, use_reentrant=True)
            for m, aux in zip(self._moe, auxes):
                m.last_aux = aux
            return out
        return checkpoint(self._run, *args, use_reentrant=True)


def wrap_children(model: torch.nn.Module) -> torch.nn.Module:
    """Checkpoint every top-level child that has parameters (the blocks of a Sequential). In place; returns model."""
    for name, child in list(model.named_children()):
        if any(True for _ in child.parameters()) and not isinstance(child, CheckpointWrapper):
            setattr(model, name, CheckpointWrapper(child))
    return model


def unwrap_name(name: str) -> str:
    """Parameter name without the wrapper's '.module' component, so slots keep full-model names."""
    return name.replace(".module.", ".")


class ActivationMeter:
    """Context manager: live and peak bytes of activations saved for backward."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.saved_total = 0
        self._refs: dict[int, int] = {}
        self._lock = threading.Lock()
        self._ctx: Any = None

    def _pack(self, t: torch.Tensor) -> Any:
        base = t._base if t._base is not None else t
        if isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad):
            return t
        key = base.untyped_storage().data_ptr()
        nb = base.untyped_storage().nbytes()
        with self._lock:
            if self._refs.get(key, 0) == 0:
                self.live += nb
                self.saved_total += nb
                self.peak = max(self.peak, self.live)
            self._refs[key] = self._refs.get(key, 0) + 1
        return _Saved(self, t, key, nb)

    @staticmethod
    def _unpack(obj: Any) -> torch.Tensor:
        return obj.tensor if isinstance(obj, _Saved) else obj

    def _release(self, key: int, nb: int) -> None:
        with self._lock:
            self._refs[key] -= 1
            if self._refs[key] == 0:
                del self._refs[key]
                self.live -= nb

    def __enter__(self) -> ActivationMeter:
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)


class _Saved:
    __slots__ = ("meter", "tensor", "key", "nb")

    def __init__(self, meter: ActivationMeter, tensor: torch.Tensor, key: int, nb: int) -> None:
        self.meter, self.tensor, self.key, self.nb = meter, tensor, key, nb

    def __del__(self) -> None:
        self.meter._release(self.key, self.nb)


def measure(model_factory: Any, x: torch.Tensor, y: torch.Tensor, loss_fn: Any = None,
            repeats: int = 3) -> dict[str, float]:
    """Peak saved-activation bytes and step time of one forward+backward, without and with checkpointing.

    Returns {'peak_bytes_plain', 'peak_bytes_checkpointed', 'seconds_plain', 'seconds_checkpointed',
    'block_forwards_per_step'} — the last is 2 with checkpointing (each block's forward runs again in backward)."""
    import time
    loss_fn = loss_fn or torch.nn.functional.cross_entropy
    out: dict[str, float] = {}
    for label, ck in (("plain", False), ("checkpointed", True)):
        model = model_factory()
        if ck:
            wrap_children(model)
        times = []
        for _ in range(repeats):
            model.zero_grad(set_to_none=True)
            with ActivationMeter() as meter:
                t0 = time.perf_counter()
                loss_fn(model(x), y).backward()
                times.append(time.perf_counter() - t0)
        out[f"peak_bytes_{label}"] = meter.peak
        out[f"seconds_{label}"] = min(times)
        if ck:
            counts = [m.forwards for m in model.modules() if isinstance(m, CheckpointWrapper) and m.forwards]
            out["block_forwards_per_step"] = max(counts) / repeats if counts else 1.0
    return out
