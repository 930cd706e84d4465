"""Conversions between `Policy` and the policy objects of Keras and jmp."""

from __future__ import annotations

from typing import Any

_KERAS_NAMES = ("float16", "bfloat16", "float32", "float64", "mixed_float16", "mixed_bfloat16")


def to_keras(policy: Any) -> Any:
    """Returns the ``keras.DTypePolicy`` with the same variable and compute dtypes.

    Raises:
      ValueError: the policy has no Keras equivalent (Keras layers output their
        compute dtype and only know variables in float32 under mixed policies).
    """
    if policy.name not in _KERAS_NAMES:
        raise ValueError(
            f"Received {policy!r}, which Keras cannot express: a Keras DTypePolicy is one "
            f"of {list(_KERAS_NAMES)} and its layers output their compute dtype. Apply the "
            f"policy with mixedpolicy.apply_policy instead, or use one of those names.")
    import keras

    return keras.DTypePolicy(policy.name)


def to_jmp(policy: Any) -> Any:
    """Returns the ``jmp.Policy`` with the same param, compute and output dtypes."""
    import jax.numpy as jnp
    import jmp

    def dt(name: str) -> Any:
        # jmp keys its names (str(policy), get_policy) by the scalar types, jnp.float32...
        return getattr(jnp, name)

    return jmp.Policy(param_dtype=dt(policy.variable_dtype), compute_dtype=dt(policy.compute_dtype),
                      output_dtype=dt(policy.output_dtype))
