"""Policies on JAX: plain functions of pytrees, Flax NNX modules, Flax linen modules."""

import functools
import warnings

import numpy as np
import pytest

from conftest import require_module

jax = require_module("jax")
jnp = jax.numpy
flax = require_module("flax", "jax")
jmp = require_module("jmp", "jax")
from flax import nnx  # noqa: E402
import flax.linen as nn  # noqa: E402

import mixedpolicy as mp  # noqa: E402

X = np.random.default_rng(0).normal(size=(8, 6)).astype(np.float32)


def params_tree():
    rng = np.random.default_rng(1)
    return {"w1": jnp.asarray(rng.normal(size=(6, 16)), jnp.float32), "b1": jnp.zeros(16, jnp.float32),
            "w2": jnp.asarray(rng.normal(size=(16, 3)), jnp.float32), "b2": jnp.zeros(3, jnp.float32)}


def mlp(params, x):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return h @ params["w2"] + params["b2"]


def test_jax_runs_with_strict_dtype_promotion():
    assert jax.config.jax_numpy_dtype_promotion == "strict"


# -- plain functions -----------------------------------------------------------
def test_function_casts_params_and_inputs_and_returns_the_output_dtype():
    f = mp.apply_policy(mlp, "params=float32,compute=bfloat16,output=float32")
    out = jax.jit(f)(params_tree(), X)
    assert out.dtype == jnp.float32
    grads = jax.grad(lambda p: f(p, X).sum())(params_tree())
    assert all(g.dtype == jnp.float32 for g in jax.tree_util.tree_leaves(grads))


def test_function_matches_jmp_bit_for_bit():
    policy = "p=f32,c=f16,o=f32"
    ours = jax.jit(mp.apply_policy(mlp, policy))(params_tree(), X)
    ref_policy = mp.Policy(policy).to_jmp()

    @jax.jit
    def by_hand(params, x):
        params, x = ref_policy.cast_to_compute((params, x))
        return ref_policy.cast_to_output(mlp(params, x))

    np.testing.assert_array_equal(np.asarray(ours), np.asarray(by_hand(params_tree(), X)))


def test_float32_function_is_plain_jax_bit_for_bit():
    ours = jax.jit(mp.apply_policy(mlp, "float32"))(params_tree(), X)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(jax.jit(mlp)(params_tree(), X)))


def test_integer_and_boolean_inputs_are_never_cast():
    seen = {}

    def f(params, ids, mask):
        seen.update(ids=ids.dtype, mask=mask.dtype, w=params.dtype)
        return params[ids] * mask.astype(params.dtype)

    mp.apply_policy(f, "mixed_bfloat16")(jnp.ones(4, jnp.float32), jnp.arange(4), jnp.ones(4, bool))
    assert seen == {"ids": jnp.int32, "mask": jnp.bool_, "w": jnp.bfloat16}


def test_opaque_leaves_pass_as_jmp_passes_them_and_another_frameworks_tensor_is_an_error():
    torch = pytest.importorskip("torch")
    f = mp.apply_policy(mlp, "mixed_bfloat16")
    note = object()
    # functions, strings and opaque objects have no precision: they pass, as jmp passes them
    # (an Equinox module holds its activation functions as leaves)
    out = f(dict(params_tree(), note="first run", act=jax.nn.relu, obj=note), X)
    assert out.dtype == jnp.bfloat16
    tree = dict(o=note, h=jnp.ones([], jnp.float16), f=jnp.ones([]), i=jnp.ones([], jnp.int16))
    cast = mp.Policy("p=f32,c=f16").cast_to_param(tree)
    assert cast["o"] is note and cast["h"].dtype == jnp.float32 and cast["i"].dtype == jnp.int16
    # a tensor of another framework would stay in its own precision without a word
    with pytest.raises(TypeError, match=r"arrays of torch and jax in one call.*jnp.asarray"):
        f(dict(params_tree(), t=torch.ones(2)), X)
    # Python numbers are fine: they take the dtype of the arrays they meet.
    assert mp.apply_policy(lambda p, s: p * s, "mixed_bfloat16")(jnp.ones(2), 2.0).dtype == jnp.bfloat16


