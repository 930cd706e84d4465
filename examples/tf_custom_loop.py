"""A raw TensorFlow MLP (tf.Module) on scikit-learn's digits, trained in a GradientTape loop
under tf.function with mixedpolicy's loss-scale optimizer, accuracy against float32.

    python examples/tf_custom_loop.py
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")  # TensorFlow's optimizers are Keras's

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
try:  # noqa: E402
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
except ImportError:  # the examples' data set ships inside scikit-learn
    raise SystemExit("This example trains on scikit-learn's digits, and scikit-learn is not installed: "
                     "pip install 'mixedpolicy[bench]' (or scikit-learn).") from None

import mixedpolicy as mp  # noqa: E402


class Dense(tf.Module):
    def __init__(self, n_in, n_out, seed):
        super().__init__()
        self.w = tf.Variable(tf.random.stateless_normal((n_in, n_out), (seed, 0)) * (2.0 / n_in) ** 0.5)
        self.b = tf.Variable(tf.zeros(n_out))

    def __call__(self, x):
        return x @ self.w + self.b


class MLP(tf.Module):
    def __init__(self, seed=0):
        super().__init__()
        self.hidden = Dense(64, 128, seed)
        self.head = Dense(128, 10, seed + 1)

    def __call__(self, x):
        return self.head(tf.nn.relu(self.hidden(x)))


def train(policy, epochs=15, seed=0):
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=0.25, random_state=seed)
    model = mp.apply_policy(MLP(seed), policy)
    opt = mp.LossScaleOptimizer(keras.optimizers.Adam(3e-3), policy=policy)  # scales only under float16

    @tf.function(jit_compile=True)
    def step(x, y):
        with tf.GradientTape() as tape:
            logits = tf.cast(model(x), tf.float32)  # the loss in float32
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
            scaled = opt.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))  # unscale, skip or apply

    data = tf.data.Dataset.from_tensor_slices((x_train.astype("float32"), y_train.astype("int32")))
    for _ in range(epochs):
        for xb, yb in data.shuffle(len(x_train), seed=seed).batch(64):
            step(xb, yb)
    predictions = tf.argmax(tf.cast(model(tf.constant(x_test, tf.float32)), tf.float32), axis=1)
    accuracy = float(np.mean(predictions.numpy() == y_test))
    return accuracy, opt.num_skipped_steps, opt.loss_scale


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15, help="epochs per policy (default 15)")
    epochs = parser.parse_args().epochs
    base = None
    for policy in ("float32", "mixed_bfloat16", "mixed_float16"):
        acc, skipped, scale = train(policy, epochs=epochs)
        base = acc if base is None else base
        print(f"{policy:15s} accuracy {acc:.3f} ({acc - base:+.3f} vs float32)  "
              f"skipped steps {skipped}  final scale {scale:g}")
