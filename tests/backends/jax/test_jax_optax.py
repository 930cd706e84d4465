"""The optax LossScaleOptimizer: state fields, skipping, jmp parity, no host sync, replicas."""

import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

from conftest import require_module

jax = require_module("jax")
jnp = jax.numpy
optax = require_module("optax", "jax")
jmp = require_module("jmp", "jax")

import mixedpolicy as mp  # noqa: E402
from mixedpolicy.backends.jax import optax as optax_adapter  # noqa: E402
from mixedpolicy.backends.jax.optax import LossScaleState  # noqa: E402


@pytest.fixture(autouse=True)
def _where_loss_scaling_is_on():
    """These tests are about scaling: they run under a float16 global policy, where
    LossScaleOptimizer(opt) scales (tests/test_loss_scale_follows_policy.py: the rest)."""
    mp.set_global_policy("mixed_float16")  # the root conftest restores it


@pytest.fixture(params=["selects", "cond"])
def skip_by(request, monkeypatch):
    """Both ways a traced step skips: a select per leaf (small gradients), a ``jax.lax.cond``
    (gradients of `COND_ELEMENTS` or more; here any)."""
    if request.param == "cond":
        monkeypatch.setattr(optax_adapter, "COND_ELEMENTS", 0)
    return request.param


X = np.random.default_rng(0).normal(size=(16, 6)).astype(np.float32)
Y = np.random.default_rng(1).normal(size=(16, 3)).astype(np.float32)


def params_tree():
    rng = np.random.default_rng(2)
    return {"w": jnp.asarray(rng.normal(size=(6, 3)) * 0.3, jnp.float32), "b": jnp.zeros(3, jnp.float32)}


def loss_fn(params, poison):
    pred = X @ params["w"] + params["b"]
    # Poison multiplicatively: every gradient of the step becomes inf or NaN.
    return ((pred - Y) ** 2).mean() * jnp.where(poison, jnp.inf, 1.0).astype(jnp.float32)


def make_step(opt):
    @jax.jit
    def step(params, state, poison):
        grads = jax.grad(lambda p: opt.scale_loss(loss_fn(p, poison), state))(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state
    return step


def adam():
    # optax's adam mixes a Python float and an int32 count, which JAX's strict
    # promotion (on in this suite) rejects with or without mixedpolicy.
    return jax.numpy_dtype_promotion("standard")


def test_state_fields_and_isinstance():
    opt = mp.LossScaleOptimizer(optax.sgd(0.1), initial_scale=2.0**8)
    assert isinstance(opt, optax.GradientTransformation) and isinstance(opt, mp.LossScaleOptimizer)
    assert not isinstance(optax.sgd(0.1), mp.LossScaleOptimizer)
    state = opt.init(params_tree())
    assert isinstance(state, LossScaleState)
    assert state.loss_scale.dtype == jnp.float32 and float(state.loss_scale) == 256.0
    assert state.counter.dtype == jnp.int32 and not bool(state.last_step_skipped)
    assert int(state.num_skipped_steps) == 0


# Two different jitted programs may be fused differently by XLA on another CPU (an ulp
# now and then: -0.0019004652 vs -0.0019004651 was seen on an AVX2 EPYC), so jitted runs
# are held to a few ulp; op by op (jax.disable_jit) the two are the same arithmetic and
# must agree bit for bit.
JIT_RTOL = 8 * 2.0**-23   # 8 ulp of float32


@pytest.mark.parametrize("jitted", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("inner", ["sgd_momentum", "adam", "clipped_adamw"])
def test_trajectory_and_params_match_jmp_and_optax_step_for_step(inner, jitted):
    import contextlib

    with adam(), (contextlib.nullcontext() if jitted else jax.disable_jit()):
        tx = {"sgd_momentum": lambda: optax.sgd(0.05, momentum=0.9),
              "adam": lambda: optax.adam(1e-2),
              "clipped_adamw": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2))}[inner]()
        poison = [False, False, True, False, False, False, True, True, False, False, False, False]
        opt = mp.LossScaleOptimizer(tx, initial_scale=2.0**10, dynamic_growth_steps=3)
        step = make_step(opt)
        params, state = params_tree(), opt.init(params_tree())

        @jax.jit
        def by_hand(params, opt_state, scale, poison):
            grads = jax.grad(lambda p: scale.scale(loss_fn(p, poison)))(params)
            grads = scale.unscale(grads)
            finite = jmp.all_finite(grads)
            updates, new_opt_state = tx.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            params, opt_state = jmp.select_tree(finite, (new_params, new_opt_state), (params, opt_state))
            return params, opt_state, scale.adjust(finite)

        ref_params, ref_state = params_tree(), tx.init(params_tree())
        ref_scale = jmp.DynamicLossScale(jnp.asarray(2.0**10, jnp.float32), period=3)
        for p in poison:
            params, state = step(params, state, p)
            ref_params, ref_state, ref_scale = by_hand(ref_params, ref_state, ref_scale, p)
            assert float(state.loss_scale) == float(ref_scale.loss_scale)
            assert int(state.counter) == int(ref_scale.counter)
            assert bool(state.last_step_skipped) == p
            for a, b in zip(jax.tree_util.tree_leaves((params, state.inner_state)),
                            jax.tree_util.tree_leaves((ref_params, ref_state))):
                if jitted:  # XLA may fuse each program its own way (the global norm of clipping most)
                    tol = 1e-5 if inner == "clipped_adamw" else JIT_RTOL
                    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=tol / 100, rtol=tol)
                else:
                    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert int(state.num_skipped_steps) == sum(poison)


