"""Policies on Flax NNX modules, which are mutable: `nnx_apply` sets ``dtype`` / ``param_dtype``
on each submodule that has them, casts existing parameters to the variable dtype, gives a layer
whose output dtype differs a subclass that casts its outputs, and fp8 layers a ``dot_general``
hook (float8.py); a static record of it (kept through ``nnx.jit``, ``nnx.split`` /
``nnx.merge``) lets `nnx_remove` restore it all. Layer paths are module paths joined with dots
(``"blocks.0.linear"``). A linen module held by ``flax.nnx.bridge.ToNNX`` runs under its own
path's policy through a `PolicyLinen` (its layers inside listed by `describe` below it)."""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

from mixedpolicy.backends._subclass import policy_subclass
from mixedpolicy.backends.jax import float8
from mixedpolicy.backends.jax.arrays import Kept, dtype_name, jnp_dtype, restore_leaf
from mixedpolicy.backends.jax.flax_common import cast_tree, dotted_path, layer_kind
from mixedpolicy.layer_plan import dotted_chains, join, plan
from mixedpolicy.policy import Policy
from mixedpolicy.policy_map import LayerInfo, PolicyMap
from mixedpolicy.table import LayerPolicy, unapplied_source

_STATE = "_mixedpolicy"


class _Applied(NamedTuple):
    """What apply_policy changed on one NNX module: static, hashable, restorable."""

    policy: Policy
    source: str
    dtype: Any               # the module's dtype attribute before, or a sentinel
    param_dtype: Any         # ... and its param_dtype
    cls: type                # its class before a swap
    variables: tuple         # (attribute, dtype name) of variables cast
    originals: Any = None    # a Kept of their values before a narrowing cast
    dot_general: Any = "<missing>"  # an nnx.Linear's own dot_general, where fp8 replaced it
    linen: Any = "<missing>"        # a bridge's own linen module, where a PolicyLinen holds it


_MISSING = "<missing>"


def _bridge(module: Any) -> bool:
    """Is `module` a ``flax.nnx.bridge.ToNNX``? It holds a linen module and turns its other
    attributes into linen variables at each call, all but those named ``to_nnx__...``."""
    return "to_nnx__module" in vars(module)


def _state_name(module: Any) -> str:
    return "to_nnx__mixedpolicy" if _bridge(module) else _STATE


def _applied(module: Any) -> Any:
    return vars(module).get(_state_name(module))


def _cast_outputs(module: Any, call_super: Any, args: tuple, kwargs: dict) -> Any:
    """``__call__`` of a swapped NNX class: floating outputs leave in the output dtype."""
    return cast_tree(call_super(*args, **kwargs), _applied(module).policy.output_dtype)


def _nnx_modules(model: Any) -> list[tuple[str, Any]]:
    """(dotted path, module) for the module and every submodule, parents first."""
    from flax import nnx

    found = list(nnx.iter_modules(model))
    found.sort(key=lambda item: len(item[0]))
    return [(dotted_path(keys), module) for keys, module in found]


def _own_variables(module: Any) -> list[tuple[str, Any]]:
    """The parameters and batch statistics held directly by `module` (not by a submodule)."""
    from flax import nnx

    return [(name, value) for name, value in vars(module).items()
            if isinstance(value, (nnx.Param, nnx.BatchStat))]


def _nnx_plan(model: Any, policy_map: PolicyMap, before: bool = False) -> tuple:
    """(the plan's steps, fp8 recipes by path), checked; `before`: with the variables' dtypes
    as the policy on the model found them (a new policy is checked before the old comes off)."""
    from flax import nnx

    head = float8.head(model)
    layers = dotted_chains((path, module, LayerInfo(path, type(module), layer_kind(type(module), nnx)
                                                    or float8.kind(module, head, bool(_own_variables(module))),
                                                    matmul=float8.matmul(module)))
                           for path, module in _nnx_modules(model))

    def variables(module: Any, path: str) -> list:
        found = dict(_applied(module).variables) if before and _applied(module) is not None else {}
        return [(join(path, name), found.get(name) or dtype_name(var.get_value().dtype))
                for name, var in _own_variables(module)]

    with warnings.catch_warnings(record=before):  # (a check's warnings come once, from the real plan)
        steps = plan(policy_map, layers, fix="Create the module with param_dtype=jnp.float32", variables=variables)
    fp8 = {step.path: step.policy.float8_recipe for step in steps
           if step.policy.float8_recipe is not None and float8.eligible(step.layer)}
    for path, recipe in fp8.items():  # refused before anything changes
        float8.check(recipe, path)
    return steps, fp8


