"""The loss scales as JAX pytrees, registered when JAX is imported (the table's ``on_import``):
a scale's arrays are its children, its settings the aux data, so a `DynamicLossScale` goes
through ``jax.jit`` and ``lax.cond`` as jmp's does."""

from __future__ import annotations

import dataclasses

import jax

from mixedpolicy.loss_scale import DynamicLossScale, NoLossScale, StaticLossScale


def register() -> None:
    """Makes the loss scales JAX pytrees (as jmp's are): arrays are children, settings aux data."""
    def unflatten(cls, settings, arrays):
        new = object.__new__(cls)  # no validation: leaves may be tracers or placeholders
        names = [f.name for f in dataclasses.fields(cls)]
        values = dict(zip(names[:len(arrays)], arrays))
        values.update(zip(names[len(arrays):], settings))
        for name in names:
            object.__setattr__(new, name, values[name])
        return new

    jax.tree_util.register_pytree_node(
        NoLossScale, lambda s: ((), (s.skip_nonfinite,)), lambda aux, kids: NoLossScale(*aux))
    jax.tree_util.register_pytree_node(
        StaticLossScale, lambda s: ((s.loss_scale,), ()),
        lambda aux, kids: unflatten(StaticLossScale, aux, kids))
    jax.tree_util.register_pytree_node(
        DynamicLossScale, lambda s: ((s.loss_scale, s.counter), s._settings()),
        lambda aux, kids: unflatten(DynamicLossScale, aux, kids))


register()
