"""TensorFlow's array operations: tensors and variables, and ``tf.nest`` structures."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import tensorflow as tf

from mixedpolicy._adapter import ArrayOps
from mixedpolicy._dtypes import FLOATING_DTYPES, finite_groups, host_leaves_finite

TF_DTYPES = {name: tf.as_dtype(name) for name in FLOATING_DTYPES}
TF_DTYPES.update(bool=tf.bool, int32=tf.int32, int64=tf.int64)
NAMES = {v: k for k, v in TF_DTYPES.items() if k in FLOATING_DTYPES}


def _is_tensor(x: Any) -> bool:
    return isinstance(x, (tf.Tensor, tf.Variable))


#: A tensor of more values than this is checked in place by a product of its own (`_group_finite`).
READ_ALONE_FROM = 1 << 14
#: Smaller ones are concatenated into groups of at most this many values.
GROUPED_UP_TO = 1 << 16


def _group_finite(group: list) -> Any:
    """Are all values of `group` finite? A large float32 or float64 tensor alone is read in place
    by a matrix-vector product with zeros (``x * 0`` is 0 or NaN, and a sum of zeros cannot
    overflow), as on JAX: over 40 tensors of 61k values, one thread, 1.25 ms against 2.1 for their
    concatenation's ``is_finite`` mask (the same under XLA, whose concatenation of many values is
    a slow loop). Small tensors (the bench MLP's), other dtypes and tensors whose size is known only
    at run time (an embedding's gradient values in a graph), through the mask, concatenated."""
    first = group[0]
    size = first.shape.num_elements()
    columns = next((c for c in (256, 128, 64, 32, 16) if size % c == 0), None) if size else None
    if len(group) == 1 and columns and size > READ_ALONE_FROM and first.dtype in (tf.float32, tf.float64):
        rows = tf.reshape(first, [-1, columns])
        return tf.math.is_finite(tf.reduce_sum(tf.linalg.matvec(rows, tf.zeros([columns], first.dtype))))
    return tf.reduce_all(tf.math.is_finite(tf.concat([tf.reshape(x, [-1]) for x in group], 0)))


class TensorFlowArrays(ArrayOps):
    name = "tensorflow"

    def is_array(self, x: Any) -> bool:
        return _is_tensor(x)

    def leaves(self, tree: Any) -> Iterable[Any]:
        return tf.nest.flatten(tree)

    def tree_map(self, fn: Callable[[Any], Any], tree: Any) -> Any:
        return tf.nest.map_structure(fn, tree)

    def structure(self, tree: Any) -> Any:
        return tf.nest.map_structure(lambda _: None, tree)

    def asarray(self, value: Any, dtype: str, like: Any = None) -> Any:
        if _is_tensor(value):
            return tf.cast(value, TF_DTYPES[dtype])
        return tf.constant(value, dtype=TF_DTYPES[dtype])

    def floating_dtype(self, x: Any) -> str | None:
        return NAMES.get(x.dtype) if _is_tensor(x) else None

    def cast(self, x: Any, dtype: str) -> Any:
        if _is_tensor(x) and x.dtype.is_floating and NAMES.get(x.dtype) != dtype:
            return tf.cast(x, TF_DTYPES[dtype])
        return x

    def complex_parts(self, x: Any) -> tuple | None:
        return (tf.math.real(x), tf.math.imag(x), tf.complex) if _is_tensor(x) and x.dtype.is_complex else None

    def all_finite(self, tree: Any) -> Any:
        leaves = tf.nest.flatten(tree)
        if not host_leaves_finite(leaves, _is_tensor):  # a Python float or numpy array among the tensors
            return tf.constant(False)
        tensors = [part for x in leaves if _is_tensor(x) and (x.dtype.is_floating or x.dtype.is_complex)
                   for part in (self.complex_parts(x) or (x,))[:2]]
        flags = [_group_finite(group) for group in finite_groups(
            tensors, lambda x: x.shape.num_elements(), alone=READ_ALONE_FROM, up_to=GROUPED_UP_TO)]
        if len(flags) < 2:
            return flags[0] if flags else tf.constant(True)
        # counted by a dot product (as on JAX): XLA copies `reduce_all` of the stacked flags, a
        # chain of ands, into every fusion that reads it when jit-compiled (600 leaves: 71 s)
        counted = tf.tensordot(tf.cast(tf.stack(flags), tf.float32), tf.ones(len(flags), tf.float32), 1)
        return tf.equal(counted, float(len(flags)))

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        return tf.where(cond, a, b)

    def zeros_like(self, x: Any) -> Any:
        return tf.zeros_like(x)

    def full_like(self, x: Any, value: float) -> Any:
        return tf.fill(tf.shape(x), tf.cast(value, x.dtype))
