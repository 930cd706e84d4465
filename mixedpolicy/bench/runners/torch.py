"""PyTorch: mixedpolicy (`apply_policy` + `LossScaleOptimizer`) against `torch.autocast` + `GradScaler`."""

from __future__ import annotations

import copy

import numpy as np
import torch

import mixedpolicy as mp
from mixedpolicy.bench.models import (BN_EPSILON, BN_MOMENTUM, LN_EPSILON, MOMENTUM, learning_rate,
                                      resnet_blocks, stem_stride)
from mixedpolicy.bench import recipes, user_model
from mixedpolicy.bench.trainer import Trainer, memory, pin_tf32
from mixedpolicy.bench.user_model import UserSetup
from mixedpolicy.bench.runners.float8 import torchao_float8

_HALF = {"mixed_bfloat16": torch.bfloat16, "mixed_float16": torch.float16}
_PURE = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _param(tensor: torch.Tensor, value: np.ndarray) -> None:
    with torch.no_grad():
        tensor.copy_(torch.from_numpy(np.ascontiguousarray(value)))


def _linear(w: dict, name: str, rows: np.ndarray | None = None) -> torch.nn.Linear:
    kernel = w[f"{name}.kernel"] if rows is None else rows
    linear = torch.nn.Linear(*kernel.shape)
    _param(linear.weight, kernel.T)
    _param(linear.bias, w[f"{name}.bias"])
    return linear


