"""fp8 matmuls on Flax NNX (issue 29) through nnx.Linear's dot_general hook: 'tensorwise', the
same numbers as torchao's tensorwise recipe, and 'delayed', the same scales and histories as
the torch layer that runs Keras's algorithm, on the same weights and inputs."""

import numpy as np
import pytest

from conftest import require_module

import mixedpolicy as mp

jax = require_module("jax")
nnx = require_module("flax.nnx", "jax")
optax = require_module("optax", "jax")
jnp = jax.numpy


class Net(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(10, 16, rngs=rngs)
        self.a = nnx.Linear(32, 64, rngs=rngs)
        self.b = nnx.Linear(64, 32, rngs=rngs)
        self.norm = nnx.LayerNorm(32, rngs=rngs)
        self.head = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens).reshape(tokens.shape[0], -1)
        return self.head(self.norm(jax.nn.relu(self.b(jax.nn.relu(self.a(x))))))


def _data():
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.integers(0, 10, (16, 2))), jnp.asarray(np.arange(16) % 10)


def _loss(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x).astype(jnp.float32), y).mean()


def test_tensorwise_equals_torchaos_recipe_on_the_same_weights_within_float32_rounding():
    torch = require_module("torch")
    require_module("torchao")
    from torchao.float8 import convert_to_float8_training

    net = Net(nnx.Rngs(0))
    seq = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    for i, layer in ((0, net.a), (2, net.b)):
        seq[i].weight.data = torch.tensor(np.asarray(layer.kernel[...]).T.copy())
        seq[i].bias.data = torch.tensor(np.asarray(layer.bias[...]))
    convert_to_float8_training(seq)
    mp.apply_policy(net, mp.Policy("float32", float8_recipe="tensorwise"))
    h = np.random.default_rng(1).normal(size=(16, 32)).astype(np.float32)
    out = torch.tensor(h, requires_grad=True)
    theirs = seq(out)
    theirs.square().sum().backward()

    def body(a, b, h):
        return b(jax.nn.relu(a(h)))

    ours = body(net.a, net.b, jnp.asarray(h))
    grads = nnx.grad(lambda a, b: jnp.square(body(a, b, jnp.asarray(h))).sum(), argnums=(0, 1))(net.a, net.b)
    np.testing.assert_allclose(np.asarray(ours), theirs.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grads[0].kernel[...]).T, seq[0].weight.grad.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(grads[1].kernel[...]).T, seq[2].weight.grad.numpy(), rtol=1e-4, atol=1e-4)


