"""A memory policy on optax: stochastic rounding and Kahan summation chained after the inner
optimizer inside the LossScaleOptimizer, seeded, unbiased, and what it is for: on the digits MLP
a pure bfloat16 run with stochastic rounding or Kahan summation trains like the float32-master
run, where nearest rounding loses its small updates."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mixedpolicy as mp
from mixedpolicy.backends.jax.updates import random_bits16, stochastic_round_bfloat16, update_rounding


def test_stochastic_rounding_is_unbiased_seeded_and_lands_on_the_two_neighbours():
    # the counter-based hash: the bits Keras's rule draws on every backend (Keras suite, test_memory)
    assert random_bits16((8,), 3, 2).tolist() == [30602, 37930, 56895, 27383, 42306, 40381, 57622, 52687]
    x = jnp.full((100_000,), 1.0 + 2.0**-10, jnp.float32)  # an eighth of the way to the next bfloat16
    r = stochastic_round_bfloat16(x, random_bits16(x.shape, 0, 0))
    assert r.dtype == jnp.bfloat16
    assert set(np.unique(np.asarray(r.astype(jnp.float32)))) == {1.0, 1.0078125}
    np.testing.assert_allclose(float(r.astype(jnp.float32).mean()), 1.0 + 2.0**-10, rtol=1e-4)
    assert jnp.array_equal(r, stochastic_round_bfloat16(x, random_bits16(x.shape, 0, 0)))
    assert not jnp.array_equal(r, stochastic_round_bfloat16(x, random_bits16(x.shape, 1, 0)))  # the next step
    exact = jnp.asarray([1.0, -2.5, 0.0], jnp.float32)  # bfloat16 values stay themselves
    assert jnp.array_equal(stochastic_round_bfloat16(exact, random_bits16((3,), 5, 1)).astype(jnp.float32), exact)


def _data():
    from sklearn.datasets import load_digits

    digits = load_digits()
    x, y = (digits.data / 16).astype(np.float32), digits.target
    order = np.random.default_rng(0).permutation(len(x))
    return x[order], y[order]


def _forward(params, x, dtype):
    params = jax.tree_util.tree_map(lambda a: a.astype(dtype), params)
    hidden = jax.nn.relu(x.astype(dtype) @ params["w1"] + params["b1"])
    return (hidden @ params["w2"] + params["b2"]).astype(jnp.float32)


def _train(policy, steps=400, lr=0.01, poison=None):
    policy = mp.Policy(policy)
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    params = {"w1": jax.random.normal(k1, (64, 128)) * 0.125, "b1": jnp.zeros(128),
              "w2": jax.random.normal(k2, (128, 10)) * 0.09, "b2": jnp.zeros(10)}
    params = jax.tree_util.tree_map(lambda a: a.astype(policy.variable_dtype), params)
    tx = mp.LossScaleOptimizer(optax.sgd(lr), policy=policy)
    state = tx.init(params)
    compute = jnp.dtype(policy.compute_dtype)

    @jax.jit
    def step(params, state, x, y, bad):
        def loss_fn(p):
            loss = optax.softmax_cross_entropy_with_integer_labels(_forward(p, x, compute), y).mean()
            return loss * jnp.where(bad, jnp.inf, 1.0).astype(jnp.float32)
        grads = jax.grad(lambda p: tx.scale_loss(loss_fn(p), state))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    x, y = _data()
    rng = np.random.default_rng(1)
    for i in range(steps):
        batch = rng.integers(0, 1400, 64)
        params, state = step(params, state, x[batch], y[batch], i == poison)
    accuracy = float((jnp.argmax(_forward(params, x[1400:], compute), -1) == y[1400:]).mean())
    return params, state, 100 * accuracy


def test_pure_bfloat16_with_stochastic_rounding_or_kahan_trains_like_the_float32_master():
    _, _, master = _train("mixed_bfloat16")
    _, _, nearest = _train("bfloat16")
    _, _, stochastic = _train("bfloat16_stochastic")
    _, _, kahan = _train("p=bf16,rounding=kahan")
    # measured on a 2-core AMD EPYC: 85.9 (master), 77.1 (nearest), 85.9 (stochastic), 85.6 (kahan)
    # (another CPU's float32 accumulation moves both runs by a sample or two: 2.5 points of room)
    assert abs(stochastic - master) <= 2.5 and abs(kahan - master) <= 2.5, (master, stochastic, kahan)
    assert nearest < master - 4, (nearest, master)  # would fail if the rounding were silently nearest


def test_a_seed_gives_the_same_run_and_a_skipped_step_keeps_weights_and_rounding_state():
    a, state_a, _ = _train("bfloat16_stochastic", steps=6)
    b, _, _ = _train("bfloat16_stochastic", steps=6)
    assert all(jnp.array_equal(u, v) for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree_util.tree_leaves(a))
    c, state_c, _ = _train("bfloat16_stochastic", steps=7, poison=6)  # the 7th step is infinite: skipped
    assert int(state_c.num_skipped_steps) == 1
    assert all(jnp.array_equal(u, v) for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(c)))
    assert int(state_a.inner_state[1].step) == int(state_c.inner_state[1].step) == 6  # the skipped step drew none


def test_in_an_nnx_optimizer_with_float32_norms_only_the_bfloat16_leaves_are_rounded():
    nnx = pytest.importorskip("flax.nnx")

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.hidden, self.norm = nnx.Linear(8, 16, rngs=rngs), nnx.LayerNorm(16, rngs=rngs)
            self.out = nnx.Linear(16, 4, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.relu(self.norm(self.hidden(x))))

    model = mp.apply_policy(Net(nnx.Rngs(0)), "bfloat16_stochastic")
    assert model.norm.scale[...].dtype == jnp.float32 and model.hidden.kernel[...].dtype == jnp.bfloat16
    opt = nnx.Optimizer(model, mp.LossScaleOptimizer(optax.sgd(0.1, momentum=0.9), policy="bfloat16_stochastic"),
                        wrt=nnx.Param)  # (optax.adam fails under strict promotion by itself)

    @nnx.jit
    def step(model, opt, x, y):
        grads = nnx.grad(lambda m: optax.softmax_cross_entropy_with_integer_labels(
            m(x).astype(jnp.float32), y).mean())(model)
        opt.update(model, grads)

    before = model.norm.scale[...]
    for _ in range(3):
        step(model, opt, jnp.ones((4, 8), jnp.bfloat16), jnp.zeros((4,), jnp.int32))
    assert model.hidden.kernel[...].dtype == jnp.bfloat16 and model.norm.scale[...].dtype == jnp.float32
    assert not jnp.array_equal(before, model.norm.scale[...])


def test_the_rounding_transformation_needs_params_and_a_rounding_it_makes():
    tx = update_rounding("stochastic")
    params = {"w": jnp.ones(3, jnp.bfloat16)}
    with pytest.raises(ValueError, match="needs the parameters"):
        tx.update(params, tx.init(params))
    with pytest.raises(ValueError, match="expected 'stochastic' or 'kahan'"):
        update_rounding("nearest")
    with pytest.raises(TypeError, match="rounding=None of type NoneType"):
        update_rounding(None)
    with pytest.raises(TypeError, match="seed='x' of type str; expected a whole number"):
        update_rounding("stochastic", seed="x")


def test_a_state_dtype_stores_every_moment_in_it_as_optax_stores_one():
    params = {"w": jax.random.normal(jax.random.PRNGKey(0), (8, 4)), "b": jnp.zeros(4)}

    def run(tx, steps=5):
        p, s = params, tx.init(params)
        for i in range(steps):
            grads = jax.tree_util.tree_map(lambda a: jnp.sin(a * (i + 1)) * 0.3, p)
            updates, s = tx.update(grads, s, p)
            p = optax.apply_updates(p, updates)
        return p, s

    with jax.numpy_dtype_promotion("standard"):  # optax's own accumulator_dtype mixes dtypes
        ours, state = run(mp.LossScaleOptimizer(optax.sgd(0.1, momentum=0.9),
                                                policy=mp.Policy("mixed_bfloat16", optimizer_state_dtype="bf16")))
        theirs, _ = run(optax.sgd(0.1, momentum=0.9, accumulator_dtype=jnp.bfloat16))
        _, adam = run(mp.LossScaleOptimizer(optax.adamw(1e-2), policy="p=f32,c=bf16,state=bfloat16"))
    assert all(jnp.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs)))
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(state.inner_state)} == {jnp.dtype(jnp.bfloat16)}
    moments = adam.inner_state[0]
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves((moments.mu, moments.nu))} == {jnp.dtype(jnp.bfloat16)}
    assert moments.count.dtype == jnp.int32  # counts stay what they are


def test_one_weight_rounds_alike_on_optax_and_on_torch():
    torch = pytest.importorskip("torch")
    weight = np.random.default_rng(0).normal(size=(16, 8)).astype(np.float32)
    grad = np.random.default_rng(1).normal(size=(16, 8)).astype(np.float32) * 1e-3  # below a bfloat16 step
    params = {"w": jnp.asarray(weight).astype(jnp.bfloat16)}
    # a power-of-two rate: the update lr * g is exact in bfloat16 and float32 alike, so both sides
    # add the same float32 numbers (one IEEE add each) and round them with the same bits
    tx = mp.LossScaleOptimizer(optax.sgd(0.125), policy="bfloat16_stochastic")
    state = tx.init(params)
    for _ in range(3):
        updates, state = tx.update({"w": jnp.asarray(grad).astype(jnp.bfloat16)}, state, params)
        params = optax.apply_updates(params, updates)
    w = torch.nn.Parameter(torch.tensor(weight).to(torch.bfloat16))
    opt = mp.LossScaleOptimizer(torch.optim.SGD([w], lr=0.125), policy="bfloat16_stochastic")
    for _ in range(3):
        w.grad = torch.tensor(grad).to(torch.bfloat16)
        opt.step()
    np.testing.assert_array_equal(np.asarray(params["w"].astype(jnp.float32)), w.detach().float().numpy())
    assert not np.array_equal(np.asarray(params["w"].astype(jnp.float32)),
                              np.asarray(jnp.asarray(weight).astype(jnp.bfloat16).astype(jnp.float32)))


@jax.numpy_dtype_promotion("standard")  # optax's Adam mixes its int32 count into float moments
def test_a_state_moves_between_recipes_converted_and_said_once(caplog):
    params = {"w": jax.random.normal(jax.random.PRNGKey(0), (8, 4)).astype(jnp.bfloat16),
              "scale": jnp.ones(4, jnp.float32)}  # a float32 leaf, as a pure policy keeps norms

    def train(tx, state, steps=3):
        p = params
        for i in range(steps):
            grads = jax.tree_util.tree_map(lambda a: (jnp.sin(a.astype(jnp.float32) * (i + 1)) * 0.3).astype(a.dtype), p)
            updates, state = jax.jit(tx.update)(grads, state, p)
            p = optax.apply_updates(p, updates)
        return state

    nearest = mp.LossScaleOptimizer(optax.adam(1e-2), policy="bfloat16")
    stochastic = mp.LossScaleOptimizer(optax.adam(1e-2), policy="bfloat16_stochastic")
    kahan = mp.LossScaleOptimizer(optax.adam(1e-2), policy="p=bf16,rounding=kahan,state=float32")
    saved = train(nearest, nearest.init(params))
    caplog.set_level("WARNING", logger="mixedpolicy")
    with pytest.raises(ValueError, match=r"update_rounding='nearest'.*tx.adopt_state\(saved, params\)"):
        stochastic.adopt_state(saved)  # a new rounding's state comes from the parameters
    assert nearest.adopt_state(saved) is not None and not caplog.records  # same recipe: as it is, silently

    moved = stochastic.adopt_state(saved, params)
    assert jax.tree_util.tree_structure(moved) == jax.tree_util.tree_structure(stochastic.init(params))
    assert int(moved.inner_state[1].step) == 0
    assert jnp.array_equal(moved.inner_state[0][0].mu["w"], saved.inner_state[0].mu["w"])  # moments kept
    (record,) = caplog.records
    assert "'nearest' -> 'stochastic'" in record.getMessage() and "step count starts at 0" in record.getMessage()
    trained = train(stochastic, moved)  # and it trains on under jit, the rounding counting its steps
    assert int(trained.inner_state[1].step) == 3

    caplog.clear()
    to_kahan = kahan.adopt_state(trained, params)
    mu = to_kahan.inner_state[0][0].mu
    assert mu["w"].dtype == jnp.float32 and jnp.array_equal(mu["w"], trained.inner_state[0][0].mu["w"].astype(jnp.float32))
    assert not jnp.any(to_kahan.inner_state[1].compensation["w"])  # the compensation starts at zero
    assert "moments bfloat16+float32 -> float32" in caplog.records[0].getMessage()
    back = nearest.adopt_state(to_kahan, params)  # the rounding dropped, the moments back in bfloat16
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(saved)
    assert back.inner_state[0].mu["w"].dtype == jnp.bfloat16
    with pytest.raises(TypeError, match="another inner optimizer"):
        mp.LossScaleOptimizer(optax.sgd(0.1), policy="bfloat16_stochastic").adopt_state(saved, params)


def _adam_run(policy, steps=150):
    """An MLP with layers large enough to quantize (64x256, 256x256), Adam, digits: the final
    accuracy, the optimizer state's bytes and the state."""
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"w1": jax.random.normal(k1, (64, 256)) * 0.125, "b1": jnp.zeros(256),
              "w2": jax.random.normal(k2, (256, 256)) * 0.06, "b2": jnp.zeros(256),
              "w3": jax.random.normal(k3, (256, 10)) * 0.06, "b3": jnp.zeros(10)}
    tx = mp.LossScaleOptimizer(optax.adamw(1e-3), policy=policy)
    state = tx.init(params)  # (quantizes under the suite's strict promotion)

    def forward(p, x):
        h = jax.nn.relu(jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"])
        return h @ p["w3"] + p["b3"]

    @jax.jit
    def step(params, state, x, y):
        grads = jax.grad(lambda p: tx.scale_loss(
            optax.softmax_cross_entropy_with_integer_labels(forward(p, x), y).mean(), state))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    x, y = _data()
    rng = np.random.default_rng(1)
    with jax.numpy_dtype_promotion("standard"):  # optax's adam mixes a Python float with its int32 count
        for _ in range(steps):
            batch = rng.integers(0, 1400, 64)
            params, state = step(params, state, x[batch], y[batch])
    accuracy = 100 * float((jnp.argmax(forward(params, x[1400:]), -1) == y[1400:]).mean())
    nbytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(state.inner_state))
    return accuracy, nbytes, state, params, tx


