"""Policies on Flax modules, NNX and linen, through Flax's own ``dtype`` / ``param_dtype``.

Every Flax layer takes a compute ``dtype`` (inputs and parameters are cast to it before the
math) and a ``param_dtype`` (what new parameters are created in); a policy sets both per layer
from the `PolicyMap`, so the math is what a hand-written Flax model with those arguments does.

- NNX modules are mutable: `apply_policy` changes them in place (flax_nnx.py).
- linen modules are immutable and build their submodules lazily, so `apply_policy` returns a
  `PolicyLinen` whose ``init`` and ``apply`` run the module under a method interceptor that
  resolves each submodule's policy at its first call and sets its fields for the call (fp8
  ``nn.Dense``: Flax's own ``Fp8DirectDotGeneralOp``).

Layer paths are module paths joined with dots: ``"blocks.0.linear"`` (NNX), ``"encoder.head"`` (linen).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from typing import Any

import jax

from mixedpolicy._adapter import ModelAdapter
from mixedpolicy.backends.jax import float8
from mixedpolicy.backends.jax.arrays import jnp_dtype
from mixedpolicy.backends.jax.flax_common import cast_tree, dotted_path, layer_kind
from mixedpolicy.backends.jax.flax_nnx import nnx_apply, nnx_describe, nnx_remove
from mixedpolicy.policy import Policy
from mixedpolicy.policy_map import LayerInfo, PolicyMap, Resolution
from mixedpolicy.table import LayerPolicy


# -- dispatch ------------------------------------------------------------------
def _is_nnx(model: Any) -> bool:
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(model, nnx.Module)


class FlaxModels(ModelAdapter):
    """NNX modules are changed in place; a linen module comes back as a `PolicyLinen`."""

    runs_float8 = True  # NNX: nnx.Linear's dot_general hook; linen: Flax's own fp8 op (float8.py)

    def is_model(self, obj: Any) -> bool:
        linen = sys.modules.get("flax.linen")
        return _is_nnx(obj) or (linen is not None and isinstance(obj, linen.Module)) \
            or isinstance(obj, PolicyLinen)

    def apply_policy(self, model: Any, policy_map: PolicyMap) -> Any:
        if _is_nnx(model):
            return nnx_apply(model, policy_map, _policy_linen)
        if isinstance(model, PolicyLinen):
            model = model.module
        float8.linen_check(policy_map)
        return PolicyLinen(model, policy_map)

    def remove_policy(self, model: Any) -> Any:
        if _is_nnx(model):
            return nnx_remove(model)
        if isinstance(model, PolicyLinen):
            return model.module
        return model  # a bare linen module carries no policy

    def range_stats(self, model: Any, loss_fn: Any, batches: list, scales: tuple, activations: bool) -> dict:
        if not _is_nnx(model):
            raise TypeError(f"Received a linen {type(model).__name__}; inspect_gradients takes its "
                            f"params pytree for linen: mp.inspect_gradients(params, lambda p, b: "
                            f"loss(module.apply(p, b)), batches).")
        from mixedpolicy.backends.jax.ranges import nnx_stats

        return nnx_stats(model, loss_fn, batches, scales)

    def describe(self, model: Any) -> list:
        if _is_nnx(model):
            return nnx_describe(model)
        if isinstance(model, PolicyLinen):
            return model.describe_rows()
        raise TypeError(
            f"Received a bare linen module {type(model).__name__}: linen builds its submodules "
            f"only when called, so describe needs the PolicyLinen that apply_policy returns, "
            f"after one init or apply call.")


# -- linen -----------------------------------------------------------------------
def _under_policy(nnx_class: Any, policy: Policy) -> Any:
    """``flax.nnx.bridge.ToLinen``'s ``nnx_class`` for one call: the NNX module it builds (at
    every call) under `policy`, so that its layers compute as the linen layer's row says."""
    def build(*args: Any, **kwargs: Any) -> Any:
        return nnx_apply(nnx_class(*args, **kwargs), PolicyMap(policy), _policy_linen)

    return build


def _policy_linen(module: Any, policy: Policy) -> Any:
    """A linen module that ``flax.nnx.bridge.ToNNX`` holds, run under `policy`."""
    return PolicyLinen(module, PolicyMap(policy))


