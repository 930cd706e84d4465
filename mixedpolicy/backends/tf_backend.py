"""TensorFlow adapter: tensors and nested structures, for loss scales kept in TF tensors.

The TensorFlow optimizers of TF 2.16 and later are Keras 3 optimizers; they are
wrapped by the Keras adapter (`mixedpolicy.backends.keras_optimizer`), whose loss
scale runs on this adapter's array operations when Keras runs on TensorFlow.
Policies on raw ``tf.Module`` models are not supported yet: `role_of` claims no
model, so `apply_policy` on one names the supported kinds.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import tensorflow as tf

from mixedpolicy._dtypes import FLOATING_DTYPES
from mixedpolicy.backends.base import Adapter

_TF_DTYPES = {name: tf.as_dtype(name) for name in FLOATING_DTYPES}
_TF_DTYPES.update(bool=tf.bool, int32=tf.int32, int64=tf.int64)
_NAMES = {v: k for k, v in _TF_DTYPES.items() if k in FLOATING_DTYPES}


def _is_tensor(x: Any) -> bool:
    return isinstance(x, (tf.Tensor, tf.Variable))


class TensorFlowAdapter(Adapter):
    name = "tensorflow"
    module = "tensorflow"

    def is_array(self, x: Any) -> bool:
        return _is_tensor(x)

    def leaves(self, tree: Any) -> Iterable[Any]:
        return tf.nest.flatten(tree)

    def tree_map(self, fn: Callable[[Any], Any], tree: Any) -> Any:
        return tf.nest.map_structure(fn, tree)

    def asarray(self, value: Any, dtype: str, like: Any = None) -> Any:
        if _is_tensor(value):
            return tf.cast(value, _TF_DTYPES[dtype])
        return tf.constant(value, dtype=_TF_DTYPES[dtype])

    def floating_dtype(self, x: Any) -> str | None:
        return _NAMES.get(x.dtype) if _is_tensor(x) else None

    def cast(self, x: Any, dtype: str) -> Any:
        if _is_tensor(x) and x.dtype.is_floating and _NAMES.get(x.dtype) != dtype:
            return tf.cast(x, _TF_DTYPES[dtype])
        return x

    def all_finite(self, tree: Any) -> Any:
        flags = [tf.reduce_all(tf.math.is_finite(x)) for x in tf.nest.flatten(tree)
                 if _is_tensor(x) and x.dtype.is_floating]
        return tf.reduce_all(tf.stack(flags)) if flags else tf.constant(True)

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        return tf.where(cond, a, b)

    def zeros_like(self, x: Any) -> Any:
        return tf.zeros_like(x)

    def full_like(self, x: Any, value: float) -> Any:
        return tf.fill(tf.shape(x), tf.cast(value, x.dtype))

    def role_of(self, obj: Any) -> str | None:
        return None

    def _no_models(self, what: str) -> TypeError:
        return TypeError(f"mixedpolicy cannot {what} a raw TensorFlow object yet; build the "
                         f"model from Keras 3 layers (the keras adapter) instead.")

    def apply_policy(self, model: Any, policy_map: Any) -> Any:
        raise self._no_models("apply a policy to")

    def remove_policy(self, model: Any) -> Any:
        raise self._no_models("remove a policy from")

    def describe(self, model: Any) -> list:
        raise self._no_models("describe")

    def wrap_optimizer(self, optimizer: Any, loss_scale: Any, axis_name: Any = None) -> Any:
        raise self._no_models("wrap an optimizer of")
