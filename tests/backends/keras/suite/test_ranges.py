"""mp.inspect_gradients on a Keras model, under this process's Keras backend."""

import numpy as np
import keras

import mixedpolicy as mp


def test_keras_gradients_by_layer_path_with_a_recommendation():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu", name="d1"),
                              keras.layers.Dense(4, name="d2")], name="net")
    x = np.random.default_rng(0).standard_normal((32, 8)).astype("float32")
    y = np.arange(32) % 4
    lossf = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    before = [w.copy() for w in model.get_weights()]
    report = mp.inspect_gradients(model, lambda m, b: lossf(b[1], m(b[0], training=True)), [(x, y), (x, y)],
                                  loss_scale=4096)
    assert [(r.path, r.kind) for r in report] == [  # the paths describe shows
        ("net/d1", "weight"), ("net/d1", "weight_grad"), ("net/d2", "weight"), ("net/d2", "weight_grad")]
    assert report.row("net/d1").size == 2 * (8 * 16 + 16)
    weights = report.row("net/d1", "weight")  # once, the values as they are
    assert weights.size == 8 * 16 + 16 and weights.amax == np.abs(before[0]).max()
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    advice = report.recommend()
    assert advice.overrides == {} and advice.loss_scale >= 4096
    assert ("float16", 4096.0) in report.row("net/d2").fractions


def test_the_keras_callback_puts_the_scale_in_the_logs():
    from mixedpolicy.keras import LossScaleCallback

    keras.utils.set_random_seed(0)  # an unlucky draw could overflow at 2**15 and halve the scale
    model = mp.apply_policy(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]), "mixed_float16")
    model.compile(keras.optimizers.SGD(0.01), "mse")
    x, y = np.ones((8, 4), "float32"), np.zeros((8, 2), "float32")
    history = model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[LossScaleCallback(every_n_steps=1)])
    assert history.history["loss_scale"] == [32768.0, 32768.0]
    assert history.history["skipped_steps"] == [0, 0]
    # at each batch, what a logger placed after it (TensorBoard, CSVLogger) sees is that step's
    # (Keras's JAX trainer holds the optimizer's values apart during fit: read through self.model)
    def poisoned(y_true, y_pred):  # the third batch's loss is infinite
        return keras.ops.mean((y_true - y_pred) ** 2, axis=-1) * keras.ops.where(keras.ops.max(y_true) > 50, np.inf, 1.0)
    model.compile(keras.optimizers.SGD(0.01), poisoned)
    y = np.zeros((16, 2), "float32")
    y[9] = 100.0
    batches = []
    seen = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: batches.append(dict(logs)))
    model.fit(np.ones((16, 4), "float32"), y, batch_size=4, shuffle=False, verbose=0,
              callbacks=[LossScaleCallback(every_n_steps=1), seen])
    assert [(b["loss_scale"], b["skipped_steps"], b["last_step_skipped"]) for b in batches] == \
        [(32768.0, 0, False), (32768.0, 0, False), (16384.0, 1, True), (16384.0, 1, False)], batches
    plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])  # Keras's own optimizer: left alone
    plain.compile(keras.optimizers.SGD(0.01), "mse")
    assert "loss_scale" not in plain.fit(x, y[:8], verbose=0, callbacks=[LossScaleCallback()]).history
