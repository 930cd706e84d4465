"""A user's Flax NNX model in the bench: ``MODULE:FACTORY`` whose factory takes Flax's own
``dtype`` and ``param_dtype`` keywords, with which the hand-written side is built (see
docs/benchmarks.md, "Your own model")."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
from flax import nnx

from mixedpolicy.bench.user_model import UserSetup

COMPUTE = {"float32": jnp.float32, "mixed_bfloat16": jnp.bfloat16, "mixed_float16": jnp.float16,
           "bfloat16": jnp.bfloat16, "float16": jnp.float16}
PURE = ("bfloat16", "float16")


def _copy_state(source: nnx.Module, target: nnx.Module) -> None:
    """`source`'s parameters and batch statistics into `target`, each in `target`'s dtype."""
    kinds = (nnx.Param, nnx.BatchStat)
    target_state = nnx.state(target, kinds)
    source_state = nnx.state(source, kinds)
    if jax.tree_util.tree_structure(source_state) != jax.tree_util.tree_structure(target_state):
        raise ValueError("The factory's model has other parameters when built with dtype arguments; "
                         "they must only set the layers' dtypes (Flax's dtype and param_dtype).")
    nnx.update(target, jax.tree_util.tree_map(lambda s, t: jnp.asarray(s, t.dtype), source_state, target_state))


def user_native_kwargs(factory, policy: str) -> dict:
    """What the hand-written side of a user's Flax NNX model is built with: Flax's own
    ``dtype`` (and ``param_dtype`` for a pure policy) keyword arguments.

    Raises:
      ValueError: the factory takes no such keyword arguments.
    """
    if policy == "float32":
        return {}
    kwargs = {"dtype": COMPUTE[policy]} | ({"param_dtype": COMPUTE[policy]} if policy in PURE else {})
    params = inspect.signature(factory).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    missing = [k for k in kwargs if k not in params and not takes_all]
    if missing:
        raise ValueError(f"The Flax NNX factory {getattr(factory, '__name__', factory)}{inspect.signature(factory)} "
                         f"takes no {' or '.join(missing)} keyword argument; the bench builds the hand-written "
                         f"side of {policy} as Flax does it, with the layers' dtype=... and, for a pure "
                         f"policy, param_dtype=...: give the factory `dtype=None, param_dtype=jnp.float32` and "
                         f"pass them to its layers.")
    return kwargs


def build(model: str, policy: str) -> tuple[UserSetup, nnx.Module]:
    """(ours, native) of a user's Flax NNX ``MODULE:FACTORY``: ours as the factory gave it (with
    its own batches and loss, if it brings them), native built with Flax's dtype arguments and
    starting from ours's weights."""
    from mixedpolicy.bench.user_model import build as build_user, load_factory

    kwargs = user_native_kwargs(load_factory(model), policy)
    ours, native = build_user(model), build_user(model, **kwargs).model
    for net in (ours.model, native):
        if not isinstance(net, nnx.Module):
            raise TypeError(f"{model} returned a {type(net).__name__}; expected a Flax NNX module.")
    _copy_state(ours.model, native)
    return ours, native
