"""fp8 matmuls in a plain JAX function (issue 29): the function's jaxpr evaluated again with its
weight matmuls through the NNX hook's fp8 matmul, the layer adapters' rules per matmul."""

import numpy as np
import pytest

from conftest import require_module

import mixedpolicy as mp

jax = require_module("jax")
nnx = require_module("flax.nnx", "jax")
jnp = jax.numpy

FP8 = mp.Policy("float8_from_mixed_bfloat16", float8_recipe="tensorwise")
DELAYED_STATE = mp.float8.DELAYED_STATE


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(64, 32, rngs=rngs)
        self.b = nnx.Linear(32, 48, rngs=rngs)
        self.c = nnx.Linear(48, 24, rngs=rngs)  # 24 is no multiple of 16: kept in bfloat16
        self.head = nnx.Linear(24, 16, rngs=rngs)

    def __call__(self, x):
        for layer in (self.a, self.b, self.c):
            x = jax.nn.relu(layer(x))
        return self.head(x)


def mlp(p, x):
    for name in ("a", "b", "c"):
        x = jax.nn.relu(x @ p[name]["w"] + p[name]["b"])
    return x @ p["head"]["w"] + p["head"]["b"]


def _params(model):
    return {k: {"w": getattr(model, k).kernel[...], "b": getattr(model, k).bias[...]}
            for k in ("a", "b", "c", "head")}


