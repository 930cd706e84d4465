"""fp8 matmuls on Keras: Keras's own float8 layers, set layer by layer from the plan.

A ``Dense`` or ``EinsumDense`` layer whose policy has the ``"delayed"`` recipe gets Keras's
``QuantizedFloat8DTypePolicy("float8", <source>, amax_history_length=...)``: Keras quantizes
the layer itself (the same float8 variables and delayed scaling as ``model.quantize("float8")``,
on every backend). One with ``"tensorwise"`` (current scaling, which Keras has no layer for)
keeps its source policy and gets the quantize / dequantize in ``keras.ops`` around its own
matmul (`float8_tensorwise`). The built-in rules' kinds (embeddings, norms, the head, matmuls whose
dimensions are not multiples of 16, layers without an fp8 path) are read here.
"""

from __future__ import annotations

from typing import Any

import keras

from mixedpolicy.backends.keras.float8_tensorwise import CLASSES, make_tensorwise  # noqa: F401 (re-exported)
from mixedpolicy.float8 import Float8Recipe
from mixedpolicy.policy_map import EMBEDDING, HEAD, NO_FLOAT8, SMALL_MATMUL, LayerInfo

#: the layers Keras quantizes to float8 itself (exactly these classes, as Keras's quantize checks)
MATMULS = tuple(getattr(keras.layers, n) for n in ("Dense", "EinsumDense") if hasattr(keras.layers, n))


_KERAS_CLASS = {ours: theirs for theirs, ours in CLASSES.items()}


def keras_class(layer: Any) -> type:
    """The Keras class of `layer` (a tensorwise fp8 layer's is the one it was made from)."""
    return _KERAS_CLASS.get(type(layer), type(layer))


def eligible(layer: Any) -> bool:
    return keras_class(layer) in MATMULS


def kind(layer: Any) -> str | None:
    """The fp8 rules' kind of a layer that is not a norm (None: fp8 applies, or no weights)."""
    if isinstance(layer, keras.layers.Embedding):
        return EMBEDDING
    if eligible(layer):
        dims = [getattr(layer, "units", None)]
        kernel = getattr(layer, "_kernel", None)
        if kernel is not None:
            dims = list(kernel.shape)
        return SMALL_MATMUL if any(isinstance(d, int) and d % 16 for d in dims) else None
    if layer._trainable_variables or layer._non_trainable_variables:
        return NO_FLOAT8
    return None


def matmul(layer: Any) -> tuple | None:
    """(in_features, out_features) of a built Dense layer, else None (EinsumDense: no one pair)."""
    kernel = getattr(layer, "_kernel", None) if keras_class(layer) is keras.layers.Dense else None
    shape = tuple(kernel.shape) if kernel is not None else ()
    return shape if len(shape) == 2 and all(isinstance(d, int) for d in shape) else None


def mark_head(layers: list[tuple[Any, list[LayerInfo]]]) -> None:
    """The last fp8-capable matmul layer of the walk is the output head."""
    for layer, chain in reversed(layers):
        if eligible(layer):
            chain[-1] = chain[-1]._replace(kind=HEAD)
            return


def check(recipe: Float8Recipe, path: str, reduce_dtype: str = "float32") -> None:
    """Refuses, before anything changes, a recipe Keras's float8 layers cannot run."""
    if reduce_dtype != "float32" and recipe.recipe == "delayed":
        raise ValueError(
            f"Received a delayed fp8 policy with reduce_dtype={reduce_dtype} for Keras layer {path!r}: "
            f"Keras's float8 layers carry their scales and amax histories as gradients that "
            f"overwrite them, which mixedpolicy's reduced-precision sum across tf.distribute "
            f"replicas does not handle yet. Reduce in float32 there (the default), or use "
            f"float8_recipe='tensorwise' (no state); nothing was applied.")
    if recipe == Float8Recipe("delayed", amax_history_len=recipe.amax_history_len) or recipe.recipe == "tensorwise":
        return
    what = (f"the recipe {recipe.recipe!r}" if recipe.recipe != "delayed" else
            f"delayed scaling with margin={recipe.margin} or formats "
            f"{recipe.forward_dtype}/{recipe.backward_dtype}")
    raise ValueError(
        f"Received {what} for Keras layer {path!r}: on Keras mixedpolicy runs 'delayed' through "
        f"Keras's own fp8 layers (an amax history, margin 0, e4m3 forward, e5m2 gradients) and "
        f"'tensorwise' (current scaling, written in keras.ops); the per-row recipes run on torch "
        f"(torchao). Use float8_recipe='delayed' (amax_history_len= may change) or 'tensorwise' on "
        f"Keras. Nothing was applied.")


def tensorwise_recipe(layer: Any) -> Float8Recipe | None:
    """The tensorwise recipe `layer` runs under mixedpolicy, else None."""
    return layer.__dict__.get("_mixedpolicy_float8")


def dtype_policy(name: str, recipe: Float8Recipe) -> Any:
    """Keras's fp8 policy over the source policy `name` (tensorwise: the source's own name;
    its layer's class quantizes, `make_tensorwise`)."""
    if recipe.recipe == "tensorwise":
        return name
    return keras.dtype_policies.QuantizedFloat8DTypePolicy(
        "float8", name, amax_history_length=recipe.amax_history_len)
