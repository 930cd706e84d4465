"""mixedpolicy's Keras LossScaleOptimizer: Keras's own tests, skips, fit, saving.

Run by tests/backends/keras/test_keras.py once per Keras backend, in a pytest process of its own
(KERAS_BACKEND is chosen per process); not collected by the main run.
"""

import os
import sys
import unittest
import tempfile
import warnings

import numpy as np
import pytest
import keras

import mixedpolicy as mp


def test_keras_own_loss_scale_optimizer_tests():
    """Keras's own LossScaleOptimizer tests, through the class and the factory."""
    import keras.src.optimizers.loss_scale_optimizer_test as keras_tests
    from mixedpolicy.backends.keras.optimizer import LossScaleOptimizer

    # Every one of Keras's own tests, through the class and through the factory under a
    # float16 policy (where Keras itself uses a LossScaleOptimizer; elsewhere the factory
    # gives a pass-through: test_the_factory_follows_the_policy).
    class factory:
        from_config = mp.LossScaleOptimizer.from_config

        def __new__(cls, inner, *args, **kwargs):
            return mp.LossScaleOptimizer(inner, *args, policy="mixed_float16", **kwargs)

    for under_test in (LossScaleOptimizer, factory):
        keras_tests.LossScaleOptimizer = under_test
        suite = unittest.TestLoader().loadTestsFromTestCase(keras_tests.LossScaleOptimizerTest)
        result = unittest.TextTestRunner(stream=sys.stdout, verbosity=0).run(suite)
        assert result.wasSuccessful() and result.testsRun >= 25, (under_test, result.failures, result.errors)
    # the settings Keras cannot express travel only where they are set, and come back
    config = LossScaleOptimizer(keras.optimizers.SGD(0.5), 3.0, 2, name="t", min_scale=0.5).get_config()
    assert set(config) == {"name", "inner_optimizer", "initial_scale", "dynamic_growth_steps", "min_scale"}
    again = mp.LossScaleOptimizer.from_config(config)
    assert (again.initial_scale, again.dynamic_growth_steps, again._scale_settings.min_scale) == (3.0, 2, 0.5)
    static = LossScaleOptimizer(keras.optimizers.SGD(0.5), loss_scale=mp.StaticLossScale(8.0))
    assert LossScaleOptimizer.from_config(static.get_config())._scale_settings == mp.StaticLossScale(8.0)
    # a config written by Keras's own LossScaleOptimizer reads back, and ours reads in Keras's
    own = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.5), 4.0, 3, name="k").get_config()
    mine = mp.LossScaleOptimizer.from_config(own)
    assert isinstance(mine, LossScaleOptimizer) and (mine.initial_scale, mine.dynamic_growth_steps, mine.name) == (4.0, 3, "k")
    theirs = keras.optimizers.LossScaleOptimizer.from_config(mp.LossScaleOptimizer(keras.optimizers.SGD(0.5), policy="mixed_float16").get_config())
    assert theirs.initial_scale == 2.0**15