def _fp8_matmuls(fn, *args):
    """The dot_generals of `fn`'s jaxpr (nested ones included) that take fp8 operands."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append(str(eqn.invars[0].aval.dtype))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return sum(dtype.startswith("float8") for dtype in found)


def test_a_plain_function_computes_as_the_same_nnx_model_does_forward_and_backward():
    model = MLP(nnx.Rngs(0))
    params = _params(model)
    x = jax.random.normal(jax.random.key(1), (8, 64))
    fn = mp.apply_policy(mlp, FP8)
    mp.apply_policy(model, FP8)
    assert fn(params, x).dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(fn(params, x), np.float32), np.asarray(model(x), np.float32),
                               rtol=1e-2, atol=1e-2)
    grads = jax.grad(lambda p: jnp.sum(fn(p, x).astype(jnp.float32) ** 2))(params)
    theirs = nnx.grad(lambda m: jnp.sum(m(x).astype(jnp.float32) ** 2))(model)
    for name in ("a", "b", "c", "head"):
        assert grads[name]["w"].dtype == jnp.float32
        np.testing.assert_allclose(grads[name]["w"], getattr(theirs, name).kernel[...], rtol=2e-2, atol=1e-2)
    # a, b in fp8; c (24 wide) and the head kept; forward and both backward matmuls
    assert _fp8_matmuls(fn, params, x) == 2
    assert _fp8_matmuls(jax.grad(lambda p: jnp.sum(fn(p, x).astype(jnp.float32))), params) == 6
    assert mp.describe(fn)[0].float8 == "tensorwise"
    # the map's settings: without the built-in rules the 24-wide layer and the head too; the
    # auto filter keeps out all four (each far below the sizes where fp8 outran bf16)
    assert _fp8_matmuls(mp.apply_policy(mlp, mp.PolicyMap(FP8, builtin_rules=False)), params, x) == 4
    assert _fp8_matmuls(mp.apply_policy(mlp, mp.PolicyMap(FP8, float8_auto_filter=True)), params, x) == 0


def test_only_weight_matmuls_run_in_fp8_not_products_of_activations():
    rng = np.random.default_rng(0)
    p = {"q": jnp.asarray(rng.normal(size=(32, 32)) / 6, jnp.float32),
         "o": jnp.asarray(rng.normal(size=(32, 32)) / 6, jnp.float32),
         "head": jnp.asarray(rng.normal(size=(32, 16)) / 6, jnp.float32)}

    def attention(p, x):
        q = jnp.einsum("btd,de->bte", x, p["q"])          # a weight by an activation: fp8
        mix = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, x).astype(jnp.float32), axis=-1)
        h = jnp.einsum("bqk,bkd->bqd", mix.astype(q.dtype), x)  # two activations: kept
        h = jnp.einsum("bqd,ed->bqe", h, p["o"].T)         # the weight transposed: still a weight
        return h.mean(axis=1) @ p["head"]                  # the head: kept

    x = jnp.asarray(rng.normal(size=(2, 8, 32)), jnp.float32)
    fn = mp.apply_policy(attention, FP8)
    assert _fp8_matmuls(fn, p, x) == 2
    ref = mp.apply_policy(attention, "mixed_bfloat16")(p, x)
    ours, ref = np.asarray(fn(p, x), np.float32), np.asarray(ref, np.float32)
    assert np.linalg.norm(ours - ref) < 0.1 * np.linalg.norm(ref)  # e4m3 keeps 3 mantissa bits


def test_nested_programs_scan_jit_cond_and_checkpoint_run_their_matmuls_in_fp8():
    rng = np.random.default_rng(0)
    p = {"stack": jnp.asarray(rng.normal(size=(3, 32, 32)) / 6, jnp.float32),
         "w": jnp.asarray(rng.normal(size=(32, 32)) / 6, jnp.float32),
         "head": jnp.asarray(rng.normal(size=(32, 16)) / 6, jnp.float32)}

    def nested(p, x, flag):
        x, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["stack"])
        x = jax.jit(lambda h, w: jnp.tanh(h @ w))(x, p["w"])
        x = jax.lax.cond(flag, lambda h, w: h @ w, lambda h, w: h, x, p["w"])
        x = jax.checkpoint(lambda h, w: jnp.tanh(w.T @ h.T).T)(x, p["w"])
        return x @ p["head"]

    def unrolled(p, x, flag):
        for i in range(3):
            x = jnp.tanh(x @ p["stack"][i])
        x = jnp.tanh(x @ p["w"])
        x = x @ p["w"] if flag else x
        return jnp.tanh(x @ p["w"]) @ p["head"]

    x = jnp.asarray(rng.normal(size=(16, 32)), jnp.float32)
    fn, ref = mp.apply_policy(nested, FP8), mp.apply_policy(unrolled, FP8)
    assert _fp8_matmuls(fn, p, x, True) == 4  # scan's body once, jit, cond's branch, checkpoint
    for flag in (True, False):
        np.testing.assert_allclose(np.asarray(fn(p, x, flag), np.float32), np.asarray(ref(p, x, flag), np.float32),
                                   rtol=1e-2, atol=1e-2)
    loss = lambda f: (lambda q: jnp.sum(f(q, x, True).astype(jnp.float32) ** 2))  # noqa: E731
    ours, theirs = jax.jit(jax.grad(loss(fn)))(p), jax.jit(jax.grad(loss(ref)))(p)
    assert _fp8_matmuls(jax.grad(loss(fn)), p) >= 12  # each weight matmul's two backward ones too
    for key in p:  # e5m2 output gradients (2 mantissa bits) tell two compiled programs apart:
        # the same function jitted and eager differ by 7% here, through six layers
        assert np.linalg.norm(ours[key] - theirs[key]) < 0.3 * np.linalg.norm(theirs[key])


def test_an_equinox_models_loss_function_runs_its_matmuls_over_the_batch_in_fp8():
    """The policy on a loss that vmaps an Equinox model over the batch: the model's matmuls run
    in fp8 and its activation leaves pass through the casts (the policy on the model itself:
    test_jax_equinox.py)."""
    eqx = require_module("equinox", "jax")
    model = eqx.nn.MLP(64, 10, 64, depth=3, key=jax.random.key(0))  # 4 matmuls; the last the head
    x, y = jax.random.normal(jax.random.key(1), (32, 64)), jnp.arange(32) % 10

    def loss(model, x, y):
        logits = jax.vmap(model)(x).astype(jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))

    fn = mp.apply_policy(loss, FP8)
    weights, static = eqx.partition(model, eqx.is_array)
    assert _fp8_matmuls(lambda w: fn(eqx.combine(w, static), x, y), weights) == 3
    value, grads = eqx.filter_jit(eqx.filter_value_and_grad(fn))(model, x, y)
    ref = eqx.filter_value_and_grad(mp.apply_policy(loss, "mixed_bfloat16"))(model, x, y)[0]
    assert np.isfinite(float(value)) and abs(float(value) - float(ref)) < 0.05 * abs(float(ref))
    assert all(g.dtype == jnp.float32 and bool(jnp.any(g != 0)) for g in jax.tree_util.tree_leaves(grads))


def test_a_plain_function_trains_under_jit_in_fp8():
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = jnp.asarray(digits.data[:512] / 16.0, jnp.float32)
    y = jnp.asarray(digits.target[:512])
    params = _params(MLP(nnx.Rngs(0)))
    fn = mp.apply_policy(mlp, FP8)

    def loss(p):
        logits = fn(p, x).astype(jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits[:, :10]), y[:, None], axis=1))

    @jax.jit
    def step(p):
        value, grads = jax.value_and_grad(loss)(p)
        return jax.tree_util.tree_map(lambda w, g: w - 0.5 * g, p, grads), value

    first = None
    for _ in range(60):
        params, value = step(params)
        first = float(value) if first is None else first
    assert np.isfinite(float(value)) and float(value) < 0.5 * first


def test_under_vmap_the_scales_are_the_whole_batchs_as_without_it():
    """Called under jax.vmap the function sees one example, yet each matmul's scale is the
    batch's: the same outputs and gradients as the call on the whole batch."""
    params = _params(MLP(nnx.Rngs(0)))
    x = jax.random.normal(jax.random.key(1), (16, 64)) * jnp.linspace(0.1, 10, 16)[:, None]
    fn = mp.apply_policy(mlp, FP8)
    whole = fn(params, x)
    mapped = jax.vmap(fn, in_axes=(None, 0))(params, x)
    np.testing.assert_allclose(np.asarray(mapped, np.float32), np.asarray(whole, np.float32), rtol=1e-2, atol=1e-2)
    loss = lambda p, call: jnp.sum(call(p).astype(jnp.float32) ** 2)  # noqa: E731
    g_whole = jax.grad(loss)(params, lambda p: fn(p, x))
    g_mapped = jax.grad(loss)(params, lambda p: jax.vmap(fn, in_axes=(None, 0))(p, x))
    for a, b in zip(jax.tree_util.tree_leaves(g_mapped), jax.tree_util.tree_leaves(g_whole)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0.05, atol=0.05 * float(jnp.abs(b).max()))
    by_example = jnp.stack([fn(params, xi[None])[0] for xi in x])  # a scale per example differs
    assert float(jnp.abs(by_example.astype(jnp.float32) - whole.astype(jnp.float32)).max()) > 1e-2


