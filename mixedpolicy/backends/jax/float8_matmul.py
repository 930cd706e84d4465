"""The tensorwise fp8 matmul of the JAX adapters, whole-batch scales under ``jax.vmap`` too.

``matmul(a, b, ...)`` is ``a @ b`` for ``a`` (M, K) and ``b`` (K, N) as torchao's ``tensorwise``
recipe computes it: each operand scaled by ``fp8_max / amax`` of this step (one scale per
tensor), saturated and cast to the forward format, multiplied by JAX's own matmul on fp8
operands (``preferred_element_type=float32``) and divided by the scales; the output gradient
is cast to the gradient format the same way and both backward matmuls take fp8 operands.

A per-tensor scale has to see the whole tensor, and under ``jax.vmap`` an operand is one
example of it: an Equinox layer computes ``weight @ x`` for one example at a time, and a
function may be vmapped over the batch. So the forward and the backward are each a
``jax.custom_batching.custom_vmap`` whose rule folds the mapped axis into the operand's free
dimension and runs the same computation once, on the whole batch: one scale for the batch's
activations and output gradients, as the unmapped matmul has, and the weight gradient as one
matmul over the batch (never a per-example product summed afterwards). Nested maps fold one
after the other. Which operand is the weight is given (`weight`, 0 or 1): where the weight is
mapped (a vmap over an ensemble of models, ``nnx.vmap``), each member is its own matmul with its
own scales, for its activations too.

``delayed`` is Keras's delayed scaling on the same fp8 matmul: the scales come in with the
layer's amax histories, and the next scales and histories leave as their "gradients".
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

_EPS = 1e-12  # torchao's floor on amax


def quantize(x: Any, fmt: Any) -> tuple[Any, Any]:
    """(x in `fmt`, scaled by fp8_max / amax and saturated; the float32 scale)."""
    top = jnp.float32(jnp.finfo(fmt).max)
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    scale = top / jnp.maximum(amax, jnp.float32(_EPS))
    return jnp.clip(x.astype(jnp.float32) * scale, -top, top).astype(fmt), scale


def scaled_dot(a: Any, b: Any, scale: Any, dtype: Any) -> Any:
    """``a @ b`` of fp8 operands accumulated in float32, divided by the product of their scales."""
    return (jax.lax.dot(a, b, preferred_element_type=jnp.float32) / scale).astype(dtype)


def _fold(x: Any, first: bool) -> Any:
    """A mapped operand (n, rows, cols) as one matrix: the first operand's rows, the second's
    columns take the mapped axis."""
    n, rows, cols = x.shape
    return x.reshape(n * rows, cols) if first else jnp.moveaxis(x, 0, 1).reshape(rows, n * cols)


def _unfold(x: Any, n: int, first: bool) -> Any:
    """`_fold` undone for a product or gradient laid out as the folded operand."""
    rows, cols = x.shape
    return x.reshape(n, rows // n, cols) if first else jnp.moveaxis(x.reshape(rows, n, cols // n), 1, 0)


def _broadcast(x: Any, batched: bool, n: int) -> Any:
    return x if batched else jnp.broadcast_to(x, (n, *jnp.shape(x)))


@functools.lru_cache(maxsize=None)
def _cores(forward: str, backward: str, a_dtype: str, b_dtype: str, weight: int) -> tuple:
    """The forward and backward of one (formats, dtypes, weight side), each with its whole-batch
    vmap rule."""
    fwd_fmt, bwd_fmt = jnp.dtype(forward), jnp.dtype(backward)

    def forward_raw(a: Any, b: Any) -> tuple:
        aq, sa = quantize(a, fwd_fmt)
        bq, sb = quantize(b, fwd_fmt)
        return scaled_dot(aq, bq, sa * sb, a_dtype), aq, sa, bq, sb

    def backward_raw(aq: Any, sa: Any, bq: Any, sb: Any, g: Any) -> tuple:
        gq, sg = quantize(g, bwd_fmt)
        return scaled_dot(gq, bq.T, sg * sb, a_dtype), scaled_dot(aq.T, gq, sa * sg, b_dtype)

    fwd = custom_vmap(forward_raw)
    bwd = custom_vmap(backward_raw)

    @fwd.def_vmap
    def fwd_rule(n: int, batched: list, a: Any, b: Any) -> tuple:
        ba, bb = batched
        if batched[weight] or not (ba or bb):  # each member its own weights: its own scales
            a, b = _broadcast(a, ba, n), _broadcast(b, bb, n)
            return jax.vmap(forward_raw)(a, b), (True,) * 5
        first = ba  # the mapped activation's free dimension takes the batch
        out, aq, sa, bq, sb = fwd(_fold(a, True), b) if first else fwd(a, _fold(b, False))
        out = _unfold(out, n, first)
        if first:
            return (out, _unfold(aq, n, True), sa, bq, sb), (True, True, False, False, False)
        return (out, aq, sa, _unfold(bq, n, False), sb), (True, False, False, True, False)

    @bwd.def_vmap
    def bwd_rule(n: int, batched: list, aq: Any, sa: Any, bq: Any, sb: Any, g: Any) -> tuple:
        baq, bsa, bbq, bsb, bg = batched
        if (baq, bbq)[weight] or not (baq or bbq) or bsa or bsb:
            args = [_broadcast(x, b, n) for x, b in zip((aq, sa, bq, sb, g), batched)]
            return jax.vmap(backward_raw)(*args), (True, True)
        g = _broadcast(g, bg, n)
        if baq:
            ga, gb = bwd(_fold(aq, True), sa, bq, sb, _fold(g, True))
            return (_unfold(ga, n, True), gb), (True, False)
        ga, gb = bwd(aq, sa, _fold(bq, False), sb, _fold(g, False))
        return (ga, _unfold(gb, n, False)), (False, True)

    return fwd, bwd


# the formats, the operands' dtypes and the weight's side are static, the residuals arrays only
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def matmul(a: Any, b: Any, forward: str, backward: str, a_dtype: str, b_dtype: str, weight: int) -> Any:
    """``a @ b`` in fp8, tensorwise (see the module docstring); the output in `a_dtype`; `weight`
    says which operand (0 or 1) is the weight."""
    return _cores(forward, backward, a_dtype, b_dtype, weight)[0](a, b)[0]


def _matmul_fwd(a: Any, b: Any, forward: str, backward: str, a_dtype: str, b_dtype: str, weight: int) -> tuple:
    out, *residuals = _cores(forward, backward, a_dtype, b_dtype, weight)[0](a, b)
    return out, tuple(residuals)


def _matmul_bwd(forward: str, backward: str, a_dtype: str, b_dtype: str, weight: int, residuals: tuple,
                g: Any) -> tuple:
    return tuple(_cores(forward, backward, a_dtype, b_dtype, weight)[1](*residuals, g))


matmul.defvjp(_matmul_fwd, _matmul_bwd)


# -- delayed scaling: Keras's algorithm (its state is the caller's: float8.py, float8_function.py)
def _next(x: Any, scale: Any, history: Any, fmt: Any, margin: int) -> tuple[Any, Any]:
    """Keras's order: the next scale from the history so far, then this amax into it."""
    top = jnp.float32(jnp.finfo(fmt).max)
    amax = jnp.max(history)
    usable = (amax > 0) & jnp.isfinite(amax)
    factor = top / amax / jnp.float32(2.0 ** margin)
    new_scale = jnp.where(usable, 1.0 / factor, scale)
    this = jnp.max(jnp.abs(x)).astype(jnp.float32)
    return new_scale, jnp.roll(history, -1).at[0].set(this)


