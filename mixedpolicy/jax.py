"""JAX: reducing gradients across replicas (``shard_map``, ``pmap``) in a policy's reduce dtype,
the optax transformations that carry a policy's update recipe (the `LossScaleOptimizer`
chains them itself; these are for a chain written by hand), and the training step of a Flax
NNX model with delayed-scaling fp8 layers or of a plain function's delayed fp8 state.

Importing this module imports JAX and optax (Flax on the first call of the fp8 functions).
"""

from typing import Any

from mixedpolicy.backends.jax.reduce import all_reduce, bytes_per_step
from mixedpolicy.backends.jax.updates import state_storage, update_rounding

__all__ = ["all_reduce", "bytes_per_step", "state_storage", "update_rounding", "with_float8", "update_float8"]


def with_float8(params: Any = None) -> Any:
    """The ``nnx`` filter a training step differentiates by when a Flax NNX model has
    delayed-scaling fp8 layers: `params` (default ``nnx.Param``) and the layers' fp8 state
    (their scales and amax histories, of type ``Float8Meta``).

    Those values move only through their "gradients", which hold their next values (the
    output gradient's amax exists only in the backward pass); a step that differentiates the
    kernels but not them is refused when it is traced. See `update_float8`::

        grads = nnx.grad(loss_fn, argnums=nnx.DiffState(0, mp.jax.with_float8()))(model, x, y)
        optimizer.update(model, grads)  # nnx.Optimizer(model, tx, wrt=nnx.Param)
        mp.jax.update_float8(model, grads, optimizer)

    Args:
      params: the filter of what the optimizer trains (``nnx.Param``, ``nnx.LoRAParam``...).
    """
    from mixedpolicy.backends.jax.float8 import with_float8 as build

    filters = params if isinstance(params, (tuple, list)) else (params,)
    if not all(f is None or f is ... or isinstance(f, (type, str, bool)) or callable(f) for f in filters):
        raise TypeError(f"Received params={params!r:.80} of type {type(params).__name__}; expected an nnx "
                        f"filter of what the optimizer trains, such as nnx.Param or nnx.LoRAParam.")
    return build(params)


def update_float8(model: Any, grads: Any, optimizer: Any = None, axis_name: Any = None) -> Any:
    """Overwrites the fp8 scales and amax histories of `model`'s delayed-scaling layers with
    the values `grads` holds for them (taken with `with_float8`), as Keras's optimizers and
    Flax's ``_overwrite_with_gradient`` collection do; exact, never an optimizer's update.

    For a plain function under delayed scaling, `model` is the state it was called with
    (``float8_state``, from ``init_float8``) and `grads` that state's gradient: the new state
    is returned (the old one where the step was skipped), nothing is changed in place::

        (loss, (g, new)) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, state)
        updates, opt_state = tx.update(g, opt_state, params)
        state = mp.jax.update_float8(state, new, opt_state)

    Args:
      model: the Flax NNX model, or a plain function's fp8 state.
      grads: what ``nnx.grad(..., argnums=nnx.DiffState(0, mp.jax.with_float8()))`` returned,
        or the gradient of the function's state.
      optimizer: the ``nnx.Optimizer`` (or its optax state) that has just applied the step:
        where a mixedpolicy `LossScaleOptimizer` skipped it (a non-finite gradient), the fp8
        state is kept too, as the parameters were; the wrapper's state is found wherever it
        sits (inside ``optax.chain`` or ``MultiSteps`` too). Call this after ``optimizer.update``.
      axis_name: inside ``shard_map`` or ``pmap``, the replicas' axis: each replica saw its own
        inputs and output gradients, so the amax entering each history is the largest over the
        replicas (as ``DelayedFloat8Linear`` reduces it across torch ranks) and every replica
        keeps the same scales. Under ``jax.jit`` with sharded arrays the amax is already the
        whole array's.

    Returns:
      The new state for a function's state; None for a model (updated in place).

    Raises:
      TypeError: `optimizer` is an optax transformation rather than its state.
      ValueError: the model has delayed fp8 layers and `grads` holds none of their state, or a
        function's state and its gradient differ in structure.
    """
    if isinstance(model, tuple):
        from mixedpolicy.backends.jax.float8_matmul import next_state

        return next_state(model, grads, optimizer, axis_name)
    from mixedpolicy.backends.jax.float8 import update_float8 as overwrite

    overwrite(model, grads, optimizer, axis_name)
    return None
