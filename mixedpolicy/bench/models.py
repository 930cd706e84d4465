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
- ``resnet50``: ResNet-50's shape (torchvision's v1.5): a 7x7 stride-2 stem, a 3x3
  stride-2 max pool, four stages of bottleneck blocks (1x1, 3x3 carrying the stride,
  1x1 to 4x the width; a 1x1 projection where the shape changes), global average
  pooling, a dense head. On a GPU the real one: widths 64-512, 3-4-6-3 blocks, 224x224
  images; on the CPU one block per stage, an eighth of the width, 64x64 images.
- ``gpt2``: a GPT-2-style decoder: token embedding plus learned positions, pre-norm
  blocks with causal self-attention, a final layer norm, an (untied) language-model
  head on every token, trained on next-token cross entropy. On digits a digit is a
  sentence: its 64 pixel intensities (0-16) as tokens, then a class token (17 + the
  label), so the task is language modelling and the accuracy is that of the class
  token predicted after the 64th pixel. On a GPU 12 x 768 with 12 heads (GPT-2
  small); with ``--data synthetic`` also GPT-2's 50257 tokens and 1024 positions.

Sizes depend on the device: small enough to train on a 2-core CPU, GPU-sized on
a GPU (the 12-block transformer and ResNet-20 the GPU figures use). With
``--data synthetic`` (seeded random inputs and labels, see `data.synthetic`) the
models take their real input sizes (`config`).
"""

from __future__ import annotations

import numpy as np

MODELS = ("mlp", "cnn", "transformer", "resnet", "resnet50", "gpt2")
#: The data sets a run trains on (`data.digits`, `data.synthetic`).
DATASETS = ("digits", "synthetic")

_CPU = {
    "mlp": {"sizes": (64, 128, 128, 10)},
    "cnn": {"channels": (32, 64)},
    "transformer": {"d_model": 64, "heads": 4, "blocks": 2, "mlp": 128},
    "resnet": {"widths": (16, 32, 64), "blocks_per_stage": 1},
    "resnet50": {"widths": (8, 16, 32, 64), "blocks_per_stage": (1, 1, 1, 1), "block": "bottleneck",
                 "stem": "imagenet", "image": 64},
    "gpt2": {"d_model": 64, "heads": 4, "blocks": 2, "mlp": 256},
}
_GPU = {
    "mlp": {"sizes": (64, 1024, 1024, 10)},
    "cnn": {"channels": (64, 128)},
    "transformer": {"d_model": 512, "heads": 8, "blocks": 12, "mlp": 2048},
    "resnet": {"widths": (16, 32, 64), "blocks_per_stage": 3},
    "resnet50": {"widths": (64, 128, 256, 512), "blocks_per_stage": (3, 4, 6, 3), "block": "bottleneck",
                 "stem": "imagenet", "image": 224},
    "gpt2": {"d_model": 768, "heads": 12, "blocks": 12, "mlp": 3072},
}
#: What the data set fixes: digits' 10 classes, and its 64-pixel sentences (17 intensities
#: and 10 class tokens); synthetic data takes ImageNet's classes and GPT-2's vocabulary and
#: context on a GPU, and smaller ones on the CPU.
_DIGITS = {"classes": 10, "vocab": 27, "seq": 64}
_SYNTHETIC = {"cpu": {"classes": 10, "vocab": 512, "seq": 128},
              "gpu": {"classes": 1000, "vocab": 50257, "seq": 1024}}
#: The first class token of the digits sentences (tokens 0-16 are pixel intensities).
CLASS_TOKEN = 17

#: Every framework trains with SGD at this learning rate and momentum ...
LR, MOMENTUM = 0.05, 0.9
#: ... but the transformers at this one: at 0.05 the GPU-sized 12-block one diverges in
#: float32 (its loss went from 2.9 to 42 in ten steps), at 0.01 it falls on every size.
TRANSFORMER_LR = 0.01


def is_user(model: str) -> bool:
    """Is `model` a user's ``MODULE:FACTORY`` (see `mixedpolicy.bench.user_model`)?"""
    return ":" in model


