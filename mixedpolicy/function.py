"""A policy on a plain function ``f(params, *inputs)`` of arrays, for any array framework."""

from __future__ import annotations

import functools
from typing import Any, Callable

from mixedpolicy import _registry
from mixedpolicy._registry import cast_tree
from mixedpolicy.policy_map import PolicyMap


class PolicyFunction:
    """Calls `fn` with floating arguments in the compute dtype, returns the output dtype.

    `policy_map` is a `PolicyMap` without overrides, a `Policy` or its name (None: the global
    policy); ``apply_policy(fn, policy)`` gives the same wrapper.

    Parameters and floating inputs are cast to the compute dtype on the way in
    (integer and boolean leaves are never cast); floating outputs are cast to the
    output dtype on the way out. Under autodiff the casts are differentiated
    through, so gradients with respect to float32 parameters come back float32.
    The array framework is read from the arguments at each call, so one wrapper
    serves numpy, JAX or PyTorch arrays alike.

    Under an fp8 policy with the ``"tensorwise"`` recipe (current scaling: a plain function
    has no variables to keep delayed scaling's amax histories in), a JAX function's weight
    matmuls run in fp8: those of a leaf of ``params`` by an activation, but for the last one
    (the output head) and those whose weight is not a multiple of 16 in both sizes, as the
    layer adapters' rules say (docs/float8.md); ``PolicyMap(builtin_rules=False)`` puts them
    in fp8 too, ``float8_auto_filter=True`` keeps out those too small to gain.

    >>> import numpy as np
    >>> f = PolicyFunction(lambda w, x: w * x, PolicyMap("p=f32,c=f16,o=f32"))
    >>> f(np.float32(2.0), np.ones(2, np.float32)).dtype
    dtype('float32')
    """

    def __init__(self, fn: Callable[..., Any], policy_map: Any = None):
        if not callable(fn):
            raise TypeError(f"Received {fn!r:.60} (a {type(fn).__name__}) as the function; expected a "
                            f"callable f(params, *inputs) of arrays, e.g. PolicyFunction(f, 'mixed_bfloat16').")
        if not isinstance(policy_map, PolicyMap):  # a policy or its name, as apply_policy takes it
            policy_map = PolicyMap(policy_map)
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
        recipe = self.policy.float8_recipe
        if recipe is not None and recipe.recipe != "tensorwise":
            raise ValueError(
                f"Received the fp8 policy {self.policy.name!r} (recipe {recipe.recipe!r}) for the plain "
                f"function {getattr(fn, '__name__', fn)!r}: a plain function runs the 'tensorwise' "
                f"recipe (current scaling) only, having no variables to keep amax histories in "
                f"(Keras's float8_ names alone mean 'delayed'). Pass Policy({self.policy.name!r}, "
                f"float8_recipe='tensorwise'), or put the policy on a Flax NNX, Keras or torch model.")
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = cast_tree((args, kwargs), self.policy.compute_dtype)
        recipe = self.policy.float8_recipe
        if recipe is None:
            return cast_tree(self.fn(*args, **kwargs), self.policy.output_dtype)
        framework, call = _registry.float8_function((args, kwargs))
        if call is None:
            raise TypeError(
                f"Received {framework} arrays for the fp8 function {getattr(self.fn, '__name__', self.fn)!r}; "
                f"a plain function's matmuls run in fp8 on {_registry.float8_function_frameworks()} "
                f"arrays only (jnp.asarray the arguments; on torch, put the policy on a "
                f"torch.nn.Module, which runs torchao's fp8 layers).")
        out = call(self.fn, recipe, args, kwargs, builtin_rules=self.policy_map.builtin_rules,
                   auto_filter=self.policy_map.float8_auto_filter)
        return cast_tree(out, self.policy.output_dtype)

    def __repr__(self) -> str:
        return f"PolicyFunction({getattr(self.fn, '__name__', self.fn)!r}, {self.policy!r})"
