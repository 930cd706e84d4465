"""Policies on raw TensorFlow ``tf.Module`` models.

A ``tf.Module`` has no dtype of its own: its code reads its variables and does the
math. `apply_policy` resolves each module's policy (its attribute path such as
``"encoder.layers.0"``, its class; a class named ``...Norm`` or ``...Normalization``
gets the built-in normalisation rule) and, where a module must compute in another
dtype than its variables or its parent, swaps its class for a subclass (same name,
``isinstance`` holds) whose ``__call__``:

- casts floating tensor inputs to the compute dtype;
- for the call, shows the module's own floating variables cast to the compute
  dtype (``tf.cast`` of the variable, so gradients reach the float32 variable);
- casts floating outputs to the output dtype where it differs from the compute dtype.

This runs at trace time under ``tf.function`` and ``jit_compile=True``. Pure
policies (``bfloat16``) replace the variables with ones in that dtype;
`remove_policy` restores the originals (with their trained values). A float32
model is left as plain TensorFlow.

The TensorFlow optimizers of TF 2.16 and later are Keras 3 optimizers; the Keras
adapter wraps them (`mixedpolicy.backends.keras.optimizer`), and their loss scale
runs on TensorFlow's array operations (`mixedpolicy.backends.tensorflow.arrays`).
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import tensorflow as tf

from mixedpolicy.backends._subclass import policy_subclass
from mixedpolicy._adapter import ModelAdapter
from mixedpolicy.backends.tensorflow.arrays import NAMES as _NAMES, TF_DTYPES as _TF_DTYPES
from mixedpolicy.backends.tensorflow.reduce import CARRIED
from mixedpolicy.table import NOT_APPLIED, LayerPolicy
from mixedpolicy.policy import Policy
from mixedpolicy.layer_plan import dotted_chains, join, plan
from mixedpolicy.policy_map import NORMALIZATION, LayerInfo, PolicyMap

_STATE = "_mixedpolicy"

class TensorFlowModules(ModelAdapter):
    def is_model(self, obj: Any) -> bool:
        return isinstance(obj, tf.Module)

    def apply_policy(self, model: Any, policy_map: Any) -> Any:
        return apply_policy(model, policy_map)

    def remove_policy(self, model: Any) -> Any:
        return remove_policy(model)

    def describe(self, model: Any) -> list:
        rows = []
        for path, module in _modules(model):
            state = module.__dict__.get(_STATE)
            if state is not None:
                policy, source, cls = state.policy, state.source, state.cls
            else:
                dtypes = {_NAMES.get(v.dtype) for v in _own_variables(module).values()} - {None}
                policy = Policy(dtypes.pop() if len(dtypes) == 1 else "float32")
                source, cls = NOT_APPLIED, type(module)
            rows.append(LayerPolicy(path, cls.__name__, policy, source))
        return rows


class _Applied(NamedTuple):
    policy: Policy
    source: str
    cls: type                  # the class before a swap
    cast: tuple                # names of own variables shown in the compute dtype
    replaced: dict             # name -> original variable, for pure policies
    variables: dict            # name -> the variable each cast name stands for
    lock: Any                  # one call at a time swaps the variables (threads)


def _modules(model: tf.Module) -> list[tuple[str, tf.Module]]:
    """(dotted attribute path, module) for the model and its submodules, parents first."""
    found = model._flatten(predicate=lambda m: isinstance(m, tf.Module), with_path=True)
    subs = sorted(((".".join(str(k) for k in path), m) for path, m in found),
                  key=lambda item: item[0].count(".") if item[0] else -1)
    seen, out = set(), []
    for path, module in [("", model)] + subs:
        if id(module) not in seen:  # a module reachable twice keeps its first path
            seen.add(id(module))
            out.append((path, module))
    return out


def _kind(cls: type) -> str | None:
    """Raw TensorFlow has no normalisation classes: a module class named like one
    (``LayerNorm``, ``BatchNorm``, ``RMSNorm``, ``GroupNormalization``) gets the norm rule."""
    return NORMALIZATION if cls.__name__.endswith(("Norm", "Normalization")) else None


def _own_variables(module: tf.Module) -> dict[str, tf.Variable]:
    """The floating variables held directly as attributes of `module`."""
    return {name: value for name, value in vars(module).items()
            if isinstance(value, tf.Variable) and value.dtype.is_floating and name != _STATE}


def _call_under_policy(module: tf.Module, call_super: Any, args: tuple, kwargs: dict) -> Any:
    """``__call__`` of a swapped tf.Module class (see the module docstring)."""
    state = module.__dict__[_STATE]
    compute = _TF_DTYPES[state.policy.compute_dtype]
    args, kwargs = cast_floating((args, kwargs), compute)
    if state.cast:
        # The swap is held under the module's lock and undone from the variables recorded
        # at apply time, so calls from several threads can neither see each other's cast
        # copies nor leave one behind in place of a variable.
        with state.lock:
            for name in state.cast:
                module.__dict__[name] = tf.cast(state.variables[name], compute)  # this call only
            try:
                out = call_super(*args, **kwargs)
            finally:
                module.__dict__.update(state.variables)
    else:
        out = call_super(*args, **kwargs)
    if state.policy.output_dtype != state.policy.compute_dtype:
        out = cast_floating(out, _TF_DTYPES[state.policy.output_dtype])
    return out


def cast_floating(tree: Any, dtype: Any) -> Any:
    def leaf(x):
        if isinstance(x, (tf.Tensor, tf.Variable)) and x.dtype.is_floating and x.dtype != dtype:
            return tf.cast(x, dtype)
        return x
    return tf.nest.map_structure(leaf, tree)


def apply_policy(model: tf.Module, policy_map: PolicyMap) -> tf.Module:
    remove_policy(model)
    layers = dotted_chains((path, module, LayerInfo(path, type(module), _kind(type(module))))
                           for path, module in _modules(model))
    steps = plan(policy_map, layers, fix="Create the variables in float32",
                 reduce_engine=("tf.distribute", CARRIED),
                 variables=lambda module, path: [(join(path, name), _NAMES.get(var.dtype))
                                                 for name, var in _own_variables(module).items()])
    for step in steps:
        module, policy = step.layer, step.policy
        target = _TF_DTYPES[policy.variable_dtype]
        replaced = {}
        for name, var in _own_variables(module).items():
            if var.dtype != target:
                replaced[name] = var
                setattr(module, name, tf.Variable(tf.cast(var, target), trainable=var.trainable,
                                                  name=var.name.split(":")[0]))
        cast = tuple(name for name in _own_variables(module)
                     if policy.compute_dtype != policy.variable_dtype)
        # a float32 root is plain TensorFlow; elsewhere a region where the policy changes
        differs = step.changes_policy if step.parent_policy is not None else policy != Policy("float32")
        cls = type(module)
        if cast or differs:
            module.__class__ = policy_subclass("tensorflow", cls, _call_under_policy)
        module.__dict__[_STATE] = _Applied(policy, step.resolution.source, cls, cast, replaced,
                                           {name: module.__dict__[name] for name in cast},
                                           threading.RLock())
    return model


def remove_policy(model: tf.Module) -> tf.Module:
    for _, module in _modules(model):
        state = module.__dict__.pop(_STATE, None)
        if state is None:
            continue
        module.__class__ = state.cls
        for name, original in state.replaced.items():
            # the original value wherever it is unchanged since the narrowing; a value
            # trained under the policy is kept, widened
            current = tf.convert_to_tensor(getattr(module, name))
            untouched = tf.equal(current, tf.cast(original, current.dtype))
            original.assign(tf.where(untouched, original, tf.cast(current, original.dtype)))
            setattr(module, name, original)
    return model