def test_rules_describe_training_under_jit_and_remove_policy():
    net = Net(nnx.Rngs(0))
    plain_dot = net.a.dot_general
    mp.apply_policy(net, "p=f32,c=bf16,float8=tensorwise")
    rows = {r.path: r for r in mp.describe(net)}
    assert rows["a"].float8 == rows["b"].float8 == "tensorwise"
    assert rows[""].float8 == "-" and rows[""].policy.float8_recipe is not None  # the container runs no matmul
    for path, why in (("embed", "embeddings"), ("head", "the output head"), ("norm", "normalization")):
        assert rows[path].float8 == "-" and why in rows[path].source, rows[path]
    optimizer = nnx.Optimizer(net, mp.LossScaleOptimizer(optax.sgd(0.1), policy="mixed_bfloat16"), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(_loss)(model, x, y)
        optimizer.update(model, grads)
        return loss

    x, y = _data()
    losses = [float(step(net, optimizer, x, y)) for _ in range(20)]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert net.a(jnp.ones((2, 32))).dtype == jnp.bfloat16
    mp.remove_policy(net)
    assert net.a.dot_general is plain_dot and mp.describe(net)[1].source == "no policy applied"


def test_what_nnx_cannot_run_is_refused_before_anything_changes():
    net = Net(nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"recipe 'rowwise' for Flax NNX layer 'a'.*'tensorwise'.*'delayed'.*runs on torch"):
        mp.apply_policy(net, "p=f32,c=bf16,float8=rowwise")
    assert all(r.source == "no policy applied" for r in mp.describe(net))
    linen = require_module("flax.linen", "jax")
    with pytest.raises(ValueError, match="for a Flax linen module: linen runs 'tensorwise'.*'delayed'.*nothing was applied"):
        mp.apply_policy(linen.Dense(4), "p=f32,c=bf16,float8=rowwise")


def test_tensorwise_on_linen_is_the_nnx_hook_on_the_same_weights():
    """linen's nn.Dense under 'tensorwise' takes the hook nnx.Linear takes (stateless: no fp8
    variables): the same outputs and gradients as NNX on the same weights and inputs, within
    float32 rounding (two programs); the head stays in the source precision."""
    nn = require_module("flax.linen", "jax")

    class Lin(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(64, name="a")(x))
            x = nn.relu(nn.Dense(32, name="b")(x))
            return nn.Dense(10, name="head")(x)

    class Nnx(nnx.Module):
        def __init__(self, rngs):
            self.a, self.b, self.head = nnx.Linear(32, 64, rngs=rngs), nnx.Linear(64, 32, rngs=rngs), nnx.Linear(32, 10, rngs=rngs)

        def __call__(self, x):
            return self.head(jax.nn.relu(self.b(jax.nn.relu(self.a(x)))))

    x = jnp.asarray(np.random.default_rng(1).normal(size=(16, 32)).astype(np.float32))
    policy = mp.Policy("float32", float8_recipe="tensorwise")
    lin = mp.apply_policy(Lin(), policy)
    variables = lin.init(jax.random.key(0), x)
    assert set(variables) == {"params"}  # no fp8 state
    net = Nnx(nnx.Rngs(0))
    for name in ("a", "b", "head"):
        getattr(net, name).kernel[...] = variables["params"][name]["kernel"]
        getattr(net, name).bias[...] = variables["params"][name]["bias"]
    mp.apply_policy(net, policy)
    ours = lin.apply(variables, x)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(net(x)), rtol=1e-5, atol=1e-5)
    g_lin = jax.grad(lambda v: jnp.square(lin.apply(v, x)).sum())(variables)["params"]
    g_nnx = nnx.grad(lambda m: jnp.square(m(x)).sum())(net)
    for name in ("a", "b", "head"):
        np.testing.assert_allclose(np.asarray(g_lin[name]["kernel"]), np.asarray(getattr(g_nnx, name).kernel[...]),
                                   rtol=1e-4, atol=1e-4)
    plain = Lin().apply(variables, x)  # fp8 changes the numbers where it applies
    assert not np.allclose(np.asarray(ours), np.asarray(plain), rtol=1e-6, atol=1e-6)
    rows = {r.path: r for r in mp.describe(lin)}
    assert rows["a"].float8 == rows["b"].float8 == "tensorwise" and rows["head"].float8 == "-"
    assert rows[""].float8 == "-" and rows[""].policy.float8_recipe is not None  # the container runs no matmul


def test_delayed_on_linen_is_flax_own_fp8_op_bit_for_bit():
    """A linen nn.Dense under 'delayed' runs Flax's Fp8DirectDotGeneralOp: the same losses and
    fp8 state as nn.Dense(dot_general_cls=Fp8DirectDotGeneralOp) written by hand; the head
    (the last Dense, found by one trace) stays in the source precision."""
    import functools

    nn = require_module("flax.linen", "jax")

    class Net(nn.Module):
        fp8: object = None

        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(64, dot_general_cls=self.fp8)(x))
            x = nn.relu(nn.Dense(32, dot_general_cls=self.fp8)(x))
            return nn.Dense(10)(x)

    x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 32)).astype(np.float32))
    y = jnp.arange(16) % 10

    def train(model):
        variables = model.init(jax.random.key(0), x)

        def loss(v):
            return optax.softmax_cross_entropy_with_integer_labels(model.apply(v, x), y).mean()

        losses = []
        for _ in range(4):  # Flax's fp8 pattern: the op's state is overwritten by its "gradient"
            value, grads = jax.jit(jax.value_and_grad(loss))(variables)
            variables = {"params": jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, variables["params"], grads["params"]),
                         "_overwrite_with_gradient": grads["_overwrite_with_gradient"]}
            losses.append(float(value))
        return losses, variables

    ours = mp.apply_policy(Net(), mp.Policy("float8_from_float32", amax_history_len=16))
    theirs = Net(fp8=functools.partial(nn.Fp8DirectDotGeneralOp, amax_history_length=16))
    (a, va), (b, vb) = train(ours), train(theirs)
    assert a == b
    for p, q in zip(jax.tree_util.tree_leaves(va), jax.tree_util.tree_leaves(vb)):
        np.testing.assert_array_equal(np.asarray(p), np.asarray(q))
    rows = {r.path: r for r in mp.describe(ours)}
    assert rows["Dense_0"].float8 == rows["Dense_1"].float8 == "delayed"
    assert rows["Dense_2"].float8 == "-" and "the output head" in rows["Dense_2"].source
    assert va["_overwrite_with_gradient"]["Dense_0"]["Fp8DirectDotGeneralOp_0"]["input_amax_history"].shape == (16,)


