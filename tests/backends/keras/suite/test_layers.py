"""Keras layers under mixedpolicy maps: paths, globs, classes, inheritance, the norm rule, built or not.

Run by tests/backends/keras/test_keras.py once per Keras backend, in a pytest process of its own
(KERAS_BACKEND is chosen per process); not collected by the main run.
"""

import warnings

import numpy as np
import pytest
import keras

import mixedpolicy as mp


def test_per_layer_maps():
    """Paths, globs, classes, inheritance, the norm rule, before and after build."""
    x = np.random.default_rng(0).normal(size=(4, 8)).astype("float32")

    def make(name="net", built=True):
        block = keras.Sequential([keras.layers.Dense(16, name="dense"),
                                  keras.layers.LayerNormalization(name="norm")], name="block")
        head = [keras.Input((8,))] if built else []  # with an Input, Sequential builds at once
        return keras.Sequential(head + [keras.layers.Dense(16, name="embed"), block,
                                        keras.layers.Dense(3, name="head")], name=name)

    def rows(model):
        return {r.path: r for r in mp.describe(model)}

    # before build: path, glob, class, inheritance and the norm rule
    model = make(built=False)
    mp.apply_policy(model, "mixed_bfloat16", {"net/head": "float32", "*/block": "mixed_float16"})
    table = rows(model)
    assert table["net/embed"].compute_dtype == "bfloat16" and table["net/embed"].source == "map default"
    assert table["net/head"].policy == mp.Policy("float32") and table["net/head"].source == "map key 'net/head'"
    assert table["net/block/dense"].compute_dtype == "float16", table
    assert "inherited from 'net/block'" in table["net/block/dense"].source
    # the norm keeps float32 variables and statistics and hands on the surrounding compute dtype
    assert table["net/block/norm"].policy == mp.Policy("mixed_float16"), table["net/block/norm"]
    assert table["net/block/norm"].source == "built-in rule: normalization"
    assert model(x).dtype == "float32" or str(model(x).dtype).endswith("float32")
    embed_out = model.get_layer("embed")(x)
    assert keras.backend.standardize_dtype(embed_out.dtype) == "bfloat16"
    norm = model.get_layer("block").get_layer("norm")
    assert keras.backend.standardize_dtype(norm(keras.ops.ones((2, 16), "float16")).dtype) == "float16"
    assert keras.backend.standardize_dtype(norm.gamma.dtype) == "float32"
    assert all(keras.backend.standardize_dtype(w.dtype) == "float32" for w in model.weights)

    by_class = rows(mp.apply_policy(make(), "mixed_float16", {keras.layers.LayerNormalization: "mixed_float16"}))
    assert by_class["net/block/norm"].policy == mp.Policy("mixed_float16")
    assert by_class["net/block/norm"].source.startswith("map key keras")

    # after build: a mixed policy keeps the float32 variables and applies
    built = make()
    built(x)
    mp.apply_policy(built, "mixed_float16")
    assert keras.backend.standardize_dtype(built.get_layer("embed")(x).dtype) == "float16"
    # a pure policy would need new variables: refused, nothing changed
    try:
        mp.apply_policy(built, "bfloat16")
        raise AssertionError("expected a ValueError")
    except ValueError as err:
        assert "cannot change the dtype of existing variables" in str(err), err
    assert built.get_layer("embed").dtype_policy.name == "mixed_float16"

    # a pure policy before build stores the variables in half precision (norms in float32)
    pure = mp.apply_policy(make(built=False), "bfloat16")
    pure(x)
    assert keras.backend.standardize_dtype(pure.get_layer("embed").kernel.dtype) == "bfloat16"
    assert keras.backend.standardize_dtype(pure.get_layer("block").get_layer("norm").gamma.dtype) == "float32"

    # remove_policy restores what was there
    mp.remove_policy(built)
    assert {r.policy.name for r in mp.describe(built)} == {"float32"}
    assert {r.source for r in mp.describe(built)} == {"no policy applied"}

    # what Keras cannot express is refused with the fix
    try:
        mp.apply_policy(make(), "p=f32,c=bf16,o=f32")
        raise AssertionError("expected a ValueError")
    except ValueError as err:
        assert "Keras layers output their compute dtype" in str(err)

    # a key that matches nothing warns with the nearest paths
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mp.apply_policy(make(), "mixed_float16", {"net/haed": "float32"})
    assert any("'net/haed' matches no layer path" in str(w.message) and "net/head" in str(w.message)
               for w in caught), [str(w.message) for w in caught]

    # compile wraps a plain optimizer in the bounded loss-scale optimizer under any float16
    from mixedpolicy.backends.keras.optimizer import LossScaleOptimizer
    m = mp.apply_policy(make(), "float32", {"net/embed": "mixed_float16"})
    m.compile(optimizer="sgd", loss="mse")
    assert isinstance(m.optimizer, LossScaleOptimizer), type(m.optimizer)
    mp.set_global_policy("mixed_float16")
    g = make("global_net")
    assert g.dtype_policy.name == "mixed_float16"
    g.compile(keras.optimizers.SGD(0.1), loss="mse")
    assert isinstance(g.optimizer, LossScaleOptimizer), type(g.optimizer)
    # Keras's own, passed explicitly, is kept as it is
    g.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    assert type(g.optimizer) is keras.optimizers.LossScaleOptimizer
    mp.set_global_policy(None)