def _conv(w: dict, name: str, stride: int = 1) -> torch.nn.Conv2d:
    kernel = w[f"{name}.kernel"]  # (h, w, in, out) -> (out, in, h, w)
    size, _, n_in, n_out = kernel.shape
    bias = f"{name}.bias" in w
    conv = torch.nn.Conv2d(n_in, n_out, size, stride=stride, padding=size // 2, bias=bias)
    _param(conv.weight, kernel.transpose(3, 2, 0, 1))
    if bias:
        _param(conv.bias, w[f"{name}.bias"])
    return conv


def _batch_norm(w: dict, name: str) -> torch.nn.BatchNorm2d:
    bn = torch.nn.BatchNorm2d(len(w[f"{name}.scale"]), eps=BN_EPSILON, momentum=1 - BN_MOMENTUM)
    for attr, key in (("weight", "scale"), ("bias", "bias"), ("running_mean", "mean"), ("running_var", "var")):
        _param(getattr(bn, attr), w[f"{name}.{key}"])
    return bn


def _layer_norm(w: dict, name: str) -> torch.nn.LayerNorm:
    ln = torch.nn.LayerNorm(len(w[f"{name}.scale"]), eps=LN_EPSILON)
    _param(ln.weight, w[f"{name}.scale"])
    _param(ln.bias, w[f"{name}.bias"])
    return ln


class CNN(torch.nn.Module):
    def __init__(self, w: dict):
        super().__init__()
        self.conv1, self.conv2 = _conv(w, "conv1"), _conv(w, "conv2")
        # The shared head reads (height, width, channel) features; PyTorch flattens (channel, h, w).
        kernel = w["head.kernel"]
        channels = kernel.shape[0] // 16
        rows = kernel.reshape(4, 4, channels, -1).transpose(2, 0, 1, 3).reshape(kernel.shape)
        self.head = _linear(w, "head", rows)

    def forward(self, x):
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.head(torch.nn.functional.max_pool2d(x, 2).flatten(1))


def _encoder(w: dict, cfg: dict) -> torch.nn.TransformerEncoder:
    """PyTorch's own pre-norm encoder layers (batch first, exact GELU, no dropout), set from
    the shared weights (q, k and v packed in MultiheadAttention's in-projection)."""
    layer = torch.nn.TransformerEncoderLayer(cfg["d_model"], cfg["heads"], cfg["mlp"], dropout=0.0,
                                             activation="gelu", layer_norm_eps=LN_EPSILON, batch_first=True,
                                             norm_first=True)
    encoder = torch.nn.TransformerEncoder(layer, cfg["blocks"], enable_nested_tensor=False)
    for i, block in enumerate(encoder.layers):
        p = f"block{i}"
        _param(block.self_attn.in_proj_weight, np.concatenate([w[f"{p}.{q}.kernel"].T for q in "qkv"]))
        _param(block.self_attn.in_proj_bias, np.concatenate([w[f"{p}.{q}.bias"] for q in "qkv"]))
        _param(block.self_attn.out_proj.weight, w[f"{p}.o.kernel"].T)
        _param(block.self_attn.out_proj.bias, w[f"{p}.o.bias"])
        block.norm1, block.norm2 = _layer_norm(w, f"{p}.ln1"), _layer_norm(w, f"{p}.ln2")
        block.linear1, block.linear2 = _linear(w, f"{p}.mlp1"), _linear(w, f"{p}.mlp2")
    return encoder


class Transformer(torch.nn.Module):
    def __init__(self, w: dict, cfg: dict):
        super().__init__()
        self.embed = _linear(w, "embed")
        self.pos = torch.nn.Parameter(torch.from_numpy(w["pos"].copy()))
        self.encoder = _encoder(w, cfg)
        self.ln = _layer_norm(w, "ln")
        self.head = _linear(w, "head")

    def forward(self, x):
        h = self.encoder(self.embed(x) + self.pos)
        return self.head(self.ln(h).mean(1))


class Decoder(torch.nn.Module):
    """gpt2: token embedding plus positions, the encoder layers under a causal mask, logits
    for every token."""

    def __init__(self, w: dict, cfg: dict):
        super().__init__()
        self.tok = torch.nn.Embedding.from_pretrained(torch.from_numpy(w["tok.embedding"].copy()), freeze=False)
        self.pos = torch.nn.Parameter(torch.from_numpy(w["pos"].copy()))
        self.encoder = _encoder(w, cfg)
        self.ln = _layer_norm(w, "ln")
        self.head = _linear(w, "head")

    def forward(self, x):
        t = x.shape[1]
        mask = torch.nn.Transformer.generate_square_subsequent_mask(t, device=x.device)
        h = self.encoder(self.tok(x) + self.pos[:t], mask=mask, is_causal=True)
        return self.head(self.ln(h))


class Block(torch.nn.Module):
    """A basic block (two 3x3 convolutions), or a bottleneck one (1x1, 3x3 with the stride,
    1x1) where the weights have a third convolution."""

    def __init__(self, w: dict, name: str, stride: int):
        super().__init__()
        bottleneck = f"{name}.conv3.kernel" in w
        self.convs = torch.nn.ModuleList([_conv(w, f"{name}.conv1", 1 if bottleneck else stride),
                                          _conv(w, f"{name}.conv2", stride if bottleneck else 1)]
                                         + ([_conv(w, f"{name}.conv3")] if bottleneck else []))
        self.bns = torch.nn.ModuleList([_batch_norm(w, f"{name}.bn{i + 1}") for i in range(len(self.convs))])
        self.proj = (torch.nn.Sequential(_conv(w, f"{name}.proj", stride), _batch_norm(w, f"{name}.proj_bn"))
                     if f"{name}.proj.kernel" in w else torch.nn.Identity())

    def forward(self, x):
        out = x
        for i, (conv, bn) in enumerate(zip(self.convs, self.bns)):
            out = bn(conv(out))
            out = torch.relu(out) if i < len(self.convs) - 1 else out
        return torch.relu(out + self.proj(x))


class ResNet(torch.nn.Module):
    def __init__(self, w: dict, cfg: dict):
        super().__init__()
        self.stem, self.stem_bn = _conv(w, "stem", stem_stride(cfg)), _batch_norm(w, "stem_bn")
        self.pool = cfg.get("stem") == "imagenet"
        self.blocks = torch.nn.Sequential(*(Block(w, name, stride) for name, _, _, stride in resnet_blocks(cfg)))
        self.head = _linear(w, "head")

    def forward(self, x):
        x = torch.relu(self.stem_bn(self.stem(x)))
        if self.pool:
            x = torch.nn.functional.max_pool2d(x, 3, 2, 1)
        return self.head(self.blocks(x).mean((2, 3)))


def _model(model: str, cfg: dict, w: dict, device: str) -> torch.nn.Module:
    return _user(model).model.to(device) if ":" in model else _built_in(model, cfg, w, device)


def _user(model: str) -> UserSetup:
    """A user's MODULE:FACTORY, built (the model, and its own batches and loss if it brings them)."""
    setup = user_model.build(model)
    if not isinstance(setup.model, torch.nn.Module):
        raise TypeError(f"{model} returned a {type(setup.model).__name__}; expected a torch.nn.Module.")
    return setup


def _built_in(model: str, cfg: dict, w: dict, device: str) -> torch.nn.Module:
    if model == "mlp":
        layers = []
        for i in range(len(cfg["sizes"]) - 1):
            layers += [_linear(w, f"dense{i}"), torch.nn.ReLU()]
        net = torch.nn.Sequential(*layers[:-1])
    elif model == "cnn":
        net = CNN(w)
    elif model == "transformer":
        net = Transformer(w, cfg)
    elif model == "gpt2":
        net = Decoder(w, cfg)
    else:
        net = ResNet(w, cfg)
    return net.to(device)


def prepare(model: str, x: np.ndarray) -> np.ndarray:
    """Images channels first, as PyTorch's convolutions take them."""
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2)) if x.ndim == 4 else x