# -- delayed: Keras's algorithm, its state as Float8Meta variables ---------------------------
class Mlp(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(32, 64, rngs=rngs)
        self.down = nnx.Linear(64, 16, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def _delayed_step(lr=0.01):
    def mse(model, x, y):
        return jnp.mean(jnp.square(model(x).astype(jnp.float32) - y))

    @nnx.jit
    def step(model, optimizer, x, y):
        def scaled(model, x, y):  # the loss scaled where the optimizer is ours (a float16 source scales)
            loss = mse(model, x, y)
            scale = getattr(optimizer.tx, "scale_loss", lambda loss, state: loss)
            return scale(loss, optimizer.opt_state), loss

        (_, loss), grads = nnx.value_and_grad(scaled, argnums=nnx.DiffState(0, mp.jax.with_float8()),
                                              has_aux=True)(model, x, y)
        optimizer.update(model, grads)
        mp.jax.update_float8(model, grads, optimizer)
        return loss
    return step


def _inputs(steps):
    rng = np.random.default_rng(0)
    return [(rng.normal(size=(8, 32)).astype("float32") * (i + 1), np.zeros((8, 16), "float32")) for i in range(steps)]


def test_delayed_gives_the_torch_layers_scales_and_histories_on_the_same_weights():
    """NNX and torch (DelayedFloat8Linear) run Keras's delayed algorithm: the same scales and
    amax histories for the input, the kernel and the output gradient, step by step."""
    torch = require_module("torch")
    net = Mlp(nnx.Rngs(0))
    seq = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    for i, layer in ((0, net.up), (2, net.down)):
        seq[i].weight.data = torch.tensor(np.asarray(layer.kernel[...]).T.copy())
        seq[i].bias.data = torch.tensor(np.asarray(layer.bias[...]))
    policy = mp.Policy("float8_from_float32", amax_history_len=4)
    mp.apply_policy(net, mp.PolicyMap(policy, {"down": policy}))  # the head in fp8 too
    mp.apply_policy(seq, mp.PolicyMap(policy, {"2": policy}))
    assert [r.float8 for r in mp.describe(net)] == ["-", "delayed", "delayed"]
    optimizer = nnx.Optimizer(net, mp.LossScaleOptimizer(optax.sgd(0.01)), wrt=nnx.Param)
    sgd = torch.optim.SGD(seq.parameters(), lr=0.01)
    step = _delayed_step()
    for x, y in _inputs(4):
        ours = float(step(net, optimizer, jnp.asarray(x), jnp.asarray(y)))
        sgd.zero_grad()
        theirs = torch.nn.functional.mse_loss(seq(torch.tensor(x)), torch.tensor(y))
        theirs.backward()
        sgd.step()
        assert ours == pytest.approx(theirs.item(), rel=2e-3)  # fp8 roundings of values an ulp apart
        for layer, twin in ((net.up, seq[0]), (net.down, seq[2])):
            for operand, name in (("inputs", "input"), ("kernel", "weight"), ("outputs_grad", "grad")):
                for what in ("scale", "amax_history"):
                    got = np.asarray(getattr(layer, f"float8_{operand}_{what}")[...])
                    want = getattr(twin, f"{name}_{what}").detach().numpy()
                    np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"{operand}_{what}")
    assert float(net.up.float8_outputs_grad_scale[...]) != 1.0  # the backward wrote its next scale


def test_delayed_refuses_a_step_that_drops_its_state_and_evaluation_changes_nothing():
    net = Mlp(nnx.Rngs(0))
    mp.apply_policy(net, mp.Policy("mixed_bfloat16", float8_recipe="delayed", amax_history_len=8))
    optimizer = nnx.Optimizer(net, optax.sgd(0.01), wrt=nnx.Param)
    x, y = (jnp.asarray(a) for a in _inputs(1)[0])

    @nnx.jit
    def forgetful(model, optimizer, x, y):
        grads = nnx.grad(lambda m: jnp.mean(jnp.square(m(x).astype(jnp.float32) - y)))(model)
        optimizer.update(model, grads)

    with pytest.raises(ValueError, match=r"without one of its fp8 state variables.*mp\.jax\.with_float8\(\)"):
        forgetful(net, optimizer, x, y)
    with pytest.raises(ValueError, match="without the fp8 state"):
        mp.jax.update_float8(net, nnx.state(net, nnx.Param))
    with pytest.raises(TypeError, match="Received grads of type dict; expected what nnx.grad"):
        mp.jax.update_float8(net, {"up": {}})
    with pytest.raises(TypeError, match="Received model of type str; expected the Flax NNX model"):
        mp.jax.update_float8("net", nnx.state(net))
    with pytest.raises(TypeError, match="Received params=42 of type int; expected an nnx filter"):
        mp.jax.with_float8(42)
    before = nnx.state(net, nnx.Not(nnx.Param))
    assert net(x).dtype == jnp.bfloat16  # a forward alone quantizes with the scales it has ...
    after = nnx.state(net, nnx.Not(nnx.Param))
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda a, b: bool(jnp.array_equal(a, b)), before, after))
    _delayed_step()(net, optimizer, x, y)  # ... and a training step moves them
    assert float(net.up.float8_inputs_amax_history[...][0]) > 0
    mp.remove_policy(net)
    assert not [k for k in vars(net.up) if k.startswith("float8")] and type(net.up) is nnx.Linear


