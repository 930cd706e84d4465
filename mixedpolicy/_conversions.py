"""Conversions between `Policy` and the policy objects of Keras, jmp and FSDP2.

The checks that need no framework are here; the conversions themselves live in each
framework's backend folder, reached through the table of frameworks (`_registry`), so this
ground-floor module imports no framework and names no backend module.
"""

from __future__ import annotations

from typing import Any

from mixedpolicy import _registry
from mixedpolicy._dtypes import refuse_uncarried
from mixedpolicy.float8 import KERAS_SOURCES

_KERAS_NAMES = ("float16", "bfloat16", "float32", "float64", "mixed_float16", "mixed_bfloat16")
_FSDP_REDUCE = ("float32", "bfloat16", "float16", "float64")


def to_keras(policy: Any) -> Any:
    """Returns the ``keras.DTypePolicy`` with the same variable and compute dtypes.

    Raises:
      ValueError: the policy has no Keras equivalent (Keras layers output their
        compute dtype and only know variables in float32 under mixed policies).
    """
    recipe = policy.float8_recipe
    if recipe is not None:
        source = policy.source.name
        if not (recipe.recipe == "delayed" and source in KERAS_SOURCES
                and recipe == type(recipe)("delayed", amax_history_len=recipe.amax_history_len)):
            raise ValueError(
                f"Received {policy!r}, which Keras cannot express: Keras's fp8 policies "
                f"(QuantizedFloat8DTypePolicy, 'float8_from_<source>') scale with an amax history "
                f"(the 'delayed' recipe, margin 0, e4m3 forward and e5m2 gradients) from a source "
                f"policy among {list(KERAS_SOURCES)}. Use Policy('float8_from_mixed_bfloat16') "
                f"(amax_history_len= may change), or apply the policy with mixedpolicy.apply_policy.")
        return _registry.conversion("keras", "to_keras")(f"float8_from_{source}", recipe.amax_history_len)
    if policy.name not in _KERAS_NAMES:
        raise ValueError(
            f"Received {policy!r}, which Keras cannot express: a Keras DTypePolicy is one "
            f"of {list(_KERAS_NAMES)} and its layers output their compute dtype. Apply the "
            f"policy with mixedpolicy.apply_policy instead, or use one of those names.")
    return _registry.conversion("keras", "to_keras")(policy.name)


def to_jmp(policy: Any) -> Any:
    """Returns the ``jmp.Policy`` with the same param, compute and output dtypes."""
    return _registry.conversion("jax", "to_jmp")(policy)


def to_fsdp(policy: Any) -> Any:
    """Returns FSDP2's ``torch.distributed.fsdp.MixedPrecisionPolicy`` for the policy.

    ``param_dtype`` is the compute dtype (FSDP2 all-gathers the parameters in it and
    computes each module in it; the sharded parameters stay in the variable dtype the
    model was created in), ``reduce_dtype`` the reduce dtype, ``output_dtype`` the output
    dtype where it differs from the compute dtype.

    Raises:
      ValueError: the reduce dtype is 8-bit or a table codec (FSDP2 reduce-scatters in a
        torch float dtype).
    """
    refuse_uncarried([policy.reduce_dtype], f"{policy!r} for to_fsdp()", "FSDP2", _FSDP_REDUCE,
                     why="; it reduce-scatters in a torch float dtype")
    return _registry.conversion("torch", "to_fsdp")(policy)


def dtypes_of(obj: Any, kind: str, **fields: str) -> dict:
    """The ``variable_dtype``, ``compute_dtype`` (and ``output_dtype``) keywords of `Policy` that
    `obj`, a Keras or jmp policy, holds under the attribute names `fields` give.

    Raises:
      TypeError: `obj` lacks one of them.
      ValueError: one is None (a quantized or unset policy).
    """
    missing = [attr for attr in fields.values() if not hasattr(obj, attr)]
    if missing:
        raise TypeError(f"Received {type(obj).__name__}, which has no {missing}; "
                        f"expected a {kind} with fields {list(fields.values())}.")
    values = {key: getattr(obj, attr) for key, attr in fields.items()}
    if any(v is None for v in values.values()):
        raise ValueError(f"Received a {kind} whose dtypes are {values}; a quantized or "
                         f"unset policy has no mixedpolicy equivalent.")
    return {f"{key}_dtype": value for key, value in values.items()}