DELAYED = mp.Policy("p=f32,c=bf16,float8=delayed,amax_history_len=4")


def test_delayed_scaling_in_a_function_is_the_same_nnx_models_step_for_step():
    """A function has no variables for delayed scaling's state, so the caller holds it: made by
    init_float8, passed as float8_state, its gradient the next state. Three SGD steps of the
    function and of the same NNX model under the same policy: the same losses, weights, scales
    and amax histories (Keras's algorithm, state in Keras's names) within float32 rounding."""
    model = MLP(nnx.Rngs(0))
    params = _params(model)
    mp.apply_policy(model, DELAYED)
    x, y = jax.random.normal(jax.random.key(1), (8, 64)), jax.random.normal(jax.random.key(2), (8, 16))
    fn = mp.apply_policy(mlp, DELAYED)
    state = fn.init_float8(params, x)
    assert len(state) == 2 and set(state[0]) == set(DELAYED_STATE)  # a and b; c is 24 wide, head kept

    @jax.jit
    def step(p, s):
        loss = lambda p, s: jnp.mean((fn(p, x, float8_state=s).astype(jnp.float32) - y) ** 2)  # noqa: E731
        value, (gp, gs) = jax.value_and_grad(loss, argnums=(0, 1))(p, s)
        return jax.tree_util.tree_map(lambda w, g: w - 0.1 * g, p, gp), gs, value

    @nnx.jit
    def nnx_step(m):
        loss = lambda m: jnp.mean((m(x).astype(jnp.float32) - y) ** 2)  # noqa: E731
        value, grads = nnx.value_and_grad(loss, argnums=nnx.DiffState(0, mp.jax.with_float8()))(m)
        nnx.update(m, jax.tree_util.tree_map(lambda w, g: w - 0.1 * g, nnx.state(m, nnx.Param), nnx.state(grads, nnx.Param)))
        mp.jax.update_float8(m, grads)
        return value

    # two compiled programs (jax.jit, nnx.jit): equal within rounding, never asked to be bit equal
    for _ in range(3):
        params, state, value = step(params, state)
        np.testing.assert_allclose(float(value), float(nnx_step(model)), rtol=1e-3)
    for layer, own in zip((model.a, model.b), state):
        for name, array in own.items():
            np.testing.assert_allclose(np.asarray(array), np.asarray(getattr(layer, name)[...]), rtol=1e-3, err_msg=name)
    np.testing.assert_allclose(np.asarray(params["a"]["w"]), np.asarray(model.a.kernel[...]), rtol=1e-3, atol=1e-5)
    # the newest amax first: the input's, as the bfloat16 compute dtype holds it
    assert float(state[0]["float8_inputs_amax_history"][0]) == float(jnp.abs(x.astype(jnp.bfloat16)).max())


