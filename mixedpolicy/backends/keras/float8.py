"""fp8 matmuls on Keras: Keras's own float8 layers, set layer by layer from the plan.

A ``Dense`` or ``EinsumDense`` layer whose policy has the ``"delayed"`` recipe gets Keras's
``QuantizedFloat8DTypePolicy("float8", <source>, amax_history_length=...)``: Keras quantizes
the layer itself (the same float8 variables and delayed scaling as ``model.quantize("float8")``,
on every backend). The built-in rules' kinds (embeddings, norms, the head, matmuls whose
dimensions are not multiples of 16, layers without an fp8 path) are read here.
"""

from __future__ import annotations

from typing import Any

import keras

from mixedpolicy.float8 import Float8Recipe
from mixedpolicy.policy_map import EMBEDDING, HEAD, NO_FLOAT8, SMALL_MATMUL, LayerInfo

#: the layers Keras quantizes to float8 itself (exactly these classes, as Keras's quantize checks)
MATMULS = tuple(getattr(keras.layers, n) for n in ("Dense", "EinsumDense") if hasattr(keras.layers, n))


def eligible(layer: Any) -> bool:
    return type(layer) in MATMULS


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
    kernel = getattr(layer, "_kernel", None) if type(layer) is keras.layers.Dense else None
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
    if reduce_dtype != "float32":
        raise ValueError(
            f"Received an fp8 policy with reduce_dtype={reduce_dtype} for Keras layer {path!r}: "
            f"Keras's float8 layers carry their scales and amax histories as gradients that "
            f"overwrite them, which mixedpolicy's reduced-precision sum across tf.distribute "
            f"replicas does not handle yet. Reduce in float32 there (the default); nothing was applied.")
    if recipe == Float8Recipe("delayed", amax_history_len=recipe.amax_history_len):
        return
    what = (f"the recipe {recipe.recipe!r}" if recipe.recipe != "delayed" else
            f"delayed scaling with margin={recipe.margin} or formats "
            f"{recipe.forward_dtype}/{recipe.backward_dtype}")
    raise ValueError(
        f"Received {what} for Keras layer {path!r}: Keras's own fp8 layers scale with an amax "
        f"history ('delayed', margin 0, e4m3 forward, e5m2 gradients), and mixedpolicy has no "
        f"other Keras fp8 path yet ('tensorwise' runs on torch and Flax NNX, the per-row recipes on torch). Use "
        f"float8_recipe='delayed' (amax_history_len= may change) on Keras. Nothing was applied.")


def dtype_policy(name: str, recipe: Float8Recipe) -> Any:
    """Keras's fp8 policy over the source policy `name`."""
    return keras.dtype_policies.QuantizedFloat8DTypePolicy(
        "float8", name, amax_history_length=recipe.amax_history_len)
