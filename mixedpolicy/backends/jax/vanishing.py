"""Where an optax transformation's update of float16 weights divides by an epsilon that float16
rounds to 0: optax's Adam family computes in the weights' dtype, where ``eps=1e-8`` is 0, so a
gradient whose squared moment underflows (any under about 2.4e-4) makes the update 0/0 or x/0
from finite gradients, which no check of the gradients sees. The torch wrapper reads ``eps``
from the optimizer's groups (checks.warn_vanishing_eps); an optax transformation hides it in a
closure, so here its update of a zero gradient is computed once on one element per float16
parameter: finite for any epsilon float16 can hold, NaN where it is 0.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mixedpolicy._warnings import user_stacklevel


def _zero_element(x: Any) -> Any:
    """A zero of `x`'s dtype and rank, one element, for an array (traced or not); other leaves
    as they are."""
    dtype = getattr(x, "dtype", None)
    return x if dtype is None else jnp.zeros((1,) * np.ndim(x), dtype)


def zero_update_is_finite(inner: Any, params: Any) -> bool:
    """Is `inner`'s first update of zero gradients finite, computed on one element per leaf of
    `params` (concretely, also while `params` are traced)? True where it cannot be computed: a
    transformation that needs the real shapes or extra arguments is not judged."""
    try:
        with jax.ensure_compile_time_eval():
            small = jax.tree_util.tree_map(_zero_element, params)
            updates, _ = inner.update(small, inner.init(small), small)
            return all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree_util.tree_leaves(updates)
                       if jnp.issubdtype(getattr(u, "dtype", np.int32), jnp.floating))
    except Exception:  # noqa: BLE001 - a probe: any failure here means "not judged", never an error
        return True


def warn_vanishing_eps(inner: Any, params: Any) -> None:
    """Warns, at the user's line, where `params` hold float16 arrays and `inner`'s update of a
    zero gradient there is not finite (see the module docstring)."""
    if not any(getattr(x, "dtype", None) == jnp.float16 for x in jax.tree_util.tree_leaves(params)):
        return
    if zero_update_is_finite(inner, params):
        return
    warnings.warn(
        "Received float16 parameters and an optax transformation whose update of a zero gradient is "
        "NaN there: it divides by an epsilon that is 0 in float16 (optax.adam's eps=1e-8 is), so a "
        "small gradient's squared moment underflows to 0 and the weights become NaN from finite "
        "gradients, which no check of the gradients sees (as the transformation alone does on float16 "
        "weights). Give eps=1e-4 (optax.adam(learning_rate, eps=1e-4)), keep the optimizer state in "
        "float32 (mp.LossScaleOptimizer(tx, policy=mp.Policy('float16', optimizer_state_dtype='float32'))), "
        "or keep the weights in float32 with a mixed policy ('mixed_float16').",
        UserWarning, stacklevel=user_stacklevel("jax", "optax", "flax"))
