"""A policy's update rounding on optax: a transformation chained after the inner optimizer,
inside the `LossScaleOptimizer` (so a skipped step keeps its state too).

optax has no rounding of its own: ``optax.apply_updates`` adds each update to its parameter and
rounds the sum to the nearest value of the parameter's dtype, so a bfloat16 weight loses every
update below half its step. Here the updates are rewritten so that the same ``apply_updates``
lands where the rounding puts the weight:

- ``"stochastic"``: the float32 sum ``p + u`` is rounded into bfloat16 up or down with the
  probability of its remainder (the low 16 bits of its float32 pattern plus 16 random bits,
  then cut: torchao's rounding; the bits are a counter-based hash of the element, the leaf, the
  step and a seed, the same as the Keras rule's), and the update becomes ``rounded - p``;
- ``"kahan"``: a half-precision compensation buffer per weight keeps what the nearest rounding
  dropped and adds it back at the next step (Kahan summation).

Either difference is one the parameter's dtype holds exactly whenever a step moves a weight by
less than a factor of two (Sterbenz), so ``apply_updates`` lands exactly on the rounded value;
a larger step lands within half a step of the update's own rounding. Only leaves in half
precision are touched: float32 leaves (the norms a pure policy keeps in float32) update as
always. The step count lives in the state: two runs from one seed round alike.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mixedpolicy import quantized_state
from mixedpolicy._dtypes import FLOATING_DTYPES
from mixedpolicy.backends.jax.arrays import dtype_name

_HALF = (jnp.bfloat16, jnp.float16)


class RoundingState(NamedTuple):
    """The rounding's state: the step count the stochastic rounding's bits are drawn for, or the
    Kahan compensation per half-precision leaf (None elsewhere)."""

    step: Any
    compensation: Any


def _value(x: Any) -> Any:
    return x.get_value() if hasattr(x, "get_value") and not isinstance(x, jax.Array) else x


# murmur3's finaliser constants and the golden-ratio step (the same hash as the Keras rule, so one
# model rounds alike on optax and on Keras)
_GOLDEN, _M1, _M2, _VARIABLE, _SEED = 0x9E3779B1, 0x85EBCA6B, 0xC2B2AE35, 668265261, 0x5EED


def _mix(h: Any) -> Any:
    h = h ^ (h >> 16)
    h = h * jnp.uint32(_M1)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(_M2)
    return h ^ (h >> 16)


def random_bits16(shape: tuple, step: Any, index: int, seed: int = _SEED) -> Any:
    """16 uniform random bits per element (uint32 in [0, 65536)), a counter-based hash of the
    element's position, `step`, the leaf's `index` and `seed`: cheaper on a CPU than threefry, and
    the bits Keras's rule draws."""
    position = jax.lax.iota(jnp.uint32, max(1, int(np.prod(shape)))).reshape(shape)
    start = jnp.asarray(step).astype(jnp.uint32) * jnp.uint32(_GOLDEN) + jnp.uint32(
        (index * _VARIABLE + seed) & 0x7FFFFFFF)
    h = _mix(position * jnp.uint32(_GOLDEN) + start)
    return _mix(h + start) & jnp.uint32(0xFFFF)