# -- Flax NNX ------------------------------------------------------------------
class Block(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(16, 16, rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)

    def __call__(self, x):
        return self.norm(jax.nn.relu(self.linear(x)))


class Net(nnx.Module):
    def __init__(self, rngs, param_dtype=jnp.float32):
        self.embed = nnx.Linear(6, 16, param_dtype=param_dtype, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(2)])
        self.head = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def net():
    return Net(nnx.Rngs(0))


def rows(model):
    return {r.path: r for r in mp.describe(model)}


def test_nnx_layers_compute_in_the_policy_and_keep_float32_params():
    model = mp.apply_policy(net(), "mixed_bfloat16")
    table = rows(model)
    assert table["embed"].compute_dtype == "bfloat16"
    assert table["blocks.0.norm"].compute_dtype == "float32"
    assert table["blocks.0.norm"].source == "built-in rule: normalization"
    assert model.embed.dtype == jnp.bfloat16 and model.blocks[0].norm.dtype == jnp.float32
    params = nnx.state(model, nnx.Param)
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(params)} == {jnp.dtype("float32")}
    assert model(X).dtype == jnp.bfloat16
    # The norm computes in float32 and hands on the compute dtype.
    assert model.blocks[0](jnp.ones((2, 16), jnp.bfloat16)).dtype == jnp.bfloat16


def test_nnx_policy_is_what_hand_written_flax_dtypes_do():
    hand = net()
    for module in (hand.embed, hand.head, *(b.linear for b in hand.blocks)):
        module.dtype = jnp.bfloat16
    for b in hand.blocks:
        b.norm.dtype = jnp.float32
    # The norm hands on the compute dtype (as in Keras); the next layer casts to it anyway.
    ours = mp.apply_policy(net(), "mixed_bfloat16")

    @nnx.jit
    def run(model, x):
        return model(x).astype(jnp.float32)

    np.testing.assert_allclose(np.asarray(run(ours, X)), np.asarray(run(hand, X)), rtol=0, atol=0)


def test_nnx_float32_policy_is_plain_flax_bit_for_bit():
    ours = mp.apply_policy(net(), "float32")
    np.testing.assert_array_equal(np.asarray(nnx.jit(lambda m, x: m(x))(ours, X)),
                                  np.asarray(nnx.jit(lambda m, x: m(x))(net(), X)))


def test_nnx_overrides_by_path_glob_class_and_inheritance():
    model = mp.apply_policy(net(), mp.PolicyMap("mixed_float16", {
        "head": "float32", "blocks.*.linear": "mixed_bfloat16", "blocks.1": "bfloat16",
        "embed": "bfloat16"}))
    table = rows(model)
    assert table["head"].policy == mp.Policy("float32") and table["head"].source == "map key 'head'"
    assert table["blocks.0.linear"].source == "map key 'blocks.*.linear'"
    assert table["blocks.1"].policy == mp.Policy("bfloat16")
    assert table["blocks.1.linear"].policy == mp.Policy("mixed_bfloat16")  # its own key wins
    assert table["blocks.1.norm"].source == "built-in rule: normalization"
    assert table["blocks.1.norm"].policy.variable_dtype == "float32"
    assert table["blocks.0.norm"].policy.compute_dtype == "float32"
    # a pure bfloat16 layer stores its parameters in bfloat16
    assert model.embed.kernel.get_value().dtype == jnp.bfloat16
    assert model.blocks[1].linear.kernel.get_value().dtype == jnp.float32
    by_class = rows(mp.apply_policy(net(), "mixed_float16", {nnx.LayerNorm: "mixed_float16"}))
    assert by_class["blocks.0.norm"].source == "map key flax.nnx.nn.normalization.LayerNorm"
    assert by_class["blocks.0.norm"].compute_dtype == "float16"
    inherited = rows(mp.apply_policy(net(), "mixed_float16", {"blocks.0": "float32"}))
    assert inherited["blocks.0.linear"].source == "map key 'blocks.0' (inherited from 'blocks.0')"


