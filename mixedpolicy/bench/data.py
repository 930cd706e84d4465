"""The data and the batch order that every framework shares.

The data is scikit-learn's digits (shipped inside scikit-learn, no download): 8x8
images as 64 features in [0, 1], 10 classes, a fixed 75/25 train/test split. The
batch order comes from one seeded numpy generator, so every run sees the same
batches in the same order (the shared initial weights are in `models`).

`synthetic` is the other data set (``--data synthetic``): seeded random inputs and
labels already in the model's shape, at the sizes real models take (224x224 images,
1024 tokens): for speed and memory at scale, not for accuracy (its labels are noise).
"""

from __future__ import annotations

import numpy as np

def digits(seed: int = 0) -> tuple:
    """x_train, y_train, x_test, y_test: float32 features in [0, 1] and int32 labels."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=0.25, random_state=seed)
    return (x_train.astype(np.float32), y_train.astype(np.int32),
            x_test.astype(np.float32), y_test.astype(np.int32))


def synthetic(model: str, cfg: dict, n_train: int, n_test: int, seed: int = 0) -> tuple:
    """x_train, y_train, x_test, y_test of random data in `model`'s input shape (`cfg`'s
    sizes): standard-normal float32 inputs and uniform int32 labels over its classes; for
    gpt2 uniform int32 tokens, the labels being each next token."""
    from mixedpolicy.bench.models import input_shape

    rng = np.random.default_rng(seed)
    out = []
    for n in (n_train, n_test):
        if model == "gpt2":
            tokens = rng.integers(0, cfg["vocab"], (n, cfg["seq"] + 1), dtype=np.int32)
            out += [tokens[:, :-1].copy(), tokens[:, 1:].copy()]
        else:
            out += [rng.standard_normal((n, *input_shape(model, cfg)), dtype=np.float32),
                    rng.integers(0, cfg["classes"], n, dtype=np.int32)]
    return tuple(out)


_SPLIT = ("x_train", "y_train", "x_test", "y_test")


def save(path: str, split: tuple) -> None:
    """Writes a `digits` split once, so that every worker reads the very same arrays (and
    none pays scikit-learn's import)."""
    np.savez(path, **dict(zip(_SPLIT, split)))


def load(path: str) -> tuple:
    """The split that `save` wrote: x_train, y_train, x_test, y_test."""
    with np.load(path) as f:
        return tuple(f[name] for name in _SPLIT)


def batch_order(n: int, batch_size: int, steps: int, seed: int = 0) -> np.ndarray:
    """(steps, batch_size) indices into the training set: epochs of shuffled full batches."""
    rng = np.random.default_rng(seed)
    per_epoch = n // batch_size
    if per_epoch == 0:
        raise ValueError(f"Received --batch-size {batch_size}, larger than the {n} training "
                         f"samples; choose at most {n}.")
    rows = []
    while len(rows) < steps:
        order = rng.permutation(n)
        rows.extend(order[i * batch_size:(i + 1) * batch_size] for i in range(per_epoch))
    return np.stack(rows[:steps])