def test_bounded_scale_skips_and_checkpoints():
    """Bounded scale, visible skips, compiled loops, fit, save and load."""
    from keras import ops

    backend = keras.backend.backend()
    opt = mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), policy="mixed_float16")
    assert isinstance(opt, mp.LossScaleOptimizer) and isinstance(opt, keras.optimizers.LossScaleOptimizer)
    try:  # Keras's exception type, with the fix
        mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), learning_rate=0.1)
        raise AssertionError("expected a ValueError")
    except ValueError as err:
        assert "belong to the inner optimizer" in str(err), err
    try:  # GradScaler's name for a setting: the refusal names ours
        mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), growth_interval=10)
        raise AssertionError("expected a ValueError")
    except ValueError as err:
        assert "for growth_interval= pass dynamic_growth_steps=" in str(err), err
    named = mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), name="opt", dynamic=True)
    assert named.name == "opt"

    # 200 overflows in a row, eagerly (Keras's own fails on jax here, and reaches a
    # scale of 0 on the others): weights untouched, scale at its floor, no iteration
    w = keras.Variable(np.array([1.0, 2.0, 3.0], "float32"))
    opt.build([w])
    inf = ops.convert_to_tensor(np.array([np.inf, 1.0, 1.0], "float32"))
    for _ in range(200):
        opt.apply([inf], [w])
    np.testing.assert_array_equal(ops.convert_to_numpy(w), [1.0, 2.0, 3.0])
    assert opt.loss_scale == 1.0 and opt.num_skipped_steps == 200 and opt.last_step_skipped
    assert int(ops.convert_to_numpy(opt.iterations)) == 0
    opt.apply([ops.convert_to_tensor(np.array([1.0, 1.0, 1.0], "float32"))], [w])
    np.testing.assert_allclose(ops.convert_to_numpy(w), [0.9, 1.9, 2.9], rtol=1e-6)
    assert not opt.last_step_skipped and int(ops.convert_to_numpy(opt.iterations)) == 1

    # the scaled loss is float32, whatever the loss dtype
    assert keras.backend.standardize_dtype(opt.scale_loss(ops.ones((), "float16")).dtype) == "float32"

    # compiled custom loops
    def compiled_apply(opt, grads, w):
        if backend == "tensorflow":
            import tensorflow as tf
            tf.function(lambda: opt.apply(grads, [w]))()
        elif backend == "jax":
            import jax
            values, opt_values = jax.jit(opt.stateless_apply)(
                [v.value for v in opt.variables], grads, [w.value])
            w.assign(values[0])
            for v, value in zip(opt.variables, opt_values):
                v.assign(value)
        else:
            opt.apply(grads, [w])

    opt2 = mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=4.0)
    w2 = keras.Variable(np.array([1.0, 2.0, 3.0], "float32"))
    opt2.build([w2])
    compiled_apply(opt2, [inf], w2)
    np.testing.assert_array_equal(ops.convert_to_numpy(w2), [1.0, 2.0, 3.0])
    assert opt2.loss_scale == 2.0 and opt2.num_skipped_steps == 1
    compiled_apply(opt2, [ops.convert_to_tensor(np.array([2.0, 2.0, 2.0], "float32"))], w2)
    np.testing.assert_allclose(ops.convert_to_numpy(w2), [0.9, 1.9, 2.9], rtol=1e-6)
    assert opt2.num_skipped_steps == 1 and not opt2.last_step_skipped
    # the check alone (float32: no scale), compiled: the skip is counted in the skipping branch
    # only, and the last step's answer follows each step, skipped or applied
    safe = mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), policy="float32")
    w3 = keras.Variable(np.array([1.0, 2.0, 3.0], "float32"))
    safe.build([w3])
    ones = ops.convert_to_tensor(np.ones(3, "float32"))
    for grad, skipped, count in [(inf, True, 1), (ones, False, 1), (inf, True, 2), (inf, True, 3), (ones, False, 3)]:
        compiled_apply(safe, [grad], w3)
        assert (safe.last_step_skipped, safe.num_skipped_steps) == (skipped, count)
    np.testing.assert_allclose(ops.convert_to_numpy(w3), [0.8, 1.8, 2.8], rtol=1e-6)

    # model.fit with one poisoned batch per epoch: that step is skipped, counted, the rest train
    # (a first step may also overflow in float16 at the initial scale of 2**15: skipped too)
    mp.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    x[16:32] = np.nan  # the second batch of 16
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    from mixedpolicy.backends.keras.optimizer import LossScaleOptimizer
    assert isinstance(model.optimizer, LossScaleOptimizer)
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    skipped = model.optimizer.num_skipped_steps
    assert skipped >= 2, skipped
    assert int(ops.convert_to_numpy(model.optimizer.iterations)) + skipped == 8
    assert all(np.isfinite(ops.convert_to_numpy(v)).all() for v in model.weights)

    # saved and restored with the model
    path = os.path.join(tempfile.mkdtemp(), "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, LossScaleOptimizer)
    assert loaded.optimizer._scale_settings == model.optimizer._scale_settings
    assert loaded.optimizer.num_skipped_steps == skipped
    assert loaded.optimizer.loss_scale == model.optimizer.loss_scale
    mp.set_global_policy(None)


def test_a_checkpoint_with_a_collapsed_scale_is_refused_on_load():
    w = keras.Variable(np.ones(3, "float32"))
    opt = mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), policy="mixed_float16")
    opt.build([w])
    store = {str(i): keras.ops.convert_to_numpy(v) for i, v in enumerate(opt.variables)}
    index = [i for i, v in enumerate(opt.variables) if v is opt.dynamic_scale][0]
    store[str(index)] = np.asarray(np.nan, "float32")
    fresh = mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), policy="mixed_float16")
    fresh.build([keras.Variable(np.ones(3, "float32"))])
    try:
        fresh.load_own_variables(store)
        raise AssertionError("expected a ValueError")
    except ValueError as err:
        assert "loss scale is nan" in str(err), err
    fresh.load_own_variables({str(i): keras.ops.convert_to_numpy(v) for i, v in enumerate(opt.variables)})
    assert fresh.loss_scale == 2.0**15


def test_a_scale_moves_between_scaling_and_pass_through_wrappers_as_on_torch(tmp_path, caplog):
    """load_weights of a float16 run's file into a model under bf16 (a wrapper that scales
    nothing): the scale is dropped, said once, the skip count kept; of a bf16 run's file into a
    float16 one: the scaling wrapper keeps its own initial scale, not the 1.0 the other stored."""
    path = str(tmp_path / "w.weights.h5")
    x, y = np.ones((8, 8), "float32"), np.full((8, 2), 1e6, "float32")  # large: a skipped step or two

    def trained(policy):
        mp.set_global_policy(policy)
        try:
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(2)])
            model.compile(mp.LossScaleOptimizer(keras.optimizers.SGD(1e-3)), "mse")
        finally:
            mp.set_global_policy("float32")
        model.fit(x, y, batch_size=8, epochs=3, verbose=0)
        return model

    scaled = trained("mixed_float16")
    skipped = scaled.optimizer.num_skipped_steps
    assert scaled.optimizer.loss_scale < 2.0**15 and skipped > 0
    scaled.save_weights(path)
    plain = trained("mixed_bfloat16")
    with caplog.at_level("WARNING", logger="mixedpolicy"):
        plain.load_weights(path)
    said = [r.getMessage() for r in caplog.records if "scales nothing" in r.getMessage()]
    assert len(said) == 1 and f"loss scale is {scaled.optimizer.loss_scale:g}" in said[0]
    assert plain.optimizer.loss_scale == 1.0 and plain.optimizer.num_skipped_steps == skipped
    plain.save_weights(path)
    again = trained("mixed_float16")
    again.load_weights(path)
    assert again.optimizer.loss_scale == 2.0**15 and again.optimizer.num_skipped_steps == skipped
    scaled.save_weights(path)  # the same kind of wrapper: the scale and counters as saved
    again.load_weights(path)
    assert again.optimizer.loss_scale == scaled.optimizer.loss_scale



