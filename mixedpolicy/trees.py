"""jmp's tree functions, on the trees of every framework: the two of a hand-written
loss-scaling loop (is every gradient finite; keep the new state or the old one), in the trees'
own framework without a host sync, and the casts to full and half precision.

A jmp loop moves over by its import::

    grads = loss_scale.unscale(grads)
    finite = mp.all_finite(grads)
    loss_scale = loss_scale.adjust(finite)
    params = mp.select_tree(finite, new_params, params)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mixedpolicy._dtypes import DType, show
from mixedpolicy._registry import array_ops_for_tree as _tree_ops, cast_tree
from mixedpolicy._scale_checks import check_finite_flag


def all_finite(tree: Any) -> Any:
    """A boolean scalar of the tree's framework: are all floating leaves free of inf and NaN?

    Python floats count as floating leaves. No host sync for framework arrays.

    >>> bool(all_finite({"w": np.ones(2, np.float32), "b": float("inf")}))
    False
    """
    return _tree_ops(tree).all_finite(tree)


def select_tree(pred: Any, a: Any, b: Any) -> Any:
    """`a` where the boolean scalar `pred` is true, else `b`, leaf by leaf (jmp's ``select_tree``):
    a step's new parameters and optimizer state, or the old ones after a non-finite step. Runs
    in the trees' framework (a ``where``: under ``jax.jit`` and on a device, no host sync).

    Raises:
      TypeError: `pred` is not a boolean scalar.
      ValueError: `a` and `b` differ in their structure (keys, nesting) or in a leaf's shape.

    >>> select_tree(np.bool_(False), {"w": np.ones(2)}, {"w": np.zeros(2)})
    {'w': array([0., 0.])}
    """
    check_finite_flag(pred, what="pred")
    ops = _tree_ops((pred, a, b))
    a_leaves, b_leaves = list(ops.leaves(a)), list(ops.leaves(b))
    if len(a_leaves) != len(b_leaves):
        raise ValueError(f"Received trees of {len(a_leaves)} and {len(b_leaves)} leaves; select_tree "
                         f"picks between two trees of one structure (new and old parameters).")
    if ops.structure(a) != ops.structure(b):  # as many leaves, in other places (other keys)
        raise ValueError(f"Received trees of two structures, {show(ops.structure(a), 120)} and "
                         f"{show(ops.structure(b), 120)}; select_tree picks between two trees of one "
                         f"structure (the same keys and nesting: new and old parameters).")
    for i, (x, y) in enumerate(zip(a_leaves, b_leaves)):
        if (x is None) != (y is None) or tuple(getattr(x, "shape", ())) != tuple(getattr(y, "shape", ())):
            raise ValueError(f"Received leaves of shapes {show(tuple(getattr(x, 'shape', ())))} and "
                             f"{show(tuple(getattr(y, 'shape', ())))} at leaf {i} ({show(x, 40)} and "
                             f"{show(y, 40)}); select_tree picks "
                             f"between two trees of one structure, leaf for leaf.")
    if isinstance(pred, (bool, np.bool_, np.ndarray)):  # known on the host: a tree as it is
        return a if bool(pred) else b
    others = iter(b_leaves)

    def pick(x: Any) -> Any:
        y = next(others)
        return None if x is None else ops.where(pred, x, y)  # (torch's pytree hands None over as a leaf)
    return ops.tree_map(pick, a)


def half_dtype(tree: Any = None) -> DType:
    """The half-precision dtype for the device a framework computes on (jmp's ``half_dtype``):
    ``"bfloat16"`` on a TPU, where float16 has no hardware, else ``"float16"``. Judged by the
    framework of `tree`'s arrays, or without a tree by JAX's default device where JAX is imported.

    >>> half_dtype(np.ones(2, np.float32))
    'float16'
    """
    if isinstance(tree, (str, bytes)):  # a device or platform name would silently mean "no arrays"
        raise TypeError(f"Received half_dtype({tree!r}); expected a tree of arrays, whose device decides, or "
                        f"nothing (JAX's default device, as jmp.half_dtype()). A policy's half dtype is "
                        f"Policy(...).compute_dtype.")
    if tree is None:
        from mixedpolicy._registry import imported_array_ops

        halves = {ops.half_dtype() for ops in imported_array_ops()}
        return DType("bfloat16" if "bfloat16" in halves else "float16")
    return DType(_tree_ops(tree).half_dtype())


def cast_to_full(tree: Any) -> Any:
    """The floating leaves of `tree` cast to float32, every other leaf as it is (jmp's
    ``cast_to_full``).

    >>> cast_to_full({"w": np.ones(2, np.float16), "step": np.int32(3)})["w"].dtype
    dtype('float32')
    """
    return cast_tree(tree, "float32")


def cast_to_half(tree: Any) -> Any:
    """The floating leaves of `tree` cast to `half_dtype` of its framework, every other leaf as it
    is (jmp's ``cast_to_half``).

    >>> cast_to_half([np.ones(2, np.float32), np.arange(2)])[0].dtype
    dtype('float16')
    """
    ops = _tree_ops(tree)  # (one look at the tree's leaves for both)
    return ops.cast_tree(tree, ops.half_dtype())
