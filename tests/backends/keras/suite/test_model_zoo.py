"""A keras-hub model (a small BERT text classifier, random weights, nothing downloaded) under
mixedpolicy: overrides by class and by path reach the layers they name, `describe` says what
each computes in and the layers compute so, training matches Keras's own policy on the same
weights and batches, and the weights resume from a checkpoint.
Run by tests/backends/keras/test_keras.py once per Keras backend; not collected by the main run.
"""

import os
import tempfile

import numpy as np
import keras
import pytest

import mixedpolicy as mp

keras_hub = pytest.importorskip("keras_hub")


@pytest.fixture(autouse=True)
def _standard_promotion():
    """JAX's default promotion, as users run it: JAX's own dot_product_attention (which Keras's
    attention calls) promotes bfloat16 with float32 implicitly, which the suite's strict mode refuses."""
    if keras.backend.backend() != "jax":
        yield
        return
    import jax

    with jax.numpy_dtype_promotion("standard"):
        yield


def classifier():
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.BertBackbone(vocabulary_size=64, num_layers=1, num_heads=2, hidden_dim=16,
                                             intermediate_dim=32, max_sequence_length=12, dropout=0.0)
    return keras_hub.models.BertTextClassifier(backbone, num_classes=3, preprocessor=None, dropout=0.0)


def batches(n=3):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        x = {"token_ids": rng.integers(0, 64, (8, 12)).astype("int32"),
             "segment_ids": np.zeros((8, 12), "int32"), "padding_mask": np.ones((8, 12), "bool")}
        out.append((x, rng.integers(0, 3, 8).astype("int32")))
    return out