def stochastic_round_bfloat16(x: Any, bits16: Any) -> Any:
    """`x` (float32) rounded into bfloat16 up or down with the probability of its remainder
    (unbiased, ``E[round(x)] == x``), the 16 random bits given."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    cut = (bits + bits16.astype(jnp.uint32)) & jnp.uint32(0xFFFF0000)
    return jax.lax.bitcast_convert_type(cut, jnp.float32).astype(jnp.bfloat16)


def update_rounding(rounding: str, seed: int = _SEED) -> optax.GradientTransformation:
    """The optax transformation that rounds each update into half-precision weights as
    `rounding` says (``"stochastic"`` or ``"kahan"``); it needs the parameters in ``update``."""
    if not isinstance(rounding, str) or rounding not in ("stochastic", "kahan"):
        raise (ValueError if isinstance(rounding, str) else TypeError)(
            f"Received rounding={rounding!r:.60} of type {type(rounding).__name__}; expected 'stochastic' "
            f"or 'kahan' (nearest is what optax.apply_updates does by itself).")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"Received seed={seed!r:.60} of type {type(seed).__name__}; expected a whole number.")

    def init(params: Any) -> RoundingState:
        params = jax.tree_util.tree_map(_value, params)
        if rounding == "kahan":
            return RoundingState(None, jax.tree_util.tree_map(
                lambda p: jnp.zeros_like(p) if p.dtype in _HALF else None, params))
        return RoundingState(jnp.zeros((), jnp.uint32), None)

    def update(updates: Any, state: RoundingState, params: Any = None) -> tuple:
        if params is None:
            raise ValueError(f"update_rounding={rounding!r} needs the parameters: call "
                             f"opt.update(grads, state, params) (nnx.Optimizer passes them).")
        params = jax.tree_util.tree_map(_value, params)
        leaves, tree = jax.tree_util.tree_flatten(updates)
        p_leaves = tree.flatten_up_to(params)
        if rounding == "stochastic":
            out = [_stochastic(u, p, random_bits16(p.shape, state.step, i, seed))
                   for i, (u, p) in enumerate(zip(leaves, p_leaves))]
            return tree.unflatten(out), RoundingState(state.step + jnp.uint32(1), None)
        c_leaves = tree.flatten_up_to(state.compensation)
        pairs = [_kahan(u, p, c) for u, p, c in zip(leaves, p_leaves, c_leaves)]
        return (tree.unflatten([u for u, _ in pairs]),
                RoundingState(None, tree.unflatten([c for _, c in pairs])))

    return optax.GradientTransformation(init, update)


def _stochastic(u: Any, p: Any, bits16: Any) -> Any:
    if p.dtype != jnp.bfloat16:
        return u
    rounded = stochastic_round_bfloat16(p.astype(jnp.float32) + u.astype(jnp.float32), bits16)
    return (rounded.astype(jnp.float32) - p.astype(jnp.float32)).astype(p.dtype)  # exact: the weights' dtype


def _kahan(u: Any, p: Any, c: Any) -> tuple:
    if p.dtype not in _HALF:
        return u, c
    y = u.astype(jnp.float32) + c.astype(jnp.float32)  # the update plus what was dropped before
    t = (p.astype(jnp.float32) + y).astype(p.dtype)  # where nearest rounding puts the weight
    step = t.astype(jnp.float32) - p.astype(jnp.float32)
    return step.astype(p.dtype), (y - step).astype(c.dtype)


def _is_moment(leaf: Any) -> bool:
    """A floating array of the state with at least one axis: a per-parameter moment (scalar
    floats are hyperparameters, e.g. an injected learning rate, and keep their dtype)."""
    return hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating) and jnp.ndim(leaf) > 0


def state_storage(inner: Any, dtype: str) -> optax.GradientTransformation:
    """`inner` with its moments stored in `dtype`: the update reads them as stored and the new
    ones are rounded to `dtype` when they are stored, which is what optax's own ``mu_dtype`` (Adam's
    first moment) and ``accumulator_dtype`` (``trace``) do, here for every moment."""
    if not isinstance(inner, optax.GradientTransformation):
        raise TypeError(f"Received {type(inner).__name__} ({inner!r:.60}) as the optimizer; expected an "
                        f"optax GradientTransformation, e.g. mp.jax.state_storage(optax.adam(1e-3), 'bfloat16').")
    name = dtype_name(dtype) if not isinstance(dtype, (bool, int, float)) else None
    if name is None:
        raise (ValueError if isinstance(dtype, str) else TypeError)(
            f"Received dtype={dtype!r:.60} of type {type(dtype).__name__}; expected the dtype the moments "
            f"are stored in, one of {list(FLOATING_DTYPES)} (8-bit state: a policy's "
            f"optimizer_state_dtype='int8').")
    target = jnp.dtype(name)
    inner = optax.with_extra_args_support(inner)

    def store(state: Any) -> Any:
        return jax.tree_util.tree_map(lambda s: s.astype(target) if _is_moment(s) else s, state)

    def init(params: Any) -> Any:
        return store(inner.init(params))

    def update(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> tuple:
        updates, state = inner.update(updates, state, params, **extra_args)
        return updates, store(state)

    return optax.GradientTransformationExtraArgs(init, update)


class QuantizedState(NamedTuple):
    """An optax state whose large moments are stored 8-bit block-quantized
    (`mixedpolicy.quantized_state`): the inner state with each such moment replaced by its uint8
    codes (same shape), and beside it, in the order of those moments, each one's float32 largest
    magnitude per block and which map its codes index (signed, or unsigned for a moment with no
    negative entry). The codes sit where the moments sat, so the state keeps the parameters'
    structure (``nnx.Optimizer`` wraps it as it wraps optax's own)."""

    inner_state: Any
    absmax: tuple
    signed: Any


def quantize_state(state: Any) -> QuantizedState:
    """`state` with its moments of `quantized_state.MIN_SIZE` values or more (a multiple of a
    block) quantized; the others keep their dtype."""
    leaves, tree = jax.tree_util.tree_flatten(state)
    if any(hasattr(leaf, "dtype") and jnp.dtype(leaf.dtype) == jnp.uint8 for leaf in leaves):
        raise TypeError("Received an inner optimizer whose state holds uint8 arrays of its own; "
                        "optimizer_state_dtype='int8' stores moments as uint8 codes and could not tell "
                        "them apart. Train it under state=float32 or state=bfloat16.")
    out, absmax, signed = [], [], []
    for leaf in leaves:
        if _is_moment(leaf) and quantized_state.quantizable(jnp.shape(leaf)):
            sign = jnp.any(leaf < 0)  # one map's codes computed, not both (a select would run both)
            codes, scale = jax.lax.cond(sign, lambda x: quantized_state.quantize(jnp, x, True),
                                        lambda x: quantized_state.quantize(jnp, x, False), leaf)
            out.append(codes)
            absmax.append(scale)
            signed.append(sign)
        else:
            out.append(leaf)
    return QuantizedState(tree.unflatten(out), tuple(absmax),
                          jnp.stack(signed) if signed else jnp.zeros((0,), jnp.bool_))


def dequantize_state(state: QuantizedState) -> Any:
    """The inner state with its quantized moments back in float32."""
    leaves, tree = jax.tree_util.tree_flatten(state.inner_state)
    signed = _value(state.signed)
    out, k = [], 0
    for leaf in leaves:
        if jnp.dtype(leaf.dtype) == jnp.uint8:
            out.append(quantized_state.dequantize(jnp, leaf, _value(state.absmax[k]), signed[k]))
            k += 1
        else:
            out.append(leaf)
    return tree.unflatten(out)


def quantized_storage(inner: Any) -> optax.GradientTransformationExtraArgs:
    """`inner` with its large moments stored 8-bit block-quantized: the update reads them
    dequantized to float32 and the new ones are quantized when they are stored (torchao's and
    bitsandbytes' 8-bit optimizers, here for every optax optimizer's moments)."""
    inner = optax.with_extra_args_support(inner)

    def init(params: Any) -> QuantizedState:
        return quantize_state(inner.init(params))

    def update(updates: Any, state: QuantizedState, params: Any = None, **extra_args: Any) -> tuple:
        updates, new = inner.update(updates, dequantize_state(state), params, **extra_args)
        return updates, quantize_state(new)

    return optax.GradientTransformationExtraArgs(init, update)


# -- a state saved under one recipe, adopted by a wrapper under another ---------------------------

def mark(optimizer: Any, rounding: str, state_dtype: str | None) -> Any:
    """`optimizer` (the chain `with_updates` built) labelled with its recipe, which the
    `LossScaleOptimizer` around it reads (`recipe_of_transformation`)."""
    optimizer.update.mixedpolicy_recipe = (rounding, state_dtype)
    return optimizer


def recipe_of_transformation(inner: Any) -> tuple:
    """(rounding, state dtype or None: the variables') of a transformation `with_updates` built."""
    return getattr(inner.update, "mixedpolicy_recipe", ("nearest", None))


def _split(inner_state: Any) -> tuple:
    """(rounding, the inner optimizer's own state, the RoundingState or None) of a saved state."""
    if isinstance(inner_state, tuple) and len(inner_state) == 2 and isinstance(inner_state[1], RoundingState):
        return ("kahan" if inner_state[1].compensation is not None else "stochastic"), *inner_state
    return "nearest", inner_state, None


def _moments_dtype(state: Any) -> str | None:
    """The dtypes the moments are kept in, e.g. ``"bfloat16"``, ``"bfloat16+float32"`` or ``"int8"``
    (8-bit block-quantized, with ``+float32`` where small moments stay float32)."""
    quantized = isinstance(state, QuantizedState)
    leaves = jax.tree_util.tree_leaves(state.inner_state if quantized else state)
    names = {jnp.dtype(leaf.dtype).name for leaf in leaves if _is_moment(leaf)}
    if quantized and any(jnp.dtype(leaf.dtype) == jnp.uint8 for leaf in leaves):
        names.add("int8")
    return "+".join(sorted(names)) or None


def _plain(state: Any) -> Any:
    return dequantize_state(state) if isinstance(state, QuantizedState) else state


def _convert(saved: Any, fresh: Any) -> Any:
    """The saved optimizer state in the form of the fresh one: moments cast to its dtypes, then
    quantized where it quantizes."""
    plain = jax.tree_util.tree_map(lambda s, f: s.astype(f.dtype) if _is_moment(s) and s.dtype != f.dtype else s,
                                   _plain(saved), _plain(fresh))
    return quantize_state(plain) if isinstance(fresh, QuantizedState) else plain


def adopt_recipe(saved: Any, recipe: tuple, fresh: Any = None) -> tuple:
    """(`saved`, an inner state written under any update recipe, as a wrapper under `recipe` keeps
    it; what changed, in words, or None). `fresh` is that wrapper's own new inner state (from the
    parameters), which a change of recipe needs: the moments take its dtypes, a rounding new to
    the state starts from its fresh state (the step count at 0, the Kahan compensation at zero).

    Raises:
      ValueError: the recipes differ and `fresh` is None.
      TypeError: `saved` holds another inner optimizer's state than `fresh`.
    """
    rounding, state_dtype = recipe
    saved_rounding, saved_opt, saved_rounds = _split(saved)
    saved_dtype = _moments_dtype(saved_opt)
    if fresh is None:
        kept = saved_dtype in (None, state_dtype) or (state_dtype == "int8" and "int8" in saved_dtype.split("+"))
        if saved_rounding == rounding and (state_dtype is None or kept):
            return saved, None
        raise ValueError(
            f"Received a state saved under update_rounding={saved_rounding!r} with moments in {saved_dtype} "
            f"for a wrapper under update_rounding={rounding!r}, optimizer_state_dtype="
            f"{state_dtype or 'the variables'!r}: converting it needs the parameters (the new "
            f"rounding's state and the moments' dtypes come from them). Call tx.adopt_state(saved, params).")
    _, fresh_opt, fresh_rounds = _split(fresh)
    if jax.tree_util.tree_structure(_plain(saved_opt)) != jax.tree_util.tree_structure(_plain(fresh_opt)):
        raise TypeError("Received a state of another inner optimizer than this wrapper's (their state "
                        "trees differ); adopt_state moves a state between policies and recipes of the "
                        "same optax optimizer.")
    opt = _convert(saved_opt, fresh_opt)
    rounds = None if rounding == "nearest" else (saved_rounds if saved_rounding == rounding else fresh_rounds)
    fresh_dtype = _moments_dtype(fresh_opt)
    if saved_rounding == rounding and saved_dtype == fresh_dtype:
        said = None
    else:
        said = (f"update_rounding {saved_rounding!r} -> {rounding!r}, moments {saved_dtype} -> {fresh_dtype}"
                + ({"stochastic": " (the rounding's step count starts at 0)",
                    "kahan": " (the Kahan compensation starts at zero)"}.get(rounding, "")
                   if saved_rounding != rounding else ""))
    return (opt if rounds is None else (opt, rounds)), said
