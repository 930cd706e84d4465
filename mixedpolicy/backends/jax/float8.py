"""fp8 matmuls on Flax NNX: the ``dot_general`` hook of ``nnx.Linear``, current scaling.

Flax NNX has no fp8 layer of its own, so for the ``"tensorwise"`` recipe the adapter
writes the quantize / dequantize around JAX's own matmul on fp8 operands
(``jax.lax.dot_general`` with ``preferred_element_type=float32``), as torchao does around
``torch._scaled_mm``: each operand is scaled by ``fp8_max / amax`` of this step (one
scale per tensor), saturated and cast to the forward format; the output gradient is
cast to the gradient format the same way, and both backward matmuls take the fp8
operands, so the numbers are torchao's ``tensorwise`` recipe (within float32
rounding: JAX computes the scale in float32, torchao in float64). No state: the
scales are computed in the step, under ``jax.jit`` or not.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from mixedpolicy.float8 import Float8Recipe

_EPS = 1e-12  # torchao's floor on amax


def eligible(module: Any) -> bool:
    from flax import nnx

    return type(module) is nnx.Linear


def matmul(module: Any) -> tuple | None:
    """(in_features, out_features) of an NNX layer that can run in fp8, else None."""
    return (module.in_features, module.out_features) if eligible(module) else None


def kind(module: Any, head: Any, has_weights: bool) -> str | None:
    """The fp8 rules' kind of an NNX module that is not a norm (None: fp8 applies, or no weights)."""
    from flax import nnx

    from mixedpolicy.policy_map import EMBEDDING, HEAD, NO_FLOAT8, SMALL_MATMUL

    if isinstance(module, nnx.Embed):
        return EMBEDDING
    if eligible(module):
        if module is head:
            return HEAD
        return SMALL_MATMUL if module.in_features % 16 or module.out_features % 16 else None
    return NO_FLOAT8 if has_weights else None


def check(recipe: Float8Recipe, path: str) -> None:
    if recipe.recipe == "tensorwise":
        return
    raise ValueError(
        f"Received the fp8 recipe {recipe.recipe!r} for Flax NNX layer {path or '(root)'!r}: on JAX "
        f"mixedpolicy runs 'tensorwise' (current scaling, through nnx.Linear's dot_general) so far; "
        f"{recipe.recipe!r} runs on " + ("Keras and torch" if recipe.recipe == "delayed" else "torch (torchao)")
        + ". Nothing was applied.")


def _quantize(x: Any, fmt: Any) -> tuple[Any, Any]:
    """(x in `fmt`, scaled by fp8_max / amax and saturated; the float32 scale)."""
    top = jnp.float32(jnp.finfo(fmt).max)
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    scale = top / jnp.maximum(amax, jnp.float32(_EPS))
    return jnp.clip(x.astype(jnp.float32) * scale, -top, top).astype(fmt), scale


def _dot(a: Any, b: Any, scale: Any, dtype: Any) -> Any:
    return (jax.lax.dot(a, b, preferred_element_type=jnp.float32) / scale).astype(dtype)


# the formats and the operands' dtypes are static (names), the residuals arrays only
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _matmul(x: Any, w: Any, forward: str, backward: str, x_dtype: str, w_dtype: str) -> Any:
    return _matmul_fwd(x, w, forward, backward, x_dtype, w_dtype)[0]


def _matmul_fwd(x: Any, w: Any, forward: str, backward: str, x_dtype: str, w_dtype: str) -> tuple:
    xq, sx = _quantize(x, jnp.dtype(forward))
    wq, sw = _quantize(w, jnp.dtype(forward))
    return _dot(xq, wq, sx * sw, x_dtype), (xq, sx, wq, sw)


