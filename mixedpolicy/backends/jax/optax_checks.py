"""What the optax wrapper checks of what it is given: gradients that are numbers, weights in a
dtype the policy it follows stores, and a loss scaled before a scaling update."""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mixedpolicy import _warnings
from mixedpolicy._warnings import user_stacklevel
from mixedpolicy.loss_scale import summary

_HALF = ("float16", "bfloat16")


def is_number(x: Any) -> bool:
    """An array (a tracer too) or a number that JAX computes with (not a bool, string or object)."""
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return bool(jnp.issubdtype(x.dtype, jnp.number))
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_gradients(grads: Any) -> Any:
    """The first leaf of `grads` (None if it has none), after checking every leaf is a number."""
    leaves = jax.tree_util.tree_leaves(grads)
    if not all(map(is_number, leaves)):
        path, leaf = next((path, leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]
                          if not is_number(leaf))
        why = "" if getattr(leaf, "dtype", None) != jax.dtypes.float0 else (
            ", the float0 gradient of an integer leaf (jax.grad(..., allow_int=True)), which optax's optimizers "
            "cannot step either: differentiate the floating leaves only (eqx.filter_grad, nnx.DiffState...)")
        raise TypeError(
            f"Received gradients with a leaf of type {type(leaf).__name__} ({leaf!r:.40}) at "
            f"{jax.tree_util.keystr(path) or 'the root'}{why}; expected a pytree of arrays, such as "
            f"jax.grad(loss_fn)(params) returns.")
    return leaves[0] if leaves else None


def warn_half_masters(params: Any, stored: Any) -> None:
    """Warns, at the user's line, where `params` hold float16 or bfloat16 weights while every policy
    the wrapper follows stores its variables wider (`stored`, their variable dtypes; empty: not
    known): updates smaller than half an ulp of a weight are lost to rounding, the reason mixed
    precision keeps float32 masters. The torch wrapper refuses such weights; JAX code keeps half
    weights on purpose often enough (jmp's ``params=bfloat16``) that a pure policy is the fix."""
    if not stored or any(d in _HALF for d in stored):
        return
    half = sorted({str(x.dtype) for x in jax.tree_util.tree_leaves(params) if str(getattr(x, "dtype", "")) in _HALF})
    if half:
        warnings.warn(
            f"Received {' and '.join(half)} parameters for an optimizer that follows a policy storing its "
            f"variables in {' and '.join(sorted(stored))}: updates smaller than half a unit in the last "
            f"place of a weight are lost to rounding (why mixed precision keeps float32 master weights). "
            f"Keep the parameters in float32 (the mixed policy's variables), or say that half-precision "
            f"weights are meant: mp.LossScaleOptimizer(tx, policy={half[0]!r}) (a pure policy; "
            f"Policy({half[0]!r}, update_rounding='stochastic') rounds updates without loss in the mean).",
            UserWarning, stacklevel=user_stacklevel("jax", "optax", "flax"))


def refuse_reevaluation(extra_args: dict, what: str) -> None:
    """A line search (``optax.lbfgs``, ``optax.scale_by_backtracking_linesearch``...) under loss
    scaling: it compares ``value_fn``'s loss at trial points with the value and gradients it is
    handed, which come from the scaled loss; refused as torch's LBFGS is under scaling."""
    if "value_fn" in extra_args:
        raise TypeError(
            f"Received value_fn= for an update under {what}: the inner transformation re-evaluates "
            f"the loss (a line search: optax.lbfgs, optax.scale_by_backtracking_linesearch, "
            f"optax.scale_by_zoom_linesearch), and loss scaling cannot follow those re-evaluations "
            f"(its value= and grad= come from the scaled loss, value_fn's loss does not; torch's "
            f"LBFGS is refused under scaling for the same reason). Under a bfloat16 or float32 "
            f"policy the wrapper scales nothing and takes it; with float16 compute use a "
            f"first-order optimizer such as optax.adamw.")


def warn_unscaled(update: Any, config: Any) -> None:
    """Warns once per wrapper, at the user's line, where a scaling wrapper's `update` comes while
    its ``scale_loss`` was never called: a loop that differentiates the plain loss has its update
    divided by the scale. torch's wrapper (and GradScaler) refuse such a step; a JAX wrapper sees
    arrays only, not where they came from, and gradients multiplied by ``state.loss_scale`` by
    hand are right, so it warns, and not at all once code of the user's has read that scale.
    Under ``jax.jit`` the check runs as the step is traced."""
    if getattr(update, "scaled_a_loss", False) or getattr(update, "warned_unscaled", False) \
            or _warnings.SCALE_READ_BY_USER[0]:
        return
    update.warned_unscaled = True
    warnings.warn(
        f"update() of a LossScaleOptimizer that scales the loss ({summary(config)}) was called, and its "
        f"scale_loss never was: "
        f"where these are the gradients of the plain loss, dividing them by the loss scale makes "
        f"the update that many times too small (torch's GradScaler refuses such a step). "
        f"Differentiate tx.scale_loss(loss, opt_state) (with nnx.Optimizer: "
        f"optimizer.tx.scale_loss(loss, optimizer.opt_state)).",
        UserWarning, stacklevel=user_stacklevel("jax", "optax", "flax"))