def test_delayed_names_the_weight_kernel_whichever_side_of_the_matmul_it_is():
    w = jax.random.normal(jax.random.key(0), (32, 64)) * 3.0

    def transposed(p, x):  # the weight on the left: (out, in) @ (in, batch)
        return (p["w"] @ x.T).T

    fn = mp.apply_policy(transposed, mp.PolicyMap(DELAYED, builtin_rules=False))
    x = jax.random.normal(jax.random.key(1), (16, 64))
    state = fn.init_float8({"w": w}, x)
    new = jax.grad(lambda s: fn({"w": w}, x, float8_state=s).astype(jnp.float32).sum())(state)
    amax = lambda a: float(jnp.abs(a.astype(jnp.bfloat16)).max())  # noqa: E731  (the compute dtype's values)
    assert float(new[0]["float8_kernel_amax_history"][0]) == amax(w) and amax(w) != amax(x)
    assert float(new[0]["float8_inputs_amax_history"][0]) == amax(x)


def test_delayed_state_moves_once_a_call_under_vmap_too_and_what_cannot_is_refused():
    params = _params(MLP(nnx.Rngs(0)))
    x = jnp.ones((4, 64))
    fn = mp.apply_policy(mlp, "float8_from_mixed_bfloat16")  # Keras's name alone: delayed
    with pytest.raises(TypeError, match="no float8_state .* 2 fp8 matmuls.*init_float8"):
        fn(params, x)
    with pytest.raises(ValueError, match="does not fit .*histories of shape \\(1024,\\)"):
        fn(params, x, float8_state=fn.init_float8(params, x)[:1])
    state = fn.init_float8(params, x)
    x = jax.random.normal(jax.random.key(1), (4, 64)) * jnp.arange(1.0, 5.0)[:, None]
    mapped = jax.grad(lambda s: jax.vmap(lambda xi: fn(params, xi, float8_state=s))(x).astype(jnp.float32).sum())(state)
    whole = jax.grad(lambda s: fn(params, x, float8_state=s).astype(jnp.float32).sum())(state)
    for a, b in zip(jax.tree_util.tree_leaves(mapped), jax.tree_util.tree_leaves(whole)):  # under vmap: the
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5)  # batch's amax, moved once
    stacked = {"w": jnp.ones((3, 32, 32)) / 32}

    def scanned(p, x):
        return jax.lax.scan(lambda h, w: (jax.nn.relu(h @ w), None), x, p["w"])[0]

    looped = mp.apply_policy(scanned, mp.PolicyMap(DELAYED, builtin_rules=False))
    with pytest.raises(ValueError, match="inside a jax.lax.scan.*once a call"):
        looped.init_float8(stacked, jnp.ones((4, 32)))
    with pytest.raises(TypeError, match="keeps no fp8 state"):
        mp.apply_policy(mlp, FP8)(params, x, float8_state=())
    with pytest.warns(UserWarning, match="nothing runs in fp8"):  # no fp8 matmul: no state asked for
        assert mp.apply_policy(lambda p, x: x * 2.0, DELAYED)(params, x).shape == x.shape
    with pytest.raises(ValueError, match="keeps no fp8 state"):
        mp.apply_policy(mlp, FP8).init_float8(params, x)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_an_ensemble_under_vmap_scales_each_member_by_its_own_weights(recipe):
    """A mapped weight is an ensemble's members, not a batch: each member's matmuls scale by its
    own tensors (members a thousand times apart in magnitude compute as each alone)."""
    policy = mp.PolicyMap(mp.Policy(f"p=f32,c=bf16,float8={recipe}"), builtin_rules=False)
    members = [jax.tree_util.tree_map(lambda a, s=s: a * s, _params(MLP(nnx.Rngs(i)))) for i, s in enumerate((0.03, 1.0, 30.0))]
    stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *members)
    x = jax.random.normal(jax.random.key(1), (8, 64))
    fn = mp.apply_policy(mlp, policy)
    if recipe == "delayed":  # a state per member, stacked as its weights are: the next states
        state = fn.init_float8(members[0], x)
        stacked_state = jax.tree_util.tree_map(lambda a: jnp.stack([a] * 3), state)
        step = lambda p, s: jax.grad(lambda s: fn(p, x, float8_state=s).astype(jnp.float32).sum())(s)  # noqa: E731
        mapped = jax.tree_util.tree_leaves(jax.vmap(step)(stacked, stacked_state))
        out = [jnp.concatenate([leaf[i].reshape(-1) for leaf in mapped]) for i in range(3)]
        alone = [jnp.concatenate([leaf.reshape(-1) for leaf in jax.tree_util.tree_leaves(step(p, state))])
                 for p in members]
    else:
        out = jax.vmap(fn, in_axes=(0, None))(stacked, x)
        alone = [fn(p, x) for p in members]
    for got, want in zip(out, alone):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2,
                                   atol=1e-2 * float(jnp.abs(want.astype(jnp.float32)).max()))