def _matmul_bwd(forward: str, backward: str, x_dtype: str, w_dtype: str, residuals: tuple, g: Any) -> tuple:
    xq, sx, wq, sw = residuals
    gq, sg = _quantize(g, jnp.dtype(backward))
    return _dot(gq, wq.T, sg * sw, x_dtype), _dot(xq.T, gq, sx * sg, w_dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


class TensorwiseDotGeneral:
    """A ``dot_general`` for ``nnx.Linear``: inputs (..., in) by kernel (in, out) in fp8."""

    def __init__(self, recipe: Float8Recipe):
        self.recipe = recipe

    def __eq__(self, other: object) -> bool:  # static module state: equal recipes, equal hooks
        return isinstance(other, TensorwiseDotGeneral) and other.recipe == self.recipe

    def __hash__(self) -> int:
        return hash(self.recipe)

    def __call__(self, lhs: Any, rhs: Any, dimension_numbers: Any, precision: Any = None,
                 preferred_element_type: Any = None, **_: Any) -> Any:
        (contract_l, contract_r), (batch_l, batch_r) = dimension_numbers
        if rhs.ndim != 2 or tuple(contract_l) != (lhs.ndim - 1,) or tuple(contract_r) != (0,) or batch_l or batch_r:
            raise ValueError(f"Received a dot_general of shapes {lhs.shape} x {rhs.shape} with "
                             f"{dimension_numbers}; the fp8 hook runs nnx.Linear's x @ kernel only.")
        x = lhs.reshape(-1, lhs.shape[-1])
        out = _matmul(x, rhs, self.recipe.forward_dtype, self.recipe.backward_dtype, str(x.dtype), str(rhs.dtype))
        out = out.reshape(*lhs.shape[:-1], rhs.shape[1])
        return out if preferred_element_type is None else out.astype(preferred_element_type)


# -- Flax linen: Flax's own delayed-scaling op, and the tensorwise hook -------------------
def linen_check(policy_map: Any) -> None:
    """Refuses, before anything runs, a recipe in `policy_map` linen has no fp8 path for."""
    for policy in (policy_map.default, *dict(policy_map.overrides).values()):
        recipe = policy.float8_recipe if policy is not None else None
        if recipe is None or recipe.recipe == "tensorwise":
            continue
        if recipe != Float8Recipe("delayed", amax_history_len=recipe.amax_history_len):
            _refuse_linen(recipe)


def _refuse_linen(recipe: Float8Recipe) -> None:
    raise ValueError(
        f"Received the fp8 recipe {recipe!r} for a Flax linen module: linen runs 'tensorwise' "
        f"(current scaling, the hook nnx.Linear takes) and 'delayed' through Flax's own fp8 op "
        f"(Fp8DirectDotGeneralOp: margin 0, e4m3 forward, e5m2 gradients; amax_history_len= may "
        f"change). Use one of those there; nothing was applied.")


@functools.lru_cache(maxsize=None)
def linen_dot_general_cls(recipe: Float8Recipe) -> Any:
    """What ``nn.Dense(dot_general_cls=...)`` takes for `recipe`: Flax's own delayed op (one
    per history length), or the tensorwise hook (stateless: no variables)."""
    import flax.linen as nn

    if recipe.recipe == "tensorwise":
        return functools.partial(TensorwiseDotGeneral, recipe)
    return functools.partial(nn.Fp8DirectDotGeneralOp, amax_history_length=recipe.amax_history_len)


def linen_kind(module: Any, inputs: Any, head: str | None, path: str) -> str | None:
    """The fp8 rules' kind of a linen module at its call (None: fp8 applies, or no weights known)."""
    import flax.linen as nn

    from mixedpolicy.policy_map import EMBEDDING, HEAD, NO_FLOAT8, SMALL_MATMUL

    if isinstance(module, nn.Embed):
        return EMBEDDING
    if type(module) is nn.Dense:
        if path == head:
            return HEAD
        width = getattr(inputs, "shape", (16,))[-1] if inputs is not None else 16
        return SMALL_MATMUL if module.features % 16 or width % 16 else None
    convs = tuple(getattr(nn, n) for n in ("Conv", "ConvTranspose", "ConvLocal", "DenseGeneral", "Einsum")
                  if hasattr(nn, n))
    return NO_FLOAT8 if isinstance(module, convs) else None