def test_flax_dynamic_scale_trajectory_with_its_settings_spelled_for_the_wrapper():
    """Flax's ``flax.training.dynamic_scale.DynamicScale(growth_interval=N)`` grows on the
    step after N finite ones (N + 1 in a row), starts at 2**16 and has no ceiling but float32's
    largest: the wrapper with ``initial_scale=2.0**16, dynamic_growth_steps=N + 1``,
    ``min_scale``/``max_scale`` at float32's smallest normal and largest, gives its scales
    and its parameters step for step, in Flax's linen loop's select-by-``is_fin`` form (the
    mapping docs/jax.md gives)."""
    dynamic_scale = pytest.importorskip("flax.training.dynamic_scale")
    tiny, largest = float(jnp.finfo(jnp.float32).tiny), float(jnp.finfo(jnp.float32).max)
    n, tx = 3, optax.sgd(0.1, momentum=0.5)
    poison = [False] * 5 + [True] + [False] * 4 + [True, True] + [False] * 9

    def loss16(p, poison):  # a float16 loss: at 2**16 its scaled value overflows
        return jnp.sum(jnp.asarray(p["w"], jnp.float16) ** 2) * jnp.where(poison, jnp.inf, 1).astype(jnp.float16)

    @jax.jit
    def flax_step(ds, params, opt_state, poison):
        ds, finite, _, grads = ds.value_and_grad(loss16)(params, poison)
        updates, new_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731 (Flax's examples' select)
        return ds, jax.tree_util.tree_map(keep, new_params, params), jax.tree_util.tree_map(keep, new_state, opt_state)

    opt = mp.LossScaleOptimizer(tx, initial_scale=2.0**16, dynamic_growth_steps=n + 1, min_scale=tiny,
                                max_scale=largest)

    @jax.jit
    def step(params, state, poison):
        grads = jax.grad(lambda p: opt.scale_loss(loss16(p, poison), state))(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    start = {"w": jnp.array([1.0, -2.0, 0.5], jnp.float32)}
    ds, ref, ref_state = dynamic_scale.DynamicScale(growth_interval=n), start, tx.init(start)
    params, state = start, opt.init(start)
    scales = []
    for p in poison:
        with jax.numpy_dtype_promotion("standard"):  # Flax multiplies its float32 scale by the float16 loss
            ds, ref, ref_state = flax_step(ds, ref, ref_state, p)
        params, state = step(params, state, p)
        assert float(state.loss_scale) == float(ds.scale)
        np.testing.assert_allclose(np.asarray(params["w"]), np.asarray(ref["w"]), rtol=JIT_RTOL)
        scales.append(float(ds.scale))
    assert max(scales) > min(scales[5:]) and len(set(scales)) > 3  # it backed off and grew


def test_a_skipped_step_leaves_params_inner_state_and_its_count_alone(skip_by):
    with adam():
        opt = mp.LossScaleOptimizer(optax.adam(1e-2))
        step = make_step(opt)
        params, state = step(params_tree(), opt.init(params_tree()), False)
        after, new = step(params, state, True)
    for a, b in zip(jax.tree_util.tree_leaves((params, state.inner_state)),
                    jax.tree_util.tree_leaves((after, new.inner_state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(new.inner_state[0].count) == 1
    assert bool(new.last_step_skipped) and int(new.num_skipped_steps) == 1
    assert float(new.loss_scale) == 2.0**14 and int(new.counter) == 0


def test_gradient_accumulation_inside_the_wrapper_and_a_chain_around_it():
    """mp.LossScaleOptimizer(optax.MultiSteps(...)): each micro-batch unscaled and checked, finite
    steps equal plain accumulation, an overflowing micro-batch skipped alone; scale_loss takes
    the state of a chain around the wrapper. MultiSteps around the wrapper is refused: its sum
    turns NaN for good at the first overflow (it clears it by multiplying with 0)."""
    def run(tx, scale_loss, poisoned=()):
        params, state = params_tree(), tx.init(params_tree())
        for i in range(4):
            grads = jax.grad(lambda p: scale_loss(loss_fn(p, i in poisoned), state))(params)
            updates, state = jax.jit(tx.update)(grads, state, params)
            params = optax.apply_updates(params, updates)
        return params, state

    with adam():
        lso = mp.LossScaleOptimizer(optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2))
        tx = optax.chain(lso, optax.identity())
        plain, _ = run(optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2), lambda v, s: v)
        ours, _ = run(tx, lso.scale_loss)
        for a, b in zip(jax.tree_util.tree_leaves(plain), jax.tree_util.tree_leaves(ours)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        skipped, state = run(tx, lso.scale_loss, poisoned=(0,))
        assert int(state[0].num_skipped_steps) == 1 and float(state[0].loss_scale) == 2.0**14
        assert int(state[0].inner_state.gradient_step) == 1  # micro-batches 1 and 2 made a step
        assert all(bool(jnp.isfinite(leaf).all()) for leaf in jax.tree_util.tree_leaves(skipped))
        around = optax.MultiSteps(mp.LossScaleOptimizer(optax.adam(1e-2)), every_k_schedule=2)
        with pytest.raises(ValueError, match=r"optax.MultiSteps around this LossScaleOptimizer.*"
                                             r"mp.LossScaleOptimizer\(optax.MultiSteps\(tx"):
            around.inner_opt.scale_loss(loss_fn(params_tree(), False), around.init(params_tree()))


def test_transformations_ahead_of_a_scaling_wrapper_in_a_chain_are_warned_of_once():
    """optax.chain(clip, wrapper): the clip receives the scaled gradients (clipped to norm 1, then
    unscaled, the update is 2**15 times too small), silently before; warned once, at the user's
    line, naming the fix. Behind the wrapper, or with nothing to scale, nothing is said."""
    params = {"w": jnp.ones((4,))}

    def first_update(tx, lso):
        state = tx.init(params)
        grads = jax.grad(lambda p: lso.scale_loss(jnp.sum(p["w"] ** 2), state))(params)
        return tx.update(grads, state, params)[0]["w"]

    lso = mp.LossScaleOptimizer(optax.sgd(0.1), policy="mixed_float16")
    with pytest.warns(UserWarning, match=r"runs behind 1 other transformation in an optax.chain.*"
                                         r"mp.LossScaleOptimizer\(optax.chain\(optax.clip_by_global_norm") as seen:
        first_update(optax.chain(optax.clip_by_global_norm(1.0), lso), lso)
    assert seen[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first_update(optax.chain(optax.clip_by_global_norm(1.0), lso), lso)  # once per wrapper
        inside = mp.LossScaleOptimizer(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1)),
                                       policy="mixed_float16")
        np.testing.assert_allclose(first_update(inside, inside), -0.05)  # the clip of the true gradient
        behind = mp.LossScaleOptimizer(optax.sgd(0.1), policy="mixed_float16")
        first_update(optax.chain(behind, optax.add_decayed_weights(1e-4)), behind)
        unscaled = mp.LossScaleOptimizer(optax.sgd(0.1), policy="mixed_bfloat16")  # scales nothing
        first_update(optax.chain(optax.clip_by_global_norm(1.0), unscaled), unscaled)
        held = mp.LossScaleOptimizer(optax.sgd(0.1), policy="mixed_float16")  # the user's own containers
        for together in ((params, held.init(params)), {"params": params, "opt_state": held.init(params)}):
            held.scale_loss(jnp.float32(1.0), together)
    named = mp.LossScaleOptimizer(optax.sgd(0.1), policy="mixed_float16")
    with pytest.warns(UserWarning, match=r"behind 2 other transformations.*their states: EmptyState, ZeroNansState"):
        first_update(optax.named_chain(("clip", optax.clip(1.0)), ("zeros", optax.zero_nans()), ("opt", named)),
                     named)
    # optax.multi_transform: another label's SGD receives the scaled gradients too (2**15 times too
    # far); a label whose gradients are set to zero is harmless
    two = {"w": jnp.ones((4,)), "v": jnp.ones((2,))}
    for other, warns in ((optax.sgd(0.1), True), (optax.set_to_zero(), False)):
        part = mp.LossScaleOptimizer(optax.sgd(0.1), policy="mixed_float16")
        tx = optax.multi_transform({"scaled": part, "other": other}, {"w": "scaled", "v": "other"})
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            part.scale_loss(jnp.float32(1.0), tx.init(two))
        assert any("beside 1 other transformation in an optax.partition" in str(w.message) for w in seen) == warns


def test_200_overflows_leave_the_weights_and_the_scale_at_its_floor(skip_by):
    opt = mp.LossScaleOptimizer(optax.sgd(0.1))
    step = make_step(opt)
    params, state = params_tree(), opt.init(params_tree())
    for _ in range(200):
        params, state = step(params, state, True)
    assert float(state.loss_scale) == 1.0 and int(state.num_skipped_steps) == 200
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(params_tree())):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    params, state = step(params, state, False)
    assert all(bool(jnp.isfinite(p).all()) for p in jax.tree_util.tree_leaves(params))
    assert not bool(state.last_step_skipped)


def test_the_scale_is_bounded_above():
    opt = mp.LossScaleOptimizer(optax.sgd(0.0), initial_scale=2.0**23, dynamic_growth_steps=1,
                                max_scale=2.0**24)
    step = make_step(opt)
    params, state = params_tree(), opt.init(params_tree())
    for _ in range(3):
        params, state = step(params, state, False)
    assert float(state.loss_scale) == 2.0**24


def test_a_jitted_step_makes_no_host_round_trip(skip_by):
    opt = mp.LossScaleOptimizer(optax.sgd(0.1, momentum=0.9))
    step = make_step(opt)
    params, state = jax.device_put((params_tree(), opt.init(params_tree())))
    poison = jax.device_put(jnp.asarray(False))
    step(params, state, poison)  # compile
    with jax.transfer_guard("disallow"):
        for _ in range(3):
            params, state = step(params, state, poison)


def test_works_with_nnx_optimizer():
    nnx = require_module("flax.nnx", "jax")
    model = mp.apply_policy(nnx.Linear(6, 3, rngs=nnx.Rngs(0)), "mixed_float16")
    optimizer = nnx.Optimizer(model, mp.LossScaleOptimizer(optax.sgd(0.1)), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, poison):
        def scaled(m):
            pred = m(X).astype(jnp.float32)
            loss = ((pred - Y) ** 2).mean() * jnp.where(poison, jnp.inf, 1.0).astype(jnp.float32)
            return optimizer.tx.scale_loss(loss, optimizer.opt_state)
        optimizer.update(model, nnx.grad(scaled)(model))

    before = np.asarray(model.kernel.get_value())
    step(model, optimizer, True)
    np.testing.assert_array_equal(np.asarray(model.kernel.get_value()), before)
    assert int(optimizer.opt_state.num_skipped_steps) == 1
    step(model, optimizer, False)
    assert not np.array_equal(np.asarray(model.kernel.get_value()), before)
    assert model.kernel.get_value().dtype == jnp.float32


def test_a_state_moves_between_scaling_and_non_scaling_wrappers_as_on_torch(caplog):
    """adopt_state across policies: a float16 run's scale is dropped by a wrapper that scales
    nothing (said once, the skip count kept); a state from such a wrapper (scale 1, no growth
    count) leaves a scaling wrapper its own initial scale; between scaling wrappers it goes on."""
    jnp = jax.numpy
    params = {"w": jnp.ones(3)}
    f16 = mp.LossScaleOptimizer(optax.sgd(0.1), policy="mixed_float16")
    state = f16.init(params)
    for _ in range(3):
        _, state = f16.update({"w": jnp.full(3, jnp.inf)}, state, params)
    bf16 = mp.LossScaleOptimizer(optax.sgd(0.1), policy="mixed_bfloat16")
    with caplog.at_level("WARNING", logger="mixedpolicy"):
        moved = bf16.adopt_state(state)
    (said,) = [r.getMessage() for r in caplog.records]
    assert "loss scale is 4096" in said and "no scaling" in said
    assert float(moved.loss_scale) == 1.0 and int(moved.num_skipped_steps) == 3
    back = f16.adopt_state(moved)
    assert float(back.loss_scale) == 2.0**15 and int(back.num_skipped_steps) == 3
    assert float(f16.adopt_state(state).loss_scale) == 4096.0  # the same kind: as saved


def test_static_and_no_loss_scale():
    static = mp.LossScaleOptimizer(optax.sgd(0.1), loss_scale=mp.StaticLossScale(64.0))
    step = make_step(static)
    params, state = step(params_tree(), static.init(params_tree()), True)
    assert float(state.loss_scale) == 64.0 and bool(state.last_step_skipped)
    none = mp.LossScaleOptimizer(optax.sgd(0.1), loss_scale=mp.NoLossScale())
    state = none.init(params_tree())
    assert float(none.scale_loss(jnp.float32(3.0), state)) == 3.0
    params, state = make_step(none)(params_tree(), state, False)
    assert int(state.num_skipped_steps) == 0


def test_a_float16_update_that_divides_by_a_vanished_eps_is_warned_of_at_init():
    """optax's Adam family on float16 weights divides by eps=1e-8, which is 0 in float16: the
    weights turn NaN from finite gradients, which no gradient check sees. The wrapper warns at
    init, at the user's line (also under jit), where the fixes do not."""
    import warnings

    params = {"w": jnp.ones((3, 2), jnp.float16), "b": jnp.ones(2, jnp.float16)}

    def warned(tx, tree=params, jit=False, **kw):
        # (optax's adam mixes a float and an int32 count, which the suite's strict promotion refuses)
        with warnings.catch_warnings(record=True) as caught, jax.numpy_dtype_promotion("standard"):
            warnings.simplefilter("always")
            opt = mp.LossScaleOptimizer(tx, **kw)
            (jax.jit(opt.init) if jit else opt.init)(tree)
        hits = [w for w in caught if "is 0 in float16" in str(w.message)]
        assert all(w.filename == __file__ for w in hits), [w.filename for w in hits]
        return bool(hits)

    for tx in (optax.adam(1e-3), optax.adamw(1e-3), optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))):
        assert warned(tx, loss_scale=mp.NoLossScale()) and warned(tx, jit=True, loss_scale=mp.NoLossScale())
    # and it is what it warns of: optax's own adam ends NaN on these weights
    inner = optax.adam(1e-3)
    with jax.numpy_dtype_promotion("standard"):
        u, _ = inner.update(jax.tree_util.tree_map(lambda x: x * 1e-3, params), inner.init(params), params)
    assert not bool(jnp.isfinite(optax.apply_updates(params, u)["w"]).all())
    # an eps float16 holds, an optimizer without one, float32 weights, state kept in float32
    assert not warned(optax.adam(1e-3, eps=1e-4)) and not warned(optax.sgd(0.1, momentum=0.9))
    assert not warned(optax.adam(1e-3), tree={"w": jnp.ones(3)})
    assert not warned(optax.adam(1e-3), policy=mp.Policy("float16", optimizer_state_dtype="float32"))


