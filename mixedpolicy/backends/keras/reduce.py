"""Keras on TensorFlow: gradients summed across tf.distribute replicas in a reduce dtype.

This package's Keras `LossScaleOptimizer` takes a ``reduce_policy``; under a strategy it
sums the gradients in that policy's reduce dtypes (`mixedpolicy.tensorflow.all_reduce`)
and leaves out the inner optimizer's own float32 sum. Keras's JAX and torch backends
reduce in the variable dtype through Keras's own distribution: a reduce dtype other than
the variables' is refused there. The step's finite flag lives here too: counted over the
gradients (`all_finite`), agreed across replicas, and read on the host where it is concrete.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import keras
from keras import ops

from mixedpolicy._dtypes import finite_groups, refuse_uncarried, show
from mixedpolicy.policy import Policy, as_policy
from mixedpolicy.layer_plan import check_class_keys
from mixedpolicy.policy_map import PolicyMap


def reduce_engine() -> tuple[str, tuple[str, ...]]:
    """What carries a Keras model's gradients across replicas: on TensorFlow, tf.distribute
    (through this package's LossScaleOptimizer, see `mp.tensorflow.all_reduce`); on JAX and
    torch, Keras's own distribution, which reduces in the variable dtype."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        from mixedpolicy.backends.tensorflow.reduce import CARRIED

        return "Keras on TensorFlow (tf.distribute)", CARRIED
    return f"Keras on {backend}", ()


def check_reduce_policy(policy: Any) -> Any:
    """The reduce policy as a `Policy` or `PolicyMap` (None stays None), refused where this
    backend cannot carry its reduce dtypes."""
    if policy is None:
        return None
    resolved = policy if isinstance(policy, PolicyMap) else as_policy(policy, what="reduce_policy")
    check_class_keys(resolved, "a Keras optimizer", "or give the map to apply_policy, whose compile "
                     "carries it with the model's layer classes")
    policies = ([resolved.default] + [p for _, p in resolved.overrides] if isinstance(resolved, PolicyMap)
                else [resolved])
    engine, carried = reduce_engine()
    for p in policies:
        if p is not None:
            refuse_uncarried([p.reduce_dtype], f"reduce_policy with reduce dtype {p.reduce_dtype}", engine,
                             tuple(dict.fromkeys(("float32",) + carried)))
    return resolved


def by_layer_path(policy_map: PolicyMap, steps: Any) -> PolicyMap:
    """`policy_map` with its layer-class keys replaced by the paths of the layers they
    resolved to in `steps` (the planned layers of a model): what an optimizer, which sees
    variables by path only, can resolve. A map without class keys is returned as it is."""
    if not any(isinstance(k, type) for k, _ in policy_map.overrides):
        return policy_map
    keys = {k: p for k, p in policy_map.overrides if not isinstance(k, type)}
    for step in steps:
        if step.path and step.path not in keys:  # every layer pinned to what it resolved to
            keys[step.path] = step.policy
    return PolicyMap(policy_map.default, keys)


def reduce_to_config(policy: Any) -> Any:
    """The reduce policy as a config: a policy name, or {"default", "overrides"} for a
    `PolicyMap` keyed by paths and globs (a map keyed by layer classes has no config: it is
    left out, and the loaded optimizer reduces in float32 until one is given again)."""
    if isinstance(policy, Policy):
        return policy.name if policy.reduce_dtype != "float32" else None
    if isinstance(policy, PolicyMap) and all(isinstance(k, str) for k, _ in policy.overrides):
        if all(p.reduce_dtype == "float32" for p in [policy.default, *(p for _, p in policy.overrides)]
               if p is not None):
            return None
        return {"default": None if policy.default is None else policy.default.name,
                "overrides": {k: p.name for k, p in policy.overrides}}
    return None


def reduce_from_config(config: Any) -> Any:
    if isinstance(config, dict):
        return PolicyMap(config.get("default"), config.get("overrides") or {})
    return config


@contextlib.contextmanager
def already_summed(optimizer: Any, summed: bool) -> Iterator[None]:
    """While `summed`, the inner (TensorFlow-backend) optimizer takes the gradients as they
    come instead of summing them over the replicas a second time."""
    if not summed:
        yield
        return
    if not hasattr(optimizer, "_all_reduce_sum_gradients"):
        raise RuntimeError(f"This Keras version's {type(optimizer).__name__} has no "
                           f"_all_reduce_sum_gradients to leave out, so gradients summed in the reduce "
                           f"dtype would be summed again; use a float32 reduce_dtype with it.")
    optimizer.__dict__["_all_reduce_sum_gradients"] = list  # this instance only (Keras tracks setattr)
    try:
        yield
    finally:
        optimizer.__dict__.pop("_all_reduce_sum_gradients", None)


def _is_tensor_like(x: Any) -> bool:
    return hasattr(x, "dtype") and hasattr(x, "shape") and not isinstance(x, (str, bytes))


def check_loss(loss: Any) -> None:
    """Refuses a loss that is no tensor or number (a string, a dict...) with what was received."""
    if _is_tensor_like(loss) or (isinstance(loss, (int, float)) and not isinstance(loss, bool)):
        return
    raise TypeError(f"Received a loss of type {type(loss).__name__} ({loss!r:.60}); expected the scalar "
                    f"loss tensor of this step (or a number).")


def check_gradients(grads: Any, variables: Any) -> None:
    """Refuses gradients that are not one tensor (or None) per variable, before any is used."""
    if isinstance(grads, (list, tuple)) and all(g is None or _is_tensor_like(g) for g in grads):
        if variables is None or len(grads) == len(variables):
            return
        raise ValueError(f"Received {len(grads)} gradients for {len(variables)} trainable variables; "
                         f"expected one gradient (or None) per variable, in the variables' order.")
    odd = grads if not isinstance(grads, (list, tuple)) else next(g for g in grads if not _is_tensor_like(g))
    raise TypeError(f"Received gradients {show(grads, 60)} holding {type(odd).__name__}; expected a list "
                    f"of gradient tensors (None for a variable without one), one per trainable variable, "
                    f"as tape.gradient(loss, model.trainable_variables) returns.")


def _static_size(x: Any) -> int | None:
    """The number of elements of `x`, None where its shape is not known until run time."""
    shape = tuple(x.shape)
    return None if any(d is None for d in shape) else math.prod(shape)


def all_finite(grads: Any) -> Any:
    """A boolean scalar tensor: are all the gradients (None skipped) free of inf and NaN?

    The check mixedpolicy makes on the backend's own tensors (`mixedpolicy.all_finite`): a large
    gradient read in place, small ones a group at a time. Through ``keras.ops`` every group was
    concatenated, which cost XLA:CPU 350 us over an MLP's 151k gradient values where JAX's own
    check takes 24 (torch 363 against 119). On TensorFlow with numpy gradients given to ``apply``,
    a group of gradients at a time (`finite_groups`), over their values concatenated, counted by
    a dot product, not ``all`` of the stacked flags as Keras's own check: XLA copies that chain of
    ands into every fusion that reads the flag, a compile time quadratic in the number of
    weights."""
    present = [g for g in grads if g is not None]
    backend = keras.backend.backend()
    if backend == "jax":
        from mixedpolicy.backends.jax.arrays import all_finite as check

        return check(present)
    if backend == "torch":
        from mixedpolicy.backends.torch.arrays import TorchArrays

        return TorchArrays().all_finite(present)
    if backend == "tensorflow" and all(ops.is_tensor(g) for g in present):
        import tensorflow as tf

        from mixedpolicy.backends.tensorflow.arrays import TensorFlowArrays

        # an embedding's gradient (tf.IndexedSlices): its values are what it holds
        return TensorFlowArrays().all_finite([g.values if isinstance(g, tf.IndexedSlices) else g for g in present])
    flags = [ops.all(ops.isfinite(ops.concatenate([ops.reshape(g, (-1,)) for g in group])))
             for group in finite_groups(present, _static_size)]
    if len(flags) < 2:
        return flags[0] if flags else ops.convert_to_tensor(True)
    counted = ops.dot(ops.cast(ops.stack(flags), "float32"), ops.ones((len(flags),), "float32"))
    return ops.equal(counted, float(len(flags)))  # exact: a float32 counts up to 2**24


def is_concrete(x: Any) -> bool:
    """Can `x` (the finite flag) be read on the host now (eager), rather than being traced into a graph?"""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return not isinstance(x, jax.core.Tracer)
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.executing_eagerly()
    return True


def finite_on_every_replica(finite: Any) -> Any:
    """Under ``tf.distribute`` with several replicas, `finite` all-reduced: one replica's
    overflow makes every replica skip. Elsewhere `finite` itself."""
    if keras.backend.backend() != "tensorflow":
        return finite
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync <= 1:
        return finite
    return tf.equal(context.all_reduce("sum", tf.cast(tf.logical_not(finite), tf.float32)), 0.0)


def sum_across_replicas(grads: Any, variables: Any, reduce_policy: Any) -> tuple[Any, bool]:
    """(the gradients summed over the tf.distribute replicas in their reduce dtypes, True),
    or (the gradients, False) where Keras's own float32 sum stands (no reduce policy, another
    backend, one replica, or float32 everywhere)."""
    if reduce_policy is None or keras.backend.backend() != "tensorflow":
        return grads, False
    import tensorflow as tf

    from mixedpolicy.backends.tensorflow.reduce import reduce_dtypes, sum_in

    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync < 2:
        return grads, False
    dtypes = reduce_dtypes(list(variables), reduce_policy)
    if all(d == "float32" for d in dtypes):
        return grads, False
    return sum_in(list(grads), dtypes, context), True
