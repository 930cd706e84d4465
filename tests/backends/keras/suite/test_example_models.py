"""Example models from the Keras and TensorFlow docs under mixedpolicy match Keras's own policy.

The mixed-precision guide's MLP (float32 softmax head) and the keras-io "text classification
with transformer" block, built under Keras's own global policy, under `mp.set_global_policy`
and under `mp.apply_policy`: every layer's dtype policy and every output dtype are Keras's;
the one under `apply_policy` trains a few steps on generated data (scale and skips visible),
saves and loads.
Run by tests/backends/keras/test_keras.py once per Keras backend; not collected by the main run.
"""

import os
import tempfile

import numpy as np
import keras
import pytest

import mixedpolicy as mp

VOCAB, LENGTH, DIM = 50, 12, 16


class TransformerBlock(keras.layers.Layer):
    """The keras-io text-classification block: attention, feed-forward, two norms, residuals."""

    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.att = keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential([keras.layers.Dense(ff_dim, activation="relu"),
                                     keras.layers.Dense(embed_dim)])
        self.layernorm1 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = keras.layers.Dropout(rate)
        self.dropout2 = keras.layers.Dropout(rate)

    def call(self, inputs, training=False):
        attn_output = self.dropout1(self.att(inputs, inputs), training=training)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.dropout2(self.ffn(out1), training=training)
        return self.layernorm2(out1 + ffn_output)


def transformer():
    inputs = keras.Input((LENGTH,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, DIM)(inputs)
    x = TransformerBlock(DIM, 2, 32)(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    x = keras.layers.Dense(8, activation="relu")(x)
    outputs = keras.layers.Dense(2, activation="softmax", dtype="float32", name="probs")(x)
    return keras.Model(inputs, outputs, name="text_transformer")


def guide_mlp():
    inputs = keras.Input((16,))
    x = keras.layers.Dense(32, activation="relu", name="dense_1")(inputs)
    x = keras.layers.Dense(32, activation="relu", name="dense_2")(x)
    x = keras.layers.Dense(4, name="dense_logits")(x)
    outputs = keras.layers.Activation("softmax", dtype="float32", name="predictions")(x)
    return keras.Model(inputs, outputs, name="guide_mlp")


def data(builder):
    rng = np.random.default_rng(0)
    if builder is transformer:
        return rng.integers(0, VOCAB, size=(32, LENGTH)).astype("int32"), rng.integers(0, 2, size=32)
    return rng.normal(size=(32, 16)).astype("float32"), rng.integers(0, 4, size=32)


def layer_dtypes(model, x):
    """(name, dtype policy, output dtype) of every layer, outputs from a probe model."""
    probe = keras.Model(model.inputs, [layer.output for layer in model.layers[1:]])
    outputs = probe(x[:2])
    return [(layer.name, layer.dtype_policy.name, keras.backend.standardize_dtype(out.dtype))
            for layer, out in zip(model.layers[1:], outputs)]


def _jax_on_cpu():
    if keras.backend.backend() != "jax":
        return False
    import jax

    return jax.default_backend() == "cpu"


def build(builder, how, policy):
    keras.utils.clear_session()  # the same auto-generated layer names each time
    if how == "keras":
        keras.config.set_dtype_policy(policy)
        try:
            return builder()
        finally:
            keras.config.set_dtype_policy("float32")
    if how == "set_global_policy":
        mp.set_global_policy(policy)
        try:
            return builder()
        finally:
            mp.set_global_policy(None)
    return mp.apply_policy(builder(), policy)


@pytest.fixture(autouse=True)
def _standard_promotion():
    """Keras's own MultiHeadAttention mixes dtypes, which the suite's strict JAX promotion refuses."""
    if keras.backend.backend() != "jax":
        yield
        return
    import jax

    with jax.numpy_dtype_promotion("standard"):
        yield


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("builder", [guide_mlp, transformer])
def test_per_layer_dtypes_equal_keras_own_policy_then_train_save_load(builder, policy):
    x, y = data(builder)
    theirs = layer_dtypes(build(builder, "keras", policy), x)
    for how in ("set_global_policy", "apply_policy"):
        model = build(builder, how, policy)
        assert layer_dtypes(model, x) == theirs, how
        inner = {l.name: l.dtype_policy.name for l in model.layers if isinstance(l, TransformerBlock)}
        for block in (l for l in model.layers if isinstance(l, TransformerBlock)):
            assert block.layernorm1.dtype_policy.name == policy  # float32 statistics inside, Keras's way
            assert keras.backend.standardize_dtype(block.layernorm1.gamma.dtype) == "float32"
        assert all(v == policy for v in inner.values())
        if how != "apply_policy":
            continue  # one trained and saved model per case: the dtypes above are the comparison
        if builder is transformer and policy == "mixed_float16" and _jax_on_cpu():
            continue  # Keras's own fit fails there too: XLA:CPU has no F16_F16_F32 dot (its gradient)
        optimizer = keras.optimizers.Adam(1e-3)
        if policy == "mixed_float16":
            optimizer = mp.LossScaleOptimizer(optimizer)
        model.compile(optimizer, "sparse_categorical_crossentropy")
        history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
        assert np.isfinite(history.history["loss"]).all()
        path = os.path.join(tempfile.mkdtemp(), "m.keras")
        model.save(path)
        # TransformerBlock builds its sublayers without passing its dtype on, so, as with
        # Keras's own policy, they take the global policy in force when the model loads
        with mp.policy_scope(policy):
            mp.set_global_policy(policy)
            try:
                loaded = keras.saving.load_model(path, custom_objects={"TransformerBlock": TransformerBlock})
            finally:
                mp.set_global_policy(None)
        assert layer_dtypes(loaded, x) == theirs
        np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-2, atol=1e-3)
        if policy == "mixed_float16":
            assert loaded.optimizer.loss_scale == model.optimizer.loss_scale
            assert loaded.optimizer.num_skipped_steps == model.optimizer.num_skipped_steps
