"""fp8 matmuls on Flax NNX: the ``dot_general`` hook of ``nnx.Linear``, current and delayed scaling.

Flax NNX has no fp8 layer of its own, so for the ``"tensorwise"`` recipe the adapter
writes the quantize / dequantize around JAX's own matmul on fp8 operands
(``jax.lax.dot_general`` with ``preferred_element_type=float32``), as torchao does around
``torch._scaled_mm``: each operand is scaled by ``fp8_max / amax`` of this step (one
scale per tensor), saturated and cast to the forward format; the output gradient is
cast to the gradient format the same way, and both backward matmuls take the fp8
operands, so the numbers are torchao's ``tensorwise`` recipe (within float32
rounding: JAX computes the scale in float32, torchao in float64). No state: the
scales are computed in the step, under ``jax.jit`` or not.

For ``"delayed"`` the hook runs Keras's algorithm (as ``DelayedFloat8Linear`` does on torch):
the input, the kernel and the output gradient each have a scale and an amax history, kept on
the layer as `Float8Meta` variables under Keras's names (``float8_inputs_scale``...); a step
quantizes with the current scale, and the next scale comes from the history before this
step's amax, which then enters the history. The new values leave the step as the variables'
"gradients" (the output gradient's amax exists only in the backward): a training step
overwrites the variables with them (`update_float8`), as Keras's optimizers and Flax's
``_overwrite_with_gradient`` collection do. A forward without gradients (evaluation) uses the
scales and changes nothing.
"""

from __future__ import annotations

import contextvars
import functools
import sys
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from mixedpolicy.backends._subclass import policy_subclass
from mixedpolicy.backends.jax.float8_matmul import delayed as _delayed, matmul as _matmul, next_state
from mixedpolicy.float8 import DELAYED_STATE, Float8Recipe

def eligible(module: Any) -> bool:
    from flax import nnx

    return type(module) is nnx.Linear


def head(model: Any) -> Any:
    """The output head: the last ``nnx.Linear`` in the order the model's attributes were set
    (``nnx.iter_modules`` sorts them by name, which would make ``up`` come after ``head``)."""
    found: list = []
    seen: set = set()

    def walk(value: Any) -> None:
        if isinstance(value, nnx.Module) and id(value) not in seen:
            seen.add(id(value))
            found.extend([value] if eligible(value) else [])
            value = [v for k, v in vars(value).items() if not k.startswith("_pytree__")]
        if isinstance(value, (list, tuple, dict)):
            for child in (value.values() if isinstance(value, dict) else value):
                walk(child)

    walk(model)
    return found[-1] if found else None


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
    if recipe.recipe in ("tensorwise", "delayed"):
        return
    raise ValueError(
        f"Received the fp8 recipe {recipe.recipe!r} for Flax NNX layer {path or '(root)'!r}: on JAX "
        f"mixedpolicy runs 'tensorwise' (current scaling) and 'delayed' through nnx.Linear's "
        f"dot_general; {recipe.recipe!r} runs on torch (torchao). Nothing was applied.")


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
        out = self._matmul(lhs.reshape(-1, lhs.shape[-1]), rhs).reshape(*lhs.shape[:-1], rhs.shape[1])
        return out if preferred_element_type is None else out.astype(preferred_element_type)

    def _matmul(self, x: Any, w: Any) -> Any:
        return _matmul(x, w, self.recipe.forward_dtype, self.recipe.backward_dtype, str(x.dtype), str(w.dtype), 1)


# -- delayed scaling: Keras's algorithm, its state as variables on the layer -------------------
class Float8Meta(nnx.Variable):
    """The scales and amax histories of a delayed-scaling fp8 layer: overwritten by their
    "gradients" (`update_float8`), never trained by an optimizer."""


_LAYER: contextvars.ContextVar = contextvars.ContextVar("mixedpolicy_fp8_layer", default=None)


def attach(module: Any, recipe: Float8Recipe) -> Any:
    """Gives an ``nnx.Linear`` its fp8 hook (and, delayed, its state); returns its own hook."""
    own = module.dot_general
    if recipe.recipe == "delayed":
        lead = tuple(module.kernel[...].shape[:-2])  # layers stacked by nnx.vmap (for nnx.scan): one each
        for name in DELAYED_STATE:
            value = jnp.ones(lead) if name.endswith("scale") else jnp.zeros((*lead, recipe.amax_history_len))
            setattr(module, name, Float8Meta(value.astype(jnp.float32)))
        module.__class__ = policy_subclass("jax-fp8-delayed", type(module), _named_call)
        module.dot_general = DelayedDotGeneral(recipe)
    else:
        module.dot_general = TensorwiseDotGeneral(recipe)
    return own


