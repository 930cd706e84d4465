"""A Keras 3 MLP on scikit-learn's digits with model.fit under each policy, accuracy against float32.

Runs unchanged under any Keras backend:

    KERAS_BACKEND=jax python examples/keras_mlp.py      # or torch, tensorflow
"""

import keras
import numpy as np
try:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
except ImportError:  # the examples' data set ships inside scikit-learn
    raise SystemExit("This example trains on scikit-learn's digits, and scikit-learn is not installed: "
                     "pip install 'mixedpolicy[bench]' (or scikit-learn).") from None

import mixedpolicy as mp


def data(seed=0):
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=0.25, random_state=seed)
    return x_train.astype("float32"), y_train, x_test.astype("float32"), y_test


def train(policy, epochs=15, seed=0):
    x_train, y_train, x_test, y_test = data()
    mp.set_global_policy(policy)  # layers built from here on follow it
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.LayerNormalization(),             # float32 statistics and variables (built-in rule)
        keras.layers.Dense(10),
        keras.layers.Activation("softmax", dtype="float32", name="probabilities"),
    ])
    mp.apply_policy(model, policy)                     # per-layer policies and the norm rule
    # Under mixed_float16, compile wraps the optimizer in mixedpolicy's bounded LossScaleOptimizer.
    model.compile(keras.optimizers.Adam(3e-3), "sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x_train, y_train, batch_size=64, epochs=epochs, verbose=0)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    opt = model.optimizer
    skipped = getattr(opt, "num_skipped_steps", 0)
    scale = getattr(opt, "loss_scale", 1.0)
    mp.set_global_policy(None)
    return accuracy, skipped, scale


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15, help="epochs per policy (default 15)")
    epochs = parser.parse_args().epochs
    print(f"Keras {keras.__version__} on {keras.backend.backend()}")
    base = None
    for policy in ("float32", "mixed_bfloat16", "mixed_float16"):
        acc, skipped, scale = train(policy, epochs=epochs)
        base = acc if base is None else base
        print(f"{policy:15s} accuracy {acc:.3f} ({acc - base:+.3f} vs float32)  "
              f"skipped steps {skipped}  final scale {scale:g}")
