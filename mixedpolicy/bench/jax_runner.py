"""JAX (Flax NNX): mixedpolicy against Flax's own dtype arguments and jmp-style loss scaling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import mixedpolicy as mp
from mixedpolicy.bench.worker import Trainer

LR = 0.05
_COMPUTE = {"float32": jnp.float32, "mixed_bfloat16": jnp.bfloat16, "mixed_float16": jnp.float16}


class MLP(nnx.Module):
    def __init__(self, weights: list, dtype=None):
        self.layers = nnx.List()
        for i in range(0, len(weights), 2):
            w, b = weights[i], weights[i + 1]
            linear = nnx.Linear(*w.shape, dtype=dtype, rngs=nnx.Rngs(0))
            linear.kernel.set_value(jnp.asarray(w))
            linear.bias.set_value(jnp.asarray(b))
            self.layers.append(linear)

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


def _loss(model, x, y):
    logits = model(x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


class _Nnx(Trainer):
    def __init__(self, model):
        self.model = model
        self._loss = None

    def sync(self) -> None:
        jax.block_until_ready(self._loss)

    def last_loss(self) -> float:
        return float(self._loss)

    def accuracy(self, x: np.ndarray, y: np.ndarray) -> float:
        return float((np.asarray(self.model(jnp.asarray(x)).argmax(-1)) == y).mean())


@nnx.jit
def _ours_step(model, optimizer, x, y):
    def scaled(model):
        loss = _loss(model, x, y)
        if isinstance(optimizer.tx, mp.LossScaleOptimizer):
            return optimizer.tx.scale_loss(loss, optimizer.opt_state), loss
        return loss, loss
    grads, loss = nnx.grad(scaled, has_aux=True)(model)
    optimizer.update(model, grads)
    return loss


class Ours(_Nnx):
    def __init__(self, policy: str, weights: list):
        super().__init__(mp.apply_policy(MLP(weights), policy))
        sgd = optax.sgd(LR, momentum=0.9)
        tx = mp.LossScaleOptimizer(sgd) if mp.Policy(policy).needs_loss_scaling else sgd
        self.optimizer = nnx.Optimizer(self.model, tx, wrt=nnx.Param)

    def step(self, x, y) -> None:
        self._loss = _ours_step(self.model, self.optimizer, x, y)

    def skipped_steps(self) -> int:
        state = self.optimizer.opt_state
        return int(state.num_skipped_steps) if hasattr(state, "num_skipped_steps") else 0

    def loss_scale(self):
        state = self.optimizer.opt_state
        return float(state.loss_scale.get_value()) if hasattr(state, "loss_scale") else None


@nnx.jit
def _native_step(model, optimizer, x, y, scale, counter):
    """jmp's recipe: scale, unscale, all_finite, select; the scale's arrays carried by hand."""
    scaled_loss, grads = nnx.value_and_grad(lambda m: _loss(m, x, y) * scale)(model)
    loss = scaled_loss / scale
    grads = jax.tree_util.tree_map(lambda g: g / scale, grads)
    finite = jnp.all(jnp.stack([jnp.isfinite(g).all() for g in jax.tree_util.tree_leaves(grads)]))
    grads = jax.tree_util.tree_map(lambda g: jnp.where(finite, g, jnp.zeros_like(g)), grads)
    before = nnx.state(optimizer)
    optimizer.update(model, grads)
    nnx.update(optimizer, jax.tree_util.tree_map(lambda new, old: jnp.where(finite, new, old),
                                                 nnx.state(optimizer), before))
    grow = finite & (counter + 1 >= 2000)
    scale = jnp.where(grow, scale * 2, jnp.where(finite, scale, jnp.maximum(scale / 2, 1.0)))
    counter = jnp.where(finite & ~grow, counter + 1, jnp.zeros_like(counter))
    return loss, scale, counter


@nnx.jit
def _plain_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(_loss)(model, x, y)
    optimizer.update(model, grads)
    return loss


class Native(_Nnx):
    def __init__(self, policy: str, weights: list):
        super().__init__(MLP(weights, dtype=_COMPUTE[policy]))
        self.optimizer = nnx.Optimizer(self.model, optax.sgd(LR, momentum=0.9), wrt=nnx.Param)
        self.scaled = policy == "mixed_float16"
        self.scale, self.counter = jnp.asarray(2.0**15, jnp.float32), jnp.zeros((), jnp.int32)

    def step(self, x, y) -> None:
        if self.scaled:
            self._loss, self.scale, self.counter = _native_step(
                self.model, self.optimizer, x, y, self.scale, self.counter)
        else:
            self._loss = _plain_step(self.model, self.optimizer, x, y)


def trainers(policy: str, weights: list, device: str):
    jax.config.update("jax_default_matmul_precision", "highest")  # pinned: no TF32
    return Ours(policy, weights), Native(policy, weights)