def test_delayed_state_resumes_bit_for_bit_and_a_skipped_step_keeps_it():
    policy = mp.Policy("float8_from_mixed_float16", amax_history_len=4)
    net = Mlp(nnx.Rngs(0))
    mp.apply_policy(net, mp.PolicyMap(policy, {"down": policy}))
    optimizer = nnx.Optimizer(net, mp.LossScaleOptimizer(optax.sgd(0.01, momentum=0.9), policy=policy),
                              wrt=nnx.Param)
    step = _delayed_step()
    data = [(jnp.asarray(x), jnp.asarray(y)) for x, y in _inputs(4)]
    for x, y in data[:2]:
        step(net, optimizer, x, y)
    graph, state = nnx.split((net, optimizer))
    twin_net, twin_opt = nnx.merge(graph, jax.tree_util.tree_map(jnp.copy, state))
    ours = [float(step(net, optimizer, x, y)) for x, y in data[2:]]
    assert ours == [float(step(twin_net, twin_opt, x, y)) for x, y in data[2:]]
    kept = nnx.state(net, mp.jax.with_float8(nnx.Not(nnx.Param)))
    step(net, optimizer, data[0][0].at[0, 0].set(jnp.nan), data[0][1])  # NaN: the step is skipped
    assert bool(optimizer.opt_state.last_step_skipped)
    now = nnx.state(net, mp.jax.with_float8(nnx.Not(nnx.Param)))
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda a, b: bool(jnp.array_equal(a, b)), kept, now))


def test_an_optimizer_given_the_fp8_state_to_train_is_refused_with_the_fix():
    net = Mlp(nnx.Rngs(0))
    mp.apply_policy(net, "float8_from_mixed_bfloat16")
    optimizer = nnx.Optimizer(net, mp.LossScaleOptimizer(optax.sgd(0.01)), wrt=mp.jax.with_float8())
    x, y = (jnp.asarray(a) for a in _inputs(1)[0])
    with pytest.raises(TypeError, match=r"float8_inputs_amax_history.*wrt=nnx\.Param.*update_float8"):
        _delayed_step()(net, optimizer, x, y)
    tx, tree = mp.LossScaleOptimizer(optax.sgd(0.01)), {"up": {"float8_kernel_scale": jnp.ones(())}}
    with pytest.raises(TypeError, match=r"\['up'\]\['float8_kernel_scale'\]"):  # an eager step alike
        tx.update(tree, tx.init(tree), tree)


def test_an_orbax_checkpoint_mid_run_resumes_the_fp8_state_bit_for_bit(tmp_path):
    ocp = require_module("orbax.checkpoint", "jax")
    policy = mp.Policy("float8_from_mixed_bfloat16", amax_history_len=4)

    def build():
        net = Mlp(nnx.Rngs(0))
        mp.apply_policy(net, mp.PolicyMap(policy, {"down": policy}))
        return net, nnx.Optimizer(net, mp.LossScaleOptimizer(optax.sgd(0.01, momentum=0.9)), wrt=nnx.Param)

    step = _delayed_step()
    data = [(jnp.asarray(x), jnp.asarray(y)) for x, y in _inputs(6)]
    net, optimizer = build()
    for x, y in data[:3]:
        step(net, optimizer, x, y)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", nnx.state((net, optimizer)))
    checkpointer.wait_until_finished()
    expected = [float(step(net, optimizer, x, y)) for x, y in data[3:]]
    fresh, fresh_optimizer = build()
    abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, nnx.state((fresh, fresh_optimizer)))
    nnx.update((fresh, fresh_optimizer), checkpointer.restore(tmp_path / "ckpt", abstract))
    assert float(fresh.up.float8_inputs_amax_history[...][0]) > 0  # the histories came back
    assert [float(step(fresh, fresh_optimizer, x, y)) for x, y in data[3:]] == expected