def test_nnx_output_dtype_is_cast_where_it_differs_from_compute():
    model = mp.apply_policy(net(), "p=f32,c=bf16,o=f32")
    assert model(X).dtype == jnp.float32
    assert model.blocks[0].linear(jnp.ones((1, 16))).dtype == jnp.float32
    assert type(model.embed).__name__ == "Linear" and isinstance(model.embed, nnx.Linear)


def test_nnx_policy_survives_jit_split_merge_and_training():
    import optax

    model = mp.apply_policy(net(), "mixed_bfloat16", {"head": "float32"})
    graphdef, state = nnx.split(model)
    again = nnx.merge(graphdef, state)
    assert rows(again)["head"].source == "map key 'head'" and again(X).dtype == jnp.float32
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(model)
        optimizer.update(model, grads)
        return loss

    first = step(model, optimizer, X)
    assert step(model, optimizer, X) < first
    assert model.embed.kernel.get_value().dtype == jnp.float32


def test_nnx_a_bridged_linen_module_runs_under_its_paths_policy_and_trains():
    # flax.nnx.bridge.ToNNX turns a linen module's attributes into linen variables at each call
    # (the policy's record among them broke every call); its linen module now runs under the
    # policy of the bridge's path, linen's layers listed below it by describe, and comes back
    from flax.nnx import bridge
    import optax

    class Inner(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(16)(nn.LayerNorm()(nn.Dense(16)(x)))

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.bridged = bridge.ToNNX(Inner(), rngs=rngs)
            self.head = nnx.Linear(16, 3, rngs=rngs)

        def __call__(self, x):
            return self.head(self.bridged(x))

    x, y = jnp.ones((2, 8)), jnp.array([0, 1])
    model = Model(nnx.Rngs(0))
    bridge.lazy_init(model.bridged, x)
    plain = model(x)
    mp.apply_policy(model, "mixed_bfloat16")
    out = model(x)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(plain), atol=0.05)
    rows = {row.path: (row.compute_dtype, row.variable_dtype) for row in mp.describe(model)}
    assert rows["bridged"] == rows["bridged.Dense_0"] == rows["bridged.Dense_1"] == ("bfloat16", "float32")
    assert rows["bridged.LayerNorm_0"] == ("float32", "float32")  # the built-in rule, inside linen too
    opt = nnx.Optimizer(model, mp.LossScaleOptimizer(optax.sgd(0.1), policy="mixed_bfloat16"), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt):
        def loss(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(x).astype(jnp.float32), y).mean()
        value, grads = nnx.value_and_grad(loss)(model)
        opt.update(model, grads)
        return value

    losses = [float(step(model, opt)) for _ in range(3)]
    assert losses[-1] < losses[0] and int(opt.opt_state.num_skipped_steps) == 0
    assert {v.dtype for v in jax.tree.leaves(nnx.state(model, nnx.Param))} == {jnp.dtype("float32")}
    mp.remove_policy(model)
    assert type(model.bridged.to_nnx__module) is Inner and model(x).dtype == jnp.float32


