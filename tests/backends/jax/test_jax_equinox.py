"""Policies on Equinox modules: rebuilt trees with PolicyModule regions where the policy changes."""

import numpy as np
import pytest

from conftest import require_module

jax = require_module("jax")
jnp = jax.numpy
eqx = require_module("equinox", "jax")
optax = require_module("optax", "jax")

import mixedpolicy as mp  # noqa: E402

X = np.random.default_rng(0).normal(size=(8, 6)).astype(np.float32)
F32, BF16 = jnp.dtype("float32"), jnp.dtype("bfloat16")


class Block(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.LayerNorm

    def __init__(self, key):
        self.linear = eqx.nn.Linear(16, 16, key=key)
        self.norm = eqx.nn.LayerNorm(16)

    def __call__(self, x):
        return self.norm(jax.nn.relu(self.linear(x)))

    def hidden(self, x):
        return self.linear(x)


class Net(eqx.Module):
    embed: eqx.nn.Linear
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, key=jax.random.key(0), dtype=jnp.float32):
        keys = jax.random.split(key, 4)
        self.embed = eqx.nn.Linear(6, 16, key=keys[0], dtype=dtype)
        self.blocks = [Block(keys[1]), Block(keys[2])]
        self.head = eqx.nn.Linear(16, 3, key=keys[3])

    def __call__(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def dtypes(tree):
    return {leaf.dtype for leaf in jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_array))}


def rows(model):
    return {r.path: r for r in mp.describe(model)}


@eqx.filter_jit
def run(model, x):
    return jax.vmap(model)(x)


def test_layers_compute_in_the_policy_params_and_grads_stay_float32():
    model = mp.apply_policy(Net(), "mixed_bfloat16")
    assert isinstance(model, mp.backends.jax.equinox.PolicyModule)
    table = rows(model)
    assert table[""].compute_dtype == table["blocks.0.linear"].compute_dtype == "bfloat16"
    assert table["blocks.1.norm"].compute_dtype == "float32"
    assert table["blocks.1.norm"].source == "built-in rule: normalization"
    assert dtypes(model) == {F32}
    assert run(model, X).dtype == BF16
    grads = eqx.filter_grad(lambda m: run(m, X).astype(jnp.float32).sum())(model)
    assert dtypes(grads) == {F32}
    # Every module is wrapped and casts its own arrays and inputs; attributes read through.
    assert type(model.blocks[0].linear.module) is eqx.nn.Linear
    assert model.blocks[0].linear.weight.dtype == F32


def test_the_policy_is_what_hand_written_casts_do_bit_for_bit():
    plain = Net()
    ours = run(mp.apply_policy(plain, "mixed_bfloat16"), X)

    def by_hand(x):  # jmp-style: cast params and inputs, a float32 norm that hands on bfloat16
        half = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16) if eqx.is_array(a) else a, plain)
        x = half.embed(x.astype(jnp.bfloat16))
        for block, fp32 in zip(half.blocks, plain.blocks):
            x = fp32.norm(jax.nn.relu(block.linear(x)).astype(jnp.float32)).astype(jnp.bfloat16)
        return half.head(x)

    hand = jax.jit(jax.vmap(by_hand))(X)
    assert ours.dtype == hand.dtype == BF16
    np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(hand, np.float32))


def test_float32_policy_is_plain_equinox_bit_for_bit():
    np.testing.assert_array_equal(np.asarray(run(mp.apply_policy(Net(), "float32"), X)),
                                  np.asarray(run(Net(), X)))


def test_overrides_by_path_glob_class_and_inheritance():
    model = mp.apply_policy(Net(), "mixed_float16", {
        "head": "float32", "blocks.*.linear": "mixed_bfloat16", "blocks.1": "bfloat16"})
    table = rows(model)
    assert table["head"].policy == mp.Policy("float32") and table["head"].source == "map key 'head'"
    assert table["blocks.0.linear"].source == "map key 'blocks.*.linear'"
    assert table["blocks.1"].policy == mp.Policy("bfloat16")
    assert table["blocks.1.linear"].policy == mp.Policy("mixed_bfloat16")  # its own key wins
    assert table["blocks.1.norm"].policy.variable_dtype == "float32"
    assert model.blocks[1].linear.weight.dtype == F32  # mixed: float32 variables
    assert run(model, X).dtype == F32  # the float32 head's output leaves as it is
    by_class = rows(mp.apply_policy(Net(), "mixed_float16", {eqx.nn.LayerNorm: "mixed_float16"}))
    assert by_class["blocks.0.norm"].compute_dtype == "float16"
    assert by_class["blocks.0.norm"].source.startswith("map key equinox")
    inherited = rows(mp.apply_policy(Net(), "mixed_float16", {"blocks.0": "float32"}))
    assert inherited["blocks.0.linear"].source == "map key 'blocks.0' (inherited from 'blocks.0')"


