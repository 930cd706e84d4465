"""`inspect_gradients` on Keras 3: per-layer ranges of the weights' gradients, on any backend.

The gradients come the backend's own way (TensorFlow's GradientTape, torch autograd, JAX's
grad through a ``StatelessScope``); a layer is a variable's path without its name
(``"sequential/dense"``, as `describe` shows it). On torch and JAX the stats vector
(`mixedpolicy.ranges.layout`) is computed on the device by those backends' functions; on
TensorFlow with numpy after one transfer per layer.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from mixedpolicy.backends.keras.saving import to_numpy
from mixedpolicy.ranges import merge, numpy_stats


def _gradients(model: Any, loss_fn: Any, batch: Any, variables: list) -> list:
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = loss_fn(model, batch)
        return tape.gradient(loss, variables)
    if backend == "torch":
        import torch

        loss = loss_fn(model, batch)
        return list(torch.autograd.grad(loss, [v.value for v in variables], allow_unused=True))
    if backend == "jax":
        import jax

        def loss_of(values: list) -> Any:
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                return loss_fn(model, batch)

        return jax.grad(loss_of)([v.value for v in variables])
    raise TypeError(f"inspect_gradients does not support Keras's {backend!r} backend.")


def _stats(flat: list, scales: tuple) -> np.ndarray:
    """One stats vector of a layer's variables (or their gradients), each a Keras kernel
    (..., in, out) scaled by rows of its outputs, as on JAX."""
    backend = keras.backend.backend()
    total = None
    for g in flat:
        if backend == "torch":
            from mixedpolicy.backends.torch.ranges import stats

            g = g.reshape(-1, g.shape[-1]).T if g.dim() > 1 else g
            vector = stats(g, scales).cpu().numpy()
        elif backend == "jax":
            from mixedpolicy.backends.jax.ranges import by_output, stats as jax_stats

            vector = jax_stats(by_output(g), scales)
        else:
            a = np.asarray(to_numpy(g))
            vector = numpy_stats(a.reshape(-1, a.shape[-1]).T if a.ndim > 1 else a, scales)
        total = merge(total, vector)
    return total


def range_stats(model: Any, loss_fn: Any, batches: list, scales: tuple) -> dict:
    variables = list(model.trainable_variables)
    weights: dict = {}
    for v in variables:  # the weights as they are (no step is taken)
        weights.setdefault(v.path.rpartition("/")[0], []).append(v.value)
    totals: dict = {(path, "weight"): _stats(flat, scales) for path, flat in weights.items()}
    for batch in batches:
        layers: dict = {}
        for v, g in zip(variables, _gradients(model, loss_fn, batch, variables)):
            if g is not None:
                layers.setdefault(v.path.rpartition("/")[0], []).append(g)
        for path, flat in layers.items():
            totals[(path, "weight_grad")] = merge(totals.get((path, "weight_grad")), _stats(flat, scales))
    order = {path: i for i, path in enumerate(weights)}
    return dict(sorted(totals.items(), key=lambda item: (order.get(item[0][0], len(order)), item[0][1] != "weight")))
