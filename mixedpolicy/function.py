"""A policy on a plain function ``f(params, *inputs)`` of arrays, for any array framework."""

from __future__ import annotations

import functools
from typing import Any, Callable

from mixedpolicy._registry import cast_tree
from mixedpolicy.policy_map import PolicyMap


class PolicyFunction:
    """Calls `fn` with floating arguments in the compute dtype, returns the output dtype.

    Parameters and floating inputs are cast to the compute dtype on the way in
    (integer and boolean leaves are never cast); floating outputs are cast to the
    output dtype on the way out. Under autodiff the casts are differentiated
    through, so gradients with respect to float32 parameters come back float32.
    The array framework is read from the arguments at each call, so one wrapper
    serves numpy, JAX or PyTorch arrays alike.

    >>> import numpy as np
    >>> f = PolicyFunction(lambda w, x: w * x, PolicyMap("p=f32,c=f16,o=f32"))
    >>> f(np.float32(2.0), np.ones(2, np.float32)).dtype
    dtype('float32')
    """

    def __init__(self, fn: Callable[..., Any], policy_map: PolicyMap):
        if policy_map.overrides:
            raise TypeError(
                f"Received per-layer overrides for the plain function {fn!r}, which has no "
                f"layers to match them against. Pass one policy for the whole function, or "
                f"apply the map to a module of a framework (torch.nn.Module, a Flax or Keras model).")
        self.fn = fn
        self.policy_map = policy_map
        resolution = policy_map._inherited(())
        self.policy = resolution.policy
        self.source = resolution.source
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = cast_tree((args, kwargs), self.policy.compute_dtype)
        return cast_tree(self.fn(*args, **kwargs), self.policy.output_dtype)

    def __repr__(self) -> str:
        return f"PolicyFunction({getattr(self.fn, '__name__', self.fn)!r}, {self.policy!r})"
