"""What the optax wrapper checks of what it is given: gradients that are numbers, weights in a
dtype the policy it follows stores, and a loss scaled before a scaling update."""

from __future__ import annotations

import collections
import warnings
import weakref
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


def check_axis(axis_name: Any) -> None:
    """Refuses an `axis_name` that names no axis this update is mapped over (JAX's NameError
    says only "unbound axis name"), whatever the wrapper scales."""
    try:
        jax.lax.psum(1, axis_name)  # the axis size, known while tracing: no collective
    except NameError:
        raise ValueError(
            f"Received axis_name={axis_name!r}, but this update does not run inside a mapped axis of "
            f"that name (jax.pmap, shard_map or vmap with axis_name={axis_name!r}). Pass axis_name only "
            f"where the step is mapped over it, or leave it out (sharding under jax.jit needs none).") from None


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


# The counts arrays (or tracers) of the states `scale_loss` was given, weakly: an update of such a
# state follows a scaled loss even where the wrapper running it is not the one whose scale_loss
# was called (optax.inject_hyperparams builds its inner transformation anew at every update).
_SCALED_COUNTS: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


def note_scaled(counts: Any) -> None:
    """Notes that a loss was scaled with the state whose counts array is `counts` (an object that
    takes no weak reference is not noted: its update then goes by the wrapper's own flag)."""
    try:
        _SCALED_COUNTS[id(counts)] = counts
    except TypeError:
        pass


def warn_unscaled(update: Any, config: Any, counts: Any = None) -> None:
    """Warns once per wrapper, at the user's line, where a scaling wrapper's `update` comes while
    its ``scale_loss`` was never called: a loop that differentiates the plain loss has its update
    divided by the scale. torch's wrapper (and GradScaler) refuse such a step; a JAX wrapper sees
    arrays only, not where they came from, and gradients multiplied by ``state.loss_scale`` by
    hand are right, so it warns, and not at all once code of the user's has read that scale.
    Under ``jax.jit`` the check runs as the step is traced."""
    if getattr(update, "scaled_a_loss", False) or getattr(update, "warned_unscaled", False) \
            or _warnings.SCALE_READ_BY_USER[0] or (counts is not None and _SCALED_COUNTS.get(id(counts)) is counts):
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


def _is_transformation_state(x: Any) -> bool:
    """An optax transformation's state: a NamedTuple (``EmptyState``, ``ScaleByAdamState``...) or
    a chain's tuple of them; not parameters or a train state the user holds beside the optimizer's."""
    return isinstance(x, tuple) and (hasattr(x, "_fields") or all(map(_is_transformation_state, x)))


def _beside_in_partition(node: Any, label: Any) -> list:
    """The states of `optax.partition` / ``multi_transform``'s other labels that transform
    their gradients (each inside a ``MaskedState``; a bare ``EmptyState``, such as
    ``set_to_zero``'s, does not)."""
    return [s for k, s in node.inner_states.items() if k != label
            and type(getattr(s, "inner_state", s)).__name__ != "EmptyState"]


def _seeing_scaled_gradients(state: Any, path: tuple) -> tuple:
    """(the states of the transformations that run before the one at `path` in `state`: those
    before it in each ``optax.chain`` (a plain tuple of states) or ``optax.named_chain`` (an
    ordered dict of them) on the way down, a tuple or dict of the user's holding parameters
    beside the state being none; those beside it in an ``optax.partition``)."""
    ahead, beside, node = [], [], state
    for i, key in enumerate(path):
        if (isinstance(key, jax.tree_util.GetAttrKey) and key.name == "inner_states" and i + 1 < len(path)
                and type(node).__name__ in ("PartitionState", "MultiTransformState")):
            beside.extend(_beside_in_partition(node, getattr(path[i + 1], "key", None)))
        if isinstance(key, jax.tree_util.SequenceKey):
            if type(node) is tuple and all(map(_is_transformation_state, node[:key.idx])):
                ahead.extend(node[:key.idx])
            node = node[key.idx]
        elif isinstance(key, jax.tree_util.DictKey):
            if type(node) is collections.OrderedDict:
                before = [node[k] for k in list(node)[:list(node).index(key.key)]]
                ahead.extend(before if all(map(_is_transformation_state, before)) else [])
            node = node[key.key]
        elif isinstance(key, jax.tree_util.GetAttrKey):
            node = getattr(node, key.name)
        else:  # a node flattened by index alone: nothing more to tell
            break
    return ahead, beside


def warn_transformations_ahead(update: Any, state: Any, path: tuple, config: Any) -> None:
    """Warns once per wrapper, at the user's line, where a scaling wrapper runs behind other
    transformations in an ``optax.chain`` (or beside them in an ``optax.partition``): they
    receive the gradients multiplied by the loss scale, so a clip (``clip_by_global_norm``),
    weight decay or any transformation not linear in the gradients acts on scaled values
    (clipped to norm 1 and then unscaled, an update is the scale's factor too small), silently.
    Only a transformation that commutes with scaling (``optax.identity``, ``optax.scale``) is
    harmless there, and it loses nothing inside."""
    if getattr(update, "warned_ahead", False):
        return
    ahead, beside = _seeing_scaled_gradients(state, path)
    if not ahead and not beside:
        return
    update.warned_ahead = True
    where = []
    if ahead:
        where.append(f"behind {len(ahead)} other transformation{'s' if len(ahead) > 1 else ''} in an "
                     f"optax.chain (their states: {', '.join(type(s).__name__ for s in ahead)})")
    if beside:
        where.append(f"beside {len(beside)} other transformation{'s' if len(beside) > 1 else ''} in an "
                     f"optax.partition / multi_transform (the other labels' states: "
                     f"{', '.join(type(getattr(s, 'inner_state', s)).__name__ for s in beside)})")
    warnings.warn(
        f"This LossScaleOptimizer ({summary(config)}) runs {' and '.join(where)}: they receive the "
        f"gradients multiplied by the loss scale, which only the wrapper divides out, so a clip "
        f"(optax.clip_by_global_norm), weight decay or any other transformation that is not linear "
        f"in the gradients acts on the scaled values (a clip to norm 1 then makes the update the "
        f"scale's factor too small; a plain SGD beside it steps that many times too far). Put them "
        f"inside the wrapper, which hands them unscaled gradients: mp.LossScaleOptimizer(optax.chain("
        f"optax.clip_by_global_norm(1.0), optax.adam(1e-3))), mp.LossScaleOptimizer(optax.multi_transform(...)).",
        UserWarning, stacklevel=user_stacklevel("jax", "optax", "flax"))