def test_a_pass_through_or_static_wrapper_loads_a_scale_as_on_torch_and_optax(tmp_path, caplog):
    """A pass-through (skip_nonfinite=False) scales nothing: a scaling file's scale is dropped and
    said, and its own file leaves a float16 wrapper its initial scale (it left 1.0: a float16 run
    started unscaled); a static scale keeps its own and says what it dropped (it took the saved
    one), as the torch wrapper's load_state_dict and the optax wrapper's adopt_state do."""
    path = str(tmp_path / "w.weights.h5")
    x, y = np.ones((8, 8), "float32"), np.full((8, 2), 1e6, "float32")

    def trained(policy="float32", **wrapper):
        mp.set_global_policy(policy)  # float16 compute: a skipped step or two on these targets
        try:
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(2)])
            model.compile(mp.LossScaleOptimizer(keras.optimizers.SGD(1e-3), **wrapper), "mse")
        finally:
            mp.set_global_policy("float32")
        model.fit(x, y, batch_size=8, epochs=3, verbose=0)
        return model

    scaled = trained(policy="mixed_float16")
    assert scaled.optimizer.loss_scale < 2.0**15
    scaled.save_weights(path)
    for wrapper, kind, own in ((dict(skip_nonfinite=False), "scales nothing (pass-through", 1.0),
                               (dict(loss_scale=mp.StaticLossScale(128.0)), "with a static scale of 128", 128.0)):
        model = trained(**wrapper)
        caplog.clear()
        with caplog.at_level("WARNING", logger="mixedpolicy"):
            model.load_weights(path)
        said = [r.getMessage() for r in caplog.records if "Loaded a checkpoint" in r.getMessage()]
        assert len(said) == 1 and kind in said[0] and f"loss scale is {scaled.optimizer.loss_scale:g}" in said[0]
        assert model.optimizer.loss_scale == own, wrapper
    trained(skip_nonfinite=False).save_weights(path)
    again = trained(policy="mixed_float16")
    again.load_weights(path)
    assert again.optimizer.loss_scale == 2.0**15

def test_reads_keras_layout_and_its_own_earlier_layout():
    """Saved variables: Keras's own order (no counters) now; the earlier files (counters
    at index 2) still load; any other count is Keras's warning, not a wrong assignment."""
    from keras import ops

    w = [keras.Variable(np.ones(3, "float32"))]
    opt = mp.LossScaleOptimizer(keras.optimizers.SGD())
    opt.build(w)
    values = {v.path.split("/")[-1]: np.asarray(ops.convert_to_numpy(v)) for v in opt.variables}
    keras_layout = [v for v in opt.variables if v is not opt._skips]
    store = {str(i): (np.asarray(512.0, "float32") if v is opt.dynamic_scale else
                      np.asarray(ops.convert_to_numpy(v))) for i, v in enumerate(keras_layout)}
    opt.load_own_variables(store)
    assert opt.loss_scale == 512.0 and opt.num_skipped_steps == 0
    earlier = {str(i): (np.asarray([4, 1], "int32") if v is opt._skips else
                        np.asarray(ops.convert_to_numpy(v))) for i, v in enumerate(opt.variables)}
    opt.load_own_variables(earlier)
    assert opt.num_skipped_steps == 4 and opt.last_step_skipped and opt.loss_scale == 512.0
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_own_variables({"0": np.asarray(1)})
    assert any("Skipping variable loading" in str(c.message) for c in caught)
    assert opt.loss_scale == 512.0 and values  # nothing was overwritten


def test_a_keras_dtype_policy_map_as_the_global_policy_scales_where_one_of_its_policies_computes_in_float16():
    """Keras's global policy may be a DTypePolicyMap (per-layer policies): the wrapper scales where
    its default or one of its entries computes in float16. A map with entries is no single Policy
    (it says how to write the PolicyMap); one without is its default."""
    from keras.dtype_policies import DTypePolicyMap

    mp.set_global_policy(None)
    try:
        for default, entry, scales in (("mixed_float16", "float32", True), ("float32", "mixed_float16", True),
                                       ("mixed_bfloat16", "float32", False)):
            policy_map = DTypePolicyMap(default_policy=default)
            policy_map["dense"] = entry
            keras.config.set_dtype_policy(policy_map)
            opt = mp.LossScaleOptimizer(keras.optimizers.SGD(0.1))
            assert opt.loss_scaling.startswith("dynamic") == scales, (default, entry, opt.loss_scaling)
            with pytest.raises(ValueError, match="DTypePolicyMap with per-layer entries .'dense'.*mp.PolicyMap"):
                mp.Policy.from_keras(policy_map)
            with pytest.raises(ValueError, match="per-layer entries"):
                mp.PolicyMap(policy_map)
        assert mp.Policy.from_keras(DTypePolicyMap(default_policy="mixed_bfloat16")) == mp.Policy("mixed_bfloat16")
    finally:
        keras.config.set_dtype_policy("float32")


