"""Reducing gradients across ``tf.distribute`` replicas in a policy's ``reduce_dtype``.

`all_reduce(grads, variables, policy)` is called in a replica context (inside
``strategy.run``, e.g. ``MirroredStrategy``): each gradient is cast to its variable's
reduce dtype, summed over the replicas by the strategy's own ``all_reduce`` (one call per
dtype, batched as Keras batches its float32 one), and cast back. float16 travels divided
by the replica count (the sum cannot overflow) and is multiplied back after. A float32
reduce is the very call Keras's TensorFlow optimizers make, so it is bit for bit theirs.

TensorFlow carries float32, bfloat16 and float16. Its collectives cannot carry float8
tensors (TensorFlow cannot even bitcast them to bytes), and table-N codes would be a
hand-rolled format: those reduce dtypes are refused here, naming the engines that carry
them (PyTorch DDP, JAX).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import tensorflow as tf

from mixedpolicy._dtypes import refuse_uncarried, show
from mixedpolicy.layer_plan import attribute_type_at, check_class_keys, reduce_dtypes_at

#: The reduce dtypes TensorFlow's collectives carry.
CARRIED = ("float32", "bfloat16", "float16")


def variable_path(variable: Any) -> str:
    """A variable's path as a `PolicyMap` resolves it: a Keras variable's ``path``
    (``"sequential/dense/kernel"``, its layer's path as `describe` shows it, then its name),
    a tf.Variable's name without its ``:0``."""
    return getattr(variable, "path", None) or variable.name.split(":")[0]


def reduce_dtypes(variables: Sequence[Any], policy: Any, model: Any = None) -> list[str]:
    """The reduce dtype of each variable's gradient under `policy` (see `check_carried`); with
    `model`, each variable resolved at its path in the model, its layers' classes known."""
    if model is None:
        check_class_keys(policy, "tf.distribute without model=",
                         "or pass model= (the tf.Module or Keras model the variables belong to)")
        dtypes = reduce_dtypes_at(policy, [variable_path(v) for v in variables], sep="/", root=False)
    else:
        dtypes = _reduce_dtypes_in(model, variables, policy)
    check_carried(dtypes, "tf.distribute")
    return dtypes


def _reduce_dtypes_in(model: Any, variables: Sequence[Any], policy: Any) -> list[str]:
    """A Keras model: its variables' paths and its layers' classes by path (``"dense/kernel"``,
    as `describe` shows Keras layers). A ``tf.Module``: each variable's attribute path
    (``"body.0.w"``, as `describe` shows its modules) and the classes along it."""
    layers = getattr(model, "_flatten_layers", None)
    if callable(layers) and all(getattr(v, "path", None) for v in variables):
        classes = {layer.path: type(layer) for layer in layers(include_self=True)}
        return reduce_dtypes_at(policy, [variable_path(v) for v in variables], sep="/", root=False,
                                type_at=classes.get)
    if not isinstance(model, tf.Module):
        raise TypeError(f"Received model={show(model)} of type {type(model).__name__}; expected the "
                        f"tf.Module or Keras model the variables belong to.")
    paths = {id(v): ".".join(map(str, path)) for path, v in model._flatten(
        predicate=lambda x: isinstance(x, tf.Variable), with_path=True)}
    missing = [v.name for v in variables if id(v) not in paths]
    if missing:
        raise ValueError(f"Received variables {missing[:5]} that are not in model={type(model).__name__} "
                         f"(expected the variables of the model given, as its trainable_variables lists them).")
    return reduce_dtypes_at(policy, [paths[id(v)] for v in variables], type_at=attribute_type_at(model))


def check_carried(dtypes: Sequence[str], where: str) -> None:
    """Refuses a reduce dtype TensorFlow's collectives cannot carry, naming what they can."""
    refuse_uncarried(dtypes, f"reduce dtypes for gradients reduced by {where}", where, CARRIED,
                     why="; TensorFlow's collectives cannot carry float8 tensors, and table codecs need a byte "
                         "format of their own")


def all_reduce(grads: Sequence[Any], variables: Sequence[Any], policy: Any = None, *, model: Any = None) -> list:
    """The sum over the replicas of each gradient, each travelling in its reduce dtype.

    Args:
      grads: the gradients of `variables` (None entries pass through).
      variables: the variables, whose paths resolve a `PolicyMap`.
      policy: a `Policy`, a name or a `PolicyMap`; None uses the global policy.
      model: the ``tf.Module`` or Keras model the variables belong to: a map's keys then name
        what `describe` prints for it (a tf.Module's attribute paths, ``"body.0"``), and its
        layer-class keys reach the layers of that class. Without it, keys name the variables'
        own paths (a Keras variable's ``path``, a tf.Variable's name) and class keys that
        decide a reduce dtype are refused.

    Returns:
      The summed gradients, each in its own dtype (as Keras's optimizers sum them); with
      one replica (no strategy) the gradients as they are.

    Raises:
      RuntimeError: not called in a replica context of a tf.distribute strategy.
      ValueError: a reduce dtype TensorFlow cannot carry (see `check_carried`).
    """
    from mixedpolicy.scope import global_policy

    context = tf.distribute.get_replica_context()
    if context is None:
        raise RuntimeError("mp.tensorflow.all_reduce was called in a cross-replica context; call it "
                           "inside strategy.run(...), where each replica has its gradients.")
    try:
        grads = list(grads)
    except TypeError:
        raise TypeError(f"Received grads of type {type(grads).__name__}; expected a list, the gradients "
                        f"as tape.gradient returns them.") from None
    variables = _variables(variables)
    if len(grads) != len(variables):
        raise ValueError(f"Received {len(grads)} gradients for {len(variables)} variables; expected "
                         f"one gradient (or None) per variable.")
    dtypes = reduce_dtypes(variables, global_policy() if policy is None else policy, model)
    if context.num_replicas_in_sync == 1:  # nothing travels (outside a strategy too)
        return grads
    return sum_in(grads, dtypes, context)


def sum_in(grads: list, dtypes: Sequence[str], context: Any) -> list:
    """The sum over `context`'s replicas of each gradient in its reduce dtype (see
    `all_reduce`, which resolves the dtypes and checks the context)."""
    n = float(context.num_replicas_in_sync)
    out = list(grads)
    for dtype in dict.fromkeys(dtypes):
        chosen = [i for i, (g, d) in enumerate(zip(grads, dtypes))
                  if d == dtype and g is not None and g.dtype.is_floating]
        if not chosen:
            continue
        if all(grads[i].dtype.name == dtype for i in chosen):  # no cast: the engine's own call
            summed = context.all_reduce(tf.distribute.ReduceOp.SUM, [grads[i] for i in chosen])
            for i, s in zip(chosen, summed):
                out[i] = s
            continue
        wire = tf.as_dtype(dtype)
        divide = dtype == "float16" and n > 1  # divided before the cast: the sum cannot overflow
        sent = [tf.cast(grads[i] / n if divide else grads[i], wire) for i in chosen]
        summed = context.all_reduce(tf.distribute.ReduceOp.SUM, sent)
        for i, s in zip(chosen, summed):
            back = tf.cast(s, grads[i].dtype)
            out[i] = back * n if divide else back
    return out


def _variables(variables: Any) -> list:
    """`variables` as a list, each a variable (a tf.Variable or a Keras variable); else a TypeError."""
    if isinstance(variables, (str, bytes)) or not hasattr(variables, "__iter__"):
        raise TypeError(f"Received variables={show(variables)} of type {type(variables).__name__}; expected "
                        f"a list of variables, as model.trainable_variables gives it.")
    variables = list(variables)
    for v in variables:
        if not (hasattr(v, "shape") and hasattr(v, "dtype") and (hasattr(v, "path") or hasattr(v, "name"))):
            raise TypeError(f"Received {show(v)} of type {type(v).__name__} among the variables; expected "
                            f"tf.Variable or Keras variables, as model.trainable_variables gives them.")
    return variables


def bytes_per_step(variables: Sequence[Any], policy: Any = None, *, model: Any = None) -> int:
    """Bytes one replica sends to reduce the gradients of `variables` once (`model` as for
    `all_reduce`)."""
    from mixedpolicy.codecs import wire_bytes
    from mixedpolicy.scope import global_policy

    variables = _variables(variables)
    dtypes = reduce_dtypes(variables, global_policy() if policy is None else policy, model)
    return sum(wire_bytes(int(math.prod(v.shape)), d) for v, d in zip(variables, dtypes)
               if tf.as_dtype(v.dtype).is_floating)
