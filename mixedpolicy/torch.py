"""PyTorch: gradients reduced between DDP replicas in a policy's reduce dtype.

The torch front door beside `mixedpolicy.jax.all_reduce` and `mixedpolicy.tensorflow`'s:
``mp.torch.register(ddp_model, policy)`` registers the DDP communication hook;
``mp.torch.bytes_per_step(model, policy)`` counts what it would send each step.
`mixedpolicy.distributed.register` is the same function under its older name.
"""

from mixedpolicy.codecs import wire_bytes
from mixedpolicy.distributed import bytes_per_step, register

__all__ = ["bytes_per_step", "register", "wire_bytes"]