def _cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy in float32 over every (sample or token) position."""
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), y.flatten().long())


def _default_loss(outputs, y: torch.Tensor) -> torch.Tensor:
    return _cross_entropy(user_model.logits_of(outputs), y)


def _on_device(tree, device: str, floats: torch.dtype | None = None):
    """A batch's arrays (numpy or torch, in dicts, tuples, lists) as tensors on `device`; the
    floating ones in `floats` where given (a pure policy's module takes its inputs so)."""
    def move(leaf):
        if isinstance(leaf, np.ndarray):
            leaf = torch.from_numpy(leaf)
        if not isinstance(leaf, torch.Tensor):
            return leaf
        leaf = leaf.to(device, non_blocking=True)
        return leaf.to(floats) if floats is not None and leaf.is_floating_point() else leaf
    return user_model.tree_map(move, tree)


class _Torch(Trainer):
    def __init__(self, model: torch.nn.Module, device: str, setup: UserSetup | None = None):
        self.model, self.device = model, device
        self._loss = self.pure = None
        self.objective = (setup.loss if setup and setup.loss else _default_loss)
        self.user_batches = setup.batches if setup else None  # a user's own data, or None: digits

    def _input(self, x):
        return _on_device(x, self.device, self.pure)

    def _batch(self, x, y):
        return self._input(x), _on_device(y, self.device)

    def _forward(self, x):
        return user_model.call(self.model, x)

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def last_loss(self) -> float:
        return float(self._loss)

    def predict(self, x) -> np.ndarray:
        self.model.eval()
        with torch.no_grad():
            logits = user_model.logits_of(self._forward(self._input(x))).float().cpu().numpy()
        self.model.train()
        return logits

    def peak_memory_bytes(self):
        return torch.cuda.max_memory_allocated() if self.device.startswith("cuda") else None

    def memory(self) -> dict:
        state = [(t.shape, t.dtype) for t in user_model.leaves(self.opt.state_dict())  # (the scale: numbers)
                 if isinstance(t, torch.Tensor)]
        params = [p for p in self.model.parameters() if p.requires_grad]
        return memory([(p.shape, p.dtype) for p in params],
                      [(t.shape, t.dtype) for t in (*self.model.parameters(), *self.model.buffers())], state)


class Ours(_Torch):
    def __init__(self, net: torch.nn.Module, policy: str, device: str, lr: float, setup: UserSetup | None = None):
        super().__init__(mp.apply_policy(net, policy), device, setup)
        sgd = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=MOMENTUM)
        # one training loop for every policy: a pass-through where the policy needs no scaling;
        # float16 weights take none (the optimizer refuses to scale for them, and says so)
        pure16 = (chosen := mp.Policy(policy)).variable_dtype == "float16"
        self.opt = (mp.LossScaleOptimizer(sgd, loss_scale=mp.NoLossScale()) if pure16 else
                    mp.LossScaleOptimizer(sgd, policy=chosen))
        self._scaled = chosen.needs_loss_scaling and not pure16

    def step(self, x, y) -> None:
        x, y = self._batch(x, y)
        loss = self.objective(self._forward(x), y)
        self.opt.scale_loss(loss).backward()
        self.opt.step()
        self.opt.zero_grad()
        self._loss = loss.detach()

    def skipped_steps(self) -> int:
        return self.opt.num_skipped_steps

    def loss_scale(self):
        return float(self.opt.loss_scale) if self._scaled else None


