"""Your own workload: your model, your data and your loss, trained by every pslab strategy without editing pslab.

Write a function that returns a `UserWorkload` in a file or module of yours, and name it in the config:

    # my_cnn.py
    import numpy as np, torch
    from torch import nn
    from pslab.experiments.workloads.user import UserWorkload, npz

    def make_workload() -> UserWorkload:
        train, test = npz("images.npz")          # arrays x_train, y_train, x_test, y_test (no download)
        def model(seed: int) -> nn.Module:      # seeded: the same seed gives the same initial parameters
            torch.manual_seed(seed)
            return nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 26 * 26, 10))
        return UserWorkload(model=model, train=train, test=test)   # loss: cross-entropy on (x, y) by default

    # config.toml
    [workload]
    name = "my_cnn.py:make_workload"             # a file (relative to the working directory) or "my_pkg.mod:fn"

The parts, and what pslab does with them:

- `train`, `test`: the examples. A tuple of equal-length arrays or tensors (x, y, ...), a dict of them
  ({"x": ..., "y": ...}), or a torch Dataset (indexable, with len; items collated by torch's default_collate).
  Readers for data on disk, none of which downloads or unpickles: `npz(path)` (arrays x_train, y_train, x_test,
  y_test), `image_folder(path)` (PATH/<class>/<image>, read with Pillow, a fixed split), `token_file(path,
  context)` (a .npy of token ids, or a text file one character a token: next-token windows).
  pslab's batch schedule (schedule.py) splits the training examples into the workers' disjoint shards and picks
  worker w's batch at step t as for the built-in workloads, so every strategy sees the same examples.
- `model(seed) -> nn.Module`: any module, called as `model(inputs(batch))`.
- `inputs(batch)`: what the model is called with. Default: `batch[0]` for a tuple, the whole dict for a dict.
- `loss(output, batch) -> scalar tensor`: the training loss. Default: cross-entropy of `output` against `batch[1]`
  (a tuple) or `batch["y"]` (a dict). The output can be any object (a tensor, a dict, a dataclass): only your loss
  and evaluate look inside it.
- `evaluate(model, test_batch) -> {name: float}`: metrics on the test set (the whole set as one batch, at most
  `max_eval` examples). Default: `test_loss` (your loss), and `test_acc` when the output is a tensor of class scores
  and the target an integer tensor. `test_acc` is what time-to-accuracy and the studies read.

- `tp_plan`: {name of an nn.Linear in the model: "colwise" | "rowwise"}, how tensor parallelism splits it (as
  torch's parallelize_module with ColwiseParallel / RowwiseParallel, and Hugging Face's tp_plan): a colwise
  Linear keeps its output features split, its rowwise partner takes them and sums the partial products — only
  per-feature operations (an activation) between the two. (A model may also carry the dict as `model.tp_plan`.)
- `pp_cuts`: for pipeline parallelism, the child indices of the model (an nn.Sequential) where stages 1, 2, ...
  begin — `[3]` cuts it into children 0-2 and 3-end (as torch.distributed.pipelining's split points). Without
  it, pslab spreads the parameterised children evenly. Stage 0 is called with `inputs(micro_batch)` (a tensor, a
  tuple or a dict: the batch is cut into micro-batches along dim 0), every later cut carries one tensor, and the
  last stage scores `loss(output, micro_batch)` — which must be the mean over the micro-batch's examples (as
  cross-entropy is), so the micro-batches' losses weighted by their sizes sum to the batch's.
  With a tp_plan too, each stage splits the planned Linears it holds (dp x tp x pp, 3D): a colwise Linear and its
  rowwise partner must fall in one stage.

Where it runs: every strategy (local, allreduce, every ps-*), the simulator, data parallelism and ZeRO 1-3, any
module; tensor parallelism by the model's tp_plan and pipeline parallelism for an nn.Sequential, alone or
together (x dp). Context, sequence and expert parallelism split pslab's own transformer and MoE blocks
(parallelism/models.py); what a model cannot do gets one line saying so.

The function is imported in every process pslab starts (by its module name, or by file path), so it must be
importable from the working directory, and calling it must give the same data each time (read files, seed any
generation). Model parameters must be float32.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from pslab.experiments.errors import ConfigError


@dataclass
class UserWorkload:
    """What a user's workload function returns (see the module docstring)."""
    model: Callable[[int], nn.Module]
    train: Any
    test: Any = None
    loss: Callable[[Any, Any], torch.Tensor] | None = None
    inputs: Callable[[Any], Any] | None = None
    evaluate: Callable[[nn.Module, Any], Mapping[str, float]] | None = None
    max_eval: int = 2000
    description: str = "a user workload"
    tp_plan: Mapping[str, str] | None = None
    pp_cuts: Sequence[int] | None = None


