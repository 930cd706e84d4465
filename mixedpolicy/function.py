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

    Under an fp8 policy a JAX function's weight matmuls run in fp8: those of a leaf of
    ``params`` by an activation, but for the last one (the output head) and those whose weight
    is not a multiple of 16 in both sizes, as the layer adapters' rules say (docs/float8.md);
    ``PolicyMap(builtin_rules=False)`` puts them in fp8 too, ``float8_auto_filter=True`` keeps
    out those too small to gain. Under ``"delayed"`` scaling the function has no variables for
    the scales and amax histories, so the caller holds them: ``state =
    f.init_float8(params, *inputs)``, then ``f(params, *inputs, float8_state=state)``, whose
    gradient with respect to ``state`` is the next state (as Flax linen's fp8 variables move).

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
        if recipe is not None and recipe.recipe not in ("tensorwise", "delayed"):
            raise ValueError(
                f"Received the fp8 policy {self.policy.name!r} (recipe {recipe.recipe!r}) for the plain "
                f"function {getattr(fn, '__name__', fn)!r}: a plain function runs the 'tensorwise' "
                f"(current) and 'delayed' scalings; {recipe.recipe!r} runs on torch (torchao). Pass "
                f"Policy({self.policy.source.name!r}, float8_recipe='tensorwise'), or put the policy "
                f"on a torch model.")
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, float8_state: Any = None, **kwargs: Any) -> Any:
        recipe = self.policy.float8_recipe
        if float8_state is not None and (recipe is None or recipe.recipe != "delayed"):
            raise TypeError(f"Received float8_state for {self!r}, whose policy keeps no fp8 state (only "
                            f"float8_recipe='delayed' does); call it without float8_state.")
        return self._call(args, kwargs, float8_state, init=False)

    def init_float8(self, *args: Any, **kwargs: Any) -> tuple:
        """The fresh fp8 state of a delayed-scaling function, for these arguments' shapes: a
        tuple with, for each of its fp8 matmuls in the order they run, a dict of Keras's six
        names (``float8_inputs_scale``, ``float8_inputs_amax_history``, ``float8_kernel_...``,
        ``float8_outputs_grad_...``): scales 1, histories of zeros.

        Raises:
          ValueError: the policy has no delayed fp8 recipe.
        """
        recipe = self.policy.float8_recipe
        if recipe is None or recipe.recipe != "delayed":
            raise ValueError(f"Received init_float8 on {self!r}, whose policy keeps no fp8 state; "
                             f"only a policy with float8_recipe='delayed' has scales and histories to hold.")
        return self._call(args, kwargs, None, init=True)

    def _call(self, args: tuple, kwargs: dict, state: Any, init: bool) -> Any:
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
                   auto_filter=self.policy_map.float8_auto_filter, state=state, init=init)
        return out if init else cast_tree(out, self.policy.output_dtype)

    def __repr__(self) -> str:
        return f"PolicyFunction({getattr(self.fn, '__name__', self.fn)!r}, {self.policy!r})"