def learning_rate(model: str) -> float:
    """The SGD learning rate every framework uses for `model`."""
    return TRANSFORMER_LR if model in ("transformer", "gpt2") else LR
#: Batch-norm settings shared by every framework (PyTorch's momentum 0.1 is 0.9 elsewhere).
BN_MOMENTUM, BN_EPSILON = 0.9, 1e-5
LN_EPSILON = 1e-5
CLASSES = 10


def config(model: str, device: str, data: str = "digits") -> dict:
    """The sizes of `model` on `device` ("cpu", "cuda" or "cuda:N") trained on `data`."""
    if is_user(model):  # a user's model takes digits' 64 features to 10 logits
        if data != "digits":
            raise ValueError(f"Received --data {data} with the user model {model}; a user's model "
                             f"trains on digits (64 features in, 10 logits out) or on the batches its "
                             f"factory returns (see docs/benchmarks.md, 'Your own model'): drop --data.")
        return {"classes": 10}
    if model not in MODELS:
        raise ValueError(f"Received model {model!r}; expected one of: {', '.join(MODELS)}.")
    if data not in DATASETS:
        raise ValueError(f"Received data {data!r}; expected one of: {', '.join(DATASETS)}.")
    cfg = dict((_CPU if device == "cpu" else _GPU)[model])
    fixed = _DIGITS if data == "digits" else _SYNTHETIC["cpu" if device == "cpu" else "gpu"]
    cfg["classes"] = fixed["classes"]
    if model == "gpt2":
        cfg.update(vocab=fixed["vocab"], seq=fixed["seq"])
    return cfg


def input_shape(model: str, cfg: dict) -> tuple:
    """One sample's input shape (channels last), and for gpt2 its number of tokens."""
    if is_user(model):
        return (64,)
    side = cfg.get("image", 32)
    return {"mlp": (64,), "cnn": (8, 8, 1), "transformer": (8, 8), "resnet": (side, side, 3),
            "resnet50": (side, side, 3), "gpt2": (cfg.get("seq", 64),)}[model]