class PolicyLinen:
    """A Flax linen module under a policy: ``init`` and ``apply`` as on the module itself.

    Made by `mixedpolicy.apply_policy` from a ``flax.linen.Module``. Each submodule's policy
    is resolved at its first call (linen builds submodules lazily) by its params path
    (``"encoder.head"``), class or a built-in rule; during the call its ``dtype`` and
    ``param_dtype`` are set, floating inputs cast to the compute dtype and outputs to the
    output dtype (under ``jax.jit`` or not). An fp8 ``nn.Dense`` runs Flax's own
    ``Fp8DirectDotGeneralOp``, whose scales live in the ``_overwrite_with_gradient`` collection.

    Attributes:
      module: the linen module.
      policy_map: the `PolicyMap` it runs under.
    """

    def __init__(self, module: Any, policy_map: PolicyMap):
        self.module, self.policy_map = module, policy_map
        self._seen: dict[str, tuple[type, Resolution]] = {}
        self._warned, self._lock = False, threading.Lock()
        self._fp8 = any(p.float8_recipe is not None
                        for p in (policy_map.default, *dict(policy_map.overrides).values()) if p)
        self._head: str | None = None

    def init(self, rngs: Any, *args: Any, **kwargs: Any) -> Any:
        """``module.init`` under the policy: parameters come out in their variable dtype."""
        return self._run(self.module.init, rngs, *args, **kwargs)

    def init_with_output(self, rngs: Any, *args: Any, **kwargs: Any) -> Any:
        """``module.init_with_output`` under the policy."""
        return self._run(self.module.init_with_output, rngs, *args, **kwargs)

    def apply(self, variables: Any, *args: Any, **kwargs: Any) -> Any:
        """``module.apply`` under the policy (jit it as you would the module's)."""
        return self._run(self.module.apply, variables, *args, **kwargs)

    def _run(self, fn: Any, first: Any, *args: Any, **kwargs: Any) -> Any:
        import flax.linen as nn

        if self._fp8 and self._head is None:  # fp8's head rule: the last Dense, seen by one trace
            dense: list = []

            def record(next_fun: Any, a: tuple, k: dict, context: Any) -> Any:
                if type(context.module) is nn.Dense and context.method_name == "__call__":
                    dense.append(dotted_path(tuple(context.module.path)))
                return next_fun(*a, **k)

            with nn.intercept_methods(record):
                jax.eval_shape(lambda: fn(first, *args, **kwargs))
            self._head = dense[-1] if dense else ""
        with nn.intercept_methods(self._intercept):
            out = fn(first, *args, **kwargs)
        if not self._warned:
            self._warned = True
            self.policy_map.warn_unmatched(self._infos())
        return out

    def _infos(self) -> list[LayerInfo]:
        import flax.linen as nn

        return [LayerInfo(path, cls, layer_kind(cls, nn)) for path, (cls, _) in self._seen.items()]

    def _resolve(self, module: Any, inputs: Any = None) -> Resolution:
        import flax.linen as nn

        keys = tuple(module.path)
        chain = []
        for i in range(len(keys)):
            seen = self._seen.get(dotted_path(keys[:i]))
            if seen is not None:
                chain.append(LayerInfo(dotted_path(keys[:i]), seen[0], layer_kind(seen[0], nn)))
        kind = layer_kind(type(module), nn) or float8.linen_kind(module, inputs, self._head, dotted_path(keys))
        chain.append(LayerInfo(dotted_path(keys), type(module), kind))
        resolution = self.policy_map.resolve(chain)
        with self._lock:
            self._seen[dotted_path(keys)] = (type(module), resolution)
        return resolution

    def _intercept(self, next_fun: Any, args: tuple, kwargs: dict, context: Any) -> Any:
        import flax.linen as nn

        module = context.module
        root_call = not module.path and type(module) is type(self.module)
        if context.method_name != "__call__" and not root_call:
            # helpers, setup of submodules, and the wrappers of lifted transforms (nn.remat,
            # nn.scan: a clone of the lifted class at path () in a scope of its own) run as
            # they are; the module they wrap is intercepted at its own path
            return next_fun(*args, **kwargs)
        policy = self._resolve(module, args[0] if args else None).policy
        fields = {f.name for f in dataclasses.fields(module)}
        changed = {}
        for name, dtype in (("dtype", policy.compute_dtype), ("param_dtype", policy.variable_dtype)):
            if name in fields:
                changed[name] = getattr(module, name)
                object.__setattr__(module, name, jnp_dtype(dtype))
        if "nnx_class" in fields and type(module).__name__ == "ToLinen":  # an NNX module in linen (bridge)
            changed["nnx_class"] = module.nnx_class
            object.__setattr__(module, "nnx_class", _under_policy(module.nnx_class, policy))
        if policy.float8_recipe is not None and type(module) is nn.Dense:  # Flax's own fp8 op
            changed["dot_general_cls"] = module.dot_general_cls
            object.__setattr__(module, "dot_general_cls",
                               float8.linen_dot_general_cls(policy.float8_recipe))
        # a recurrent cell's carry (nn.RNN's scan state): uncast, as Flax's dtype= leaves it; kept dtypes
        carry = args[:1] if isinstance(module, nn.RNNCellBase) else ()
        try:
            # Only a layer that computes in its dtype casts its inputs: a float32 layer inside a
            # half-precision model sees unrounded inputs (as Flax's dtype=float32 and NNX's do).
            if "dtype" in changed:
                args = (*carry, *cast_tree(args[len(carry):], policy.compute_dtype))
                kwargs = cast_tree(kwargs, policy.compute_dtype)
            out = next_fun(*args, **kwargs)
        finally:
            for name, value in changed.items():
                object.__setattr__(module, name, value)
        out_dtype = None if policy.output_dtype == policy.compute_dtype else policy.output_dtype
        if carry and isinstance(out, tuple) and len(out) == 2:
            return (jax.tree_util.tree_map(lambda new, old: new.astype(old.dtype), out[0], carry[0]),
                    out[1] if out_dtype is None else cast_tree(out[1], out_dtype))
        return out if out_dtype is None else cast_tree(out, out_dtype)  # None: as the layers made it

    def has_run(self) -> bool:
        """Whether an init or apply has run, so that `describe_rows` can list the layers."""
        return bool(self._seen)

    def describe_rows(self) -> list:
        if not self._seen:
            raise ValueError(
                f"describe needs one init or apply call of this PolicyLinen first: linen "
                f"builds the submodules of {type(self.module).__name__} only when called.")
        dense = sys.modules["flax.linen"].Dense  # Flax's fp8 op goes on Dense alone; rows in call order
        return [LayerPolicy(path, cls.__name__, r.policy, r.source, runs_float8=cls is dense)
                for path, (cls, r) in self._seen.items()]

    def __repr__(self) -> str:
        return f"PolicyLinen({self.module!r}, {self.policy_map!r})"