def npz(path: str | Path) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """((x_train, y_train), (x_test, y_test)) from a .npz file holding those four arrays (allow_pickle is off)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"no such .npz file: {p}")
    with np.load(p, allow_pickle=False) as f:
        missing = [k for k in ("x_train", "y_train", "x_test", "y_test") if k not in f]
        if missing:
            raise ConfigError(f"{p}: a workload .npz needs arrays x_train, y_train, x_test, y_test; missing "
                              f"{', '.join(missing)} (has {', '.join(f.files)})")
        return (f["x_train"], f["y_train"]), (f["x_test"], f["y_test"])


SPLIT_SEED = 12345        # the built-in datasets' split seed (data.py): a fixed split, whatever the run's seed


def _split(x: np.ndarray, y: np.ndarray, test_fraction: float) -> tuple[tuple[np.ndarray, np.ndarray],
                                                                      tuple[np.ndarray, np.ndarray]]:
    if not 0 < test_fraction < 1:
        raise ConfigError(f"test_fraction must be in (0, 1), got {test_fraction}")
    perm = np.random.default_rng(SPLIT_SEED).permutation(len(x))
    n_test = max(1, int(round(len(x) * test_fraction)))
    if n_test >= len(x):
        raise ConfigError(f"{len(x)} examples are too few to keep {test_fraction:.0%} for the test set")
    test, train = perm[:n_test], perm[n_test:]
    return (x[train], y[train]), (x[test], y[test])


def image_folder(path: str | Path, size: tuple[int, int] | None = None, grayscale: bool = False,
                 test_fraction: float = 0.2) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """((x_train, y_train), (x_test, y_test)) from PATH/<class>/<image> (png, jpg, bmp, gif; read with Pillow):
    classes are the sub-folder names in sorted order (label = index), pixels float32 in [0, 1], channels first
    (N, C, H, W); `size` (width, height) resizes every image, else all must share one size; a fixed split (seed
    12345) keeps `test_fraction` for the test set."""
    from PIL import Image
    root = Path(path)
    classes = sorted(d.name for d in root.iterdir() if d.is_dir()) if root.is_dir() else []
    if not classes:
        raise ConfigError(f"{root}: an image folder holds one sub-folder per class (none found)")
    xs, ys = [], []
    for label, c in enumerate(classes):
        for f in sorted((root / c).iterdir()):
            if f.suffix.lower() not in (".png", ".jpg", ".jpeg", ".bmp", ".gif"):
                continue
            with Image.open(f) as im:
                im = im.convert("L" if grayscale else "RGB")
                if size is not None:
                    im = im.resize(size)
                a = np.asarray(im, dtype=np.float32) / 255.0
            xs.append(a[None] if a.ndim == 2 else a.transpose(2, 0, 1))
            ys.append(label)
    if not xs:
        raise ConfigError(f"{root}: no images in its class folders ({', '.join(classes)})")
    shapes = {x.shape for x in xs}
    if len(shapes) > 1:
        raise ConfigError(f"{root}: images differ in size {sorted(shapes)[:3]}: pass size=(width, height)")
    return _split(np.stack(xs), np.asarray(ys, dtype=np.int64), test_fraction)


def token_file(path: str | Path, context: int = 32, test_fraction: float = 0.1
               ) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray], int]:
    """A language-model dataset from a file of token ids (.npy of integers) or of text (anything else: UTF-8,
    one token per character, the vocabulary its sorted characters): non-overlapping windows of `context` tokens,
    each target the window shifted by one, as pslab's text workloads; returns (train, test, vocabulary size)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"no such token file: {p}")
    if p.suffix == ".npy":
        ids = np.load(p, allow_pickle=False)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) or len(ids) == 0 or ids.min() < 0:
            raise ConfigError(f"{p}: a token file is a 1-D array of non-negative integer ids")
        vocab = int(ids.max()) + 1
    else:
        text = p.read_text(encoding="utf-8")
        index = {c: i for i, c in enumerate(sorted(set(text)))}
        ids, vocab = np.fromiter((index[c] for c in text), dtype=np.int64, count=len(text)), len(index)
    n = (len(ids) - 1) // context
    if n < 2:
        raise ConfigError(f"{p}: {len(ids)} tokens make fewer than 2 windows of context {context} + 1")
    x = np.stack([ids[i * context: (i + 1) * context] for i in range(n)]).astype(np.int64)
    y = np.stack([ids[i * context + 1: (i + 1) * context + 1] for i in range(n)]).astype(np.int64)
    train, test = _split(x, y, test_fraction)
    return train, test, vocab