def inputs(model: str, x: np.ndarray, cfg: dict | None = None) -> np.ndarray:
    """Digits' (n, 64) features in the model's input shape (channels last; gpt2: int32
    pixel tokens)."""
    if model == "mlp" or is_user(model):
        return x
    if model == "gpt2":
        return np.rint(x * 16).astype(np.int32)                  # 64 pixel tokens, 0-16
    images = x.reshape(-1, 8, 8)
    if model == "transformer":
        return images                                            # 8 tokens of 8 pixels
    if model == "cnn":
        return images[..., None]                                 # (n, 8, 8, 1)
    side = input_shape(model, cfg or config(model, "cpu"))[0]
    if side % 8:
        raise ValueError(f"Received a {side}x{side} image size; digits scale up to a multiple of 8.")
    big = images.repeat(side // 8, axis=1).repeat(side // 8, axis=2)
    return np.ascontiguousarray(np.repeat(big[..., None], 3, axis=-1))


def targets(model: str, tokens_or_x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The training labels: the class, or for gpt2 each next token (the pixels after the
    first, then the class token) of the sentence `inputs` made."""
    if model != "gpt2":
        return y
    return np.concatenate([tokens_or_x[:, 1:], (CLASS_TOKEN + y)[:, None]], axis=1).astype(np.int32)


def class_logits(model: str, logits: np.ndarray) -> np.ndarray:
    """The logits the accuracy reads: the model's output, or for gpt2 the class tokens'
    logits at the last position (the token after the 64th pixel)."""
    if model != "gpt2":
        return logits
    return logits[:, -1, CLASS_TOKEN:CLASS_TOKEN + 10]


def resnet_blocks(cfg: dict) -> list[tuple[str, int, int, int]]:
    """(name, in channels, out channels, stride) of each block, in order (a bottleneck
    block's inner width is a quarter of its out channels)."""
    per_stage = cfg["blocks_per_stage"]
    if isinstance(per_stage, int):
        per_stage = (per_stage,) * len(cfg["widths"])
    expansion = 4 if cfg.get("block", "basic") == "bottleneck" else 1
    blocks, prev = [], cfg["widths"][0]
    for s, (width, n) in enumerate(zip(cfg["widths"], per_stage)):
        for b in range(n):
            stride = 2 if s > 0 and b == 0 else 1
            blocks.append((f"stage{s}.block{b}", prev, width * expansion, stride))
            prev = width * expansion
    return blocks


def stem_stride(cfg: dict) -> int:
    """The stem convolution's stride: ImageNet's stem strides by 2 and max-pools (3x3,
    stride 2, padding 1) after it."""
    return 2 if cfg.get("stem") == "imagenet" else 1


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
    if is_user(model):
        return {}  # the factory initialises it; each run copies its first build to the other side
    if model == "mlp":
        sizes = cfg["sizes"]
        for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            init.dense(f"dense{i}", n_in, n_out)
    elif model == "cnn":
        c1, c2 = cfg["channels"]
        init.conv("conv1", 3, 1, c1)
        init.conv("conv2", 3, c1, c2)
        init.dense("head", 4 * 4 * c2, CLASSES)
    elif model in ("transformer", "gpt2"):
        d, f = cfg["d_model"], cfg["mlp"]
        if model == "gpt2":
            init.weights["tok.embedding"] = (init.rng.standard_normal((cfg["vocab"], d)) * 0.02
                                             ).astype(np.float32)
        else:
            init.dense("embed", 8, d)
        tokens = cfg["seq"] if model == "gpt2" else 8
        init.weights["pos"] = (init.rng.standard_normal((tokens, d)) * 0.02).astype(np.float32)
        for i in range(cfg["blocks"]):
            init.norm(f"block{i}.ln1", d)
            for p in "qkvo":
                init.dense(f"block{i}.{p}", d, d)
            init.norm(f"block{i}.ln2", d)
            init.dense(f"block{i}.mlp1", d, f)
            init.dense(f"block{i}.mlp2", f, d)
        init.norm("ln", d)
        init.dense("head", d, cfg["vocab"] if model == "gpt2" else cfg.get("classes", CLASSES))
    elif model in ("resnet", "resnet50"):
        stem = 7 if cfg.get("stem") == "imagenet" else 3
        init.conv("stem", stem, 3, cfg["widths"][0], bias=False)
        init.norm("stem_bn", cfg["widths"][0], running=True)
        for name, n_in, n_out, stride in resnet_blocks(cfg):
            if cfg.get("block") == "bottleneck":
                mid = n_out // 4
                shapes = (("conv1", 1, n_in, mid), ("conv2", 3, mid, mid), ("conv3", 1, mid, n_out))
            else:
                shapes = (("conv1", 3, n_in, n_out), ("conv2", 3, n_out, n_out))
            for conv, size, c_in, c_out in shapes:
                init.conv(f"{name}.{conv}", size, c_in, c_out, bias=False)
                init.norm(f"{name}.bn{conv[-1]}", c_out, running=True)
            if stride != 1 or n_in != n_out:
                init.conv(f"{name}.proj", 1, n_in, n_out, bias=False)
                init.norm(f"{name}.proj_bn", n_out, running=True)
        init.dense("head", resnet_blocks(cfg)[-1][2], cfg.get("classes", CLASSES))
    else:
        raise ValueError(f"Received model {model!r}; expected one of: {', '.join(MODELS)}.")
    return init.weights


def save_weights(path: str, weights: dict[str, np.ndarray]) -> None:
    np.savez(path, **weights)


def load_weights(path: str) -> dict[str, np.ndarray]:
    with np.load(path) as f:
        return {name: f[name] for name in f.files}