def test_the_factory_follows_the_policy():
    """Under float32 or bfloat16, mp.LossScaleOptimizer(opt) scales nothing but skips a non-finite
    step; skip_nonfinite=False adds nothing to the inner step."""
    from keras import ops
    from mixedpolicy.backends.keras.optimizer import LossScaleOptimizer

    mp.set_global_policy(None)
    # the default under a policy without float16: no scaling, a non-finite step skipped
    safe = mp.LossScaleOptimizer(keras.optimizers.SGD(0.5))
    assert isinstance(safe, LossScaleOptimizer) and safe.loss_scaling.startswith("no scaling")
    w = keras.Variable(np.ones(2, "float32"))
    safe.apply([ops.convert_to_tensor(np.array([1.0, np.inf], "float32"))], [w])
    np.testing.assert_array_equal(ops.convert_to_numpy(w), [1.0, 1.0])  # Keras's LSO test expects this
    assert safe.last_step_skipped and safe.num_skipped_steps == 1 and safe.loss_scale == 1.0
    again = mp.LossScaleOptimizer.from_config(safe.get_config())
    assert again.loss_scaling.startswith("no scaling")
    # skip_nonfinite=False: the inner optimizer's step exactly
    opt = mp.LossScaleOptimizer(keras.optimizers.SGD(0.5), skip_nonfinite=False)
    assert isinstance(opt, LossScaleOptimizer) and opt.loss_scaling.startswith("pass-through")
    loss = ops.convert_to_tensor(np.float32(3.0))
    assert opt.scale_loss(loss) is loss and opt.loss_scale == 1.0
    w = keras.Variable(np.ones(2, "float32"))
    opt.apply([ops.convert_to_tensor(np.array([1.0, np.inf], "float32"))], [w])
    np.testing.assert_array_equal(ops.convert_to_numpy(w), [0.5, -np.inf])  # nothing checked
    assert not opt.last_step_skipped and opt.num_skipped_steps == 0
    # stateless (JAX's trainer): the inner optimizer's own stateless step
    plain = keras.optimizers.SGD(0.5) if keras.backend.backend() != "tensorflow" else None
    if plain is None:  # TensorFlow has no stateless_apply
        return _fit_with_the_pass_through()
    opt = mp.LossScaleOptimizer(keras.optimizers.SGD(0.5), skip_nonfinite=False)
    w1, w2 = keras.Variable(np.ones(2, "float32")), keras.Variable(np.ones(2, "float32"))
    opt.build([w1])
    plain.build([w2])
    grads = [ops.convert_to_tensor(np.array([1.0, 2.0], "float32"))]
    new_w, new_vars = opt.stateless_apply([v.value for v in opt.variables], grads, [w1.value])
    ref_w, ref_vars = plain.stateless_apply([v.value for v in plain.variables], grads, [w2.value])
    np.testing.assert_array_equal(ops.convert_to_numpy(new_w[0]), ops.convert_to_numpy(ref_w[0]))
    assert len(new_vars) == len(opt.variables)
    # the choice survives a config round trip; Keras's global policy is read too
    again = mp.LossScaleOptimizer.from_config(opt.get_config())
    assert again.loss_scaling.startswith("pass-through") and again.get_config()["pass_through"]
    keras.config.set_dtype_policy("mixed_float16")
    try:
        assert mp.LossScaleOptimizer(keras.optimizers.SGD(0.5)).loss_scaling.startswith("dynamic")
    finally:
        keras.config.set_dtype_policy("float32")
    assert mp.LossScaleOptimizer(keras.optimizers.SGD(0.5), policy="mixed_float16").loss_scaling.startswith("dynamic")
    _fit_with_the_pass_through()


def _fit_with_the_pass_through():
    """fit under bfloat16 with the pass-through trains like the bare optimizer."""
    mp.set_global_policy("mixed_bfloat16")
    try:
        keras.utils.set_random_seed(0)
        x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
        y = x.sum(axis=1, keepdims=True)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(mp.LossScaleOptimizer(keras.optimizers.SGD(0.05)), "mse")
        first = model.evaluate(x, y, verbose=0)
        model.fit(x, y, epochs=5, batch_size=8, verbose=0)
        assert model.evaluate(x, y, verbose=0) < first
    finally:
        mp.set_global_policy(None)