def test_int8_state_quantizes_the_large_moments_and_trains_like_float32_state():
    from mixedpolicy.backends.jax.updates import QuantizedState, dequantize_state

    full, full_bytes, _, _, _ = _adam_run("float32")
    eight, eight_bytes, state, params, tx = _adam_run("p=f32,state=int8")
    quantized = state.inner_state
    assert isinstance(quantized, QuantizedState)
    adam = quantized.inner_state[0]
    # the two large kernels' moments are uint8 codes (both moments), the rest stays float32
    assert adam.mu["w1"].dtype == adam.nu["w2"].dtype == jnp.uint8 and adam.mu["w3"].dtype == jnp.float32
    assert len(quantized.absmax) == 4 and quantized.absmax[0].shape == (64,)  # 64*256 / 256 blocks
    assert quantized.signed.tolist() == [True, True, False, False]  # mu signed, nu (never negative) unsigned
    assert eight_bytes < 0.3 * full_bytes  # 8 bytes per parameter -> about 2 for the large layers
    assert abs(eight - full) <= 2.5, (full, eight)  # measured: 97.7 and 97.7 (2.5 points of room)
    # the codes stand for the moments within the map's resolution
    plain = dequantize_state(quantized)[0]
    assert plain.mu["w2"].dtype == jnp.float32 and plain.mu["w2"].shape == (256, 256)
    assert tx.loss_scaling.startswith("no scaling")
    # an inner state with uint8 arrays of its own could not be told from the codes: refused
    own = optax.GradientTransformation(lambda p: {"flags": jnp.zeros(3, jnp.uint8)}, lambda u, s, p=None: (u, s))
    with pytest.raises(TypeError, match="uint8 arrays of its own.*state=float32"):
        mp.LossScaleOptimizer(own, policy="p=f32,state=int8").init(params)