def is_user_workload(name: str) -> bool:
    """'file.py:fn' or 'package.module:fn' (a built-in workload's name has no colon)."""
    return ":" in name


def load_user_workload(name: str) -> UserWorkload:
    """Import `name` ('path/to/file.py:fn' or 'pkg.mod:fn') and call fn(); ConfigError with the reason if not."""
    target, _, attr = name.rpartition(":")
    if not target or not attr.isidentifier():
        raise ConfigError(f"workload.name {name!r}: a user workload is 'file.py:function' or 'module:function'")
    try:
        if target.endswith(".py"):
            path = Path(target).resolve()
            if not path.is_file():
                raise ConfigError(f"workload.name {name!r}: no such file {path}")
            modname = f"pslab_user_workload_{abs(hash(str(path)))}"
            module = sys.modules.get(modname)
            if module is None:
                spec = importlib.util.spec_from_file_location(modname, path)
                module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
                sys.modules[modname] = module
                spec.loader.exec_module(module)  # type: ignore[union-attr]
        else:
            module = importlib.import_module(target)
    except ConfigError:
        raise
    except ImportError as e:
        raise ConfigError(f"workload.name {name!r}: cannot import {target}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"workload.name {name!r}: {target} has no function {attr!r}")
    wl = fn()
    if not isinstance(wl, UserWorkload):
        raise ConfigError(f"workload.name {name!r}: {attr}() must return a "
                          f"pslab.experiments.workloads.user.UserWorkload, got {type(wl).__name__}")
    return wl


class _Examples:
    """Indexable examples: take(idx) -> one collated batch of the same structure (tuple, dict or collated items)."""

    def __init__(self, data: Any, what: str) -> None:
        if isinstance(data, Mapping):
            self.kind, self.parts = "dict", {k: _tensor(v, f"{what}[{k!r}]") for k, v in data.items()}
            lens = {len(v) for v in self.parts.values()}
        elif isinstance(data, (tuple, list)) and data and all(isinstance(v, (np.ndarray, torch.Tensor)) for v in data):
            self.kind, self.parts = "tuple", tuple(_tensor(v, f"{what}[{i}]") for i, v in enumerate(data))
            lens = {len(v) for v in self.parts}
        elif hasattr(data, "__getitem__") and hasattr(data, "__len__"):
            self.kind, self.parts, lens = "dataset", data, {len(data)}
        else:
            raise ConfigError(f"the workload's {what} must be a tuple or dict of equal-length arrays, or a torch "
                              f"Dataset; got {type(data).__name__}")
        if len(lens) != 1:
            raise ConfigError(f"the workload's {what} arrays differ in length: {sorted(lens)}")
        self.n = lens.pop()
        if self.n < 1:
            raise ConfigError(f"the workload's {what} set is empty")

    def take(self, idx: np.ndarray) -> Any:
        t = torch.from_numpy(np.asarray(idx, dtype=np.int64))
        if self.kind == "dict":
            return {k: v[t] for k, v in self.parts.items()}
        if self.kind == "tuple":
            return tuple(v[t] for v in self.parts)
        from torch.utils.data import default_collate
        return default_collate([self.parts[int(i)] for i in idx])


def _tensor(v: Any, what: str) -> torch.Tensor:
    t = v if isinstance(v, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(v))
    if t.dtype == torch.float64:
        t = t.float()                         # pslab's parameters and wire are float32
    if t.dim() == 0:
        raise ConfigError(f"the workload's {what} is a scalar; give one row per example")
    return t


def _target(batch: Any) -> Any:
    if isinstance(batch, Mapping):
        if "y" not in batch:
            raise ConfigError("the default loss reads batch['y']; give the workload a loss(output, batch)")
        return batch["y"]
    if isinstance(batch, Sequence) and len(batch) >= 2:
        return batch[1]
    raise ConfigError("the default loss reads batch[1]; give the workload a loss(output, batch)")


def default_inputs(batch: Any) -> Any:
    return batch if isinstance(batch, Mapping) else batch[0]


def default_loss(output: Any, batch: Any) -> torch.Tensor:
    if not isinstance(output, torch.Tensor):
        raise ConfigError(f"the model returns a {type(output).__name__}, not a tensor of class scores: give the "
                          "workload a loss(output, batch)")
    return F.cross_entropy(output, _target(batch))


@dataclass(frozen=True)
class _Data:
    """What pslab reads of a dataset beside the batches: its size (and a class count where it knows one)."""
    name: str
    n_train: int
    num_classes: int = 0


class UserWorkloadRunner:
    """A user workload behind the built-in workloads' interface (make_model, batch, loss, evaluate, ...)."""

    task = "user"

    def __init__(self, name: str, workers: int, batch_size: int, seed: int) -> None:
        from .schedule import BatchSchedule
        self.name, self.seed = name, seed
        self.user = load_user_workload(name)
        self.spec = self.user                  # (the built-ins' spec: read only for its .model)
        self.model_kwargs: dict = {}
        self.train = _Examples(self.user.train, "train")
        self.test = _Examples(self.user.test, "test") if self.user.test is not None else None
        self.data = _Data(name, self.train.n)
        self.schedule = BatchSchedule(self.train.n, workers, batch_size, seed)
        self._inputs = self.user.inputs or default_inputs
        self._loss = self.user.loss or default_loss

    @property
    def workers(self) -> int:
        return self.schedule.workers

    def make_model(self) -> nn.Module:
        model = self.user.model(self.seed)
        if not isinstance(model, nn.Module):
            raise ConfigError(f"{self.name}: model(seed) must return a torch nn.Module, got {type(model).__name__}")
        if self.user.tp_plan is not None:
            model.tp_plan = dict(self.user.tp_plan)       # what tensor parallelism splits (parallelism/tensor.py)
        if self.user.pp_cuts is not None:
            model.pp_cuts = list(self.user.pp_cuts)       # where pipeline parallelism cuts (parallelism/pipeline.py)
        bad = [n for n, p in model.named_parameters() if p.dtype != torch.float32]
        if bad:
            raise ConfigError(f"{self.name}: parameters must be float32 (pslab's wire and optimizers are); "
                              f"{bad[0]} is {dict(model.named_parameters())[bad[0]].dtype}")
        return model

    def batch(self, worker: int, step: int) -> tuple[Any, Any, np.ndarray]:
        """(model inputs, the whole batch — what the loss reads, example indices)."""
        idx = self.schedule.indices(worker, step)
        b = self.train.take(idx)
        return self._inputs(b), b, idx

    def fixed_batch(self, n: int = 512) -> tuple[Any, Any]:
        b = self.train.take(np.arange(min(n, self.train.n)))
        return self._inputs(b), b

    def digest(self, worker: int, step: int) -> str:
        from .schedule import batch_digest
        return batch_digest(self.schedule.indices(worker, step))

    def loss_from_output(self, out: Any, batch: Any) -> torch.Tensor:
        return self._loss(out, batch)

    def loss(self, model: nn.Module, x: Any, batch: Any) -> torch.Tensor:
        return self._loss(model(x), batch)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, max_examples: int | None = None) -> dict[str, float]:
        if self.test is None:
            return {}
        b = self.test.take(np.arange(min(self.test.n, max_examples or self.user.max_eval)))
        if self.user.evaluate is not None:
            return {str(k): float(v) for k, v in self.user.evaluate(model, b).items()}
        out = model(self._inputs(b))
        metrics = {"test_loss": float(self._loss(out, b))}
        try:
            y = _target(b)
        except ConfigError:
            return metrics
        if isinstance(out, torch.Tensor) and isinstance(y, torch.Tensor) and not y.is_floating_point() \
                and out.dim() == y.dim() + 1:
            metrics["test_acc"] = float((out.argmax(-1) == y).float().mean())
        return metrics