def test_keras_own_compile_wrapping_is_ours_only_while_the_global_policy_computes_in_float16():
    """The patch of Keras's trainer is undone when the global policy leaves float16; a model
    given a float16 policy by apply_policy still compiles into the bounded wrapper."""
    from keras.src.trainers import trainer
    from mixedpolicy.backends.keras.optimizer import LossScaleOptimizer

    def net():
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])

    try:
        mp.set_global_policy("mixed_float16")
        plain = net()
        plain.compile(keras.optimizers.SGD(0.1), "mse")
        assert isinstance(plain.optimizer, LossScaleOptimizer)
        ours = mp.apply_policy(net(), "mixed_float16")
    finally:
        mp.set_global_policy(None)
    # Keras's own again (the name compile calls builds Keras's class; it only checks a pass-through of ours)
    assert type(trainer.LossScaleOptimizer(keras.optimizers.SGD())) is keras.optimizers.LossScaleOptimizer
    keras.config.set_dtype_policy("mixed_float16")
    try:
        theirs = net()
    finally:
        keras.config.set_dtype_policy("float32")
    theirs.compile(keras.optimizers.SGD(0.1), "mse")
    assert type(theirs.optimizer) is keras.optimizers.LossScaleOptimizer
    ours.compile(keras.optimizers.SGD(0.1), "mse")
    assert isinstance(ours.optimizer, LossScaleOptimizer) and ours.optimizer.loss_scaling.startswith("dynamic")


def test_a_pass_through_around_nadam_trains_as_nadam_alone():
    """Nadam keeps a variable it makes by attribute (_u_product); built inside Keras's
    LossScaleOptimizer it went untracked, and JAX's stateless step never updated it."""
    x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
    y = np.arange(64) % 3
    losses = []
    for wrap in (False, True):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
        opt = keras.optimizers.Nadam(1e-2)
        model.compile(mp.LossScaleOptimizer(opt, policy="float32") if wrap else opt,
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        losses.append(model.fit(x, y, epochs=3, batch_size=16, verbose=0, shuffle=False).history["loss"])
        assert len(opt.variables) == 2 + 2 * 4 + 1  # iterations, learning rate, 2 moments each, _u_product
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)  # two compiled programs; the bug: 4%



@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_gradient_accumulation_trains_as_under_keras_own_wrapper_and_skips_a_micro_batch(policy):
    """An inner optimizer with gradient_accumulation_steps (Keras's `iterations` is then its
    counter divided, a tensor: the skip count read it as a variable and the step failed on jax
    and tensorflow): the same losses as Keras's own wrapper, or the bare optimizer, and a
    non-finite micro-batch skipped and counted."""
    x = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
    y = np.arange(32) % 3
    losses, weights = [], []
    for wrap in (False, True):
        keras.utils.set_random_seed(0)
        keras.config.set_dtype_policy(policy)
        try:
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                      keras.layers.Dense(3, dtype="float32")])
        finally:
            keras.config.set_dtype_policy("float32")
        inner = keras.optimizers.Adam(1e-2, gradient_accumulation_steps=2)
        opt = (mp.LossScaleOptimizer(inner, policy=policy) if wrap else
               keras.optimizers.LossScaleOptimizer(inner) if policy == "mixed_float16" else inner)
        model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        losses.append(model.fit(x, y, epochs=2, batch_size=8, verbose=0, shuffle=False).history["loss"])
        weights.append(model.get_weights())
        assert int(keras.ops.convert_to_numpy(inner.iterations)) == 4  # 8 micro-batches, 4 updates
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)  # two compiled programs
    for a, b in zip(*weights):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    before = [keras.ops.convert_to_numpy(v) for v in model.trainable_variables]
    bad = [keras.ops.full(v.shape, float("nan")) for v in model.trainable_variables]
    opt.apply(bad, model.trainable_variables)  # one micro-batch's gradients, not finite
    assert opt.num_skipped_steps == 1 and opt.last_step_skipped
    for a, b in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(a, keras.ops.convert_to_numpy(b))
    good = [keras.ops.zeros(v.shape) for v in model.trainable_variables]
    opt.apply(good, model.trainable_variables)
    assert opt.num_skipped_steps == 1 and not opt.last_step_skipped

def test_all_finite_reads_keras_variables_as_well_as_backend_tensors():
    """A Keras variable holds its backend's array: mp.all_finite read it as an opaque leaf and
    answered True over an inf weight."""
    weights = [keras.Variable(np.array([1.0, np.inf], "float32")), keras.Variable(np.ones(2, "float32"))]
    assert not bool(mp.all_finite(weights)) and not bool(mp.all_finite({"w": weights[0], "t": keras.ops.ones(2)}))
    assert bool(mp.all_finite(weights[1:])) and bool(mp.all_finite([weights[1], keras.ops.ones(2)]))


def test_the_finite_check_counts_every_gradient_once_and_finds_the_one_that_is_not():
    """The flag is counted by a dot product (Keras's own `all` of the stacked flags is copied by
    XLA into every fusion that reads it): the same answers, None gradients skipped."""
    from mixedpolicy.backends.keras.reduce import all_finite

    grads = [keras.ops.ones((3, 2)) for _ in range(50)]
    assert bool(all_finite(grads)) and bool(all_finite([])) and bool(all_finite([None, grads[0]]))
    for bad in (np.inf, -np.inf, np.nan):
        poisoned = list(grads)
        poisoned[31] = keras.ops.convert_to_tensor(np.full((3, 2), bad, np.float32))
        assert not bool(all_finite(poisoned)) and not bool(all_finite([None, poisoned[31]]))
    assert bool(all_finite([keras.ops.ones((2,), "float16") * 60000]))  # large but finite