def nnx_apply(model: Any, policy_map: PolicyMap, wrap_linen: Any = None) -> Any:
    """Puts `policy_map` on the NNX `model`; `wrap_linen(module, policy)` gives the linen module
    a ``ToNNX`` bridge holds its path's policy (flax.py passes a `PolicyLinen`)."""
    if any(_applied(module) is not None for _, module in _nnx_modules(model)):
        _nnx_plan(model, policy_map, before=True)  # a refusal leaves the policy the model has
    nnx_remove(model)
    steps, fp8 = _nnx_plan(model, policy_map)
    for step in steps:
        module, policy, resolution = step.layer, step.policy, step.resolution
        before_dtype = getattr(module, "dtype", _MISSING)
        before_param = getattr(module, "param_dtype", _MISSING)
        if before_dtype is not _MISSING:
            module.dtype = jnp_dtype(policy.compute_dtype)
        if before_param is not _MISSING:
            module.param_dtype = jnp_dtype(policy.variable_dtype)
        cast, kept = [], {}
        for name, var in _own_variables(module):
            dtype = dtype_name(var.get_value().dtype)
            if dtype is not None and dtype != policy.variable_dtype:
                cast.append((name, dtype))
                kept[name] = var.get_value()
                var.set_value(var.get_value().astype(jnp_dtype(policy.variable_dtype)))
        cls = type(module)
        region = step.changes_policy or before_dtype is not _MISSING
        if region and policy.output_dtype != policy.compute_dtype:
            module.__class__ = policy_subclass("jax", cls, _cast_outputs)
        before_dot = float8.attach(module, fp8[step.path]) if step.path in fp8 else _MISSING
        linen = module.to_nnx__module if _bridge(module) and wrap_linen is not None else _MISSING
        if linen is not _MISSING:  # the linen module runs under this path's policy, its rules inside
            module.to_nnx__module = wrap_linen(linen, policy)
        setattr(module, _state_name(module), _Applied(policy, resolution.source, before_dtype, before_param, cls,
                                                      tuple(cast), Kept(kept) if kept else None, before_dot, linen))
    return model


def nnx_remove(model: Any) -> Any:
    for _, module in _nnx_modules(model):
        applied = _applied(module)
        if applied is None:
            continue
        delattr(module, _state_name(module))
        module.__class__ = applied.cls
        if applied.linen is not _MISSING:
            module.to_nnx__module = applied.linen
        if applied.dtype is not _MISSING:
            module.dtype = applied.dtype
        if applied.param_dtype is not _MISSING:
            module.param_dtype = applied.param_dtype
        if applied.dot_general is not _MISSING:
            float8.detach(module, applied.dot_general)
        kept = applied.originals.arrays if applied.originals is not None else {}
        for name, dtype in applied.variables:
            var = getattr(module, name)
            var.set_value(restore_leaf(var.get_value(), kept.get(name), dtype))
    return model


def nnx_describe(model: Any) -> list:
    rows = []
    for path, module in _nnx_modules(model):
        applied = _applied(module)
        if applied is not None:
            policy, source, cls = applied.policy, applied.source, applied.cls
        else:
            variable = dtype_name(getattr(module, "param_dtype", None)) or "float32"
            compute = dtype_name(getattr(module, "dtype", None)) or variable
            policy = Policy(f"params={variable},compute={compute},output={compute}")
            source, cls = unapplied_source(policy, "its own dtype/param_dtype"), type(module)
        rows.append(LayerPolicy(path, cls.__name__, policy, source, applied is not None and applied.dot_general is not _MISSING))
        if applied is not None and applied.linen is not _MISSING and module.to_nnx__module.has_run():
            rows += [row._replace(path=join(path, row.path))  # the linen layers it has run, by their paths
                     for row in module.to_nnx__module.describe_rows() if row.path]
    return rows
