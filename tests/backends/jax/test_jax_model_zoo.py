"""Flax's and Equinox's own building blocks under mixedpolicy, as their examples put them
together: the Flax NNX tutorial's CNN with Flax's MultiHeadAttention, and Equinox's built-in
MLP, MultiheadAttention and LayerNorm. Each layer computes as `describe` says, a printed path
pastes back as a key, overrides by class reach the layers, and training matches the
framework's own mixed precision (Flax's dtype= arguments) on the same seeded model."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mixedpolicy as mp

nnx = pytest.importorskip("flax.nnx")


class CNN(nnx.Module):
    def __init__(self, dtype=None, *, rngs):
        self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), dtype=dtype, rngs=rngs)
        self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), dtype=dtype, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=16, qkv_features=16, decode=False,
                                           dtype=dtype, rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)  # float32, as the built-in rule keeps norms
        self.linear = nnx.Linear(16, 10, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.conv1(x))
        x = nnx.avg_pool(nnx.relu(self.conv2(x)), window_shape=(2, 2), strides=(2, 2))
        tokens = x.reshape(x.shape[0], -1, 16)
        tokens = self.norm(tokens + self.attn(tokens))
        return self.linear(tokens.mean(1))


def _data():
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.normal(size=(8, 8, 8, 1)), jnp.float32), jnp.arange(8) % 10


def _train(model, tx, steps=3):
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    x, y = _data()

    @nnx.jit
    def step(model, optimizer):
        def loss_fn(model):
            loss = optax.softmax_cross_entropy_with_integer_labels(model(x).astype(jnp.float32), y).mean()
            scaled = optimizer.tx.scale_loss(loss, optimizer.opt_state) if hasattr(optimizer.tx, "scale_loss") else loss
            return scaled, loss
        grads, loss = nnx.grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        return loss

    return [float(step(model, optimizer)) for _ in range(steps)]


def test_flax_nnx_tutorial_cnn_with_attention_matches_flax_own_dtypes():
    with jax.numpy_dtype_promotion("standard"):  # as users run Flax (its attention promotes)
        ours = mp.apply_policy(CNN(rngs=nnx.Rngs(0)), "mixed_bfloat16")
        rows = {r.path: r for r in mp.describe(ours)}
        assert rows["attn"].policy == mp.Policy("mixed_bfloat16") and rows["norm"].policy.compute_dtype == "float32"
        x, _ = _data()
        assert ours(x).dtype == jnp.bfloat16
        assert all(v.dtype == jnp.float32 for v in jax.tree_util.tree_leaves(nnx.state(ours, nnx.Param)))
        native = CNN(dtype=jnp.bfloat16, rngs=nnx.Rngs(0))  # Flax's own: the same seed, the same weights
        mine = _train(ours, mp.LossScaleOptimizer(optax.adam(1e-3), policy="mixed_bfloat16"))
        theirs = _train(native, optax.adam(1e-3))
        np.testing.assert_allclose(mine, theirs, rtol=2e-2)
        assert mine[-1] < mine[0]
        # a printed path pastes back as a key
        again = mp.apply_policy(CNN(rngs=nnx.Rngs(0)), mp.PolicyMap("mixed_bfloat16", {"attn": "float32"}))
        assert {r.path: r for r in mp.describe(again)}["attn"].policy == mp.Policy("float32")


def test_equinox_builtin_mlp_attention_and_norm_under_a_class_override():
    eqx = pytest.importorskip("equinox")

    class Net(eqx.Module):
        att: eqx.nn.MultiheadAttention
        mlp: eqx.nn.MLP
        norm: eqx.nn.LayerNorm

        def __call__(self, t):
            t = jax.vmap(self.norm)(t + self.att(t, t, t))
            return self.mlp(t.mean(0))

    key = jax.random.PRNGKey(0)
    net = Net(eqx.nn.MultiheadAttention(2, 16, key=key), eqx.nn.MLP(16, 4, 32, 2, key=key), eqx.nn.LayerNorm(16))
    ours = mp.apply_policy(net, mp.PolicyMap("mixed_float16", {eqx.nn.LayerNorm: "float32"}))
    rows = {r.path: r for r in mp.describe(ours)}
    assert rows["norm"].policy == mp.Policy("float32") and "LayerNorm" in rows["norm"].source
    assert rows["att.query_proj"].policy == mp.Policy("mixed_float16")
    t = jnp.asarray(np.random.default_rng(0).normal(size=(5, 16)), jnp.float32)
    assert ours(t).dtype == jnp.float16
    tx = mp.LossScaleOptimizer(optax.sgd(0.05), policy="mixed_float16")
    state = tx.init(eqx.filter(ours, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(net, state):
        def loss_fn(net):
            loss = jnp.mean((net(t).astype(jnp.float32) - 1.0) ** 2)
            return tx.scale_loss(loss, state), loss
        grads, loss = eqx.filter_grad(loss_fn, has_aux=True)(net)
        updates, state = tx.update(grads, state, eqx.filter(net, eqx.is_inexact_array))
        return eqx.apply_updates(net, updates), state, loss

    losses = []
    for _ in range(3):
        ours, state, loss = step(ours, state)
        losses.append(float(loss))
    assert all(np.isfinite(losses)) and losses[-1] < losses[0] and int(state.num_skipped_steps) == 0
    # the weights stay float32 masters
    assert all(a.dtype == jnp.float32 for a in jax.tree_util.tree_leaves(eqx.filter(ours, eqx.is_inexact_array)))
