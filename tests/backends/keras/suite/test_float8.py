"""fp8 matmuls on Keras through Keras's own float8 layers (issue 29): the 'delayed' recipe
equals Keras's ``model.quantize("float8")`` bit for bit, the built-in rules keep the head and
norms in the source precision, keys override them, what Keras cannot run is refused first.
Run by tests/backends/keras/test_keras.py once per Keras backend; not collected by the main run.
"""

import os
import tempfile

import numpy as np
import keras
import pytest

import mixedpolicy as mp


def _net():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, name="a"), keras.layers.Dense(32, name="b"),
                             keras.layers.LayerNormalization(name="n"), keras.layers.Dense(10, name="head")])


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(32, 16)).astype("float32"), np.arange(32) % 10


def _fit(model, epochs=2):
    model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data()
    return model.fit(x, y, epochs=epochs, batch_size=8, verbose=0, shuffle=False).history["loss"]


def test_delayed_equals_keras_own_float8_quantization_bit_for_bit():
    ours = mp.apply_policy(_net(), "float8_from_mixed_bfloat16")
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        theirs = _net()
    finally:
        keras.config.set_dtype_policy("float32")
    theirs.quantize("float8", filters=lambda layer: layer.name in ("a", "b"))  # the layers the rules leave to fp8
    assert _fit(ours) == _fit(theirs)
    for a, b in zip(ours.get_weights(), theirs.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert ours.get_layer("a").dtype_policy.name == "float8_from_mixed_bfloat16"


def test_describe_the_rules_and_a_key_that_puts_the_head_in_fp8():
    model = mp.apply_policy(_net(), mp.Policy("mixed_bfloat16", float8_recipe="delayed", amax_history_len=16))
    rows = {r.path.rpartition("/")[2]: r for r in mp.describe(model)}
    assert rows["a"].float8 == rows["b"].float8 == "delayed"
    assert rows["a"].policy.float8_recipe.amax_history_len == 16
    assert tuple(model.get_layer("a").inputs_amax_history.shape) == (16,)
    assert rows["head"].float8 == "-" and "the output head" in rows["head"].source
    assert rows["n"].float8 == "-"
    fp8 = mp.Policy("float8_from_float32")
    model = mp.apply_policy(_net(), mp.PolicyMap(fp8, {"head": fp8, "a": "float32"}))
    assert model.get_layer("head").quantization_mode == "float8"
    assert model.get_layer("a").quantization_mode is None
    assert np.all(np.isfinite(_fit(model)))


def test_a_recipe_keras_has_no_path_for_is_refused_before_anything_changes():
    model = _net()
    with pytest.raises(ValueError, match=r"the recipe 'tensorwise' for Keras layer '.*a'.*'delayed'.*"
                                         r"Nothing was applied"):
        mp.apply_policy(model, mp.Policy("mixed_bfloat16", float8_recipe="tensorwise"))
    with pytest.raises(ValueError, match="margin=2"):
        mp.apply_policy(model, mp.Policy("mixed_bfloat16", float8_recipe="delayed", margin=2))
    if keras.backend.backend() == "tensorflow":
        with pytest.raises(ValueError, match="reduce_dtype=bfloat16 for Keras layer.*Reduce in float32"):
            mp.apply_policy(model, mp.Policy("float8_from_mixed_bfloat16", reduce_dtype="bfloat16"))
    assert all(layer.quantization_mode is None for layer in model.layers)
    assert all(layer.dtype_policy.name == "float32" for layer in model.layers)


def test_a_float16_source_scales_the_loss_and_leaves_the_fp8_state_unscaled():
    model = mp.apply_policy(_net(), "float8_from_mixed_float16")
    losses = _fit(model, epochs=3)
    assert isinstance(model.optimizer, mp.LossScaleOptimizer) and model.optimizer.loss_scale > 1
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    layer = model.get_layer("a")
    # the scales Keras's delayed recipe wrote: the inputs' own amax (about 4 here), never
    # divided by the loss scale (Keras's rule for overwrite-with-gradient variables)
    history = keras.ops.convert_to_numpy(layer.inputs_amax_history)
    assert 1.0 < history.max() < 10.0


def test_a_saved_fp8_model_loads_with_its_policies_and_state():
    model = mp.apply_policy(_net(), mp.Policy("float8_from_mixed_bfloat16", amax_history_len=8))
    _fit(model)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.keras")
        model.save(path)
        again = keras.saving.load_model(path)
    assert again.get_layer("a").dtype_policy.amax_history_length == 8
    saved = {f"{layer.name}/{v.name}": keras.ops.convert_to_numpy(v) for layer in model.layers for v in layer.weights}
    loaded = {f"{layer.name}/{v.name}": keras.ops.convert_to_numpy(v) for layer in again.layers for v in layer.weights}
    assert sorted(saved) == sorted(loaded) and any("amax_history" in k for k in saved)
    for key, value in saved.items():
        np.testing.assert_array_equal(value, loaded[key], err_msg=key)
    assert mp.describe(again)[1].policy == mp.Policy("float8_from_mixed_bfloat16", amax_history_len=8)


def test_the_auto_filter_keeps_dense_layers_too_small_to_gain():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(1088, name="up"),
                              keras.layers.Dense(64, name="down"), keras.layers.Dense(10, name="head")])
    mp.apply_policy(model, mp.PolicyMap("float8_from_mixed_bfloat16", float8_auto_filter=True))
    assert model.get_layer("up").quantization_mode == "float8"  # 64 -> 1088: out above 1024
    assert model.get_layer("down").quantization_mode is None  # 1088 -> 64: too small to gain
    rows = {r.path.rpartition("/")[2]: r for r in mp.describe(model)}
    assert "1088 -> 64 is too small" in rows["down"].source