class Native(_Torch):
    """torch.autocast + GradScaler for a mixed policy (fp8: torchao's Float8Linear in it); for a
    pure one ``module.to(dtype)`` (Lightning's "bf16-true"), inputs cast to it, no scaler."""

    def __init__(self, net: torch.nn.Module, policy: str, device: str, lr: float, setup: UserSetup | None = None):
        chosen = mp.Policy(policy)  # (an fp8 policy's autocast and scaler: its source's)
        pure, fp8, source = _PURE.get(policy), chosen.float8_recipe, chosen.source.name
        super().__init__(net.to(pure) if pure else net if fp8 is None else torchao_float8(net, fp8.recipe),
                         device, setup)
        self.pure, self.dtype = pure, _HALF.get(source)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=MOMENTUM)
        self.scaler = torch.amp.GradScaler(device.split(":")[0], enabled=source == "mixed_float16")
        self.recipe = ("" if fp8 is None else f"torchao convert_to_float8_training({fp8.recipe!r}), ") + (
            f"module.to(torch.{policy}), inputs cast to it, no loss scale" if self.pure else
            "float32, no autocast" if self.dtype is None else
            f"torch.autocast(torch.{source[6:]})" + (" + GradScaler" if self.scaler.is_enabled() else ""))

    def _forward(self, x):  # under its autocast, predictions too: a mixed row's accuracy is the mixed model's
        with torch.autocast(self.device.split(":")[0], dtype=self.dtype or torch.float32, enabled=bool(self.dtype)):
            return user_model.call(self.model, x)

    def step(self, x, y) -> None:
        x, y = self._batch(x, y)
        loss = self.objective(self._forward(x), y)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad()
        self._loss = loss.detach()


def trainers(model: str, cfg: dict, policy: str, weights: dict, device: str, compile: bool = False,
             tf32: bool = False):
    """(ours, native); `compile` runs both models through torch.compile (the optimizer steps
    stay eager on both sides). A user's factory is called once: native is a copy of its model."""
    pin_tf32("torch", device, tf32)
    setup = _user(model) if ":" in model else None
    net = setup.model.to(device) if setup else _built_in(model, cfg, weights, device)
    twin = copy.deepcopy(net)  # the same initial weights on both sides (a user's model too)
    ours = Ours(net, policy, device, learning_rate(model), setup)
    native = Native(twin, recipes.model_part(policy), device, learning_rate(model), setup)  # no update recipe: nearest
    if compile:
        ours.model, native.model = torch.compile(ours.model), torch.compile(native.model)
    return ours, native


def network(model: str, cfg: dict, weights: dict, device: str) -> torch.nn.Module:
    """The bench model in float32, no policy (what `mixedpolicy inspect` looks at)."""
    return _model(model, cfg, weights, device)


def loss(net: torch.nn.Module, x: np.ndarray, y: np.ndarray) -> torch.Tensor:
    return user_loss(UserSetup(net), net, (x, y.astype(np.int64)))


def user_loss(setup: UserSetup, net: torch.nn.Module, batch: tuple) -> torch.Tensor:
    """The loss of `net` (a user's model) on one of its own (inputs, targets) batches."""
    x, y = (_on_device(part, str(next(iter(net.parameters()), torch.empty(0)).device)) for part in batch)
    return (setup.loss or _default_loss)(user_model.call(net, x), y)


def check_user(setup: UserSetup) -> float:
    """The loss of a user's model on its first batch (no gradient): what the bench checks first."""
    with torch.no_grad():
        return float(user_loss(setup, setup.model, setup.batches[0]))
