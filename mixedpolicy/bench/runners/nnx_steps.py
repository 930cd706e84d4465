"""The bench's compiled Flax NNX steps (ours, the jmp-style hand-written one, the plain one and
the prediction), made once per trainer for a loss: the built-in models' cross entropy or a
user's own.

Each trainer gets its own ``nnx.jit`` functions. Shared by several live models of the same
structure, one ``nnx.jit`` function's call grows slower with each model built after the
first (measured on the bench's MLP: the 2nd +9%, the 3rd +16%, the 4th +22% on a 0.35 ms
step, identical models), which would bias every side-by-side ratio by build order."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from mixedpolicy.bench import user_model


def cross_entropy(outputs, y):
    """Mean cross entropy in float32 of the logits on integer class targets (every position)."""
    logits = user_model.logits_of(outputs).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def steps(objective=cross_entropy) -> SimpleNamespace:
    """Fresh compiled steps for a loss ``objective(outputs, targets)``: the built-in models'
    cross entropy, or a user's own loss (one set per trainer: see the module docstring)."""

    def loss_of(model, x, y):
        return objective(user_model.call(model, x), y)

    @nnx.jit
    def predict(model, x):
        return user_model.logits_of(user_model.call(model, x)).astype(jnp.float32)

    @nnx.jit
    def ours(model, optimizer, x, y):
        def scaled(model):
            loss = loss_of(model, x, y)
            return optimizer.tx.scale_loss(loss, optimizer.opt_state), loss
        grads, loss = nnx.grad(scaled, has_aux=True)(model)
        optimizer.update(model, grads)
        return loss

    @nnx.jit
    def native(model, optimizer, x, y, scale, counter):
        """jmp's recipe: scale, unscale, all_finite, update, then select the new or the old
        parameters and optimizer state (jmp's select_tree); the scale's arrays carried by hand."""
        scaled_loss, grads = nnx.value_and_grad(lambda m: loss_of(m, x, y) * scale)(model)
        loss = scaled_loss / scale
        grads = jax.tree_util.tree_map(lambda g: g / scale, grads)
        finite = jnp.all(jnp.stack([jnp.isfinite(g).all() for g in jax.tree_util.tree_leaves(grads)]))

        def snapshot():  # the values now (nnx.state holds the variables, which update() changes)
            return jax.tree_util.tree_map(lambda v: v, (nnx.state(model, nnx.Param), nnx.state(optimizer)))

        before = snapshot()
        optimizer.update(model, grads)
        after = snapshot()
        chosen = jax.tree_util.tree_map(lambda new, old: jnp.where(finite, new, old), after, before)
        nnx.update(model, chosen[0])
        nnx.update(optimizer, chosen[1])
        grow = finite & (counter + 1 >= 2000)
        scale = jnp.where(grow, scale * 2, jnp.where(finite, scale, jnp.maximum(scale / 2, 1.0)))
        counter = jnp.where(finite & ~grow, counter + 1, jnp.zeros_like(counter))
        return loss, scale, counter

    @nnx.jit
    def plain(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(loss_of)(model, x, y)
        optimizer.update(model, grads)
        return loss

    return SimpleNamespace(predict=predict, ours=ours, native=native, plain=plain, loss=loss_of)