def test_the_finite_check_reads_large_gradients_in_place_and_an_embeddings_slices():
    """The backend's own check: a large gradient read in place (a product with zeros), small ones
    through a mask, numpy gradients on the host; on TensorFlow an embedding's gradient, a
    tf.IndexedSlices, by its values. Each finds inf, -inf and NaN wherever it is."""
    from mixedpolicy.backends.keras.reduce import all_finite

    shapes = [(300, 256), (64, 128), (128,), (1000, 17), (5,)]
    grads = [keras.ops.ones(shape) * 3.0e38 for shape in shapes]
    assert bool(all_finite(grads)) and bool(all_finite([np.ones(70000, "float32"), None]))
    for i, shape in enumerate(shapes):
        for bad in (np.inf, -np.inf, np.nan):
            values = np.full(shape, 1.0, np.float32)
            values.reshape(-1)[-1] = bad
            poisoned = list(grads)
            poisoned[i] = keras.ops.convert_to_tensor(values)
            assert not bool(all_finite(poisoned)), (shape, bad)
            assert not bool(all_finite([values])), (shape, bad)  # numpy, read on the host
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        def slices(value):
            return tf.IndexedSlices(tf.fill([2, 8], value), tf.constant([3, 7]), tf.constant([20, 8]))

        assert bool(all_finite([slices(1.0), grads[0]])) and bool(tf.function(all_finite)([slices(1.0)]))
        assert not bool(all_finite([slices(np.inf)])) and not bool(tf.function(all_finite)([slices(np.nan)]))


def test_a_loss_gradients_or_config_that_are_not_what_they_name_are_refused():
    # a string loss reached the backend's float() ("could not convert string"), a gradient list of
    # ints an AttributeError on .dtype, a config without the inner optimizer a KeyError
    import pytest

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    opt = mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), policy="mixed_float16")
    for loss in ("nonsense", {}, object(), None):
        with pytest.raises(TypeError, match="Received a loss of type .*expected the scalar loss"):
            opt.scale_loss(loss)
    before = [np.array(v) for v in model.trainable_variables]
    for grads in (None, 1.5, "nonsense", (1, 2), [object(), None]):
        with pytest.raises(TypeError, match="Received gradients .*expected a list of gradient tensors"):
            opt.apply(grads, model.trainable_variables)
    with pytest.raises(ValueError, match="without trainable_variables, and this optimizer is not built"):
        opt.apply([np.ones((4, 3), "float32"), None])
    with pytest.raises(ValueError, match="Received 1 gradients for 2 trainable variables"):
        opt.apply([np.ones((4, 3), "float32")], model.trainable_variables)
    assert all(np.array_equal(a, np.array(v)) for a, v in zip(before, model.trainable_variables))
    for config in (None, "nonsense", {}, {"initial_scale": 2.0}):
        with pytest.raises((TypeError, ValueError), match="LossScaleOptimizer's config.*'inner_optimizer'"):
            type(opt).from_config(config)
    opt.apply([np.ones((4, 3), "float32") * 2.0 ** 15, None], model.trainable_variables)  # None: no gradient
    assert not np.array_equal(before[0], np.array(model.trainable_variables[0]))
    values = [v.value for v in model.trainable_variables]
    with pytest.raises(TypeError, match="Received gradients .*expected a list of gradient tensors"):
        opt.stateless_apply([v.value for v in opt.variables], ["x", None], values)  # as apply refuses it


def test_numpy_gradients_apply_under_every_policy_as_under_keras_own_wrapper():
    # under a scale of 1 nothing was divided, so numpy gradients reached Keras's torch optimizers,
    # which take tensors only (Keras's own LossScaleOptimizer converts them in its unscale)
    for policy in ("float32", "mixed_bfloat16", "mixed_float16"):
        v = keras.Variable(np.ones(2, "float32"))
        opt = mp.LossScaleOptimizer(keras.optimizers.SGD(0.5), policy=policy)
        opt.apply([np.array([np.inf, 1.0], "float32")], [v])  # skipped (a float16 scale halves)
        opt.apply([np.full(2, opt.loss_scale, "float32")], [v])  # a gradient of 1 once unscaled
        np.testing.assert_allclose(np.array(v), [0.5, 0.5])
        assert opt.num_skipped_steps == 1


def test_compile_warns_of_a_wrapper_that_followed_a_policy_without_scaling_for_a_float16_model():
    # made under the float32 global policy, the wrapper scales nothing; compiled with a model that
    # apply_policy put under mixed_float16, its float16 gradients would underflow unscaled, silently
    import warnings

    def compiled(model_policy, optimizer_first=True, **settings):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if optimizer_first:
                optimizer = mp.LossScaleOptimizer(keras.optimizers.Adam(), **settings)
            mp.apply_policy(model, model_policy)
            if not optimizer_first:  # made beside a live float16 model: it says so as it is made
                optimizer = mp.LossScaleOptimizer(keras.optimizers.Adam(), **settings)
            model.compile(optimizer=optimizer, loss="mse")
        return [str(w.message) for w in caught if "scales nothing" in str(w.message)]

    (message,) = compiled("mixed_float16")
    assert "followed float32" in message and "policy=" in message
    (message,) = compiled("mixed_float16", optimizer_first=False)  # once, not again at compile
    assert "follows 'float32'" in message and "apply_policy gave Sequential 'mixed_float16'" in message
    assert compiled("mixed_float16", policy="mixed_float16") == []  # it scales
    assert compiled("mixed_float16", False, policy="mixed_float16") == []
    assert compiled("mixed_float16", loss_scale=mp.NoLossScale()) == []  # chosen, not followed
    assert compiled("mixed_bfloat16") == [] and compiled("mixed_bfloat16", False) == []  # nothing to scale