class Scanned(nnx.Module):
    """Three blocks made by nnx.vmap and run by nnx.scan (how NNX stacks transformer layers)."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return nnx.Linear(32, 32, rngs=rngs)

        self.blocks = make(rngs)
        self.head = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return jax.nn.relu(block(x))

        return self.head(body(x.astype(jnp.bfloat16), self.blocks))


def test_delayed_layers_stacked_for_nnx_scan_keep_a_state_each():
    net = Scanned(nnx.Rngs(0))
    mp.apply_policy(net, mp.Policy("float8_from_mixed_bfloat16", amax_history_len=4))
    assert net.blocks.float8_inputs_amax_history[...].shape == (3, 4)
    optimizer = nnx.Optimizer(net, optax.sgd(0.01), wrt=nnx.Param)
    x, y = _inputs(1)[0]
    _delayed_step()(net, optimizer, jnp.asarray(x), jnp.asarray(y))
    first = np.asarray(net.blocks.float8_inputs_amax_history[...])[:, 0]
    grads = np.asarray(net.blocks.float8_outputs_grad_amax_history[...])[:, 0]
    assert np.all(first > 0) and len(set(first.tolist())) == 3 and np.all(grads > 0)  # one per layer


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_a_model_called_under_jax_vmap_scales_by_the_batch_as_called_on_it(recipe):
    """Under jax.vmap each layer sees one example; its fp8 scales (and, delayed, the amaxes
    entering its histories) are still the batch's: the same outputs, gradients and next fp8
    state as the model called on the batch. (Before, delayed histories summed the examples'.)"""
    policy = mp.Policy(f"p=f32,c=bf16,float8={recipe}" + (",amax_history_len=4" if recipe == "delayed" else ""))
    x = jax.random.normal(jax.random.key(1), (8, 32)) * jnp.linspace(0.1, 4.0, 8)[:, None]
    grads = []
    for mapped in (True, False):
        model = mp.apply_policy(Mlp(nnx.Rngs(0)), policy)
        loss = lambda m: jnp.sum(jnp.sin((jax.vmap(m)(x) if mapped else m(x)).astype(jnp.float32)))  # noqa: E731,B023
        grads.append(nnx.grad(loss, argnums=nnx.DiffState(0, mp.jax.with_float8()))(model))
    mapped, whole = (jax.tree_util.tree_leaves(g) for g in grads)
    for a, b in zip(mapped, whole):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    if recipe == "delayed":  # the newest amax: the whole batch's input, as bfloat16 holds it
        history = grads[0]["up"]["float8_inputs_amax_history"][...]
        assert float(history[0]) == float(jnp.abs(x.astype(jnp.bfloat16)).max()) and float(history[1]) == 0


def test_an_nnx_vmap_ensemble_scales_each_member_by_its_own_weights():
    """nnx.vmap over members (kernels stacked, the input shared): each member's fp8 matmul is
    its own, as that member alone computes it, though their kernels are 10^4 apart."""
    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key):
        return Mlp(nnx.Rngs(key))

    members = make(jax.random.split(jax.random.key(0), 3))
    members.up.kernel.set_value(members.up.kernel[...] * jnp.asarray([0.01, 1.0, 100.0])[:, None, None])
    mp.apply_policy(members, mp.Policy("p=f32,c=bf16,float8=tensorwise"))
    x = jax.random.normal(jax.random.key(1), (8, 32))
    together = nnx.vmap(lambda m, x: m(x), in_axes=(0, None))(members, x)
    graph, state = nnx.split(members)
    for i in range(3):
        alone = nnx.merge(graph, jax.tree_util.tree_map(lambda a, i=i: a[i], state))(x)
        np.testing.assert_allclose(np.asarray(together[i], np.float32), np.asarray(alone, np.float32),
                                   rtol=1e-2, atol=1e-2 * float(jnp.abs(alone.astype(jnp.float32)).max()))
