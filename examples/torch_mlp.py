"""A PyTorch MLP on scikit-learn's digits under each policy, accuracy against float32.

    python examples/torch_mlp.py
"""

import torch
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
    as_x = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    return as_x(x_train), torch.tensor(y_train), as_x(x_test), torch.tensor(y_test)


def train(policy, epochs=15, seed=0):
    x_train, y_train, x_test, y_test = data()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    mp.apply_policy(model, policy)
    loss_fn = mp.apply_policy(torch.nn.CrossEntropyLoss(), policy)  # losses in float32
    # follows the policy on the model: scales under mixed_float16, else only skips non-finite steps
    opt = mp.LossScaleOptimizer(torch.optim.Adam(model.parameters(), lr=3e-3))
    for _ in range(epochs):
        order = torch.randperm(len(x_train))
        for i in range(0, len(order), 64):
            idx = order[i:i + 64]
            opt.scale_loss(loss_fn(model(x_train[idx]), y_train[idx])).backward()
            opt.step()
            opt.zero_grad()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    return accuracy, opt.num_skipped_steps, float(opt.loss_scale)


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
