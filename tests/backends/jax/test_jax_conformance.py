"""Regressions from the conformance review, JAX models: linen lifted transforms, exact float32 layers."""

import warnings

import numpy as np
import pytest

from conftest import require_module

jax = require_module("jax")
jnp = jax.numpy
nn = require_module("flax.linen", "jax")

import mixedpolicy as mp  # noqa: E402


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _=None):
        return nn.LayerNorm()(nn.Dense(8)(x)), None


class Lifted(nn.Module):
    @nn.compact
    def __call__(self, x):
        x, _ = nn.remat(Block)()(x)
        x, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                       length=2)()(x, None)
        return nn.Dense(4)(x)


def test_modules_under_remat_and_scan_keep_their_paths_and_classes():
    model = mp.apply_policy(Lifted(), "mixed_bfloat16", {Block: "mixed_float16"})
    x = jnp.ones((2, 8), jnp.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no false "matches no layer"
        variables = model.init(jax.random.key(0), x)
        out = model.apply(variables, x)
    rows = {r.path: r for r in mp.describe(model)}
    assert rows[""].layer_type == "Lifted", rows[""]
    blocks = [r for r in rows.values() if r.layer_type == "Block"]
    assert len(blocks) == 2 and all(r.policy == mp.Policy("mixed_float16") for r in blocks)
    dense = [r for p, r in rows.items() if p.endswith("Dense_0") and p != "Dense_0"]
    assert dense and all(r.policy == mp.Policy("mixed_float16") for r in dense), rows
    assert rows["Dense_0"].policy == mp.Policy("mixed_bfloat16")
    assert out.dtype == jnp.bfloat16
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree_util.tree_leaves(variables))


class OneLayer(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3, name="first")(x)


def test_a_float32_first_layer_sees_unrounded_inputs():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 5)), jnp.float32)
    model = mp.apply_policy(OneLayer(), "mixed_bfloat16", {"first": "float32"})
    with jax.disable_jit():
        variables = model.init(jax.random.key(0), x)
        ours = model.apply(variables, x)
        theirs = nn.Dense(3, dtype=jnp.float32).apply({"params": variables["params"]["first"]}, x)
    assert ours.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


@pytest.mark.parametrize("policy", ["bfloat16", "float16"])
def test_nnx_remove_policy_gives_back_unrounded_values(policy):
    nnx = require_module("flax.nnx", "jax")
    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    before = np.asarray(model.kernel.get_value()).copy()
    mp.apply_policy(model, policy)
    assert model.kernel.get_value().dtype == jnp.dtype(policy)
    model.bias.set_value(model.bias.get_value().at[0].set(0.5))
    mp.remove_policy(model)
    assert model.kernel.get_value().dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(model.kernel.get_value()), before)
    assert float(model.bias.get_value()[0]) == 0.5


def test_equinox_remove_policy_gives_back_unrounded_values():
    eqx = require_module("equinox", "jax")
    model = eqx.nn.Linear(4, 3, key=jax.random.key(0))
    before = np.asarray(model.weight).copy()
    wrapped = mp.apply_policy(model, "bfloat16")
    assert wrapped.module.weight.dtype == jnp.bfloat16
    # trained under the policy: the rounded leaves go through a jitted update untouched
    wrapped = jax.jit(lambda m: m)(wrapped)
    plain = mp.remove_policy(wrapped)
    assert plain.weight.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(plain.weight), before)
