"""`LossScaleOptimizer` for optax: a ``GradientTransformation`` that carries the loss scale.

The wrapper's state is a `LossScaleState`: the inner optimizer's state plus
``loss_scale``, ``counter``, ``last_step_skipped`` and ``num_skipped_steps`` (the
last three packed in one array), all arrays, so the whole step stays inside ``jax.jit`` with no host round trip
(a pass-through's is a `PassThroughState`, the inner state alone, read alike). Its
``update``:

1. unscales the gradients (divides by the scale, each leaf keeping its dtype);
2. checks that every gradient is finite; with ``axis_name`` the answer is reduced
   over that axis (``pmap``, ``shard_map``), so one replica's overflow makes every
   replica skip;
3. runs the inner update and keeps it on a finite step; on a skipped step the
   updates are zeros and the inner state (its counters included) is the old one;
4. adjusts the bounded scale (`mixedpolicy.DynamicLossScale`).

A typical step::

    opt = mp.LossScaleOptimizer(optax.adam(1e-3))
    state = opt.init(params)

    @jax.jit
    def step(params, state, x, y):
        grads = jax.grad(lambda p: opt.scale_loss(loss_fn(p, x, y), state))(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mixedpolicy._adapter import OptimizerAdapter
from mixedpolicy.backends.jax.arrays import all_finite
from mixedpolicy.backends.jax.optax_state import (_STATES, LossScaleState, PassThroughState, _value, adopted_scale,
                                                  pack_counts)
from mixedpolicy.backends.jax.optax_checks import (check_axis, check_gradients, is_number, note_scaled,
                                                   refuse_reevaluation, warn_half_masters, warn_transformations_ahead,
                                                   warn_unscaled)
from mixedpolicy.backends.jax.vanishing import warn_vanishing_eps
from mixedpolicy.float8 import DELAYED_STATE
from mixedpolicy.loss_scale import DynamicLossScale, LossScale, NoLossScale, StaticLossScale, is_pass_through, summary

# The updates each LossScaleOptimizer handed on (their first leaf, weakly): a second
# wrapper in the same optax.chain receives exactly these and would unscale them again.
_handed_on: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_log = logging.getLogger("mixedpolicy")
_STRUCTURES_CHECKED: set = set()  # gradient tree structures holding no fp8 state (_refuse_float8_state)


def _scales(config: LossScale) -> bool:
    """Does `config` multiply the loss by something other than 1?"""
    return not isinstance(config, NoLossScale) and not (
        isinstance(config, StaticLossScale) and float(config.loss_scale) == 1.0)


def _check_state(state: Any, config: LossScale) -> None:
    expected = PassThroughState if is_pass_through(config) else LossScaleState
    if isinstance(state, expected):
        return
    if isinstance(state, _STATES):
        raise TypeError(
            f"Received a {type(state).__name__} for a LossScaleOptimizer whose state is a "
            f"{expected.__name__} ({summary(config)}): the state was made under another policy or "
            f"scale setting. Convert it with tx.adopt_state(state), which keeps the inner state.")
    raise TypeError(
        f"Received a state of type {type(state).__name__}; expected the {expected.__name__} that "
        f"this LossScaleOptimizer's init/update returned (or a state holding exactly one, such as "
        f"the state of an optax.chain around it).")


def _own_state(state: Any, config: LossScale, update: Any = None) -> Any:
    """This wrapper's state: `state`, or the one such state inside it (the state of an ``optax.chain``
    around it; `update`'s wrapper warns once where it scales behind other transformations there).

    Raises:
      ValueError: the state of an ``optax.MultiSteps`` around a wrapper that scales or skips.
    """
    if not isinstance(state, _STATES):
        found = [(path, x) for path, x in jax.tree_util.tree_flatten_with_path(
            state, is_leaf=lambda x: isinstance(x, _STATES))[0] if isinstance(x, _STATES)]
        inside = [x for _, x in found]
        if len(found) == 1 and update is not None and _scales(config):
            warn_transformations_ahead(update, state, found[0][0], config)
        if len(inside) == 1 and isinstance(state, optax.MultiStepsState) and not is_pass_through(config):
            raise ValueError(
                "Received the state of an optax.MultiSteps around this LossScaleOptimizer: MultiSteps "
                "sums the gradients of its micro-batches before the wrapper sees them and clears the sum "
                "by multiplying it with 0, so one micro-batch that overflows turns the sum into NaN "
                "and every later step is skipped; nor does the scale back off where MultiSteps "
                "skips a micro-batch itself. Accumulate inside the wrapper: "
                "mp.LossScaleOptimizer(optax.MultiSteps(tx, every_k_schedule=k)), which checks "
                "each micro-batch.")
        if len(inside) == 1:
            state = inside[0]
    _check_state(state, config)
    return state


class LossScaleTransformation(optax.GradientTransformationExtraArgs):
    """The ``optax.GradientTransformation`` that `mixedpolicy.LossScaleOptimizer` returns.

    Used like any optax transformation (``init``, ``update``, inside ``optax.chain``
    or ``nnx.Optimizer``), plus `scale_loss` for the loss of the current step.
    """

    __slots__ = ()

    @property
    def loss_scaling(self) -> str:
        """What this wrapper does to a step: dynamic, static, none, or a pass-through."""
        return summary(self.update.loss_scale)

    def scale_loss(self, loss: Any, state: Any) -> Any:
        """Returns ``loss * state.loss_scale`` in float32: differentiate this.

        Args:
          loss: the unscaled loss, a scalar of any floating dtype.
          state: this transformation's `LossScaleState` (as returned by ``init`` or
            ``update``, or ``nnx.Optimizer.opt_state``), or a state holding it once (that of
            an ``optax.chain`` around this transformation).

        Raises:
          ValueError: `state` is that of an ``optax.MultiSteps`` around this wrapper (see
            the message: accumulate inside the wrapper instead).
        """
        if not is_number(loss) or jnp.issubdtype(getattr(loss, "dtype", jnp.float32), jnp.complexfloating):
            raise TypeError(f"Received a loss of type {type(loss).__name__} ({loss!r:.60}); expected the "
                            f"scalar loss, a JAX array (or a number) of a floating dtype.")
        state = _own_state(state, self.update.loss_scale, self.update)
        self.update.scaled_a_loss = True  # (`warn_unscaled`)
        if isinstance(self.update.loss_scale, NoLossScale):
            return loss
        note_scaled(_value(state.counts))
        return jnp.asarray(loss).astype(jnp.float32) * state.loss_scale

    def adopt_state(self, state: Any, params: Any = None) -> Any:
        """`state`, saved by a mixedpolicy optax wrapper under any policy or scale setting,
        as this wrapper's state: the inner state and the skip counts kept; a dynamic scale goes
        on from the saved scale and counters where the saved wrapper scaled (else from its
        initial scale, as if no step had been taken); a static scale or none keeps its own,
        with a warning where the saved scale differed (it is dropped).

        A state saved under another update recipe (`Policy.update_rounding`,
        `Policy.optimizer_state_dtype`) is converted, given `params`: the moments are cast to
        this wrapper's state dtype, a rounding new to the state starts from its own fresh state
        (the step count at 0, the Kahan compensation at zero), a rounding this wrapper does not
        make is dropped; one warning names both recipes.

        For a checkpoint saved under another policy: restore it with its own structure,
        then ``tx.adopt_state(restored)`` (``tx.adopt_state(restored, params)`` across recipes).

        Raises:
          TypeError: `state` is not a `LossScaleState` or `PassThroughState`, or holds another
            inner optimizer's state.
          ValueError: the recipes differ and `params` was not given.
        """
        from mixedpolicy.backends.jax.updates import adopt_recipe

        if not isinstance(state, _STATES):
            raise TypeError(f"Received a {type(state).__name__}; expected the LossScaleState or "
                            f"PassThroughState of a mixedpolicy optax LossScaleOptimizer.")
        fresh_inner = None if params is None else self.init(params).inner_state
        inner_state, changed = adopt_recipe(state.inner_state, self.update.recipe, fresh_inner)
        if changed is not None:
            _log.warning("Adopted an optimizer state saved under another update recipe: %s.", changed)
        return adopted_scale(state, self.update.make_state(inner_state), self.update.loss_scale)


def _refuse_float8_state(grads: Any) -> None:
    """An optimizer must not train a delayed fp8 layer's scales: their "gradients" are values.
    Each structure of gradients is looked at once (eager steps too, at the cost of a lookup)."""
    structure = jax.tree_util.tree_structure(grads)
    if structure in _STRUCTURES_CHECKED:
        return
    for path, _ in jax.tree_util.tree_flatten_with_path(grads)[0]:
        key = path[-1] if path else None
        name = getattr(key, "key", getattr(key, "name", None))
        if name in DELAYED_STATE:
            raise TypeError(
                f"Received gradients holding {jax.tree_util.keystr(path)}, a delayed fp8 layer's scale or "
                f"amax history: an optimizer would train it as a weight, where it must be overwritten by "
                f"its \"gradient\" (its next value). Give the optimizer the parameters alone "
                f"(nnx.Optimizer(model, tx, wrt=nnx.Param)) and write the fp8 state back with "
                f"mp.jax.update_float8(model, grads, optimizer).")
    _STRUCTURES_CHECKED.add(structure)


def _scale_state(config: LossScale, state: LossScaleState) -> LossScale:
    if isinstance(config, DynamicLossScale):
        return config.with_state(state.loss_scale, state.counter)
    return config


#: Gradients of at least this many elements skip through a ``jax.lax.cond`` (`_update_if`).
COND_ELEMENTS = 1 << 20


def _update_if(finite: Any, update: Any, grads: Any, inner_state: Any) -> Any:
    """``update(grads, inner_state)`` where `finite`, else zero updates and `inner_state` as it was.

    Traced (under ``jax.jit``, ``pmap``...) over gradients of `COND_ELEMENTS` or more, a
    ``jax.lax.cond`` whose skipped branch passes the state through. Selecting each updated leaf
    with ``jnp.where`` (optax's ``apply_if_finite``) made XLA copy the state where the caller
    donates it: AdamW over 4.9M float32 values on one CPU core, donated, 6.1x the bare update's
    time against the cond's 2.6x (check included); not donated, 1.48x against 1.69x
    (``python -m mixedpolicy.bench.skip_sweep``). A wrapper
    cannot tell whether its caller donates: the cond has the smaller worst case (and was the
    cheaper on an H100; docs/benchmarks.md). Below that size, and called eagerly (where a
    ``cond`` traces and compiles both branches at every call), the selects: the bench MLP's
    step is 1.03x the bare one's with them, 1.10x with a ``cond``."""
    traced = isinstance(finite, jax.core.Tracer)
    if traced and sum(np.size(x) for x in jax.tree_util.tree_leaves(grads)) >= COND_ELEMENTS:
        def skip(g: Any, s: Any) -> Any:
            shapes = jax.eval_shape(update, g, s)[0]
            return jax.tree_util.tree_map(jnp.zeros_like, shapes), s  # its sharding and mapped axes too

        return jax.lax.cond(finite, update, skip, grads, inner_state)
    updates, new_state = update(grads, inner_state)
    updates = jax.tree_util.tree_map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), updates)
    return updates, jax.tree_util.tree_map(lambda new, old: jnp.where(finite, new, old), new_state, inner_state)


