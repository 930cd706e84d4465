"""The core without a framework: softmax regression on digits, float16 math, float32 weights.

Shows the loop every adapter automates: cast to the compute dtype, scale the
loss, unscale the gradients, skip the step on overflow, adjust the scale. The
scale starts far too high (2**24), so the first steps overflow in float16 and are
skipped until the scale has backed off.

    python examples/numpy_loss_scaling.py
"""

import numpy as np
try:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
except ImportError:  # the examples' data set ships inside scikit-learn
    raise SystemExit("This example trains on scikit-learn's digits, and scikit-learn is not installed: "
                     "pip install 'mixedpolicy[bench]' (or scikit-learn).") from None

import mixedpolicy as mp


def loss_and_grads(params, x, onehot, loss_scale):
    """Cross-entropy and its gradients, of the loss multiplied by `loss_scale`."""
    logits = x @ params["w"] + params["b"]
    logits = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    n = x.shape[0]
    loss = -(onehot * np.log(probs + 1e-4)).sum() / n
    dlogits = (probs - onehot) * (loss_scale / n)  # gradient of the scaled loss
    return loss, {"w": x.T @ dlogits, "b": dlogits.sum(axis=0)}


def train(policy_name, epochs=30, lr=0.5, seed=0):
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=seed)
    onehot = np.eye(10, dtype=np.float32)[y_train]
    rng = np.random.default_rng(seed)
    params = {"w": rng.normal(0, 0.01, (64, 10)).astype(np.float32), "b": np.zeros(10, np.float32)}

    policy = mp.Policy(policy_name)
    step = mp.apply_policy(loss_and_grads, policy)  # math in the compute dtype
    scale = mp.DynamicLossScale(loss_scale=2.0**24, dynamic_growth_steps=50) \
        if policy.needs_loss_scaling else mp.NoLossScale()
    skipped = 0
    for _ in range(epochs):
        for i in range(0, len(x_train), 64):
            s = np.asarray(scale.loss_scale, policy.compute_dtype)
            _, grads = step(params, x_train[i:i + 64], onehot[i:i + 64], s)
            grads = scale.unscale(mp.Policy("float32").cast_to_compute(grads))
            finite = mp.all_finite(grads)
            if finite:  # a non-finite step is skipped whole
                params = {k: params[k] - lr * grads[k] for k in params}
            else:
                skipped += 1
            scale = scale.adjust(finite)
    pred = (x_test @ params["w"] + params["b"]).argmax(axis=1)
    return float((pred == y_test).mean()), skipped, float(scale.loss_scale), params["w"].dtype


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30, help="epochs per policy (default 30)")
    epochs = parser.parse_args().epochs
    for name in ("float32", "mixed_float16"):
        with np.errstate(over="ignore", invalid="ignore"):
            acc, skipped, final_scale, wdtype = train(name, epochs=epochs)
        print(f"{name:14s} accuracy {acc:.3f}  skipped steps {skipped:2d}  "
              f"final scale {final_scale:g}  weights {wdtype}")
