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
    if policy.reduce_dtype not in ("float32", "bfloat16", "float16", "float64"):
        raise ValueError(
            f"Received {policy!r}, whose gradients would be reduced in {policy.reduce_dtype}; "
            f"FSDP2 reduce-scatters in float32, bfloat16 or float16 only. Use one of those as "
            f"reduce_dtype with FSDP2, or DistributedDataParallel with mp.distributed.register "
            f"for 8-bit and table-coded gradients.")
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    def dt(name: str) -> Any:
        return getattr(torch, name)

    return MixedPrecisionPolicy(
        param_dtype=None if policy.compute_dtype == policy.variable_dtype else dt(policy.compute_dtype),
        reduce_dtype=dt(policy.reduce_dtype),
        output_dtype=None if policy.output_dtype == policy.compute_dtype else dt(policy.output_dtype))
