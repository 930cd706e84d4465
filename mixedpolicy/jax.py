"""JAX: reducing gradients across replicas (``shard_map``, ``pmap``) in a policy's reduce dtype.

Importing this module imports JAX.
"""

from mixedpolicy.backends.jax.reduce import all_reduce, bytes_per_step

__all__ = ["all_reduce", "bytes_per_step"]
