"""numpy's array operations: the reference the other frameworks' are tested against.

They also hold loss-scale states made from Python numbers. numpy has no layers or
optimizers, so its registry row names only these.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import numpy as np

from mixedpolicy._dtypes import FLOATING_DTYPES, host_leaves_finite
from mixedpolicy._adapter import ArrayOps


def _np_dtype(dtype: str) -> Any:
    if dtype == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise ValueError("bfloat16 numpy arrays need the ml_dtypes package: "
                             "`pip install ml_dtypes`.") from None
        return ml_dtypes.bfloat16
    return np.dtype(dtype)


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _join(real: Any, imag: Any) -> Any:
    """The complex array of two floating parts (complex64 from float32 ones)."""
    real, imag = np.asarray(real), np.asarray(imag)
    out = np.empty(np.broadcast_shapes(real.shape, imag.shape), np.result_type(real, imag, np.complex64))
    out.real, out.imag = real, imag  # (real + 1j * imag would make an inf part's other part NaN)
    return out


class NumpyArrays(ArrayOps):
    name = "numpy"

    def is_array(self, x: Any) -> bool:
        return isinstance(x, (np.ndarray, np.generic))

    def leaves(self, tree: Any) -> Iterable[Any]:
        if isinstance(tree, dict):
            for key in tree:
                yield from self.leaves(tree[key])
        elif isinstance(tree, (list, tuple)):
            for item in tree:
                yield from self.leaves(item)
        elif tree is not None:
            yield tree

    def tree_map(self, fn: Callable[[Any], Any], tree: Any) -> Any:
        if isinstance(tree, dict):
            return type(tree)((k, self.tree_map(fn, v)) for k, v in tree.items())
        if _is_namedtuple(tree):
            return type(tree)(*(self.tree_map(fn, v) for v in tree))
        if isinstance(tree, (list, tuple)):
            return type(tree)(self.tree_map(fn, v) for v in tree)
        if tree is None:
            return None
        return fn(tree)

    def asarray(self, value: Any, dtype: str, like: Any = None) -> Any:
        return np.asarray(value, dtype=_np_dtype(dtype))

    def floating_dtype(self, x: Any) -> str | None:
        dtype = getattr(x, "dtype", None)
        if dtype is None or not self.is_array(x):
            return None
        name = np.dtype(dtype).name
        return name if name in FLOATING_DTYPES else None

    def cast(self, x: Any, dtype: str) -> Any:
        # (a Python float is no array: left as it is, as jmp's casts and the frameworks' leave it)
        current = self.floating_dtype(x)
        if current is None or current == dtype:
            return x
        return np.asarray(x).astype(_np_dtype(dtype))

    def complex_parts(self, x: Any) -> tuple | None:
        return (x.real, x.imag, _join) if self.is_array(x) and np.iscomplexobj(x) else None

    def all_finite(self, tree: Any) -> Any:
        return np.asarray(host_leaves_finite(self.leaves(tree)))

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        return np.where(cond, a, b)

    def zeros_like(self, x: Any) -> Any:
        return np.zeros_like(x)

    def full_like(self, x: Any, value: float) -> Any:
        return np.full_like(x, value)