def loss_scale_transformation(inner: Any, config: LossScale, axis_name: Any = None,
                              stored: Any = frozenset()) -> LossScaleTransformation:
    """Wraps an optax transformation with `config` (see the module docstring); `stored`: the
    variable dtypes of the policies it follows (empty: none known)."""
    if isinstance(inner, LossScaleTransformation):
        raise TypeError("Received a LossScaleOptimizer to wrap; it already scales the loss. "
                        "Wrap the inner optax transformation once.")
    if isinstance(inner, optax.MultiSteps):  # a class with a transformation inside, not one itself
        inner = inner.gradient_transformation()
    if axis_name is not None and not isinstance(axis_name, (str, tuple)):
        raise TypeError(f"Received axis_name={axis_name!r}; expected the name (or a tuple of "
                        f"names) of the pmap / shard_map axis the replicas run over.")
    from mixedpolicy.backends.jax.updates import recipe_of_transformation

    recipe = recipe_of_transformation(inner)
    inner = optax.with_extra_args_support(inner)

    scales = _scales(config)  # an update whose loss was never scaled is warned of

    def make_state(inner_state: Any) -> Any:
        if is_pass_through(config):
            return PassThroughState(inner_state)
        return LossScaleState(inner_state, pack_counts(config.loss_scale, getattr(config, "counter", 0), 0, 0))

    def init(params: Any) -> Any:
        inner_state = inner.init(params)
        warn_vanishing_eps(inner, params)
        warn_half_masters(params, stored)
        nested = [x for x in jax.tree_util.tree_leaves(
            inner_state, is_leaf=lambda x: isinstance(x, _STATES)) if isinstance(x, _STATES)]
        if nested:
            raise TypeError(
                "Received an inner transformation that already holds a mixedpolicy "
                "LossScaleOptimizer (inside optax.chain or another wrapper): its gradients would "
                "be divided by two loss scales. Wrap the whole chain once, e.g. "
                "mp.LossScaleOptimizer(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))).")
        return make_state(inner_state)

    def update(grads: Any, state: Any, params: Any = None, **extra_args: Any):
        _check_state(state, config)
        first = check_gradients(grads)
        if first is not None and _handed_on.get(id(first)) is first:
            raise TypeError(
                "Received as gradients the updates of another mixedpolicy LossScaleOptimizer "
                "(two in one optax.chain?): they are already unscaled, and dividing them by a "
                "second scale would make them 32768x too small. Use one LossScaleOptimizer around "
                "the whole chain: mp.LossScaleOptimizer(optax.chain(...)).")
        _refuse_float8_state(grads)
        if axis_name is not None:
            check_axis(axis_name)
        if is_pass_through(config):  # the inner update, nothing added
            updates, inner_state = inner.update(grads, state.inner_state, params, **extra_args)
            return updates, PassThroughState(inner_state)
        if not isinstance(config, NoLossScale):
            refuse_reevaluation(extra_args, summary(config))
        if scales:
            warn_unscaled(update, config, _value(state.counts))
        scale = _scale_state(config, state)  # NoLossScale: no unscale, but the skip all the same
        grads = scale.unscale(grads)
        finite = all_finite(grads)
        if axis_name is not None:
            finite = jax.lax.psum((~finite).astype(jnp.int32), axis_name) == 0
        updates, inner_state = _update_if(finite, lambda g, s: inner.update(g, s, params, **extra_args),
                                          grads, state.inner_state)
        scale = scale.adjust(finite)
        skipped = (~finite).astype(jnp.int32)
        counter = jnp.asarray(getattr(scale, "counter", state.counter), jnp.int32)
        handed = next(iter(jax.tree_util.tree_leaves(updates)), None)
        if handed is not None:
            _handed_on[id(handed)] = handed
        return updates, LossScaleState(inner_state, pack_counts(scale.loss_scale, counter, skipped,
                                                                state.num_skipped_steps + skipped))

    update.loss_scale = config  # what scale_loss needs to know of the settings
    update.make_state = make_state  # and adopt_state, the state a fresh wrapper starts from
    update.recipe = recipe  # and the update recipe (rounding, state dtype) its inner state is kept in
    return LossScaleTransformation(init, update)