def test_describe_names_keras_own_policy_where_a_layer_was_built_under_the_global_one():
    """Built under mp.set_global_policy and never given apply_policy, a layer computes in the Keras
    dtype policy it was built with: describe says so (it said "no policy applied" beside float16)."""
    mp.set_global_policy("mixed_float16")
    try:
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="d")])
    finally:
        mp.set_global_policy(None)
    model.add(keras.layers.Dense(2, name="plain"))
    rows = {r.path.rpartition("/")[2]: r for r in mp.describe(model)}
    assert rows["d"].compute_dtype == "float16" and rows["d"].source == "Keras dtype policy", rows["d"]
    assert rows["plain"].compute_dtype == "float32" and rows["plain"].source == "no policy applied"


@pytest.mark.parametrize("pure", ["float16", "bfloat16"])
def test_a_functional_model_built_under_a_pure_global_policy_applies_it_and_trains(pure):
    """The functional API builds each layer as the model is defined: under a pure global
    policy its norms hold half variables Keras cannot change. They are kept (as Keras's own
    pure policy keeps them), said in describe and in one warning; the rest applies."""
    mp.set_global_policy(pure)
    try:
        inputs = keras.Input((8,))
        x = keras.layers.BatchNormalization(name="bn")(keras.layers.Dense(16, name="dense")(inputs))
        model = keras.Model(inputs, keras.layers.Dense(3, name="head")(keras.layers.LayerNormalization(name="ln")(x)))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mp.apply_policy(model, pure)
        said = [str(w.message) for w in caught if "normalization layer(s)" in str(w.message)]
        assert len(said) == 1 and "bn, ln" in said[0] and "dtype='float32'" in said[0], said
        rows = {r.path: r for r in mp.describe(model)}
        assert rows["bn"].policy == mp.Policy(pure) and f"kept {pure}" in rows["bn"].source, rows["bn"]
        assert rows["dense"].policy == mp.Policy(pure) and rows["dense"].source == "map default"
        model.compile(keras.optimizers.SGD(0.01), loss="mse")
        history = model.fit(np.ones((8, 8), "float32"), np.zeros((8, 3), "float32"), epochs=3, verbose=0)
        assert np.all(np.isfinite(history.history["loss"]))
        assert keras.backend.standardize_dtype(model.get_layer("dense").kernel.dtype) == pure
    finally:
        mp.set_global_policy(None)


def test_keras_on_tensorflow_carries_bfloat16_and_float16_reduce_dtypes_and_other_backends_none():
    bf16 = mp.Policy("mixed_bfloat16", reduce_dtype="bfloat16")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    if keras.backend.backend() == "tensorflow":
        mp.apply_policy(model, bf16)
        model.compile(keras.optimizers.SGD(0.1), "mse")  # our optimizer carries the reduce dtype
        assert model.optimizer.get_config()["reduce_policy"] == {"default": bf16.name, "overrides": {}}
        saved = type(model.optimizer).from_config(model.optimizer.get_config())
        assert saved._reduce_policy.default == bf16
        opt = mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), policy=bf16)
        assert opt.loss_scaling.startswith("no scaling")
        again = type(opt).from_config(opt.get_config())
        assert again._reduce_policy == bf16
        # a class key reaches the layers it names: compile carries them by path
        from mixedpolicy.backends.tensorflow.reduce import reduce_dtypes

        by_class = mp.PolicyMap("float32", {keras.layers.Dense: bf16})
        two = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="head"),
                                keras.layers.LayerNormalization(name="norm")])
        mp.apply_policy(two, by_class)
        two.compile(keras.optimizers.SGD(0.1), "mse")
        dtypes = dict(zip([v.path for v in two.trainable_variables],
                          reduce_dtypes(two.trainable_variables, two.optimizer._reduce_policy)))
        assert {p: d for p, d in dtypes.items() if d == "bfloat16"} == {
            p: "bfloat16" for p in dtypes if "head" in p}, dtypes
        assert len(dtypes) == 4
        # an optimizer alone sees variables by path only: the class key is refused by name
        with pytest.raises(ValueError, match=r"layer-class keys \[.*Dense'?\] for reducing gradients "
                                             r"through a Keras optimizer.*by path or glob"):
            mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), policy=by_class)
    else:
        with pytest.raises(ValueError, match=rf"bfloat16, which mixedpolicy cannot carry through Keras on "
                                             rf"{keras.backend.backend()} \(its replicas reduce in the variable"):
            mp.apply_policy(model, bf16)
        with pytest.raises(ValueError, match="reduce_policy with reduce dtype bfloat16"):
            mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), policy=bf16)
    # a float32 reduce changes nothing anywhere: Keras's own sum
    assert "reduce_policy" not in mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), policy="mixed_float16").get_config()