def detach(module: Any, own: Any) -> None:
    """Undoes `attach` (the class is restored by the caller)."""
    module.dot_general = own
    for name in DELAYED_STATE:
        if name in vars(module):
            delattr(module, name)


def _named_call(module: Any, call_super: Any, args: tuple, kwargs: dict) -> Any:
    """``__call__`` of a delayed layer: names the layer to its hook, which reads its state."""
    token = _LAYER.set(module)
    try:
        return call_super(*args, **kwargs)
    finally:
        _LAYER.reset(token)


def _differentiated(x: Any) -> bool:
    """True where `x` is being differentiated at this level (a JVP or linearize tracer; never
    on a JAX without these internal types, which only loses the refusal)."""
    ad = sys.modules.get("jax._src.interpreters.ad")
    kinds = tuple(getattr(ad, n) for n in ("JVPTracer", "LinearizeTracer") if hasattr(ad, n))
    return bool(kinds) and isinstance(x, kinds)


class DelayedDotGeneral(TensorwiseDotGeneral):
    """``nnx.Linear``'s ``dot_general`` for the delayed recipe (see the module docstring)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DelayedDotGeneral) and other.recipe == self.recipe

    def __hash__(self) -> int:
        return hash(("delayed", self.recipe))

    def _matmul(self, x: Any, w: Any) -> Any:
        layer = _LAYER.get()
        if layer is None:
            raise RuntimeError("A delayed fp8 dot_general was called outside its nnx.Linear; it reads "
                               "the layer's scales, so call the layer itself.")
        meta = tuple(getattr(layer, name)[...] for name in DELAYED_STATE)
        if _differentiated(w) and not _differentiated(meta[0]):
            raise ValueError(
                "Received a gradient of a delayed-scaling fp8 layer's kernel without one of its fp8 "
                "state variables (Float8Meta): its scales and amax histories move only through their "
                "\"gradients\", so differentiate them too and write them back after the update: "
                "grads = nnx.grad(loss_fn, argnums=nnx.DiffState(0, mp.jax.with_float8()))(model, ...); "
                "optimizer.update(model, grads); mp.jax.update_float8(model, grads, optimizer).")
        r = self.recipe
        return _delayed((r.forward_dtype, r.backward_dtype, r.margin, str(x.dtype), str(w.dtype), 1), x, w, meta)


def with_float8(params: Any = None) -> Any:
    """The filter to differentiate by under a delayed fp8 policy: `params` (default
    ``nnx.Param``) and the fp8 layers' `Float8Meta`."""
    return nnx.Any(nnx.Param if params is None else params, Float8Meta)


def update_float8(model: Any, grads: Any, optimizer: Any = None, axis_name: Any = None) -> None:
    """`mp.jax.update_float8` (mixedpolicy/jax.py): the values in `grads` into `model`'s fp8 state."""
    for name, value, kinds, expected in (
            ("model", model, nnx.Module, "the Flax NNX model whose delayed fp8 layers the step trained, "
                                         "or a plain function's fp8 state (the tuple its init_float8 made)"),
            ("grads", grads, (nnx.State, nnx.Module), "what nnx.grad(loss_fn, argnums=nnx.DiffState(0, "
                                                      "mp.jax.with_float8())) returned (an nnx.State)")):
        if not isinstance(value, kinds):
            raise TypeError(f"Received {name} of type {type(value).__name__}; expected {expected}.")
    new = nnx.state(grads, Float8Meta)
    if not jax.tree_util.tree_leaves(new):
        if not jax.tree_util.tree_leaves(nnx.state(model, Float8Meta)):
            return  # no delayed fp8 layer: nothing to do
        raise ValueError(
            "Received gradients without the fp8 state of the model's delayed-scaling layers; take "
            "them with nnx.grad(loss_fn, argnums=nnx.DiffState(0, mp.jax.with_float8())).")
    nnx.update(model, next_state(nnx.state(model, Float8Meta), new, optimizer, axis_name))


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
