"""The bench's models, defined once: their sizes, input shapes and initial weights.

Every framework builds the same architecture from the same named weights, written
once by `mixedpolicy bench` and loaded by each run. Weights are kept in one layout
(channels last): dense kernels ``(in, out)``, convolution kernels
``(height, width, in, out)``; a framework with another layout (PyTorch) converts
them when it loads them, never during a step.

- ``mlp``: digits' 64 features, two ReLU layers, 10 classes.
- ``cnn``: the 8x8 digit as an image; two 3x3 ReLU convolutions, a 2x2 max pool,
  a dense head on the flattened (height, width, channel) features.
- ``transformer``: the 8 rows of the digit as 8 tokens of 8 pixels; a dense
  embedding plus learned positions, pre-norm encoder blocks (layer norm, multi-head
  self-attention, layer norm, GELU MLP, residuals), a final layer norm, the mean
  over tokens, a dense head.
- ``resnet``: a CIFAR-shaped ResNet (32x32x3 input, the digit scaled up 4x and
  repeated over 3 channels): a 3x3 stem, three stages of basic blocks (3x3
  convolutions with batch norm; the first block of stages 2 and 3 strides by 2 and
  has a 1x1 projection shortcut), global average pooling, a dense head.

Sizes depend on the device: small enough to train on a 2-core CPU, GPU-sized on
a GPU (the 12-block transformer and ResNet-20 the GPU figures use).
"""

from __future__ import annotations

import numpy as np

MODELS = ("mlp", "cnn", "transformer", "resnet")

_CPU = {
    "mlp": {"sizes": (64, 128, 128, 10)},
    "cnn": {"channels": (32, 64)},
    "transformer": {"d_model": 64, "heads": 4, "blocks": 2, "mlp": 128},
    "resnet": {"widths": (16, 32, 64), "blocks_per_stage": 1},
}
_GPU = {
    "mlp": {"sizes": (64, 1024, 1024, 10)},
    "cnn": {"channels": (64, 128)},
    "transformer": {"d_model": 512, "heads": 8, "blocks": 12, "mlp": 2048},
    "resnet": {"widths": (16, 32, 64), "blocks_per_stage": 3},
}

#: Every framework trains with SGD at this learning rate and momentum.
LR, MOMENTUM = 0.05, 0.9
#: Batch-norm settings shared by every framework (PyTorch's momentum 0.1 is 0.9 elsewhere).
BN_MOMENTUM, BN_EPSILON = 0.9, 1e-5
LN_EPSILON = 1e-5
CLASSES = 10


def config(model: str, device: str) -> dict:
    """The sizes of `model` on `device` ("cpu", "cuda" or "cuda:N")."""
    return dict((_CPU if device == "cpu" else _GPU)[model])


def inputs(model: str, x: np.ndarray) -> np.ndarray:
    """Digits' (n, 64) features in the model's input shape (channels last)."""
    if model == "mlp":
        return x
    images = x.reshape(-1, 8, 8)
    if model == "transformer":
        return images                                            # 8 tokens of 8 pixels
    if model == "cnn":
        return images[..., None]                                 # (n, 8, 8, 1)
    big = images.repeat(4, axis=1).repeat(4, axis=2)             # (n, 32, 32)
    return np.ascontiguousarray(np.repeat(big[..., None], 3, axis=-1))


def resnet_blocks(cfg: dict) -> list[tuple[str, int, int, int]]:
    """(name, in channels, out channels, stride) of each basic block, in order."""
    blocks, prev = [], cfg["widths"][0]
    for s, width in enumerate(cfg["widths"]):
        for b in range(cfg["blocks_per_stage"]):
            stride = 2 if s > 0 and b == 0 else 1
            blocks.append((f"stage{s}.block{b}", prev, width, stride))
            prev = width
    return blocks


class _Init:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.weights: dict[str, np.ndarray] = {}

    def dense(self, name: str, n_in: int, n_out: int, bias: bool = True) -> None:
        limit = np.sqrt(6.0 / (n_in + n_out))  # Glorot uniform
        self.weights[f"{name}.kernel"] = self.rng.uniform(-limit, limit, (n_in, n_out)).astype(np.float32)
        if bias:
            self.weights[f"{name}.bias"] = np.zeros(n_out, np.float32)

    def conv(self, name: str, size: int, n_in: int, n_out: int, bias: bool = True) -> None:
        std = np.sqrt(2.0 / (size * size * n_in))  # He normal
        self.weights[f"{name}.kernel"] = (self.rng.standard_normal((size, size, n_in, n_out)) * std
                                          ).astype(np.float32)
        if bias:
            self.weights[f"{name}.bias"] = np.zeros(n_out, np.float32)

    def norm(self, name: str, n: int, running: bool = False) -> None:
        self.weights[f"{name}.scale"] = np.ones(n, np.float32)
        self.weights[f"{name}.bias"] = np.zeros(n, np.float32)
        if running:
            self.weights[f"{name}.mean"] = np.zeros(n, np.float32)
            self.weights[f"{name}.var"] = np.ones(n, np.float32)


def init_weights(model: str, cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """The named initial weights of `model` with sizes `cfg` (see the module docstring)."""
    init = _Init(seed)
    if model == "mlp":
        sizes = cfg["sizes"]
        for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            init.dense(f"dense{i}", n_in, n_out)
    elif model == "cnn":
        c1, c2 = cfg["channels"]
        init.conv("conv1", 3, 1, c1)
        init.conv("conv2", 3, c1, c2)
        init.dense("head", 4 * 4 * c2, CLASSES)
    elif model == "transformer":
        d, f = cfg["d_model"], cfg["mlp"]
        init.dense("embed", 8, d)
        init.weights["pos"] = (init.rng.standard_normal((8, d)) * 0.02).astype(np.float32)
        for i in range(cfg["blocks"]):
            init.norm(f"block{i}.ln1", d)
            for p in "qkvo":
                init.dense(f"block{i}.{p}", d, d)
            init.norm(f"block{i}.ln2", d)
            init.dense(f"block{i}.mlp1", d, f)
            init.dense(f"block{i}.mlp2", f, d)
        init.norm("ln", d)
        init.dense("head", d, CLASSES)
    elif model == "resnet":
        init.conv("stem", 3, 3, cfg["widths"][0], bias=False)
        init.norm("stem_bn", cfg["widths"][0], running=True)
        for name, n_in, n_out, stride in resnet_blocks(cfg):
            init.conv(f"{name}.conv1", 3, n_in, n_out, bias=False)
            init.norm(f"{name}.bn1", n_out, running=True)
            init.conv(f"{name}.conv2", 3, n_out, n_out, bias=False)
            init.norm(f"{name}.bn2", n_out, running=True)
            if stride != 1 or n_in != n_out:
                init.conv(f"{name}.proj", 1, n_in, n_out, bias=False)
                init.norm(f"{name}.proj_bn", n_out, running=True)
        init.dense("head", cfg["widths"][-1], CLASSES)
    else:
        raise ValueError(f"Received model {model!r}; expected one of: {', '.join(MODELS)}.")
    return init.weights


def save_weights(path: str, weights: dict[str, np.ndarray]) -> None:
    np.savez(path, **weights)


def load_weights(path: str) -> dict[str, np.ndarray]:
    with np.load(path) as f:
        return {name: f[name] for name in f.files}
