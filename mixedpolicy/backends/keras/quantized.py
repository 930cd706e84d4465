"""Keras layers whose weights ``model.quantize`` stored as integers (``"int8"``, ``"int4"``,
``"gptq"``, ``"awq"``), under a policy.

Keras gives such a layer a ``QuantizedDTypePolicy`` named ``<mode>_from_<source>``: its
weights are integers with float scales, and its source policy (``mixed_bfloat16``...) sets
what everything else of the layer computes and keeps in (its activations, bias, scales and
LoRA weights). A policy applied to the model becomes that source, and the quantization stays:
the integer weights cannot be made float again, and Keras's own layers built under a global
policy are quantized to ``<mode>_from_<global policy>`` the same way. fp8 matmuls, which Keras
also spells as quantization, are `mixedpolicy.backends.keras.float8`'s.
"""

from __future__ import annotations

import warnings
from typing import Any

from mixedpolicy._warnings import user_stacklevel


def weight_mode(dtype_policy: Any) -> str | None:
    """``"int8"``, ``"int4/128"``... where `dtype_policy` stores the layer's weights as
    integers; None for a float policy and for Keras's fp8 one (a compute recipe)."""
    mode = getattr(dtype_policy, "quantization_mode", None)
    if mode is None or mode == "float8":
        return None
    name = str(getattr(dtype_policy, "name", mode))
    return name.split("_from_")[0] if "_from_" in name else str(mode)


def source_name(dtype_policy: Any) -> str:
    """The float policy a quantized Keras policy computes in (``"mixed_bfloat16"``...)."""
    return str(dtype_policy.get_config()["source_name"])


def with_source(dtype_policy: Any, name: str, path: str) -> Any:
    """`dtype_policy` (a quantized one) with `name` as its source: the same mode and settings.

    Raises:
      ValueError: Keras refuses the pair (int8 weights under a float16 compute dtype).
    """
    config = dict(dtype_policy.get_config(), source_name=name)
    try:
        return type(dtype_policy).from_config(config)
    except ValueError as err:
        mode = weight_mode(dtype_policy)
        raise ValueError(
            f"Received the policy {name} for Keras layer {path!r}, whose weights model.quantize "
            f"stored as {mode} ({dtype_policy.name}): Keras refuses {mode} weights under it ({err}). "
            f"Keep that layer in bfloat16 or float32 compute with an override, e.g. "
            f"{{{path!r}: 'mixed_bfloat16'}}, or apply the policy before quantizing. Nothing was "
            f"applied.") from None


def refuse_float8(dtype_policy: Any, name: str, path: str) -> ValueError:
    """The error for an fp8 policy on a layer whose weights are integers already."""
    return ValueError(
        f"Received an fp8 policy ({name}) for Keras layer {path!r}, whose weights model.quantize "
        f"stored as {weight_mode(dtype_policy)} ({dtype_policy.name}): its matmul runs on those "
        f"integer weights and cannot also run in fp8. Keep it out of fp8 with an override, e.g. "
        f"{{{path!r}: 'mixed_bfloat16'}}, or apply the fp8 policy to a model that was not "
        f"quantized. Nothing was applied.")


def restored(current: Any, original: Any, path: str) -> Any:
    """The policy `remove_policy` gives back to a layer that held `original` before a policy was
    applied and holds `current` now: `original`, unless the layer was quantized in between
    (``model.quantize`` after ``apply_policy``), whose integer weights a float policy would have
    computed with as if they were the weights themselves; then `original` becomes their source."""
    if weight_mode(current) is None or weight_mode(original) is not None or hasattr(original, "default_policy"):
        return original  # (a DTypePolicyMap the layer held is given back as it is: quantize wrote into it)
    try:
        return with_source(current, original.name, path)
    except ValueError:
        warnings.warn(
            f"Keras layer {path!r} was quantized ({current.name}) after its policy was applied, and Keras "
            f"refuses its integer weights under the policy it had before ({original.name}): it keeps "
            f"{current.name}.", UserWarning, stacklevel=user_stacklevel("keras"))
        return current