def test_clear_errors():
    with pytest.raises(ValueError, match="float16 value; the scale is kept in float32"):
        mp.LossScaleOptimizer(optax.sgd(0.1), initial_scale=jnp.float16(1024))
    with pytest.raises(ValueError, match="float16 value"):
        mp.DynamicLossScale(loss_scale=np.float16(8))
    with pytest.raises(TypeError, match=r"optax.*adam builds an optimizer: call it first.*adam\(1e-3\)"):
        mp.LossScaleOptimizer(optax.adam)
    with pytest.raises(TypeError, match="no installed mixedpolicy adapter handles.*optax GradientTransformation"):
        mp.LossScaleOptimizer({"lr": 0.1})
    with pytest.raises(TypeError, match="learning_rate.*belong to the inner optimizer"):
        mp.LossScaleOptimizer(optax.sgd(0.1), learning_rate=0.1)
    with pytest.raises(TypeError, match="axis_name=3"):
        mp.LossScaleOptimizer(optax.sgd(0.1), axis_name=3)
    # an axis the update is not mapped over: refused under every scale setting, the pass-through
    # too (JAX's own NameError said "unbound axis name"; the pass-through never looked)
    params = params_tree()
    for settings in ({"policy": "float32"}, {"policy": "mixed_float16"},
                     {"loss_scale": mp.NoLossScale(skip_nonfinite=False)}):
        mapped = mp.LossScaleOptimizer(optax.sgd(0.1), axis_name="batch", **settings)
        with pytest.raises(ValueError, match="axis_name='batch', but this update does not run inside"):
            mapped.update(params, mapped.init(params), params)
        state = mapped.init(params)
        updates = jax.vmap(lambda g: mapped.update(g, state, params)[0], axis_name="batch")(
            jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), params))
        assert jax.tree_util.tree_structure(updates) == jax.tree_util.tree_structure(params)
    opt = mp.LossScaleOptimizer(optax.sgd(0.1))
    with pytest.raises(TypeError, match="already scales the loss"):
        mp.LossScaleOptimizer(opt)
    with pytest.raises(TypeError, match="expected the LossScaleState"):
        opt.scale_loss(jnp.float32(1.0), optax.sgd(0.1).init(params_tree()))