@pytest.mark.parametrize("setter", ["keras", "mixedpolicy"])
def test_plain_compile_warns_of_a_wrapper_made_after_the_global_policy_went_back_to_float32(setter):
    # a model built under a global mixed_float16 (no apply_policy), the global policy set back to
    # float32, then the wrapper made: it follows float32 and scales nothing; Keras's own compile
    # keeps it as the model's LossScaleOptimizer, so nothing else would say its float16 gradients
    # go unscaled
    import warnings

    set_policy = keras.config.set_dtype_policy if setter == "keras" else mp.set_global_policy

    def compiled(optimizer_of, model_policy="mixed_float16"):
        set_policy(model_policy)
        try:
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        finally:
            set_policy("float32")
        optimizer = optimizer_of()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.compile(optimizer=optimizer, loss="mse")
            model.compile(optimizer=optimizer, loss="mse")  # said once
        assert model.optimizer is optimizer
        return [w for w in caught if "scales nothing" in str(w.message)]

    try:
        (warning,) = compiled(lambda: mp.LossScaleOptimizer(keras.optimizers.SGD()))
        assert "followed float32" in str(warning.message) and warning.filename == __file__
        assert compiled(lambda: mp.LossScaleOptimizer(keras.optimizers.SGD(), policy="mixed_float16")) == []
        assert compiled(lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())) == []  # Keras's own
        assert compiled(lambda: mp.LossScaleOptimizer(keras.optimizers.SGD()), "mixed_bfloat16") == []
    finally:
        mp.set_global_policy(None)
        keras.config.set_dtype_policy("float32")


def test_apply_takes_the_variables_as_any_iterable_as_keras_own_does():
    from keras import ops

    w = [keras.Variable(np.ones(3, "float32")), keras.Variable(np.ones(2, "float32"))]
    opt = mp.LossScaleOptimizer(keras.optimizers.SGD(0.5), policy="float32")
    opt.apply([ops.ones(3), ops.ones(2)], (v for v in w))  # keras.optimizers.SGD takes a generator too
    np.testing.assert_allclose(ops.convert_to_numpy(w[1]), [0.5, 0.5])
    try:  # gradients must be a list (Keras's own fails on len() of a generator)
        opt.apply((g for g in [ops.ones(3), ops.ones(2)]), w)
        raise AssertionError("expected a TypeError")
    except TypeError as err:
        assert "expected a list of gradient tensors" in str(err), err