def test_output_dtype_other_methods_and_state_arguments():
    model = mp.apply_policy(Net(), "p=f32,c=bf16,o=f32")
    assert run(model, X).dtype == F32
    block = mp.apply_policy(Block(jax.random.key(1)), "mixed_bfloat16")
    assert block.hidden(jnp.ones(16)).dtype == BF16  # a method read through runs under the policy
    assert block.linear.weight.dtype == F32  # an attribute reads through as it is
    bn, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(16, "batch", mode="batch")
    bn = mp.apply_policy(bn, "mixed_bfloat16")
    out, new_state = jax.vmap(bn, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
        jnp.ones((4, 16), jnp.bfloat16), state)
    # The norm computes in float32 (built-in rule) and hands on the compute dtype; the
    # running statistics in eqx.nn.State are never cast.
    assert out.dtype == BF16 and {d for d in dtypes(new_state) if jnp.issubdtype(d, jnp.floating)} == {F32}
    seq = mp.apply_policy(eqx.nn.Sequential([eqx.nn.Linear(16, 16, key=jax.random.key(2)), bn.module]),
                          "mixed_bfloat16")
    assert seq.layers[1].is_stateful() and not seq.layers[0].is_stateful()
    out, _ = jax.vmap(seq, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(jnp.ones((4, 16)), state)
    assert out.dtype == BF16


def test_trains_under_filter_jit_with_the_loss_scale_optimizer():
    model = mp.apply_policy(Net(), "mixed_float16")
    tx = mp.LossScaleOptimizer(optax.sgd(0.05, momentum=0.9), policy="mixed_float16")  # (it cannot see the model)
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    y = jnp.asarray(np.arange(8) % 3)

    @eqx.filter_jit
    def step(model, opt_state):
        def loss_fn(m):
            logits = jax.vmap(m)(X).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = eqx.filter_value_and_grad(
            lambda m: tx.scale_loss(loss_fn(m), opt_state))(model)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss / opt_state.loss_scale

    losses = []
    for _ in range(5):
        model, opt_state, loss = step(model, opt_state)
        losses.append(float(loss))
    assert losses[-1] < losses[0] and dtypes(model) == {F32}
    assert int(opt_state.num_skipped_steps) == 0 and float(opt_state.loss_scale) == 2.0**15


def test_remove_policy_restores_the_module_and_applying_twice_replaces():
    plain = Net()
    pure = mp.apply_policy(plain, "bfloat16", {"head": "p=f32,c=bf16,o=f32"})
    assert pure.embed.weight.dtype == BF16 and pure.head.weight.dtype == F32
    assert pure.blocks[0].norm.weight.dtype == F32  # norms keep float32 variables
    back = mp.remove_policy(pure)
    assert type(back) is Net and type(back.head) is eqx.nn.Linear
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(plain)
    assert dtypes(back) == {F32}  # values went through bfloat16, as the pure policy asked
    assert eqx.tree_equal(mp.remove_policy(mp.apply_policy(plain, "mixed_float16")), plain)
    again = mp.apply_policy(pure, "mixed_float16")
    assert dtypes(again) == {F32} and rows(again)["embed"].compute_dtype == "float16"
    assert {r.source for r in mp.describe(plain)} == {"no policy applied"}


def test_half_master_weights_are_refused_and_unmatched_keys_warn():
    half = Net(dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=r"'embed.weight' is already bfloat16"):
        mp.apply_policy(half, "mixed_bfloat16")
    assert mp.apply_policy(half, "bfloat16").embed.weight.dtype == BF16  # a pure policy is fine
    with pytest.warns(UserWarning, match=r"'blocks.0.lienar' matches no layer path.*'blocks.0.linear'"):
        mp.apply_policy(Net(), "mixed_bfloat16", {"blocks.0.lienar": "float32"})


@pytest.mark.parametrize("cell", ["GRUCell", "LSTMCell"])
def test_a_recurrent_cell_keeps_its_hidden_state_dtype_under_a_scan(cell):
    """A cell's hidden state is the carry a scan threads: passed uncast and given back in its own
    dtypes, so a float32 initial state scans (the cast state came back half and the scan refused
    it), and one step is the cell with its arrays and input cast by hand, bit for bit. (The cell
    mixes a float32 state with half-precision weights: standard promotion, as by hand.)"""
    kind = getattr(eqx.nn, cell)
    plain = kind(8, 16, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (7, 8))
    h0 = jax.random.normal(jax.random.key(2), (16,))
    h0 = (h0, h0 * 0.5) if cell == "LSTMCell" else h0
    with jax.numpy_dtype_promotion("standard"):
        for policy, half in (("mixed_bfloat16", jnp.bfloat16), ("mixed_float16", jnp.float16)):
            ours = mp.apply_policy(plain, policy)
            by_hand = jax.tree_util.tree_map(lambda a: a.astype(half) if eqx.is_inexact_array(a) else a, plain)
            for got, want in zip(jax.tree_util.tree_leaves(ours(x[0], h0)),
                                 jax.tree_util.tree_leaves(by_hand(x[0].astype(half), h0))):
                assert got.dtype == want.dtype == jnp.float32
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
            for got, want in zip(jax.tree_util.tree_leaves(ours(x[0], hidden=h0)), jax.tree_util.tree_leaves(ours(x[0], h0))):
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # hidden= by keyword too
            final, _ = jax.lax.scan(lambda h, xt: (ours(xt, h), None), h0, x)
            assert all(leaf.dtype == jnp.float32 and bool(jnp.isfinite(leaf).all()) for leaf in jax.tree_util.tree_leaves(final))


FP8 = mp.Policy("mixed_bfloat16", float8_recipe="tensorwise")


def _fp8_dots(fn, *args):
    """How many dot_generals of `fn`'s jaxpr (nested ones included) take fp8 operands."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append(str(eqn.invars[0].aval.dtype).startswith("float8"))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return sum(found)


def _loss(model, x, y):
    logits = jax.vmap(model)(x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def test_an_fp8_policy_on_the_model_scales_over_the_batch_as_on_its_loss_function():
    """An Equinox layer sees one example under jax.vmap, yet its fp8 scales are the batch's: the
    model under an fp8 policy computes the values and gradients that the same policy on the loss
    function (which sees the whole batch) computes, and not what a scale per example gives."""
    model = eqx.nn.MLP(64, 10, 64, depth=3, key=jax.random.key(0))  # 4 Linears: the last the head
    x, y = jax.random.normal(jax.random.key(1), (32, 64)), jnp.arange(32) % 10
    ours = mp.apply_policy(model, FP8)
    table = rows(ours)
    assert [table[f"layers.{i}"].float8 for i in range(4)] == ["tensorwise"] * 3 + ["-"]
    assert "output head" in table["layers.3"].source
    weights, static = eqx.partition(ours, eqx.is_array)
    assert _fp8_dots(lambda w: eqx.filter_grad(_loss)(eqx.combine(w, static), x, y), weights) == 9  # 3 x (1 + 2)
    value, grads = eqx.filter_jit(eqx.filter_value_and_grad(_loss))(ours, x, y)
    by_batch = mp.apply_policy(_loss, mp.Policy(FP8, output_dtype="float32"))
    ref_value, ref_grads = eqx.filter_jit(eqx.filter_value_and_grad(by_batch))(model, x, y)
    np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-3)
    for got, want in zip(jax.tree_util.tree_leaves(grads.module), jax.tree_util.tree_leaves(ref_grads)):
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0.05, atol=0.05 * float(jnp.abs(want).max()))
    one = jax.vmap(ours.layers[0])(x)
    per_example = jnp.stack([ours.layers[0](xi) for xi in x])  # eager: one example, its own scale
    assert float(jnp.abs(one.astype(jnp.float32) - per_example.astype(jnp.float32)).max()) > 0


def test_nested_vmaps_of_an_fp8_attention_fold_into_one_scale_and_train():
    """eqx.nn.MultiheadAttention vmaps its projections over the sequence inside the model's vmap
    over the batch: the fp8 scale covers batch x sequence (the same as one vmap over both
    flattened), and a transformer block trains under the optax wrapper, every weight finite."""
    keys = jax.random.split(jax.random.key(0), 3)
    attention = mp.apply_policy(eqx.nn.MultiheadAttention(4, 32, key=keys[0]), FP8,
                                {"output_proj": FP8})  # no head rule for a lone block's output
    x = jax.random.normal(keys[1], (6, 5, 32))
    nested = jax.vmap(jax.vmap(attention.query_proj))(x)
    flat = jax.vmap(attention.query_proj)(x.reshape(30, 32)).reshape(6, 5, 32)
    np.testing.assert_allclose(np.asarray(nested, np.float32), np.asarray(flat, np.float32), rtol=1e-2, atol=1e-2)

    class Block(eqx.Module):
        attention: eqx.nn.MultiheadAttention
        norm: eqx.nn.LayerNorm
        head: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.attention = eqx.nn.MultiheadAttention(4, 32, key=k1)
            self.norm = eqx.nn.LayerNorm(32)
            self.head = eqx.nn.Linear(32, 3, key=k2)

        def __call__(self, tokens):
            h = jax.vmap(self.norm)(tokens + self.attention(tokens, tokens, tokens))
            return self.head(h.mean(0))

    model = mp.apply_policy(Block(keys[2]), FP8)
    table = rows(model)
    assert table["attention.query_proj"].float8 == "tensorwise" and table["head"].float8 == "-"
    assert table["norm"].float8 == "-"
    y = jnp.arange(6) % 3
    tx = mp.LossScaleOptimizer(optax.sgd(0.05, momentum=0.9), policy=FP8)
    state = tx.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, state):
        value, grads = eqx.filter_value_and_grad(_loss)(model, x, y)
        updates, state = tx.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state, value

    losses = []
    for _ in range(40):
        model, state, value = step(model, state)
        losses.append(float(value))
    assert losses[-1] < 0.5 * losses[0] and int(state.num_skipped_steps) == 0
    assert all(bool(jnp.isfinite(w).all()) for w in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array)))


def test_an_fp8_recipe_equinox_cannot_run_is_refused_and_the_source_policy_comes_off():
    model = eqx.nn.MLP(32, 4, 32, depth=2, key=jax.random.key(0))
    with pytest.raises(ValueError, match="'delayed' for the eqx.nn.Linear at 'layers.0'.*loss function.*init_float8"):
        mp.apply_policy(model, "float8_from_mixed_bfloat16")  # Keras's name: delayed scaling
    with pytest.raises(ValueError, match="'rowwise' for the eqx.nn.Linear.*runs on torch"):
        mp.apply_policy(model, mp.Policy("float8_from_float32", float8_recipe="rowwise"))
    ours = mp.apply_policy(model, FP8)
    plain = mp.remove_policy(ours)
    assert type(plain) is eqx.nn.MLP
    for a, b in zip(jax.tree_util.tree_leaves(eqx.filter(plain, eqx.is_array)),
                    jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_array))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("sizes", [("scalar", "scalar"), ("scalar", 16), (16, "scalar"), (32, 16)])
@pytest.mark.parametrize("bias", [True, False])
def test_an_fp8_linear_takes_and_gives_the_shapes_of_equinoxs_own(sizes, bias):
    plain = eqx.nn.Linear(*sizes, use_bias=bias, key=jax.random.key(0))
    ours = mp.apply_policy(plain, mp.PolicyMap(FP8, builtin_rules=False))  # every size in fp8
    assert rows(ours)[""].float8 == "tensorwise"
    x = jax.random.normal(jax.random.key(1), (4,) if sizes[0] == "scalar" else (4, sizes[0]))
    got, want = jax.vmap(ours)(x), jax.vmap(plain)(x)
    assert got.shape == want.shape and got.dtype == BF16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=0.1 * float(jnp.abs(want).max()))
    if sizes[0] != "scalar":
        with pytest.raises(ValueError, match=r"input of shape \(4, 32\).*under jax.vmap"):
            ours(jnp.ones((4, 32)))


def test_inspect_gradients_reads_a_model_through_its_policies_by_the_paths_describe_prints():
    """inspect_gradients on an Equinox module (it refused any: 'does not support MLP models'):
    the gradients are those the policy computes, reported by describe's layer paths, with or
    without a policy on the model."""
    model = Net()
    y = jnp.arange(8) % 3

    def loss(m, batch):
        return optax.softmax_cross_entropy_with_integer_labels(jax.vmap(m)(batch).astype(jnp.float32), y).mean()

    ours = mp.apply_policy(model, "mixed_float16", {"head": "float32"})
    layers = {p for p in rows(ours) if p and p not in ("blocks.0", "blocks.1")}
    for m in (model, ours):
        report = mp.inspect_gradients(m, loss, [jnp.asarray(X)], loss_scale=2.0**10)
        got = {(r.path, r.kind) for r in report.rows}
        assert got == {(p, kind) for p in layers for kind in ("weight", "weight_grad")}, got
        assert all(r.amax > 0 and r.nonfinite == 0 for r in report.rows)
        recommendation = report.recommend()
        mp.apply_policy(model, "mixed_float16", recommendation.overrides)  # its keys paste back
