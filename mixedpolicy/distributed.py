"""Scaling out: the dtype gradients travel in between replicas, carried by the engines.

A `Policy`'s ``reduce_dtype`` (float32, bfloat16, float16, float8_e5m2, float8_e4m3fn)
is the dtype gradients are reduced in; `mixedpolicy.codecs` has the rules. This module
connects it to PyTorch's DDP; JAX's replicas use `mixedpolicy.jax.all_reduce`.
"""

from __future__ import annotations

import sys
from typing import Any

from mixedpolicy.codecs import wire_bytes


def register(model: Any, policy: Any = None, *, error_feedback: bool = False) -> Any:
    """Makes a ``DistributedDataParallel`` model reduce gradients in the reduce dtype.

    Registers one DDP communication hook (DDP allows one per model). Each parameter
    travels in the reduce dtype of its module's policy: `policy` (a `Policy`, a name,
    or a `PolicyMap` resolved by module path inside the wrapped module), else the
    policy `apply_policy` put on its module, else the global policy. With
    ``error_feedback=True`` what a codec drops from a gradient (the rounding of its 8-bit,
    table or half-precision values) is added to that parameter's next gradient.

    Returns:
      The hook's state: ``bytes_sent`` (bytes this rank sent so far), ``buckets``,
      ``reduce_dtypes`` (parameter name -> reduce dtype).

    Raises:
      TypeError: `model` is not a ``DistributedDataParallel`` module.
      RuntimeError: the model already has a communication hook.
    """
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            f"Received {type(model).__module__}.{type(model).__qualname__}; expected a "
            f"torch.nn.parallel.DistributedDataParallel module (JAX replicas reduce with "
            f"mixedpolicy.jax.all_reduce inside shard_map or pmap).")
    from mixedpolicy.backends.torch.reduce import register as register_ddp

    if not isinstance(error_feedback, bool):
        raise TypeError(f"Received error_feedback={error_feedback!r}; expected True or False.")
    return register_ddp(model, policy, error_feedback=error_feedback)


def bytes_per_step(model: Any, policy: Any = None) -> int:
    """Bytes one rank sends to reduce the gradients of `model` (a ``torch.nn.Module`` or its
    ``DistributedDataParallel`` wrapper) once, each parameter in the reduce dtype `register`
    would give it (`policy`, else the policies `apply_policy` put on its modules, else the
    global policy): what to expect of a policy before training, as `mixedpolicy.jax.bytes_per_step`
    and `mixedpolicy.tensorflow.bytes_per_step` say it for their engines.

    Raises:
      TypeError: `model` is not a torch module.
    """
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(model, torch.nn.Module):
        raise TypeError(f"Received {type(model).__module__}.{type(model).__qualname__}; expected a "
                        f"torch.nn.Module or its DistributedDataParallel wrapper.")
    from mixedpolicy.backends.torch.reduce import bytes_per_step as ddp_bytes

    return ddp_bytes(model, policy)


__all__ = ["bytes_per_step", "register", "wire_bytes"]