def test_linen_an_nnx_module_through_the_bridge_computes_as_its_row_says():
    # flax.nnx.bridge.to_linen builds its NNX module at every call: it now builds it under the
    # policy of its linen path (it computed in float32 where describe said bfloat16)
    from flax.nnx import bridge
    import optax

    class Outer(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(bridge.to_linen(nnx.Linear, 8, 16)(x))

    x, y = jnp.ones((2, 8)), jnp.array([0, 1])
    wrapped = mp.apply_policy(Outer(), "mixed_bfloat16")
    variables = wrapped.init(jax.random.key(0), x)
    seen = {}

    def record(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if type(context.module).__name__ == "ToLinen" and context.method_name == "__call__":
            seen["out"] = out.dtype
        return out

    with nn.intercept_methods(record):
        assert wrapped.apply(variables, x).dtype == jnp.bfloat16
    rows = {row.path: row.compute_dtype for row in mp.describe(wrapped)}
    assert rows["ToLinen_0"] == "bfloat16" == seen["out"]
    assert {v.dtype for v in jax.tree.leaves(variables["params"])} == {jnp.dtype("float32")}
    tx = mp.LossScaleOptimizer(optax.sgd(0.1), policy="mixed_bfloat16")
    params, state = variables["params"], tx.init(variables["params"])

    @jax.jit
    def step(params, state):
        def loss(p):
            logits = wrapped.apply({"params": p}, x).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        value, grads = jax.value_and_grad(loss)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    losses = []
    for _ in range(3):
        params, state, value = step(params, state)
        losses.append(float(value))
    assert losses[-1] < losses[0] and {v.dtype for v in jax.tree.leaves(params)} == {jnp.dtype("float32")}


def test_nnx_remove_policy_restores_everything():
    model = net()
    before = nnx.state(model)
    mp.apply_policy(model, "bfloat16", {"head": "p=f32,c=bf16,o=f32"})
    assert model.embed.kernel.get_value().dtype == jnp.bfloat16
    mp.remove_policy(model)
    after = nnx.state(model)
    for a, b in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(after)):
        assert a.dtype == b.dtype
    assert model.embed.dtype is None and model.embed.param_dtype == jnp.float32
    assert type(model.head) is nnx.Linear
    assert {r.source for r in mp.describe(model)} == {"no policy applied"}


def test_a_lora_model_keeps_its_half_base_under_a_pure_default_and_trains_float32_adapters():
    """nnx.LoRALinear on a bfloat16 base: a mixed policy over it is refused with the map that works
    (the base is no master weight only where nothing trains it), and that map trains the adapters
    in float32 with the base left as it is."""
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.body = nnx.LoRALinear(8, 16, lora_rank=2, rngs=rngs, param_dtype=jnp.bfloat16,
                                       lora_param_dtype=jnp.float32)
            self.head = nnx.Linear(16, 4, rngs=rngs, param_dtype=jnp.bfloat16)

        def __call__(self, x):
            return self.head(self.body(x))

    with pytest.raises(ValueError, match=r"PolicyMap\('bfloat16', \{'\*.lora': 'mixed_bfloat16'\}\)"):
        mp.apply_policy(Net(nnx.Rngs(0)), "mixed_bfloat16")
    import optax

    policy = mp.PolicyMap("bfloat16", {"*.lora": "mixed_bfloat16"})
    model = mp.apply_policy(Net(nnx.Rngs(0)), policy)
    optimizer = nnx.Optimizer(model, mp.LossScaleOptimizer(optax.sgd(0.1), policy=policy), wrt=nnx.LoRAParam)
    base, adapter = model.body.kernel.get_value(), model.body.lora.lora_b.get_value()  # (lora_a's gradient: 0 at first)
    grads = nnx.grad(lambda m: m(jnp.ones((4, 8))).astype(jnp.float32).sum(),
                     argnums=nnx.DiffState(0, nnx.LoRAParam))(model)
    optimizer.update(model, grads)
    assert model.body.lora.lora_b.get_value().dtype == jnp.float32
    assert not jnp.array_equal(model.body.lora.lora_b.get_value(), adapter)
    assert model.body.kernel.get_value().dtype == jnp.bfloat16 and jnp.array_equal(model.body.kernel.get_value(), base)


def test_describe_says_where_a_modules_own_dtype_arguments_set_its_dtypes():
    model = nnx.Sequential(nnx.Linear(2, 3, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), nnx.Linear(3, 3, rngs=nnx.Rngs(0)))
    rows = {r.path: r for r in mp.describe(model)}
    assert rows["layers.0"].compute_dtype == "bfloat16" and rows["layers.0"].source == "its own dtype/param_dtype"
    assert rows["layers.1"].source == "no policy applied"


def test_nnx_applying_twice_replaces_the_first_policy():
    model = mp.apply_policy(net(), "bfloat16")
    mp.apply_policy(model, "mixed_float16")
    assert model.embed.kernel.get_value().dtype == jnp.float32 and model.embed.dtype == jnp.float16


def test_nnx_half_master_weights_are_refused():
    model = Net(nnx.Rngs(0), param_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match=r"'embed.kernel' is already bfloat16.*param_dtype"):
        mp.apply_policy(model, "mixed_bfloat16")
    assert model.embed.dtype is None  # nothing was changed
    mp.apply_policy(model, "bfloat16")  # a pure policy is what the user meant


def test_nnx_unmatched_key_warns_with_nearest_paths():
    with pytest.warns(UserWarning, match=r"'blocks.0.lienar' matches no layer path.*'blocks.0.linear'"):
        mp.apply_policy(net(), "mixed_bfloat16", {"blocks.0.lienar": "float32"})


# -- Flax linen ----------------------------------------------------------------
class LinenNet(nn.Module):
    dtype: object = None  # set: the hand-written mixed version, with a float32 norm and head

    @nn.compact
    def __call__(self, x):
        x = jax.nn.relu(nn.Dense(16, dtype=self.dtype)(x))
        if self.dtype is None:
            x = nn.LayerNorm()(x)
            return nn.Dense(3, name="head")(x)
        x = nn.LayerNorm(dtype=jnp.float32)(x.astype(jnp.float32)).astype(self.dtype)
        return nn.Dense(3, dtype=jnp.float32, name="head")(x)


def test_linen_apply_matches_hand_written_dtypes():
    ours = mp.apply_policy(LinenNet(), "mixed_bfloat16", {"head": "float32"})
    variables = ours.init(jax.random.key(0), X)
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(variables)} == {jnp.dtype("float32")}
    out = jax.jit(ours.apply)(variables, X)
    hand = jax.jit(LinenNet(dtype=jnp.bfloat16).apply)(variables, X)
    assert out.dtype == hand.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), np.asarray(hand))
    grads = jax.grad(lambda v: ours.apply(v, X).sum())(variables)
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(grads)} == {jnp.dtype("float32")}


