"""`inspect_gradients` on JAX: per-layer ranges of the weights' gradients, on the device.

Flax NNX modules (``nnx.grad``), Equinox modules (``eqx.filter_grad``, through their policies)
and pytrees of parameters (``jax.grad``: linen's params, plain functions' weights). A leaf's layer is its path without the last key
(``"dense.kernel"`` belongs to ``"dense"``), as `PolicyMap` resolves it; each leaf's stats
vector (`mixedpolicy.ranges.layout`; a kernel's rows are its outputs') is computed in a
jitted function with XLA's own float16/bfloat16 casts, one transfer per leaf, and merged. Activations
are not exposed cheaply in JAX: only the weights' gradients are reported.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mixedpolicy.backends.jax.reduce import _path
from mixedpolicy.ranges import BINS, EMIN, ROW_BINS, merge, rows


@functools.partial(jax.jit, static_argnums=1)
def _on_device(x: Any, scales: tuple) -> tuple:
    """(int32 counts: size, zeros, non-finite, the histogram, the per-scale counts, the per-row
    histogram (rows along the last axis); max |x|)."""
    a = jnp.abs(x.astype(jnp.float32)).reshape(-1)
    finite = jnp.isfinite(a)
    a = jnp.where(finite, a, 0.0)
    nz = a > 0
    _, e = jnp.frexp(a)
    bins = jnp.where(nz, jnp.clip(e - 1 - EMIN, 0, BINS - 1), BINS)  # zeros go to a spare bin
    hist = jnp.bincount(bins, length=BINS + 1)[:BINS].astype(jnp.int32)
    parts = [jnp.stack([jnp.int32(a.size), jnp.sum(~nz & finite, dtype=jnp.int32),
                        jnp.sum(~finite, dtype=jnp.int32)]), hist]
    for s in scales:
        y = a * jnp.float32(s)
        for dt in (jnp.float16, jnp.bfloat16):
            r = y.astype(dt).astype(jnp.float32)
            tiny = float(jnp.finfo(dt).tiny)
            parts.append(jnp.stack([jnp.sum(jnp.isinf(r) & nz, dtype=jnp.int32),
                                    jnp.sum((r != 0) & (jnp.abs(r) < tiny), dtype=jnp.int32),
                                    jnp.sum((r == 0) & nz, dtype=jnp.int32)]))
    by_row = a.reshape(rows(x.shape))
    top = jnp.max(by_row, axis=1, keepdims=True) if by_row.size else by_row
    _, e = jnp.frexp(jnp.where(by_row > 0, by_row / jnp.where(top > 0, top, 1.0), 0.0).reshape(-1))
    row_bins = jnp.where(nz, jnp.clip(-e, 0, ROW_BINS - 1), ROW_BINS)  # zeros to a spare bin
    parts.append(jnp.bincount(row_bins, length=ROW_BINS + 1)[:ROW_BINS].astype(jnp.int32))
    return jnp.concatenate(parts), jnp.max(a) if a.size else jnp.float32(0)


def stats(x: Any, scales: tuple) -> np.ndarray:
    """The stats vector of `x` (`mixedpolicy.ranges.layout`), computed on the device with
    integer counts (exact for any size JAX indexes with int32), moved in one transfer."""
    counts, amax = jax.device_get(_on_device(x, scales))
    counts = np.asarray(counts, np.float64)
    return np.concatenate([counts[:3], [float(amax)], counts[3:]])


def by_output(leaf: Any) -> Any:
    """A JAX kernel (..., in, out) as rows over what each output multiplies (a row per output)."""
    return leaf.reshape(-1, leaf.shape[-1]).T if leaf.ndim > 1 else leaf


def by_layer(grads: Any) -> dict:
    """layer path -> the floating leaves of `grads` under it, each as `by_output` lays it out."""
    layers: dict = {}
    for keys, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]:
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating):
            layers.setdefault(_path(keys).rpartition(".")[0], []).append(by_output(leaf))
    return layers


def merged(leaves: list, scales: tuple) -> np.ndarray:
    """One stats vector of several arrays, each scaled by rows of its own."""
    total = None
    for leaf in leaves:
        total = merge(total, stats(leaf, scales))
    return total


def _collect(params: Any, grads_per_batch: list, scales: tuple) -> dict:
    """Each layer's weights (once) and its gradients (merged over the batches), by layer."""
    totals: dict = {(path, "weight"): merged(leaves, scales) for path, leaves in by_layer(params).items()}
    for grads in grads_per_batch:
        for path, leaves in by_layer(grads).items():
            totals[(path, "weight_grad")] = merge(totals.get((path, "weight_grad")), merged(leaves, scales))
    order = {path: i for i, (path, _) in enumerate(totals)}
    return dict(sorted(totals.items(), key=lambda item: (order[item[0][0]], item[0][1] != "weight")))


def pytree_stats(params: Any, loss_fn: Any, batches: list, scales: tuple) -> dict:
    leaves = jax.tree_util.tree_leaves(params)
    if not any(isinstance(x, (jax.Array, np.ndarray)) and jnp.issubdtype(x.dtype, jnp.floating) for x in leaves):
        kinds = sorted({type(x).__name__ for x in leaves})
        raise TypeError(f"Received a model of type {type(params).__name__} with no floating array "
                        f"among its leaves ({', '.join(kinds) or 'none'}); expected a torch.nn.Module, a "
                        f"Flax NNX module, a Keras 3 model or a JAX pytree of parameters (arrays).")
    grad = jax.grad(loss_fn)
    return _collect(params, [grad(params, batch) for batch in batches], scales)


def equinox_stats(model: Any, plain: Any, loss_fn: Any, batches: list, scales: tuple) -> dict:
    """An Equinox module's gradients through its policies (``eqx.filter_grad`` of `model`), by the
    layer paths of `plain`: `plain(tree)` is a tree without its `PolicyModule` wrappers (passed in
    by the adapter, which imports this module: no import back)."""
    import equinox as eqx

    grad = eqx.filter_grad(loss_fn)
    params = eqx.filter(plain(model), eqx.is_inexact_array)
    return _collect(params, [plain(grad(model, batch)) for batch in batches], scales)


def nnx_stats(model: Any, loss_fn: Any, batches: list, scales: tuple) -> dict:
    from flax import nnx

    grad = nnx.grad(loss_fn)
    pure = nnx.to_pure_dict if hasattr(nnx, "to_pure_dict") else (lambda state: state)
    return _collect(pure(nnx.state(model, nnx.Param)), [pure(grad(model, batch)) for batch in batches], scales)
