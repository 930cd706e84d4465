"""JAX's array operations (``jax.Array``, tracers included, and JAX's pytrees), and the
array helpers the Flax, Equinox and optax modules beside it share.

The ground floor of the JAX folder: it imports no other mixedpolicy JAX module, so
`flax`, `equinox` and `optax` all import downwards from here.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from mixedpolicy._adapter import ArrayOps
from mixedpolicy._dtypes import FLOATING_DTYPES, finite_groups, host_leaves_finite

_JNP_DTYPES = {name: jnp.dtype(name) for name in FLOATING_DTYPES}
_JNP_DTYPES.update(bool=jnp.dtype("bool"), int32=jnp.dtype("int32"), int64=jnp.dtype("int64"))
_NAMES = {v: k for k, v in _JNP_DTYPES.items() if k in FLOATING_DTYPES}


def dtype_name(dtype: Any) -> str | None:
    """The plain name of a floating dtype (``jnp.bfloat16``, ``np.float32``...), else None."""
    if dtype is None:
        return None
    try:
        return _NAMES.get(jnp.dtype(dtype))
    except TypeError:
        return None


def jnp_dtype(name: str) -> Any:
    """The jnp dtype of a plain name; float64 only where JAX has 64-bit types enabled."""
    if name == "float64" and not jax.config.jax_enable_x64:
        raise ValueError(
            "Received a float64 policy, but JAX runs with 64-bit types disabled, so it would "
            "silently compute in float32. Enable them first: "
            "jax.config.update('jax_enable_x64', True), or JAX_ENABLE_X64=1.")
    return _JNP_DTYPES[name]


def cast_leaf(x: Any, dtype: str) -> Any:
    """Casts one floating array (jax or numpy) to `dtype`; anything else passes unchanged."""
    if isinstance(x, (jax.Array, np.ndarray, np.generic)) and dtype_name(x.dtype) not in (None, dtype):
        return jnp.asarray(x).astype(jnp_dtype(dtype))
    return x


class Kept:
    """Arrays kept aside by `apply_policy` (originals of narrowed variables), never a pytree leaf.

    Hashed by identity, so it can sit in a static field (Equinox) or a module's static
    metadata (NNX) without being traced, trained or compared element by element.
    """

    __slots__ = ("arrays",)

    def __init__(self, arrays: dict):
        self.arrays = arrays

    def __repr__(self) -> str:
        return f"Kept({sorted(self.arrays)})"


def restore_leaf(current: Any, original: Any, dtype: str) -> Any:
    """`current` back in `dtype`: the original value wherever it is unchanged since the narrowing.

    A value trained under the policy is kept (widened); one still equal to the rounded
    original gets its original, unrounded value back.
    """
    wide = cast_leaf(current, dtype)
    if original is None or getattr(original, "shape", None) != getattr(current, "shape", None):
        return wide
    untouched = jnp.asarray(current) == jnp.asarray(original).astype(jnp.asarray(current).dtype)
    return jnp.where(untouched, original, wide)


def all_finite(tree: Any) -> Any:
    """A boolean scalar: are all floating and complex leaves free of inf and NaN? (no host sync; a Python
    float or numpy array among them is checked on the host, in its own dtype)"""
    leaves = jax.tree_util.tree_leaves(tree)
    if not host_leaves_finite(leaves, lambda x: isinstance(x, jax.Array)):
        return jnp.asarray(False)
    # a complex array is checked as its two parts: inf or NaN in either
    arrays = [part for x in leaves if isinstance(x, jax.Array)
              for part in ((x.real, x.imag) if jnp.iscomplexobj(x) else (x,)) if dtype_name(part.dtype) is not None]
    if not arrays:
        return jnp.asarray(True)
    terms = [_finite_term(group) for group in finite_groups(arrays, lambda x: x.size, alone=READ_ALONE_FROM,
                                                            up_to=GROUPED_UP_TO)]
    if len(terms) == 1:
        return jnp.isfinite(terms[0])
    # added up by a dot product: XLA rewrites a reduction over stacked scalars into a chain that
    # it copies into every fusion reading the flag (each select of the step's updates and
    # state), so compiling took time quadratic in the leaves (600 leaves: a minute on a CPU)
    total = jnp.dot(jnp.stack([t.astype(jnp.float32) for t in terms]), jnp.ones(len(terms), jnp.float32))
    return jnp.isfinite(total)


#: An array of more values than this is checked in place, by a product of its own (`_finite_term`).
READ_ALONE_FROM = 1 << 12
#: Smaller arrays are concatenated into groups of at most this many values (`_finite_term`).
GROUPED_UP_TO = 1 << 15


def _finite_term(group: list) -> Any:
    """A float scalar, 0 where every value of the group is finite, NaN where one is inf or NaN.

    A group of small arrays (`GROUPED_UP_TO` values at most) is concatenated into an ``isfinite``
    mask: XLA fuses the concatenation with the test into one kernel, and reduces the bytes in
    a plain loop. A larger array is read in place by a matrix-vector product with zeros
    (``x * 0`` is 0 for a finite x and NaN for inf or NaN, and a sum of zeros cannot overflow;
    no compiler folds a float product with zero away), which XLA:CPU hands to its vectorized
    matrix kernel. On one CPU core the mask (the previous reading of every group) cost 26 us
    over 43k float32 values and 340 us over 150k (XLA:CPU's concatenation of many values is a
    slow loop), a sum of ``x * 0`` per array 110 us, the products 28 us
    (docs/benchmarks.md, "The check's reading")."""
    if len(group) == 1 and group[0].size > READ_ALONE_FROM:
        return _product_with_zeros(group[0])
    flat = jnp.concatenate([x.ravel() for x in group]) if len(group) > 1 else group[0].ravel()
    return jnp.where(jnp.isfinite(flat).all(), jnp.float32(0), jnp.float32(np.nan))


def _product_with_zeros(x: Any) -> Any:
    """The sum of ``x * 0``, as a matrix-vector product over `x`'s values in rows (float16 widened
    to float32 first, exactly); bfloat16 and 8-bit floats widened and summed, which costs a CPU
    less (bfloat16: 50 against 110 us over 262k values, where float16 takes 90 against 130); a
    size no row length divides, summed."""
    columns = next((c for c in (256, 128, 64, 32, 16) if x.size % c == 0), None)
    wide = x if x.dtype in (jnp.float32, jnp.float64) else x.astype(jnp.float32)
    if columns is None or x.dtype not in (jnp.float32, jnp.float64, jnp.float16):
        return jnp.sum(wide * 0)
    rows = wide.reshape(-1, columns)
    return jnp.sum(jnp.dot(rows, jnp.zeros(columns, wide.dtype), precision=jax.lax.Precision.HIGHEST))


class JaxArrays(ArrayOps):
    name = "jax"

    def is_array(self, x: Any) -> bool:
        return isinstance(x, jax.Array)

    def leaves(self, tree: Any) -> Iterable[Any]:
        return jax.tree_util.tree_leaves(tree)

    def tree_map(self, fn: Callable[[Any], Any], tree: Any) -> Any:
        return jax.tree_util.tree_map(fn, tree)

    def structure(self, tree: Any) -> Any:
        return jax.tree_util.tree_structure(tree)

    def asarray(self, value: Any, dtype: str, like: Any = None) -> Any:
        return jnp.asarray(value, dtype=jnp_dtype(dtype))

    def floating_dtype(self, x: Any) -> str | None:
        return dtype_name(x.dtype) if isinstance(x, jax.Array) else None

    def cast(self, x: Any, dtype: str) -> Any:
        return cast_leaf(x, dtype)

    def complex_parts(self, x: Any) -> tuple | None:
        return (x.real, x.imag, jax.lax.complex) if isinstance(x, jax.Array) and jnp.iscomplexobj(x) else None

    def all_finite(self, tree: Any) -> Any:
        return all_finite(tree)

    def half_dtype(self) -> str:
        return "bfloat16" if jax.local_devices()[0].platform == "tpu" else "float16"

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        return jnp.where(cond, a, b)

    def zeros_like(self, x: Any) -> Any:
        return jnp.zeros_like(x)

    def full_like(self, x: Any, value: float) -> Any:
        return jnp.full_like(x, value)


def to_jmp(policy: Any) -> Any:
    """The ``jmp.Policy`` with the policy's param, compute and output dtypes (`Policy.to_jmp`)."""
    import jmp

    # jmp keys its names (str(policy), get_policy) by the scalar types, jnp.float32...
    return jmp.Policy(param_dtype=getattr(jnp, policy.variable_dtype),
                      compute_dtype=getattr(jnp, policy.compute_dtype),
                      output_dtype=getattr(jnp, policy.output_dtype))