_REPLICAS = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    os.environ["JAX_NUMPY_DTYPE_PROMOTION"] = "strict"
    import functools
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, PartitionSpec as P
    import mixedpolicy as mp

    assert jax.device_count() == 2, jax.devices()
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 4, 3)), jnp.float32)
    params = {"w": jnp.ones((3,), jnp.float32)}

    def local_step(opt, params, state, x, poison):
        def loss(p):
            l = ((x @ p["w"]) ** 2).mean() * jnp.where(poison, jnp.inf, 1.0).astype(jnp.float32)
            return opt.scale_loss(l, state)
        grads = jax.grad(loss)(params)  # deliberately not averaged: only the flag is shared
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    # Replica 1 overflows, replica 0 does not: both must skip and keep equal scales.
    poison = jnp.asarray([False, True])
    for name, cond_elements in (("pmap", None), ("shard_map", None), ("pmap", 0), ("shard_map", 0)):
        if cond_elements is not None:  # the skip through a lax.cond (large gradients), not selects
            mp.backends.jax.optax.COND_ELEMENTS = cond_elements
        opt = mp.LossScaleOptimizer(optax.sgd(0.1), axis_name="r", policy="mixed_float16")
        state = opt.init(params)
        rep = lambda t: jax.tree_util.tree_map(lambda a: jnp.stack([a, a]), t)
        if name == "pmap":
            step = jax.pmap(functools.partial(local_step, opt), axis_name="r")
            p, s = step(rep(params), rep(state), x, poison)
        else:
            mesh = Mesh(np.array(jax.devices()), ("r",))
            step = jax.jit(jax.shard_map(
                lambda p, s, x, z: jax.tree_util.tree_map(lambda a: a[None], local_step(
                    opt, *jax.tree_util.tree_map(lambda a: a[0], (p, s, x, z)))),
                mesh=mesh, in_specs=P("r"), out_specs=P("r")))
            p, s = step(rep(params), rep(state), x, poison)
        assert np.asarray(s.last_step_skipped).tolist() == [True, True], (name, s)
        assert np.asarray(s.loss_scale).tolist() == [2.0**14] * 2, (name, s)
        np.testing.assert_array_equal(np.asarray(p["w"]), np.ones((2, 3), np.float32))
        # without axis_name, replica 0 would have stepped on its own
        alone = mp.LossScaleOptimizer(optax.sgd(0.1), policy="mixed_float16")
        q, t = jax.pmap(functools.partial(local_step, alone))(rep(params), rep(alone.init(params)), x, poison)
        assert np.asarray(t.last_step_skipped).tolist() == [False, True]
        print(name, cond_elements, "ok")