class LinenRecurrent(nn.Module):
    cell: type = nn.OptimizedLSTMCell
    dtype: object = None

    @nn.compact
    def __call__(self, x):
        h = nn.RNN(self.cell(16, dtype=self.dtype))(x)
        return nn.Dense(3, dtype=self.dtype)(h[:, -1])


@pytest.mark.parametrize("cell", [nn.OptimizedLSTMCell, nn.LSTMCell, nn.GRUCell, nn.MGUCell, nn.SimpleCell])
def test_linen_recurrent_cells_keep_their_carry_as_flaxs_own_dtype_does(cell):
    """nn.RNN scans a cell whose carry must come back in the dtypes it went in: the carry is
    passed uncast, as Flax's own dtype= leaves it (an LSTM's float32 cell state stays float32),
    so the outputs are Flax's own bit for bit; SimpleCell, whose half-precision carry Flax's own
    dtype= hands back to the scan, runs too. (Flax's cells mix a float32 carry with half-precision
    products: standard promotion, as Flax's own dtype= needs.)"""
    x = jax.random.normal(jax.random.key(1), (4, 7, 8))
    with jax.numpy_dtype_promotion("standard"):
        variables = LinenRecurrent(cell).init(jax.random.key(0), x)
        for policy, half in (("mixed_bfloat16", jnp.bfloat16), ("mixed_float16", jnp.float16)):
            ours = mp.apply_policy(LinenRecurrent(cell), policy)
            out = jax.jit(ours.apply)(variables, x)
            assert out.dtype == half
            if cell is not nn.SimpleCell:
                hand = jax.jit(LinenRecurrent(cell, half).apply)(variables, x)  # jitted alike: one kind of program
                np.testing.assert_array_equal(np.asarray(out), np.asarray(hand))
            grads = jax.grad(lambda v: ours.apply(v, x).astype(jnp.float32).sum())(variables)
            assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(grads)} == {jnp.dtype("float32")}
            assert all(bool(jnp.isfinite(leaf).all()) for leaf in jax.tree_util.tree_leaves(grads))


def test_linen_float32_policy_is_plain_flax_bit_for_bit():
    variables = LinenNet().init(jax.random.key(0), X)
    ours = mp.apply_policy(LinenNet(), "float32")
    np.testing.assert_array_equal(np.asarray(jax.jit(ours.apply)(variables, X)),
                                  np.asarray(jax.jit(LinenNet().apply)(variables, X)))


