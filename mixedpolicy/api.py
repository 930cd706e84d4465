"""The public entry points that dispatch a model to its framework's adapter: `apply_policy`,
`remove_policy`, `describe` (the optimizer's is `mixedpolicy.optimizer.LossScaleOptimizer`)."""

from __future__ import annotations

import gc
import logging
import weakref
from typing import Any, Mapping

from mixedpolicy import _registry
from mixedpolicy.table import LayerPolicy, PolicyTable
from mixedpolicy.function import PolicyFunction
from mixedpolicy.policy_map import PolicyMap, as_policy_map
from mixedpolicy.scope import global_policy

_log = logging.getLogger("mixedpolicy")
# (framework, a weak reference to the model apply_policy returned (or None: kept while the process
# runs), what it is) for each model given a policy computing in float16 (`float16_models`)
_FLOAT16: list = []


def _note_float16(framework: str | None, model: Any, policies: tuple) -> None:
    names = sorted({p.name for p in policies if p.compute_dtype == "float16"})
    if framework is None or not names:
        return
    try:
        ref: Any = weakref.ref(model)
    except TypeError:
        ref = None
    _FLOAT16[:] = [n for n in _FLOAT16 if n[1] is None or n[1]() is not None][-15:]
    _FLOAT16.append((framework, ref, f"{type(model).__name__} {', '.join(map(repr, names))}"))


def float16_models(frameworks: tuple) -> list:
    """What each live model of `frameworks` that `apply_policy` gave a float16-computing policy is
    ("PolicyLinen 'mixed_float16'"): an optimizer of a framework that cannot see its model
    warns when it would scale nothing beside one (`LossScaleOptimizer`)."""
    def live() -> list:
        return [what for framework, ref, what in _FLOAT16
                if framework in frameworks and (ref is None or ref() is not None)]

    if not live():
        return []
    gc.collect()  # (rarely reached) a model dropped by its user but held in a reference cycle is gone
    return live()


def _no_adapter(obj: Any, role: str, expected: str = "") -> TypeError:
    """The error for an object no adapter owns: its type, what is supported, and the fix."""
    cls = type(obj)
    where = f"{cls.__module__}.{cls.__qualname__}"
    refused = _registry.unsupported(cls, role)
    if refused:
        return TypeError(f"Received {refused}")
    hint = ""
    if role == "optimizer" and callable(obj) and hasattr(obj, "__qualname__"):
        hint = (f" {obj.__module__}.{obj.__qualname__} builds an optimizer: call it first, for "
                f"example LossScaleOptimizer({obj.__qualname__}(1e-3)).")
    elif role == "model" and isinstance(obj, type):
        hint = f" {obj.__module__}.{obj.__qualname__} is a class: build the model first, {obj.__qualname__}(...)."
    elif role == "model":
        hint = " If the model's framework is installed but not imported yet, import it first."
    return TypeError(f"Received {'a model' if role == 'model' else 'an optimizer'} of type {where}, "
                     f"which no installed mixedpolicy adapter handles. Expected {expected}one of: "
                     f"{_registry.supported(role)}.{hint}")


def _model_adapter(model: Any, expected: str = "") -> Any:
    """The adapter that owns `model`, or a TypeError naming its type and the supported ones."""
    adapter = _registry.model_adapter(model)
    if adapter is None:
        raise _no_adapter(model, "model", expected)
    return adapter


def apply_policy(model: Any, policy: Any = None, overrides: Mapping[Any, Any] | None = None) -> Any:
    """Puts a policy, or a policy with per-layer overrides, onto a model of any framework.

    Args:
      model: a model or layer of a supported framework, or a plain function
        ``f(params, *inputs)`` of arrays.
      policy: a `Policy`, a name, or a `PolicyMap`; ``None`` uses the global policy.
      overrides: per-layer overrides, as for `PolicyMap` (not with a `PolicyMap`).

    Returns:
      The model with the policy applied: modified in place where the framework's
      models are mutable (torch, Keras, Flax NNX), a new object where they are not
      (a `PolicyLinen` for Flax linen, a tree of `PolicyModule` for Equinox: keep
      the returned value), or a `PolicyFunction` wrapping a plain function.

    Raises:
      TypeError: the model is of a type no installed adapter handles.
      ValueError: a policy the model's framework cannot run (an fp8 recipe it has no path
        for, a reduce dtype its engine cannot carry...), before anything changes.

    >>> import numpy as np
    >>> f = apply_policy(lambda w, x: w @ x, "mixed_float16")
    >>> f(np.ones((2, 2), np.float32), np.ones(2, np.float32)).dtype
    dtype('float16')
    """
    policy_map = as_policy_map(policy, overrides)
    adapter = _registry.model_adapter(model)
    fp8 = sorted({p.name for p in _policies_in(policy_map) if p.float8_recipe is not None})
    if adapter is None and callable(model) and not isinstance(model, type):
        result = PolicyFunction(model, policy_map)  # checks its fp8 recipe itself
        framework: str | None = "function"
    else:
        adapter = adapter or _model_adapter(model, "a plain function of arrays, or ")
        _check_float8(fp8, adapter, type(model).__name__)
        result = adapter.apply_policy(model, policy_map)
        framework = _registry.framework_of(model)
        _log.debug("apply_policy(%s): %s", type(model).__name__, policy_map)
    _note_float16(framework, result, _policies_in(policy_map))
    return result


def _check_float8(names: list, adapter: Any, what: str) -> None:
    """Refuses fp8 policies where the framework has no fp8 path here yet, before anything changes."""
    if names and not getattr(adapter, "runs_float8", False):
        raise ValueError(
            f"Received the fp8 polic{'ies' if len(names) > 1 else 'y'} {', '.join(names)} for {what}: "
            f"mixedpolicy runs fp8 matmuls on torch (torchao), Keras (Dense, EinsumDense), "
            f"Flax (nnx.Linear, linen's nn.Dense), Equinox (eqx.nn.Linear) and plain JAX "
            f"functions only so far. Use the source "
            f"policy here (policy.source, e.g. 'mixed_bfloat16'); nothing was applied.")


def _policies_in(policy_map: PolicyMap) -> tuple:
    return (policy_map.default or global_policy(), *(p for _, p in policy_map.overrides))


def remove_policy(model: Any) -> Any:
    """Undoes `apply_policy` on a model: its forwards and variable dtypes are restored.

    A `PolicyFunction` gives back the function it wraps, a `PolicyLinen` its module,
    and an Equinox `PolicyModule` tree the plain module (keep the returned value).

    Raises:
      TypeError: the model is of a type no installed adapter handles.
    """
    if isinstance(model, PolicyFunction):
        return model.fn
    return _model_adapter(model).remove_policy(model)


def describe(model: Any) -> PolicyTable:
    """Returns the per-layer table of a model: path, type, dtypes and where each policy came from.

    Raises:
      TypeError: the model is of a type no installed adapter handles.
    """
    if isinstance(model, PolicyFunction):
        name = getattr(model.fn, "__name__", type(model.fn).__name__)
        return PolicyTable([LayerPolicy("", f"function {name}", model.policy, model.source)])
    return PolicyTable(_model_adapter(model, "the result of apply_policy on a function, or ").describe(model))
