"""A Flax NNX MLP on scikit-learn's digits under each policy, accuracy against float32.

    python examples/jax_mlp.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
try:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
except ImportError:  # the examples' data set ships inside scikit-learn
    raise SystemExit("This example trains on scikit-learn's digits, and scikit-learn is not installed: "
                     "pip install 'mixedpolicy[bench]' (or scikit-learn).") from None

import mixedpolicy as mp


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(64, 128, rngs=rngs)
        self.norm = nnx.LayerNorm(128, rngs=rngs)
        self.head = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x):
        return self.head(self.norm(jax.nn.relu(self.hidden(x))))


def data(seed=0):
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=0.25, random_state=seed)
    return (x_train.astype(np.float32), y_train.astype(np.int32),
            x_test.astype(np.float32), y_test.astype(np.int32))


@nnx.jit
def train_step(model, optimizer, x, y):
    def scaled_loss(model):
        logits = model(x).astype(jnp.float32)  # the loss in float32
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return optimizer.tx.scale_loss(loss, optimizer.opt_state)

    optimizer.update(model, nnx.grad(scaled_loss)(model))


def train(policy, epochs=15, seed=0):
    x_train, y_train, x_test, y_test = data()
    model = mp.apply_policy(MLP(nnx.Rngs(seed)), policy)
    # scales under mixed_float16; under float32 and mixed_bfloat16 it only skips non-finite steps
    optimizer = nnx.Optimizer(model, mp.LossScaleOptimizer(optax.sgd(0.1, momentum=0.9), policy=policy), wrt=nnx.Param)
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        order = rng.permutation(len(x_train))
        for i in range(0, len(order) - 63, 64):
            idx = order[i:i + 64]
            train_step(model, optimizer, x_train[idx], y_train[idx])
    accuracy = float((model(x_test).argmax(-1) == y_test).mean())
    scale = mp.metrics(optimizer)  # the scale and skipped steps, under any policy
    return accuracy, scale["skipped_steps"], scale["loss_scale"]


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