def test_a_reduce_dtype_keras_cannot_carry_is_refused_before_anything_changes():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    before = model.layers[0].dtype_policy.name
    with pytest.raises(ValueError, match=r"reduced across replicas in float8_e5m2, which mixedpolicy cannot carry through Keras on"):
        mp.apply_policy(model, mp.Policy("mixed_bfloat16", reduce_dtype="e5m2"))
    assert model.layers[0].dtype_policy.name == before


def test_describe_on_the_command_line_builds_a_users_keras_model_under_the_policy(capsys):
    """`mixedpolicy describe MODULE:FACTORY --policy P` sets the global policy before the
    factory builds the model, as a script does: a pure policy applies to a Sequential model."""
    from pathlib import Path

    from mixedpolicy.__main__ import main

    factory = f"{Path(__file__).parents[3] / 'bench' / 'user_models.py'}:keras_mlp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the kept norm's warning (tested above)
        assert main(["describe", factory, "--policy", "bf16-true"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert rows and all(row[2:6] == ["bfloat16"] * 4 for row in rows), rows
    assert keras.config.dtype_policy().name == "float32"  # the global policy is put back


@pytest.mark.skipif(keras.backend.backend() != "tensorflow", reason="tf.distribute reduces on TensorFlow only")
def test_a_class_key_sets_the_reduce_dtype_of_a_keras_models_layers_under_tf_distribute():
    # with model=, the layers' classes are known by path: a class key reaches them as in apply_policy
    inner = keras.Sequential([keras.layers.Dense(3)], name="inner")
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.LayerNormalization()(inner(inputs)))
    variables = model.trainable_variables
    f32 = mp.tensorflow.bytes_per_step(variables, "float32")
    by_class = mp.PolicyMap("float32", {keras.layers.Dense: mp.Policy("float32", reduce_dtype="bfloat16")})
    assert mp.tensorflow.bytes_per_step(variables, by_class, model=model) == f32 - 2 * (4 * 3 + 3)
    with pytest.raises(ValueError, match=r"layer-class keys .*Dense.*pass model="):
        mp.tensorflow.bytes_per_step(variables, by_class)


def test_a_model_quantized_under_a_policy_keeps_its_integer_weights_when_the_policy_comes_off():
    """apply_policy, then model.quantize("int8"): the layers compute as Keras's own quantize under
    that global policy; remove_policy gives back the policies they had with their integer weights
    (a float policy on an int8 layer would multiply by the integers themselves, silently); a
    policy Keras refuses with int8 weights (float16 compute) is refused with nothing changed."""
    def mlp():
        return keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(4)])

    weights = mlp().get_weights()
    x = np.random.default_rng(0).random((4, 16)).astype("float32")

    def quantized(model):
        model.set_weights(weights)
        model.quantize("int8")
        return model

    def out(model):
        return keras.ops.convert_to_numpy(keras.ops.cast(model(x), "float32"))

    ours = mlp()
    mp.apply_policy(ours, "mixed_bfloat16")
    quantized(ours)
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        native = quantized(mlp())
    finally:
        keras.config.set_dtype_policy("float32")
    np.testing.assert_array_equal(out(ours), out(native))
    mp.remove_policy(ours)
    assert [layer.dtype_policy.name for layer in ours.layers] == ["int8_from_float32"] * 2
    np.testing.assert_array_equal(out(ours), out(quantized(mlp())))
    with pytest.raises(ValueError, match=r"whose weights model.quantize stored as int8 .* Keras refuses int8"):
        mp.apply_policy(ours, "mixed_float16")
    assert [layer.dtype_policy.name for layer in ours.layers] == ["int8_from_float32"] * 2