class OptaxOptimizers(OptimizerAdapter):
    """An optax transformation comes back as a `LossScaleTransformation` carrying the scale."""

    blind_to = ("flax", "equinox", "function")  # (it sees arrays only)

    def is_optimizer(self, obj: Any) -> bool:
        return isinstance(obj, (optax.GradientTransformation, optax.MultiSteps))

    takes_followed_policies = True  # its init warns of half-precision weights they do not store

    def wrap_optimizer(self, optimizer: Any, loss_scale: Any, axis_name: Any = None, followed: tuple = ()) -> Any:
        return loss_scale_transformation(optimizer, loss_scale, axis_name, {p.variable_dtype for p in followed})

    def update_refusal(self, optimizer: Any, policy: Any) -> str | None:
        return None  # the rounding and the state's storage wrap the inner optimizer (with_updates)

    def with_updates(self, optimizer: Any, policy: Any) -> Any:
        from mixedpolicy.backends.jax.updates import mark, quantized_storage, state_storage, update_rounding

        original = optimizer
        if isinstance(optimizer, optax.MultiSteps):
            optimizer = optimizer.gradient_transformation()
        if policy.optimizer_state_dtype == "int8":
            optimizer = quantized_storage(optimizer)
        elif policy.optimizer_state_dtype != policy.variable_dtype:
            optimizer = state_storage(optimizer, policy.optimizer_state_dtype)
        if policy.update_rounding != "nearest":
            optimizer = optax.chain(optimizer, update_rounding(policy.update_rounding))
        if optimizer is original:
            return optimizer
        own_dtype = policy.optimizer_state_dtype if policy.optimizer_state_dtype != policy.variable_dtype else None
        return mark(optimizer, policy.update_rounding, own_dtype)
