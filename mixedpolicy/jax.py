"""JAX: reducing gradients across replicas (``shard_map``, ``pmap``) in a policy's reduce dtype,
and the optax transformations that carry a policy's update recipe (the `LossScaleOptimizer`
chains them itself; these are for a chain written by hand).

Importing this module imports JAX and optax.
"""

from mixedpolicy.backends.jax.reduce import all_reduce, bytes_per_step
from mixedpolicy.backends.jax.updates import state_storage, update_rounding

__all__ = ["all_reduce", "bytes_per_step", "state_storage", "update_rounding"]