def test_refusals_say_what_was_received_and_the_fix():
    with pytest.raises(ValueError, match="'rowwise'.*runs on torch.*float8_recipe='tensorwise'"):
        mp.apply_policy(mlp, mp.Policy("float8_from_float32", float8_recipe="rowwise"))
    params = _params(MLP(nnx.Rngs(0)))
    fn = mp.apply_policy(mlp, FP8)
    with pytest.raises(TypeError, match="Received numpy arrays .*jnp.asarray"):
        fn(jax.tree_util.tree_map(np.asarray, params), np.ones((4, 64), np.float32))
    with pytest.warns(UserWarning, match="no matmul multiplies a leaf of params.*by position"):
        fn(p=params, x=jnp.ones((4, 64)))  # by keyword: no parameters to find


def test_a_skipped_step_keeps_the_state_where_the_wrapper_sits_inside_a_chain():
    """update_float8 reads the skip of the LossScaleOptimizer wherever it sits in the optax
    state (here inside a chain behind a scaling: the state is a tuple); given the transformation
    itself instead of its state, it says so (it read no skip, and kept nothing, before)."""
    optax = require_module("optax", "jax")
    params = _params(MLP(nnx.Rngs(0)))
    x = jnp.ones((4, 64))
    fn = mp.apply_policy(mlp, DELAYED)
    tx = optax.chain(optax.scale(1.0), mp.LossScaleOptimizer(optax.sgd(0.1), policy=fn.policy))
    state, opt_state = fn.init_float8(params, x), tx.init(params)

    def step(params, state, opt_state, poison):
        loss = lambda p, s: jnp.mean(fn(p, x, float8_state=s).astype(jnp.float32) ** 2) * poison  # noqa: E731
        grads, new = jax.grad(loss, argnums=(0, 1))(params, state)
        _, opt_state = tx.update(grads, opt_state, params)
        return mp.jax.update_float8(state, new, opt_state), opt_state

    moved, _ = step(params, state, opt_state, 1.0)
    kept, after = step(params, state, opt_state, jnp.inf)
    assert int(after[1].num_skipped_steps) == 1
    assert float(moved[0]["float8_inputs_amax_history"][0]) == 1.0
    for a, b in zip(jax.tree_util.tree_leaves(kept), jax.tree_util.tree_leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(TypeError, match="optax transformation .*expected its state"):
        mp.jax.update_float8(state, moved, tx)
    with pytest.raises(TypeError, match="or a plain function's fp8 state"):
        mp.jax.update_float8(None, None, opt_state)