def _quantize_by(x: Any, scale: Any, fmt: Any) -> Any:
    top = jnp.float32(jnp.finfo(fmt).max)
    return jnp.clip(x.astype(jnp.float32) / scale, -top, top).astype(fmt)


def _scaled_dot(a: Any, b: Any, scale: Any, dtype: str) -> Any:
    return (jax.lax.dot(a, b, preferred_element_type=jnp.float32) * scale).astype(dtype)


def _delayed_forward(static: tuple, a: Any, b: Any, sa: Any, ha: Any, sb: Any, hb: Any) -> tuple:
    """(a @ b quantized with this step's scales, the fp8 operands, the next scales and histories)."""
    forward, _, margin, a_dtype, _, _ = static
    fmt = jnp.dtype(forward)
    aq, bq = _quantize_by(a, sa, fmt), _quantize_by(b, sb, fmt)
    return (_scaled_dot(aq, bq, sa * sb, a_dtype), aq, bq,
            *_next(a, sa, ha, fmt, margin), *_next(b, sb, hb, fmt, margin))


def _delayed_backward(static: tuple, aq: Any, bq: Any, sa: Any, sb: Any, sg: Any, hg: Any, g: Any) -> tuple:
    """(the operands' gradients, the output gradient's next scale and history)."""
    _, backward, margin, a_dtype, b_dtype, _ = static
    fmt = jnp.dtype(backward)
    gq = _quantize_by(g, sg, fmt)
    return (_scaled_dot(gq, bq.T, sg * sb, a_dtype), _scaled_dot(aq.T, gq, sa * sg, b_dtype),
            *_next(g, sg, hg, fmt, margin))