def train_side_by_side(ours, native, learning_rate):
    """Compiles `ours` with our wrapper and `native` with Keras's SGD alone, trains both on the
    same batches and checks each step's losses agree."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ours.compile(mp.LossScaleOptimizer(keras.optimizers.SGD(learning_rate)), loss)
    native.compile(keras.optimizers.SGD(learning_rate), loss)
    for x, y in batches():
        a = float(ours.train_on_batch(x, y, return_dict=True)["loss"])
        b = float(native.train_on_batch(x, y, return_dict=True)["loss"])
        assert np.isfinite(a) and abs(a - b) < 2e-2 * max(1.0, abs(b)), (a, b)


def by_path(model):
    return {row.path: row for row in mp.describe(model)}


def test_overrides_by_class_and_path_reach_the_layers_and_describe_says_what_they_compute():
    model = classifier()
    # the embeddings by class (a subclass too: keras-hub's ReversibleEmbedding), the head by path;
    # (a float32 LayerNormalization would not run on TensorFlow: keras-hub adds its output to a
    # bfloat16 residual with a raw `+`, which TensorFlow does not promote; docs/keras.md)
    rules = mp.PolicyMap("mixed_bfloat16", {keras.layers.Embedding: "float32", "logits": "float32"})
    mp.apply_policy(model, rules)
    rows = by_path(model)
    layers = {layer.path: layer for layer in model._flatten_layers(include_self=False)}
    embeddings = [p for p, layer in layers.items() if isinstance(layer, keras.layers.Embedding)]
    assert len(embeddings) >= 2  # the token and segment embeddings
    assert all(rows[p].policy == mp.Policy("float32") and "Embedding" in rows[p].source for p in embeddings)
    for path, layer in layers.items():
        if path in rows:  # the layer computes as describe says
            assert layer.compute_dtype == rows[path].policy.compute_dtype, (path, layer.compute_dtype)
            assert layer.variable_dtype == "float32", path
    nested = next(p for p in rows if p.count("/") >= 2)  # e.g. an attention projection
    for path in (nested, "token_embedding", "pooled_dense"):  # a path describe prints pastes back
        again = mp.apply_policy(classifier(), mp.PolicyMap("mixed_bfloat16", {path: "float32"}))
        row = by_path(again)[path]
        assert row.policy == mp.Policy("float32") and repr(path) in row.source, row
    assert rows["logits"].policy == mp.Policy("float32") and "'logits'" in rows["logits"].source
    assert layers["logits"].compute_dtype == "float32"
    dense = [p for p, layer in layers.items() if isinstance(layer, keras.layers.Dense) and p != "logits"]
    assert dense and all(layers[p].compute_dtype == "bfloat16" for p in dense)
    x, _ = batches(1)[0]
    assert keras.backend.standardize_dtype(model(x).dtype) == "float32"  # the float32 head


def test_training_matches_keras_own_policy_and_the_weights_resume():
    ours = mp.apply_policy(classifier(), "mixed_bfloat16")
    start = ours.get_weights()
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        native = classifier()
    finally:
        keras.config.set_dtype_policy("float32")
    native.set_weights(start)
    train_side_by_side(ours, native, 0.05)
    assert ours.optimizer.num_skipped_steps == 0
    path = os.path.join(tempfile.mkdtemp(), "zoo.weights.h5")
    ours.save_weights(path)
    again = mp.apply_policy(classifier(), "mixed_bfloat16")
    again.load_weights(path)
    for loaded, trained in zip(again.get_weights(), ours.get_weights()):
        np.testing.assert_array_equal(loaded, trained)  # the stored values, exactly
    x, _ = batches(1)[0]
    np.testing.assert_allclose(keras.ops.convert_to_numpy(keras.ops.cast(again(x), "float32")),
                               keras.ops.convert_to_numpy(keras.ops.cast(ours(x), "float32")), atol=1e-6)


def test_per_layer_policies_survive_a_whole_model_save_and_load():
    """keras-hub makes a backbone's layers again from one dtype when a model loads; the
    overrides come back through the DTypePolicyMap mixedpolicy gives the backbone (Keras's own
    way, which keras-hub uses for quantized layers)."""
    model = classifier()
    rules = mp.PolicyMap("mixed_bfloat16", {keras.layers.Embedding: "float32", "logits": "float32"})
    mp.apply_policy(model, rules)
    x, _ = batches(1)[0]
    expected = keras.ops.convert_to_numpy(keras.ops.cast(model(x), "float32"))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "zoo.keras")
        model.save(path)
        again = keras.saving.load_model(path)
    # every layer Keras gives a path to (an attention's softmax and dropout have none, and
    # follow the backbone's own policy) computes in the policy it was saved with
    layers = {layer.path: layer for layer in again._flatten_layers(include_self=False) if layer.path}
    embeddings = [p for p, layer in layers.items() if isinstance(layer, keras.layers.Embedding)]
    assert embeddings and all(layers[p].compute_dtype == "float32" for p in embeddings)
    assert again.get_layer("logits").compute_dtype == "float32"
    assert all(by_path(again)[p].policy == mp.Policy("float32") for p in embeddings)  # describe reads the map
    np.testing.assert_allclose(keras.ops.convert_to_numpy(keras.ops.cast(again(x), "float32")), expected,
                               atol=1e-6)  # a float32 head computing in bfloat16 would be ~1e-3 off
    # applied again and taken off: the loaded model's own map is left as it was
    mp.apply_policy(again, "float32")
    assert all(layer.compute_dtype == "float32" for layer in again._flatten_layers())
    mp.remove_policy(again)
    assert all(layers[p].compute_dtype == "float32" for p in embeddings)
    assert any(layer.compute_dtype == "bfloat16" for layer in layers.values())


def _decoders():
    """Tiny keras-hub decoder backbones (learned and rotary positions, LayerNorm and RMSNorm,
    grouped-query attention): (name, build)."""
    models = keras_hub.models
    yield "gpt2", lambda: models.GPT2Backbone(vocabulary_size=64, num_layers=1, num_heads=2, hidden_dim=16,
                                              intermediate_dim=32, max_sequence_length=12, dropout=0.0)
    yield "gemma", lambda: models.GemmaBackbone(vocabulary_size=64, num_layers=1, num_query_heads=2,
                                                num_key_value_heads=1, hidden_dim=16, intermediate_dim=32, head_dim=8)
    yield "llama", lambda: models.LlamaBackbone(vocabulary_size=64, num_layers=1, num_query_heads=2,
                                                num_key_value_heads=1, hidden_dim=16, intermediate_dim=32)


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("name, build", list(_decoders()), ids=lambda v: v if isinstance(v, str) else "")
def test_decoder_backbones_compute_as_under_keras_own_global_policy(name, build, policy):
    # the policy put on a built float32 backbone: every computing layer in Keras's own dtype,
    # describe saying so, and the same outputs as the backbone built under Keras's policy
    keras.utils.set_random_seed(0)
    ours = mp.apply_policy(build(), policy)
    keras.config.set_dtype_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        native = build()
    finally:
        keras.config.set_dtype_policy("float32")
    native.set_weights(ours.get_weights())
    rows = by_path(ours)
    layers = (m._flatten_layers(include_self=False) for m in (ours, native))
    pairs = [(a, b) for a, b in zip(*layers)
             if not isinstance(a, keras.layers.InputLayer)]  # (no compute: the inputs keep their declared dtypes)
    assert pairs and all(a.compute_dtype == b.compute_dtype and a.variable_dtype == "float32" for a, b in pairs)
    assert all(row.policy.compute_dtype == layer.compute_dtype for layer, _ in pairs
               for row in [rows.get(layer.path)] if row is not None)
    rng = np.random.default_rng(0)
    x = {"token_ids": rng.integers(0, 64, (4, 12)).astype("int32"), "padding_mask": np.ones((4, 12), "bool")}
    got, expected = (keras.ops.convert_to_numpy(keras.ops.cast(m(x), "float32")) for m in (ours, native))
    np.testing.assert_array_equal(got, expected)


def test_a_decoder_under_mixed_float16_skips_and_scales_as_keras_own_loss_scale_optimizer():
    """GPT-2's backbone with a classifier head, trained under mixed_float16 with our wrapper and
    with Keras's own LossScaleOptimizer from the same weights: the same losses step for step, the
    same steps skipped (its float16 gradients overflow at the first scales) and the same scale."""
    if keras.backend.backend() == "jax":
        pytest.skip("Keras's own float16 training fails on JAX's CPU (dot_general F16_F16_F32 is unsupported there)")
    build = dict(_decoders())["gpt2"]

    def model(native):
        keras.utils.set_random_seed(0)
        if native:
            keras.config.set_dtype_policy("mixed_float16")
        try:
            backbone = build()
            pooled = keras.layers.GlobalAveragePooling1D()(backbone.output)
            out = keras.Model(backbone.input, keras.layers.Dense(3, dtype="float32", name="head")(pooled))
        finally:
            keras.config.set_dtype_policy("float32")
        return out if native else mp.apply_policy(out, "mixed_float16")

    ours, native = model(False), model(True)
    native.set_weights(ours.get_weights())
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    wrapper = mp.LossScaleOptimizer(keras.optimizers.SGD(0.05), policy="mixed_float16")
    ours.compile(wrapper, loss)
    keras_own = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05))
    native.compile(keras_own, loss)
    rng = np.random.default_rng(0)
    x = {"token_ids": rng.integers(0, 64, (4, 12)).astype("int32"), "padding_mask": np.ones((4, 12), "bool")}
    y = np.array([0, 1, 2, 0])
    for _ in range(4):
        a = float(ours.train_on_batch(x, y, return_dict=True)["loss"])
        b = float(native.train_on_batch(x, y, return_dict=True)["loss"])
        assert np.isfinite(a) and abs(a - b) <= 1e-5 * max(1.0, abs(b)), (a, b)
    applied = int(keras.ops.convert_to_numpy(keras_own.iterations))
    assert wrapper.num_skipped_steps == 4 - applied and 0 < applied < 4  # some skipped, some applied
    assert wrapper.loss_scale == float(keras.ops.convert_to_numpy(keras_own.dynamic_scale))


def test_a_task_models_optimizer_state_resumes_by_compiling_again_then_loading_the_file():
    """keras-hub task models override `compile`, so Keras's `load_model` does not compile them
    from the saved config (it warns) and their optimizer state is not restored: compiling the
    loaded model with the wrapper again and loading the same `.keras` file's weights restores
    the wrapper's and the inner optimizer's variables, and training goes on as if never saved
    (the recipe docs/keras.md gives)."""
    def compiled(model):
        wrapper = mp.LossScaleOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), initial_scale=2.0**8,
                                        policy="mixed_bfloat16")
        model.compile(wrapper, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    (x0, y0), (x1, y1), (x2, y2) = batches()
    model = compiled(mp.apply_policy(classifier(), "mixed_bfloat16"))
    model.train_on_batch(x0, y0)
    model.train_on_batch(x1, y1)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "task.keras")
        model.save(path)
        with pytest.warns(UserWarning, match="compile"):
            again = keras.saving.load_model(path)
        compiled(again)
        again.optimizer.build(again.trainable_variables)
        again.load_weights(path)
    saved = [keras.ops.convert_to_numpy(v) for v in model.optimizer.variables]
    loaded = [keras.ops.convert_to_numpy(v) for v in again.optimizer.variables]
    assert len(saved) == len(loaded) and int(keras.ops.convert_to_numpy(again.optimizer.iterations)) == 2
    for a, b in zip(saved, loaded):
        np.testing.assert_array_equal(a, b)  # the scale, the counters and the momenta
    for m in (model, again):
        m.train_on_batch(x2, y2)
    for a, b in zip(model.get_weights(), again.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_an_int8_quantized_model_with_lora_takes_a_policy_as_keras_own_quantizes_under_one():
    """`model.quantize("int8")` then LoRA (keras-hub's fine-tuning recipe), under a policy: the
    integer weights stay, the policy becomes what the layers compute in around them (Keras's
    ``int8_from_<policy>``, as Keras's own quantize under a global policy gives), `describe`
    shows both, training matches Keras's own, the policies survive a save, and an fp8 policy
    (a second quantization of the same matmuls) is refused with nothing changed."""
    start = classifier().get_weights()

    def quantized(model):
        model.set_weights(start)
        model.quantize("int8")
        keras.utils.set_random_seed(1)
        model.backbone.enable_lora(2)
        return model

    ours = quantized(classifier())
    before = {layer.path: layer.dtype_policy.name for layer in ours._flatten_layers() if layer.path}
    with pytest.raises(ValueError, match="integer weights and cannot also run in fp8"):
        mp.apply_policy(ours, "float8_from_mixed_bfloat16")
    assert {layer.path: layer.dtype_policy.name for layer in ours._flatten_layers() if layer.path} == before
    mp.apply_policy(ours, "mixed_bfloat16")
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        native = quantized(classifier())
    finally:
        keras.config.set_dtype_policy("float32")
    rows = by_path(ours)
    pairs = [(a, b) for a, b in zip(ours._flatten_layers(include_self=False), native._flatten_layers(include_self=False))
             if a.path in rows]
    int8 = [a.path for a, _ in pairs if rows[a.path].quantized == "int8"]
    assert len(int8) >= 4, int8  # the attention projections and the feed-forward's at least
    kinds = [[(m.compute_dtype, m.variable_dtype, m.quantization_mode) for m in pair] for pair in pairs]
    assert all(a == b for a, b in kinds), [(p[0].path, *k) for p, k in zip(pairs, kinds) if k[0] != k[1]]
    assert all(rows[p].policy == mp.Policy("mixed_bfloat16") for p in int8)
    assert "quantized" in str(mp.describe(ours)).splitlines()[0]
    x, _ = batches(1)[0]
    np.testing.assert_array_equal(*(keras.ops.convert_to_numpy(keras.ops.cast(m(x), "float32")) for m in (ours, native)))
    train_side_by_side(ours, native, 0.1)
    lora = [v for v in ours.trainable_variables if "lora" in v.path]
    assert lora and all(v.dtype == "float32" for v in lora)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "int8.keras")
        ours.save(path)
        again = keras.saving.load_model(path)
    assert {row.path: (row.policy, row.quantized) for row in mp.describe(again) if row.path in int8} == {
        p: (mp.Policy("mixed_bfloat16"), "int8") for p in int8}
    mp.remove_policy(ours)
    assert {layer.path: layer.dtype_policy.name for layer in ours._flatten_layers() if layer.path} == before