""")


def test_replicas_skip_together_under_pmap_and_shard_map():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", _REPLICAS], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["pmap", "None", "ok", "shard_map", "None", "ok", "pmap", "0", "ok",
                                     "shard_map", "0", "ok"], result.stdout


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_the_compiled_check_grows_with_the_leaves_not_their_square(policy):
    """The non-finite check's flag is read by a select per leaf of the updates and the state;
    it used to be a chain of ands that XLA copied into each of them (600 leaves: 360,000 ands
    and a minute to compile on a CPU). Its ops now grow linearly, and it still finds the one
    leaf that is not finite."""
    def compiled_ands(n):
        params = [jnp.ones((4, 4)) for _ in range(n)]
        tx = mp.LossScaleOptimizer(optax.sgd(0.1), policy=policy)
        update = jax.jit(lambda g, s, p: tx.update(g, s, p))
        return update.lower(params, tx.init(params), params).compile().as_text().count(" and(")

    small, large = compiled_ands(40), compiled_ands(160)
    assert large <= 8 * small + 100, (small, large)  # squared growth: 16x

    params = [jnp.ones((4, 4)) for _ in range(40)]
    tx = mp.LossScaleOptimizer(optax.sgd(0.1), policy=policy)
    state = tx.init(params)
    grads = [jnp.full((4, 4), jnp.nan) if i == 37 else jnp.ones((4, 4)) for i in range(40)]
    updates, state = jax.jit(tx.update)(grads, state, params)
    assert int(state.num_skipped_steps) == 1 and all(float(jnp.abs(u).max()) == 0 for u in updates)


def test_a_donated_adamw_state_skips_through_the_cond_as_through_the_selects():
    """Gradients of `COND_ELEMENTS` or more skip through a ``jax.lax.cond`` (selects made XLA copy
    a donated state: 5x the bare update's time on a CPU). A jitted AdamW step with its
    parameters and state donated: the finite steps compute what the selects do, a non-finite
    one leaves them as they were, over gradients of either size."""
    def run(n, cond_elements, poisons):
        optax_adapter.COND_ELEMENTS = cond_elements
        with adam():
            tx = mp.LossScaleOptimizer(optax.adamw(1e-2), policy="mixed_float16")
            params = {"w": jnp.linspace(-1.0, 1.0, n, dtype=jnp.float32), "b": jnp.zeros(3, jnp.float32)}

            def step(p, s, poison):
                grads = jax.grad(lambda q: tx.scale_loss(
                    (jnp.sum(q["w"] ** 2) + jnp.sum(q["b"])) * jnp.where(poison, jnp.inf, 1.0), s))(p)
                updates, s = tx.update(grads, s, p)
                return optax.apply_updates(p, updates), s

            step = jax.jit(step, donate_argnums=(0, 1))
            state, seen = tx.init(params), []
            for poison in poisons:
                params, state = step(params, state, poison)
                seen.append(jax.tree_util.tree_map(np.asarray, (params, state)))
        return seen

    default = optax_adapter.COND_ELEMENTS
    try:
        poisons = [False, True, False, True, True, False]
        for n in (5, 3000):
            by_cond, by_selects = run(n, 0, poisons), run(n, 10**9, poisons)
            for i, (a, b) in enumerate(zip(by_cond, by_selects)):
                for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
                    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
                if poisons[i]:  # skipped: the step before's parameters and AdamW state
                    before = jax.tree_util.tree_leaves((by_cond[i - 1][0], by_cond[i - 1][1].inner_state))
                    after = jax.tree_util.tree_leaves((a[0], a[1].inner_state))
                    for x, y in zip(before, after):
                        np.testing.assert_array_equal(x, y)
            assert int(by_cond[-1][1].num_skipped_steps) == 3
            assert float(by_cond[-1][1].loss_scale) == 2.0**15 / 8
    finally:
        optax_adapter.COND_ELEMENTS = default


_TRANSFORMATIONS = {
    "adamw_bfloat16_moments": lambda: optax.adamw(1e-2, mu_dtype=jnp.bfloat16),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
    "multi_steps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
    "clipped_momentum": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1e-2, momentum=0.9)),
    "masked": lambda: optax.masked(optax.adam(1e-2), {"w": True, "b": False}),
    "multi_transform": lambda: optax.multi_transform({"a": optax.adam(1e-2), "s": optax.sgd(1e-2)},
                                                     {"w": "a", "b": "s"}),
    "reduce_on_plateau": lambda: optax.chain(optax.adam(1e-2), optax.contrib.reduce_on_plateau()),
    "adafactor": lambda: optax.adafactor(1e-2),
}


@pytest.mark.parametrize("name", sorted(_TRANSFORMATIONS))
def test_optax_transformations_skip_through_the_cond_as_through_the_selects(name, monkeypatch):
    """The inner transformations users chain (schedules injected, accumulation, masks, partitions,
    a plateau that reads the loss, factored moments) step through the ``cond`` as through the
    selects, and a skipped step leaves their state and the parameters as they were."""
    params = {"w": jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(4, 3), "b": jnp.zeros(3, jnp.float32)}
    poisons = (False, True, False, False)

    def run(cond_elements):
        monkeypatch.setattr(optax_adapter, "COND_ELEMENTS", cond_elements)
        tx = mp.LossScaleOptimizer(_TRANSFORMATIONS[name](), policy="mixed_float16")

        @jax.jit
        def step(p, s, poison):
            loss = lambda q: (jnp.sum(q["w"] ** 2) + jnp.sum(q["b"])) * jnp.where(poison, jnp.inf, 1.0)
            grads = jax.grad(lambda q: tx.scale_loss(loss(q), s))(p)
            updates, s = tx.update(grads, s, p, value=jnp.sum(p["w"] ** 2))
            return optax.apply_updates(p, updates), s

        p, s, seen = params, tx.init(params), []
        for poison in poisons:
            p, s = step(p, s, poison)
            seen.append((p, s))
        return seen

    with adam():
        by_cond, by_selects = run(0), run(10**9)
    for (p, s), (q, t) in zip(by_cond, by_selects):
        for x, y in zip(jax.tree_util.tree_leaves((p, s)), jax.tree_util.tree_leaves((q, t))):
            np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=1e-5, atol=1e-6)
    before = jax.tree_util.tree_leaves((by_cond[0][0], by_cond[0][1].inner_state))
    after = jax.tree_util.tree_leaves((by_cond[1][0], by_cond[1][1].inner_state))
    for x, y in zip(before, after):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert int(by_cond[-1][1].num_skipped_steps) == 1


@pytest.mark.parametrize("path", ["mask", "product"])
def test_the_check_finds_every_non_finite_value_through_either_reading(path, monkeypatch):
    """Groups of small gradients are read through an isfinite mask, larger ones in place through a
    product with zeros (`arrays.READ_ALONE_FROM`: a matrix-vector product, or a sum of x * 0 for
    bfloat16 and sizes no row length divides): each finds inf, -inf and NaN in every float dtype,
    in any leaf of several groups, jitted or not, and never reads values at the top of a range as
    overflowing."""
    from mixedpolicy.backends.jax import arrays

    if path == "product":
        monkeypatch.setattr(arrays, "READ_ALONE_FROM", 0)
    tops = {jnp.float32: 3.0e38, jnp.bfloat16: 3.3e38, jnp.float16: 65504.0}
    leaves = [jnp.full(shape, top, dtype) for dtype, top in tops.items() for shape in ((300,), (64, 48))]
    leaves += [jnp.full((70000,), -3.0e38), jnp.full((3, 4096), 3.0e38), jnp.full((5,), 2.0)]
    for check in (arrays.all_finite, jax.jit(arrays.all_finite)):
        assert bool(check(leaves))
        for i, leaf in enumerate(leaves):
            for bad in (jnp.inf, -jnp.inf, jnp.nan):
                poisoned = list(leaves)
                poisoned[i] = leaf.ravel().at[-1].set(bad).reshape(leaf.shape)
                assert not bool(check(poisoned)), (path, i, bad)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_a_complex_parameter_steps_as_the_bare_optimizer_and_its_inf_is_skipped(policy, skip_by):
    """A complex parameter (an S4/S5 layer's eigenvalues, a Fourier filter): its gradient is
    unscaled and checked as its two parts. Under mixed_float16 it moved 2**15 times too far, and
    an inf in it reached the parameters under either policy."""
    params = {"w": jnp.array([1 + 1j, 2 - 1j], jnp.complex64), "b": jnp.ones(2, jnp.float32)}

    def loss(p, poison):
        return (jnp.sum(jnp.abs(p["w"] * poison) ** 2) + jnp.sum(p["b"] ** 2)).astype(jnp.float32)

    opt = mp.LossScaleOptimizer(optax.sgd(0.1), policy=policy)
    state, bare, bare_state, ref = opt.init(params), optax.sgd(0.1), None, params
    bare_state = bare.init(ref)
    for poison in (1.0, jnp.inf, 1.0):
        grads = jax.grad(lambda p: opt.scale_loss(loss(p, poison), state))(params)
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        if poison == 1.0:  # the bare optimizer, on the finite steps only
            updates, bare_state = bare.update(jax.grad(loss)(ref, poison), bare_state, ref)
            ref = optax.apply_updates(ref, updates)
        assert bool(state.last_step_skipped) == (poison != 1.0)
    assert params["w"].dtype == jnp.complex64 and int(state.num_skipped_steps) == 1
    np.testing.assert_allclose(params["w"], ref["w"], rtol=1e-6)
    np.testing.assert_allclose(params["b"], ref["b"], rtol=1e-6)


def test_half_weights_a_policy_does_not_store_are_said_at_init_as_torch_refuses_them():
    """bfloat16 or float16 parameters under a policy whose variables are float32 lose every update
    below half an ulp (why mixed precision keeps float32 masters): the torch wrapper refuses them;
    here, where half weights are often meant (jmp's params=bfloat16), init warns with the fix. A
    pure policy, or a map that stores some variables in half precision, says they are meant."""
    import warnings

    params = {"w": jnp.ones(3, jnp.bfloat16), "b": jnp.ones(2)}
    for policy in (None, "mixed_bfloat16", "mixed_float16"):
        with pytest.warns(UserWarning, match=r"Received bfloat16 parameters .*policy='bfloat16'"):
            mp.LossScaleOptimizer(optax.sgd(0.1), policy=policy).init(params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for policy in ("bfloat16", mp.PolicyMap("mixed_bfloat16", {"w": "bfloat16"})):
            mp.LossScaleOptimizer(optax.sgd(0.1), policy=policy).init(params)
        mp.LossScaleOptimizer(optax.sgd(0.1), policy="mixed_bfloat16").init({"w": jnp.ones(3)})


def test_a_line_search_runs_where_nothing_is_scaled_and_is_refused_under_scaling():
    """optax.lbfgs re-evaluates the loss (value_fn) against the value and gradients it is
    handed: under a policy that scales nothing the wrapper gives its steps exactly; under
    loss scaling, which those re-evaluations cannot follow (the run ended at 2766 against
    0.0069), it is refused with the fix, as torch's LBFGS is."""
    import jax
    import jax.numpy as jnp
    import optax

    def rosenbrock(p):
        x = p["w"]
        return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2)

    def run(opt, steps=12):
        params, state = {"w": jnp.zeros(6)}, opt.init({"w": jnp.zeros(6)})
        for _ in range(steps):
            value, grads = jax.value_and_grad(rosenbrock)(params)
            updates, state = opt.update(grads, state, params, value=value, grad=grads, value_fn=rosenbrock)
            params = optax.apply_updates(params, updates)
        return params["w"]

    theirs = run(optax.lbfgs())
    for policy in ("float32", "mixed_bfloat16"):
        np.testing.assert_array_equal(run(mp.LossScaleOptimizer(optax.lbfgs(), policy=policy)), theirs)
    with pytest.raises(TypeError, match=r"value_fn= for an update under dynamic loss scale.*re-evaluates the loss "
                                        r"\(a line search.*Under a bfloat16 or float32 policy.*optax.adamw"):
        run(mp.LossScaleOptimizer(optax.lbfgs(), policy="mixed_float16"), steps=1)


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_helpers_that_read_their_own_state_read_it_through_the_wrappers(policy):
    # optax's schedule_free_eval_params reads state.b1 and state.z by attribute: the wrapper's
    # state answers with its inner state's fields (a scaling or a pass-through wrapper alike)
    import copy
    import pickle

    import optax.contrib

    params = {"w": jnp.ones((4, 3))}
    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)

    def run(tx, scale=lambda s: 1.0):
        state, p = tx.init(params), params
        for _ in range(3):
            g = jax.grad(lambda q: jnp.mean((x @ q["w"]) ** 2) * scale(state))(p)
            updates, state = tx.update(g, state, p)
            p = optax.apply_updates(p, updates)
        return optax.contrib.schedule_free_eval_params(state, p), state

    with jax.numpy_dtype_promotion("standard"):  # optax's own mixing inside schedule-free
        alone, _ = run(optax.contrib.schedule_free_adamw(1e-2))
        wrapped, state = run(mp.LossScaleOptimizer(optax.contrib.schedule_free_adamw(1e-2), policy=policy),
                             lambda s: s.loss_scale)
    np.testing.assert_allclose(wrapped["w"], alone["w"], rtol=1e-6)
    assert state.b1 == state.inner_state.b1
    with pytest.raises(AttributeError, match="no attribute 'nothing', nor has its inner_state"):
        state.nothing
    # copies and pickles as before (their probes of dunder names are not sent on)
    assert jax.tree.structure(copy.deepcopy(state)) == jax.tree.structure(state)
    assert jax.tree.structure(pickle.loads(pickle.dumps(state))) == jax.tree.structure(state)


def test_a_loop_that_never_scales_its_loss_is_warned_once_where_the_wrapper_scales(monkeypatch):
    """torch's wrapper (as GradScaler) refuses a step whose gradients no scaled loss made; a JAX
    wrapper sees arrays only, so the first update of a scaling wrapper whose scale_loss was
    never called warns, naming the fix (under jit, as the step is traced; once). Nothing is said
    where nothing is scaled, where the loop scales, or once the user's code has read the scale
    (to scale by hand)."""
    from mixedpolicy import _warnings

    monkeypatch.setattr(_warnings, "SCALE_READ_BY_USER", [False])
    params = {"w": jnp.ones(3)}

    def run(tx, scaled, steps=2):
        @jax.jit
        def step(params, state):
            loss = lambda p: jnp.sum(p["w"] ** 2)
            grads = jax.grad(lambda p: tx.scale_loss(loss(p), state) if scaled else loss(p))(params)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        p, state = params, tx.init(params)
        for _ in range(steps):
            p, state = step(p, state)
        return p

    forgot = mp.LossScaleOptimizer(optax.sgd(0.1), policy="mixed_float16")
    with pytest.warns(UserWarning, match="scale_loss never was") as caught:
        p = run(forgot, scaled=False, steps=3)
    assert sum("scale_loss never was" in str(w.message) for w in caught) == 1
    assert "tx.scale_loss(loss, opt_state)" in str(caught[0].message)
    assert float(p["w"][0]) > 0.999  # what it warns of: the update 32768x too small
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*scale_loss never was")
        run(forgot, scaled=False)  # said once per wrapper
        np.testing.assert_allclose(run(mp.LossScaleOptimizer(optax.sgd(0.1), policy="mixed_float16"), scaled=True)["w"],
                                   run(optax.sgd(0.1), scaled=False)["w"], rtol=1e-6)
        for settings in ({"policy": "mixed_bfloat16"}, {"policy": "float32"}, {"loss_scale": mp.NoLossScale()},
                         {"loss_scale": mp.StaticLossScale(1.0)}):
            run(mp.LossScaleOptimizer(optax.sgd(0.1), **settings), scaled=False)
        # scaled by hand with the state's own scale: right, and not taken for a mistake
        by_hand = mp.LossScaleOptimizer(optax.sgd(0.1), policy="mixed_float16")
        state = by_hand.init(params)
        grads = jax.grad(lambda p: jnp.sum(p["w"] ** 2) * state.loss_scale)(params)
        updates, _ = by_hand.update(grads, state, params)
        np.testing.assert_allclose(updates["w"], -0.2 * np.ones(3), rtol=1e-6)
    monkeypatch.setattr(_warnings, "SCALE_READ_BY_USER", [False])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*scale_loss never was")
        # optax.inject_hyperparams builds the wrapper anew at every update: the update of a state
        # whose loss was scaled (by the wrapper built at init) is not one that forgot to scale
        made = []
        injected = optax.inject_hyperparams(
            lambda learning_rate: made.append(mp.LossScaleOptimizer(optax.sgd(learning_rate), policy="mixed_float16"))
            or made[-1])(learning_rate=0.1)
        injected.scale_loss = lambda loss, state: made[0].scale_loss(loss, state)
        np.testing.assert_allclose(run(injected, scaled=True)["w"], run(optax.sgd(0.1), scaled=False)["w"], rtol=1e-6)
        assert len(made) > 1