def test_a_stateless_step_scales_by_the_scale_it_carries():
    """`stateless_scale_loss(optimizer_variables, loss)` multiplies by the scale among the values a
    stateless step carries. Under JAX, a jitted loop around stateless_apply that scaled through
    `scale_loss` read the scale variable once, at trace time (Keras's own wrapper too): after a
    skipped step the gradients were scaled by 2**15 and unscaled by 2**14, twice too large. With
    the carried scale the loop takes the steps a stateful loop takes, and `scale_loss` traced
    that way warns with the fix."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
    opt = mp.LossScaleOptimizer(keras.optimizers.SGD(0.05), policy="mixed_float16")
    opt.build(model.trainable_variables)
    values = [keras.ops.convert_to_numpy(v) for v in opt.variables]
    values[[i for i, v in enumerate(opt.variables) if v is opt.dynamic_scale][0]] = np.float32(4.0)
    assert float(keras.ops.convert_to_numpy(opt.stateless_scale_loss(values, 2.0))) == 8.0
    assert float(keras.ops.convert_to_numpy(opt.scale_loss(2.0))) == 2.0 * 2**15
    with pytest.raises(ValueError, match=r"Received 1 optimizer variable values .* holds"):
        opt.stateless_scale_loss(values[:1], 2.0)
    if keras.backend.backend() != "jax":
        return
    import jax

    x = np.random.default_rng(0).standard_normal((16, 4)).astype("float32")
    y = np.ones((16, 2), "float32")
    start = ([v.value for v in model.trainable_variables], [v.value for v in opt.variables])

    def run(scaled):
        def loss_fn(tv, ov, poison):
            pred, _ = model.stateless_call(tv, [], x)
            loss = keras.ops.mean((keras.ops.cast(pred, "float32") - y) ** 2) * poison
            return scaled(ov, loss)

        @jax.jit
        def step(tv, ov, poison):
            grads = jax.grad(loss_fn)(tv, ov, poison)
            return opt.stateless_apply(ov, grads, tv)

        tv, ov = start
        for i in range(5):
            tv, ov = step(tv, ov, np.float32(np.inf if i == 1 else 1.0))
        return tv

    carried = run(opt.stateless_scale_loss)
    with pytest.warns(UserWarning, match="stateless_scale_loss"):
        baked = run(lambda ov, loss: opt.scale_loss(loss))
    # the stateful loop (variables assigned each step): the reference
    for i in range(5):
        poison = np.float32(np.inf if i == 1 else 1.0)
        grads = jax.grad(lambda tv: opt.scale_loss(keras.ops.mean(
            (keras.ops.cast(model.stateless_call(tv, [], x)[0], "float32") - y) ** 2) * poison))(
            [v.value for v in model.trainable_variables])
        opt.apply(grads, model.trainable_variables)
    stateful = [v.value for v in model.trainable_variables]
    for a, b, c in zip(carried, stateful, baked):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)  # two programs
    assert not all(np.allclose(np.asarray(b), np.asarray(c), atol=1e-3) for b, c in zip(stateful, baked))


def test_a_multi_optimizer_steps_as_alone_scaled_or_not_and_skips_a_non_finite_step():
    # Keras's MultiOptimizer (one optimizer per variable path) refuses a LossScaleOptimizer inside
    # it; around it, the wrapper steps as it does alone, scaling or not
    from keras import optimizers

    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    y = np.arange(32) % 3

    def trained(wrap, inputs=x):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="encoder"),
                                  keras.layers.Dense(3, name="head")])
        inner = optimizers.MultiOptimizer(optimizers.OptimizerMap(optimizers.SGD(0.1),
                                                                  {"encoder/.*": optimizers.Adam(0.01)}))
        model.compile(wrap(inner), "sparse_categorical_crossentropy")
        losses = model.fit(inputs, y, epochs=2, batch_size=8, verbose=0, shuffle=False).history["loss"]
        return losses, model

    alone, _ = trained(lambda opt: opt)
    for wrap in (mp.LossScaleOptimizer, lambda opt: mp.LossScaleOptimizer(opt, policy="mixed_float16")):
        np.testing.assert_allclose(trained(wrap)[0], alone, rtol=1e-5)  # (another compiled program)
    poisoned = x.copy()
    poisoned[:8] = np.inf  # each epoch's first step's gradients are not finite: skipped, the rest trains on
    _, model = trained(mp.LossScaleOptimizer, poisoned)
    assert int(model.optimizer.num_skipped_steps) == 2
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 6
    assert all(np.isfinite(keras.ops.convert_to_numpy(v)).all() for v in model.trainable_variables)


def test_a_custom_loop_that_never_scales_its_loss_is_warned_once(monkeypatch):
    """A custom loop that applies the gradients of the plain loss under a scaling wrapper has its
    update divided by the scale (Keras's own wrapper does the same, silently; torch's wrapper and
    GradScaler refuse the step): ours warns once, naming scale_loss. Nothing is said where the loop
    scales, where fit scales for it, where nothing is scaled, or once the user's code has read the
    scale to scale by hand."""
    import warnings

    from mixedpolicy import _warnings

    monkeypatch.setattr(_warnings, "SCALE_READ_BY_USER", [False])
    variable = keras.Variable(np.ones(3, "float32"))

    def said(opt, by=1.0, steps=2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(steps):
                opt.apply_gradients([(keras.ops.ones(3) * by, variable)])
        return [str(w.message) for w in caught if "scale_loss was never called" in str(w.message)]

    forgot = said(mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), policy="mixed_float16"))
    assert len(forgot) == 1 and "optimizer.scale_loss(loss)" in forgot[0], forgot
    assert np.allclose(keras.ops.convert_to_numpy(variable), 1.0, atol=1e-4)  # what it warns of
    for policy in ("mixed_bfloat16", "float32"):
        assert not said(mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), policy=policy))
    scaled = mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), policy="mixed_float16")
    scaled.scale_loss(keras.ops.ones(()))
    assert not said(scaled)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    mp.apply_policy(model, "mixed_float16")
    model.compile(mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), policy="mixed_float16"), "mse")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*scale_loss was never called")
        model.fit(np.ones((8, 3)), np.ones((8, 2)), verbose=0)
    by_hand = mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), policy="mixed_float16")
    assert not said(by_hand, by=by_hand.loss_scale)


@pytest.mark.parametrize("settings", [{"policy": "mixed_float16"}, {"policy": "float32"}, {"min_scale": 0.5}],
                         ids=["scaling", "pass-through", "bounded"])
def test_a_suite_that_turns_deprecation_warnings_into_errors_trains_with_the_wrapper(settings):
    """Keras's own loss-scale optimizer trains without reading a value to the host; ours reads a
    step's finiteness (an eager step: the torch backend) and the scale. Keras's
    `convert_to_numpy` is `np.array(...)`, which NumPy 2 warns of for a torch or TensorFlow
    tensor and a Keras variable (their `__array__` takes no `copy`): an error in a suite that
    turns warnings into errors (pytest's `-W error`), where Keras's own trained."""
    x, y = np.ones((8, 4), "float32"), np.ones((8, 2), "float32")
    bad = x.copy()
    bad[0, 0] = np.inf
    model = mp.apply_policy(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]), "mixed_float16")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (a pass-through beside a float16 model says so)
        warnings.simplefilter("error", DeprecationWarning)
        opt = mp.LossScaleOptimizer(keras.optimizers.Adam(1e-2), **settings)
        model.compile(opt, "mse")
        model.fit(x, y, batch_size=4, epochs=2, verbose=0)
        model.train_on_batch(bad, y)
        assert opt.last_step_skipped and opt.num_skipped_steps >= 1
        assert opt.loss_scale > 0 and np.isfinite(opt.loss_scale)