def test_int8_state_composes_with_loss_scaling_skips_and_moves_between_recipes(caplog):
    from mixedpolicy.backends.jax.updates import QuantizedState

    _, _, state, params, tx = _adam_run("p=f32,c=f16,state=int8", steps=3)
    assert float(state.loss_scale) == 2.0**15 and int(state.num_skipped_steps) == 0
    grads = jax.tree_util.tree_map(lambda p: jnp.full_like(p, jnp.inf), params)
    with jax.numpy_dtype_promotion("standard"):
        updates, skipped = jax.jit(tx.update)(grads, state, params)
    assert int(skipped.num_skipped_steps) == 1 and not any(jnp.any(u) for u in jax.tree_util.tree_leaves(updates))
    for old, new in zip(jax.tree_util.tree_leaves(state.inner_state), jax.tree_util.tree_leaves(skipped.inner_state)):
        assert jnp.array_equal(old, new)  # the codes, scales and counts of the skipped step kept

    full = mp.LossScaleOptimizer(optax.adamw(1e-3), policy="p=f32,c=f16")
    caplog.set_level("WARNING", logger="mixedpolicy")
    assert tx.adopt_state(state) is not None and not caplog.records  # same recipe, as it is
    moved = full.adopt_state(state, params)  # dequantized into float32 moments, the scale kept
    assert moved.inner_state[0].mu["w1"].dtype == jnp.float32 and float(moved.loss_scale) == 2.0**15
    assert "moments float32+int8 -> float32" in caplog.records[0].getMessage()
    again = tx.adopt_state(moved, params)  # and quantized again: the same codes
    assert isinstance(again.inner_state, QuantizedState)
    assert jnp.array_equal(again.inner_state.inner_state[0].mu["w1"], state.inner_state.inner_state[0].mu["w1"])