@functools.lru_cache(maxsize=None)
def _delayed_cores(static: tuple) -> tuple:
    """`_delayed_forward` and `_delayed_backward` of `static`, each whose vmap rule folds the
    mapped operand into the matrix (as `_cores`): the amax entering a history is the batch's,
    and the state moves once, unmapped."""
    forward_raw = functools.partial(_delayed_forward, static)
    backward_raw = functools.partial(_delayed_backward, static)
    fwd, bwd = custom_vmap(forward_raw), custom_vmap(backward_raw)
    weight = static[-1]

    @fwd.def_vmap
    def fwd_rule(n: int, batched: list, a: Any, b: Any, *meta: Any) -> tuple:
        ba, bb, *bmeta = batched
        if batched[weight] or not (ba or bb) or any(bmeta):  # per member (an ensemble, its own state)
            args = [_broadcast(x, f, n) for x, f in zip((a, b, *meta), batched)]
            return jax.vmap(forward_raw)(*args), (True,) * 7
        out, aq, bq, *new = fwd(_fold(a, True), b, *meta) if ba else fwd(a, _fold(b, False), *meta)
        if ba:
            return (_unfold(out, n, True), _unfold(aq, n, True), bq, *new), (True, True) + (False,) * 5
        return (_unfold(out, n, False), aq, _unfold(bq, n, False), *new), (True, False, True) + (False,) * 4

    @bwd.def_vmap
    def bwd_rule(n: int, batched: list, aq: Any, bq: Any, sa: Any, sb: Any, sg: Any, hg: Any, g: Any) -> tuple:
        baq, bbq, *bstate, bg = batched
        if (baq, bbq)[weight] or not (baq or bbq) or any(bstate):
            args = [_broadcast(x, f, n) for x, f in zip((aq, bq, sa, sb, sg, hg, g), batched)]
            return jax.vmap(backward_raw)(*args), (True,) * 4
        g = _broadcast(g, bg, n)
        if baq:
            da, db, *new = bwd(_fold(aq, True), bq, sa, sb, sg, hg, _fold(g, True))
            return (_unfold(da, n, True), db, *new), (True, False, False, False)
        da, db, *new = bwd(aq, _fold(bq, False), sa, sb, sg, hg, _fold(g, False))
        return (da, _unfold(db, n, False), *new), (False, True, False, False)

    return fwd, bwd


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def delayed(static: tuple, x: Any, w: Any, meta: tuple) -> Any:
    """``x @ w`` in fp8 with Keras's delayed scaling: `meta` is (inputs' scale and amax history,
    the kernel's, the output gradient's), `static` (forward and gradient formats, margin, the
    operands' dtypes, which operand is the weight). The "gradient" of `meta` is its next value (see float8.py); under
    ``jax.vmap`` the batch enters one amax, as the unmapped product would."""
    return _delayed_fwd(static, x, w, meta)[0]


def _delayed_fwd(static: tuple, x: Any, w: Any, meta: tuple) -> tuple:
    xs, xh, ws, wh, gs, gh = meta
    out, xq, wq, *new = _delayed_cores(static)[0](x, w, xs, xh, ws, wh)
    return out, (xq, wq, xs, ws, gs, gh, tuple(new))


def _delayed_bwd(static: tuple, residuals: tuple, g: Any) -> tuple:
    xq, wq, xs, ws, gs, gh, new_meta = residuals
    dx, dw, *new = _delayed_cores(static)[1](xq, wq, xs, ws, gs, gh, g)
    return dx, dw, new_meta + tuple(new)


delayed.defvjp(_delayed_fwd, _delayed_bwd)


def next_state(state: Any, new: Any, optimizer: Any = None, axis_name: Any = None) -> Any:
    """The delayed state a step leaves: `new` (the state's "gradient"), with the largest amax over
    `axis_name`'s replicas (their histories differ only in this step's amax), `state` kept where
    `optimizer`'s step (an ``nnx.Optimizer`` or a `LossScaleOptimizer` state) was skipped."""
    if jax.tree_util.tree_structure(state) != jax.tree_util.tree_structure(new):
        raise ValueError(f"Received a new fp8 state of structure {jax.tree_util.tree_structure(new)} for a "
                         f"state of structure {jax.tree_util.tree_structure(state)}; pass the gradient of "
                         f"the fp8 state the step was computed with.")
    if axis_name is not None:
        new = jax.lax.pmax(new, axis_name)
    skipped = _skipped(optimizer)
    if skipped is not None:
        new = jax.tree_util.tree_map(lambda n, o: jnp.where(skipped, o, n), new, state)
    return new


def _skipped(optimizer: Any) -> Any:
    """Whether the `LossScaleOptimizer` in `optimizer` (an ``nnx.Optimizer`` or an optax state,
    the wrapper's own or one holding it: a chain, ``MultiSteps``) skipped its last step; None
    where no such wrapper is found (an optimizer that never skips)."""
    from mixedpolicy.backends.jax.optax_state import LossScaleState

    if optimizer is None:
        return None
    if callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None)) \
            and not hasattr(optimizer, "opt_state"):
        raise TypeError(f"Received the optax transformation {type(optimizer).__name__} as the optimizer; "
                        f"expected its state (the opt_state tx.update returned this step) or the "
                        f"nnx.Optimizer, from which the skip of the step is read.")
    tree = getattr(optimizer, "opt_state", optimizer)
    states = [s for s in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, LossScaleState))
              if isinstance(s, LossScaleState)]
    flags = [jnp.asarray(s.last_step_skipped) for s in states]
    return functools.reduce(jnp.logical_or, flags) if flags else None
