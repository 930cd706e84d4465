"""JAX adapter: jax arrays and pytrees, Flax NNX and linen modules, optax transformations.

- arrays are ``jax.Array`` (tracers included, so every operation works under
  ``jax.jit``); pytrees are JAX's own;
- a Flax NNX module gets each submodule's ``dtype`` / ``param_dtype`` set from its
  resolved policy (see `mixedpolicy.backends.jax_flax`);
- a Flax linen module is wrapped in a `PolicyLinen`, whose ``init`` / ``apply``
  cast each submodule's parameters and inputs on the way in;
- an Equinox module is rebuilt with each of its modules wrapped in a `PolicyModule`
  that casts that module's arrays and inputs (see `mixedpolicy.backends.jax_equinox`);
- an optax ``GradientTransformation`` is wrapped into another one that carries the
  loss scale in its state (see `mixedpolicy.backends.jax_optimizer`).

Flax, Equinox and optax are imported only once the user has imported them.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from mixedpolicy.backends.base import Adapter
from mixedpolicy.backends.jax_arrays import _SCALARS, all_finite, cast_leaf, dtype_name, jnp_dtype

def _path_text(path: tuple) -> str:
    return jax.tree_util.keystr(path) or "(the root)"


def _is_equinox(obj: Any) -> bool:
    eqx = sys.modules.get("equinox")
    return eqx is not None and isinstance(obj, eqx.Module)


def _models(model: Any) -> Any:
    """The module that puts policies on `model`: Equinox's, or Flax's (NNX and linen)."""
    if _is_equinox(model):
        from mixedpolicy.backends import jax_equinox

        return jax_equinox
    from mixedpolicy.backends import jax_flax

    return jax_flax


class JaxAdapter(Adapter):
    name = "jax"
    module = "jax"

    # -- arrays ---------------------------------------------------------------
    def is_array(self, x: Any) -> bool:
        return isinstance(x, jax.Array)

    def leaves(self, tree: Any) -> Iterable[Any]:
        return jax.tree_util.tree_leaves(tree)

    def tree_map(self, fn: Callable[[Any], Any], tree: Any) -> Any:
        return jax.tree_util.tree_map(fn, tree)

    def asarray(self, value: Any, dtype: str, like: Any = None) -> Any:
        return jnp.asarray(value, dtype=jnp_dtype(dtype))

    def floating_dtype(self, x: Any) -> str | None:
        return dtype_name(x.dtype) if isinstance(x, jax.Array) else None

    def cast(self, x: Any, dtype: str) -> Any:
        return cast_leaf(x, dtype)

    def cast_tree(self, tree: Any, dtype: str) -> Any:
        """Casts floating leaves; a leaf that is neither an array nor a number is an error.

        A policy that silently skipped a leaf it cannot cast (a string, an object)
        would leave part of a computation in the wrong precision.
        """
        def leaf(path, x):
            if isinstance(x, jax.Array) or isinstance(x, _SCALARS):
                return cast_leaf(x, dtype)
            raise TypeError(
                f"Received a pytree whose leaf at {_path_text(path)} is a {type(x).__name__} "
                f"({x!r:.60}); a policy casts arrays, so every leaf must be an array or a number. "
                f"Bind non-array arguments before applying the policy (functools.partial), "
                f"or keep them out of the pytree (mark them static under jax.jit).")
        return jax.tree_util.tree_map_with_path(leaf, tree)

    def all_finite(self, tree: Any) -> Any:
        return all_finite(tree)

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        return jnp.where(cond, a, b)

    def zeros_like(self, x: Any) -> Any:
        return jnp.zeros_like(x)

    def full_like(self, x: Any, value: float) -> Any:
        return jnp.full_like(x, value)

    # -- models and optimizers ------------------------------------------------
    def role_of(self, obj: Any) -> str | None:
        nnx = sys.modules.get("flax.nnx")
        if nnx is not None and isinstance(obj, nnx.Module):
            return "model"
        linen = sys.modules.get("flax.linen")
        if linen is not None and isinstance(obj, linen.Module):
            return "model"
        if "mixedpolicy.backends.jax_flax" in sys.modules:
            from mixedpolicy.backends.jax_flax import PolicyLinen

            if isinstance(obj, PolicyLinen):
                return "model"
        optax = sys.modules.get("optax")
        if optax is not None and isinstance(obj, (optax.GradientTransformation, optax.MultiSteps)):
            return "optimizer"
        if _is_equinox(obj):
            return "model"
        return None

    def apply_policy(self, model: Any, policy_map: Any) -> Any:
        return _models(model).apply_policy(model, policy_map)

    def remove_policy(self, model: Any) -> Any:
        return _models(model).remove_policy(model)

    def describe(self, model: Any) -> list:
        return _models(model).describe(model)

    def wrap_optimizer(self, optimizer: Any, loss_scale: Any, axis_name: Any = None) -> Any:
        from mixedpolicy.backends.jax_optimizer import loss_scale_transformation

        return loss_scale_transformation(optimizer, loss_scale, axis_name)