def test_linen_describe_overrides_and_pure_policy_params():
    ours = mp.apply_policy(LinenNet(), "bfloat16", {"Dense_0": "mixed_float16"})
    with pytest.raises(ValueError, match="one init or apply call"):
        mp.describe(ours)
    variables = ours.init(jax.random.key(0), X)
    table = rows(ours)
    assert list(table) == ["", "Dense_0", "LayerNorm_0", "head"]
    assert table["Dense_0"].policy == mp.Policy("mixed_float16")
    assert table["LayerNorm_0"].policy.variable_dtype == "float32"  # the norm rule
    assert variables["params"]["head"]["kernel"].dtype == jnp.bfloat16
    assert variables["params"]["Dense_0"]["kernel"].dtype == jnp.float32
    assert mp.remove_policy(ours) is ours.module
    with pytest.raises(TypeError, match="bare linen module"):
        mp.describe(LinenNet())


def test_linen_unmatched_key_warns_once_with_nearest_paths():
    ours = mp.apply_policy(LinenNet(), "mixed_bfloat16", {"haed": "float32"})
    with pytest.warns(UserWarning, match=r"'haed' matches no layer path.*'head'"):
        variables = ours.init(jax.random.key(0), X)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours.apply(variables, X)


def test_functools_partial_binds_non_array_arguments():
    def f(params, x, activation):
        return activation(x @ params)

    g = mp.apply_policy(functools.partial(f, activation=jnp.tanh), "mixed_bfloat16")
    assert g(jnp.ones((6, 2)), X).dtype == jnp.bfloat16


def test_an_orbax_checkpoint_of_model_and_scaling_optimizer_resumes_bit_for_bit(tmp_path):
    """nnx.state of the model and an nnx.Optimizer around the optax LossScaleOptimizer, saved
    with orbax mid-run and restored into a fresh build: the same losses after as without the
    save, and the same scale and counters (what JAX users checkpoint with)."""
    ocp = require_module("orbax.checkpoint", "jax")
    import optax

    def build():
        model = mp.apply_policy(nnx.Sequential(nnx.Linear(8, 16, rngs=nnx.Rngs(0)), nnx.relu,
                                               nnx.Linear(16, 4, rngs=nnx.Rngs(1))), "mixed_float16")
        tx = mp.LossScaleOptimizer(optax.sgd(0.05, momentum=0.9), policy="mixed_float16", dynamic_growth_steps=3)
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        def loss(model):
            value = jnp.mean((model(x).astype(jnp.float32) - y) ** 2)
            return optimizer.tx.scale_loss(value, optimizer.opt_state), value
        grads, value = nnx.grad(loss, has_aux=True)(model)
        optimizer.update(model, grads)
        return value

    rng = np.random.default_rng(0)
    x, y = jnp.asarray(rng.normal(size=(32, 8)), jnp.float32), jnp.asarray(rng.normal(size=(32, 4)), jnp.float32)
    model, optimizer = build()
    for _ in range(5):
        step(model, optimizer, x, y)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", nnx.state((model, optimizer)))
    checkpointer.wait_until_finished()
    expected = [float(step(model, optimizer, x, y)) for _ in range(4)]
    fresh_model, fresh_optimizer = build()
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, nnx.state((fresh_model, fresh_optimizer)))
    nnx.update((fresh_model, fresh_optimizer), checkpointer.restore(tmp_path / "ckpt", abstract))
    assert [float(step(fresh_model, fresh_optimizer, x, y)) for _ in range(4)] == expected
    assert mp.metrics(fresh_optimizer) == mp.metrics(optimizer)
    assert float(optimizer.opt_state.loss_scale) > 2.0**15  # the scale grew, and came back grown


def test_nnx_a_refused_policy_leaves_the_model_under_the_policy_it_had():
    """The new policy is checked before the old one comes off (with the dtypes the old one
    found): a refusal changes nothing, where the old policy was taken off first and lost."""

    class Two(nnx.Module):
        def __init__(self, rngs):
            self.a, self.b = nnx.Linear(16, 32, rngs=rngs), nnx.Linear(32, 4, rngs=rngs)

        def __call__(self, x):
            return self.b(self.a(x))

    model = Two(nnx.Rngs(0))
    mp.apply_policy(model, mp.PolicyMap("mixed_bfloat16", {"b": "float32"}))
    before = [(r.path, r.policy) for r in mp.describe(model)]
    with pytest.raises(ValueError, match="rowwise"):
        mp.apply_policy(model, mp.Policy("mixed_bfloat16", float8_recipe="rowwise"))
    assert [(r.path, r.policy) for r in mp.describe(model)] == before
    assert model.a(jnp.ones((2, 16))).dtype == jnp.bfloat16
    mp.apply_policy(model, "bfloat16")  # bfloat16 parameters, then a mixed policy: not the user's
    mp.apply_policy(model, "mixed_bfloat16")
    assert model.a.kernel.get_value().dtype == jnp.float32


