"""fp8 matmuls on Keras (issue 29): the 'delayed' recipe through Keras's own float8 layers
equals Keras's ``model.quantize("float8")`` bit for bit; 'tensorwise' (current scaling, in
keras.ops) computes what a numpy reference of torchao's algorithm computes, and on the torch
backend what torch's tensorwise layer computes; the built-in rules keep the head and norms in
the source precision, keys override them, what Keras cannot run is refused first.
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
    with pytest.raises(ValueError, match=r"the recipe 'rowwise' for Keras layer '.*a'.*'delayed'.*'tensorwise'.*"
                                         r"Nothing was applied"):
        mp.apply_policy(model, mp.Policy("mixed_bfloat16", float8_recipe="rowwise"))
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
    model = keras.Sequential([keras.Input((1040,)), keras.layers.Dense(2064, name="up"),
                              keras.layers.Dense(64, name="down"), keras.layers.Dense(10, name="head")])
    mp.apply_policy(model, mp.PolicyMap("float8_from_mixed_bfloat16", float8_auto_filter=True))
    assert model.get_layer("up").quantization_mode == "float8"  # 1040 -> 2064: large enough
    assert model.get_layer("down").quantization_mode is None  # 2064 -> 64: too small to gain
    rows = {r.path.rpartition("/")[2]: r for r in mp.describe(model)}
    assert "2064 -> 64 is too small" in rows["down"].source


def _fake_quantize(x, fmt):
    """numpy reference: x at its own scale (fp8 max / amax) through `fmt`, in float32."""
    import ml_dtypes

    top = float(ml_dtypes.finfo(fmt).max)
    scale = np.float32(top) / np.maximum(np.abs(x).max(), np.float32(1e-12))
    return np.clip(x * scale, -top, top).astype(fmt).astype(np.float32) / scale


def _grads(layer, x):
    """The layer's output, and the gradients of sum(output * w) for its input and kernel."""
    w = np.random.default_rng(5).normal(size=(x.shape[0], layer.units)).astype("float32")
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        def loss(kernel, inputs):
            out, _ = layer.stateless_call([kernel, layer.bias.value], [], inputs)
            return (out.astype("float32") * w).sum(), out
        (_, out), (gk, gx) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(layer.kernel.value, x)
    elif backend == "torch":
        import torch

        inputs = torch.tensor(x, requires_grad=True, device=layer.kernel.value.device)
        out = layer(inputs)
        (out.float() * torch.tensor(w, device=out.device)).sum().backward()
        gk, gx, out = layer.kernel.value.grad, inputs.grad, out.detach()
    else:
        import tensorflow as tf

        inputs = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(inputs)
            out = layer(inputs)
            total = tf.reduce_sum(tf.cast(out, tf.float32) * w)
        gk, gx = tape.gradient(total, [layer.kernel.value, inputs])
    as_np = keras.ops.convert_to_numpy
    return as_np(out).astype("float32"), as_np(gx), as_np(gk), w


def test_tensorwise_is_torchaos_current_scaling_on_every_backend():
    keras.utils.set_random_seed(0)
    layer = keras.layers.Dense(32, name="a")
    layer.build((None, 16))
    model = keras.Sequential([keras.Input((16,)), layer])
    fp8 = mp.Policy("float32", float8_recipe="tensorwise")
    mp.apply_policy(model, mp.PolicyMap(fp8, {"a": fp8}))  # a key: the rules keep a lone head out
    assert type(layer).__name__ == "Float8TensorwiseDense" and layer.quantization_mode is None
    x = np.random.default_rng(0).normal(size=(8, 16)).astype("float32")
    out, gx, gk, w = _grads(layer, x)
    kernel = keras.ops.convert_to_numpy(layer.kernel)
    xq, kq = _fake_quantize(x, "float8_e4m3fn"), _fake_quantize(kernel, "float8_e4m3fn")
    scale = np.abs(out).max()
    np.testing.assert_allclose(out, xq @ kq, atol=1e-5 * scale)
    gq = _fake_quantize(w, "float8_e5m2")  # the output gradient, in e5m2 at its own scale
    np.testing.assert_allclose(gx, gq @ kq.T, atol=1e-5 * np.abs(gx).max())
    np.testing.assert_allclose(gk, xq.T @ gq, atol=1e-5 * np.abs(gk).max())
    # not the plain matmul: the operands went through fp8
    assert np.abs(out - x @ kernel).max() > 1e-3 * scale
    if keras.backend.backend() == "torch":  # the same numbers as torch's tensorwise layer (torchao's)
        import torch

        from conftest import require_module

        require_module("torchao")
        linear = torch.nn.Linear(16, 32)
        with torch.no_grad():
            linear.weight.copy_(torch.tensor(kernel.T))
            linear.bias.copy_(torch.tensor(keras.ops.convert_to_numpy(layer.bias)))
        torch_model = mp.apply_policy(torch.nn.Sequential(linear), mp.PolicyMap(fp8, {"0": fp8}))
        inputs = torch.tensor(x, requires_grad=True)
        theirs = torch_model(inputs)
        (theirs * torch.tensor(w)).sum().backward()
        np.testing.assert_allclose(out, theirs.detach().numpy(), atol=1e-5 * scale)
        np.testing.assert_allclose(gx, inputs.grad.numpy(), atol=1e-5 * np.abs(gx).max())


def test_tensorwise_trains_saves_loads_and_comes_off():
    model = mp.apply_policy(_net(), mp.Policy("mixed_bfloat16", float8_recipe="tensorwise"))
    rows = {r.path.rpartition("/")[2]: r for r in mp.describe(model)}
    assert rows["a"].float8 == rows["b"].float8 == "tensorwise" and rows["head"].float8 == "-"
    assert model.get_layer("a").dtype_policy.name == "mixed_bfloat16" and not model.get_layer("a").weights[2:]
    losses = _fit(model, epochs=3)
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    x, _ = _data()
    expected = model.predict(x, verbose=0)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.keras")
        model.save(path)
        again = keras.saving.load_model(path)
    assert type(again.get_layer("a")).__name__ == "Float8TensorwiseDense"
    assert mp.describe(again)[1].policy == mp.Policy("mixed_bfloat16", float8_recipe="tensorwise")
    np.testing.assert_allclose(again.predict(x, verbose=0), expected, atol=1e-6)  # a second program
    config = keras.saving.serialize_keras_object(again.get_layer("a"))
    config["config"]["float8_recipe"] = {"recipe": "rowwise"}  # a config this class cannot run
    with pytest.raises(ValueError, match="Float8Recipe\\('rowwise'\\) in the config of a Float8TensorwiseDense"):
        keras.saving.deserialize_keras_object(config)
    mp.remove_policy(model)
    assert type(model.get_layer("a")) is keras.layers.Dense and model.get_layer("a").dtype_policy.name == "float32"
    # an EinsumDense (attention's projections) too
    keras.utils.set_random_seed(0)
    einsum = keras.Sequential([keras.Input((4, 16)), keras.layers.EinsumDense("abc,cd->abd", (4, 32), name="e"),
                               keras.layers.Dense(10, name="head")])
    mp.apply_policy(einsum, mp.Policy("mixed_bfloat16", float8_recipe="tensorwise"))
    assert type(einsum.get_layer("e")).__name__ == "Float8TensorwiseEinsumDense"
    assert np.all(np.isfinite(keras.ops.convert_to_numpy(einsum(np.ones((2, 4, 16), "float32")))))