class _HalfCNN(nn.Module):
    """The Flax ImageNet example's shape in small: a convolution, BatchNorm, a Dense head, `dtype`
    the example's half-precision switch."""

    dtype: object = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(8, (3, 3), dtype=self.dtype)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9, dtype=self.dtype)(x))
        return nn.Dense(10, dtype=self.dtype)(x.mean(axis=(1, 2)))


def test_linen_trains_as_the_flax_examples_half_precision_with_its_dynamic_scale():
    """Flax's own float16 recipe (the ImageNet example: the model's dtype, flax.training's
    DynamicScale, a select of the new state on is_fin) against the policy and the optax wrapper
    on the same weights: the same losses, the same skipped step and scale, the same weights
    within float16 rounding (our norm keeps its statistics in float32; Flax's scale divides where
    ours multiplies by the reciprocal)."""
    optax = require_module("optax", "jax")
    from flax.training import dynamic_scale, train_state

    class State(train_state.TrainState):
        batch_stats: dict

    x = jax.random.normal(jax.random.key(1), (8, 8, 8, 3))
    y = jnp.arange(8) % 10
    init = _HalfCNN().init(jax.random.key(0), x)
    ours_model = mp.apply_policy(_HalfCNN(), "mixed_float16")
    tx = mp.LossScaleOptimizer(optax.sgd(0.1, momentum=0.9), policy="mixed_float16")

    def state(model, opt):
        return State.create(apply_fn=model.apply, params=init["params"], tx=opt, batch_stats=init["batch_stats"])

    def loss_of(s, p, poison):
        logits, new = s.apply_fn({"params": p, "batch_stats": s.batch_stats}, x, mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean() * poison, new

    @jax.jit
    def flax_step(s, scale, poison):
        scale, is_fin, (loss, new), grads = scale.value_and_grad(
            lambda p: loss_of(s, p, poison), has_aux=True)(s.params)
        n = s.apply_gradients(grads=grads, batch_stats=new["batch_stats"])
        keep = functools.partial(jnp.where, is_fin)
        return n.replace(opt_state=jax.tree.map(keep, n.opt_state, s.opt_state),
                         params=jax.tree.map(keep, n.params, s.params)), scale, loss

    @jax.jit
    def our_step(s, poison):
        def scaled(p):
            loss, new = loss_of(s, p, poison)
            return tx.scale_loss(loss, s.opt_state), (loss, new)
        grads, (loss, new) = jax.grad(scaled, has_aux=True)(s.params)
        return s.apply_gradients(grads=grads, batch_stats=new["batch_stats"]), loss

    theirs, scale = state(_HalfCNN(dtype=jnp.float16), optax.sgd(0.1, momentum=0.9)), dynamic_scale.DynamicScale(
        scale=2.0**15)
    ours = state(ours_model, tx)
    for poison in (1.0, 1.0, float("inf"), 1.0, 1.0):
        with jax.numpy_dtype_promotion("standard"):  # Flax's float16 BatchNorm mixes dtypes itself
            theirs, scale, their_loss = flax_step(theirs, scale, jnp.float32(poison))
        ours, our_loss = our_step(ours, jnp.float32(poison))
        assert bool(ours.opt_state.last_step_skipped) == (poison != 1.0)
        assert float(ours.opt_state.loss_scale) == float(scale.scale)
        np.testing.assert_allclose(float(our_loss), float(their_loss), rtol=1e-4)
    assert int(ours.opt_state.num_skipped_steps) == 1
    for a, b in zip(jax.tree_util.tree_leaves(ours.params), jax.tree_util.tree_leaves(theirs.params)):
        np.testing.assert_allclose(a, b, atol=1e-4)
