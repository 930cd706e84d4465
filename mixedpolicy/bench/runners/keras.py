"""Keras 3 on one backend (set by the worker's KERAS_BACKEND): mixedpolicy against Keras's own
dtype policy and LossScaleOptimizer, one `train_on_batch` step at a time (the step `fit` runs)."""

from __future__ import annotations

import math

import keras
import numpy as np

import mixedpolicy as mp
from mixedpolicy.bench.models import (BN_EPSILON, BN_MOMENTUM, LN_EPSILON, MOMENTUM, learning_rate,
                                      resnet_blocks, stem_stride)
from mixedpolicy.bench import user_model
from mixedpolicy.bench.recipes import model_part
from mixedpolicy.bench.trainer import Trainer, memory, pin_tf32
from mixedpolicy.bench.user_model import UserSetup
from mixedpolicy.bench.runners.float8 import keras_float8

#: A user's Keras model's weights in the shared weights file: ``keras.0``, ``keras.1``... in the
#: order of ``model.weights`` (see `user_weights`).
USER_PREFIX = "keras."



def _name(name: str) -> str:
    return name.replace(".", "_")


# Layers start at zeros: `load` sets every value from the shared weights, and a random
# initialiser would only cost time (on JAX, a compilation per shape).

def _dense(units: int, name: str, **kwargs) -> keras.layers.Dense:
    return keras.layers.Dense(units, name=_name(name), kernel_initializer="zeros", **kwargs)


def _conv(filters: int, size: int, name: str, stride: int = 1, bias: bool = False, **kwargs) -> list:
    """A convolution padded symmetrically, as PyTorch pads ("same" pads 0/1 when striding by 2)."""
    layers = [] if stride == 1 else [keras.layers.ZeroPadding2D(size // 2)]
    padding = "same" if stride == 1 else "valid"
    return layers + [keras.layers.Conv2D(filters, size, strides=stride, padding=padding, use_bias=bias,
                                         kernel_initializer="zeros", name=_name(name), **kwargs)]


def _bn(name: str) -> keras.layers.BatchNormalization:
    return keras.layers.BatchNormalization(momentum=BN_MOMENTUM, epsilon=BN_EPSILON, name=_name(name))


def _ln(name: str) -> keras.layers.LayerNormalization:
    return keras.layers.LayerNormalization(epsilon=LN_EPSILON, name=_name(name))


def _apply(layers: list, x):
    for layer in layers:
        x = layer(x)
    return x


class AddPosition(keras.layers.Layer):
    """Adds a learned (tokens, features) position embedding."""

    def build(self, input_shape):
        self.pos = self.add_weight(shape=tuple(input_shape[1:]), initializer="zeros", name="pos")

    def call(self, x):
        return x + keras.ops.cast(self.pos, x.dtype)


class Attention(keras.layers.Layer):
    """Multi-head self-attention, the softmax in float32. (Keras's MultiHeadAttention trains
    on JAX's CPU backend in float32 and bfloat16 but not float16: its gradient asks XLA for a
    float16 x float16 -> float32 dot, which the CPU backend does not have.)"""

    def __init__(self, name: str, heads: int, d: int, causal: bool = False, **kwargs):
        super().__init__(name=_name(name), **kwargs)
        self.heads, self.causal = heads, causal
        self.q, self.k, self.v, self.o = (_dense(d, f"{name}.{p}") for p in "qkvo")

    def call(self, x):
        tokens, d = x.shape[1], x.shape[2]
        q, k, v = (keras.ops.reshape(dense(x), (-1, tokens, self.heads, d // self.heads))
                   for dense in (self.q, self.k, self.v))
        logits = keras.ops.cast(keras.ops.einsum("bqnh,bknh->bnqk", q, k) / math.sqrt(d // self.heads), "float32")
        if self.causal:  # a token sees itself and those before it
            seen = keras.ops.tril(keras.ops.ones((tokens, tokens), "bool"))
            logits = keras.ops.where(seen, logits, float("-inf"))
        weights = keras.ops.cast(keras.ops.softmax(logits, axis=-1), v.dtype)
        return self.o(keras.ops.reshape(keras.ops.einsum("bnqk,bknh->bqnh", weights, v), (-1, tokens, d)))


class EncoderBlock(keras.layers.Layer):
    """Pre-norm: x + attention(norm(x)), then x + mlp(norm(x)) with an exact GELU."""

    def __init__(self, name: str, cfg: dict, causal: bool = False, **kwargs):
        super().__init__(name=_name(name), **kwargs)
        self.key = name  # its prefix in the shared weights
        d, heads = cfg["d_model"], cfg["heads"]
        self.ln1, self.ln2 = _ln(f"{name}.ln1"), _ln(f"{name}.ln2")
        self.attn = Attention(name, heads, d, causal)
        self.mlp1 = _dense(cfg["mlp"], f"{name}.mlp1", activation="gelu")
        self.mlp2 = _dense(d, f"{name}.mlp2")

    def call(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp2(self.mlp1(self.ln2(x)))


def _resnet(cfg: dict) -> keras.Model:
    side = cfg.get("image", 32)
    inputs = keras.Input((side, side, 3))
    stem = _conv(cfg["widths"][0], 7 if cfg.get("stem") == "imagenet" else 3, "stem", stem_stride(cfg))
    x = keras.layers.ReLU()(_bn("stem_bn")(_apply(stem, inputs)))
    if cfg.get("stem") == "imagenet":  # 3x3, stride 2, padding 1: zeros pad as -inf does after a ReLU
        x = keras.layers.MaxPooling2D(3, 2)(keras.layers.ZeroPadding2D(1)(x))
    for name, n_in, n_out, stride in resnet_blocks(cfg):
        if cfg.get("block") == "bottleneck":  # 1x1, 3x3 with the stride, 1x1
            convs = ((n_out // 4, 1, 1), (n_out // 4, 3, stride), (n_out, 1, 1))
        else:
            convs = ((n_out, 3, stride), (n_out, 3, 1))
        out = x
        for i, (filters, size, s) in enumerate(convs, 1):
            out = _bn(f"{name}.bn{i}")(_apply(_conv(filters, size, f"{name}.conv{i}", s), out))
            out = keras.layers.ReLU()(out) if i < len(convs) else out
        if stride != 1 or n_in != n_out:
            x = _bn(f"{name}.proj_bn")(_apply(_conv(n_out, 1, f"{name}.proj", stride), x))
        x = keras.layers.ReLU()(keras.layers.Add()([out, x]))
    x = _dense(cfg["classes"], "head")(keras.layers.GlobalAveragePooling2D()(x))
    return keras.Model(inputs, x)


def _user(model: str) -> UserSetup:
    """A user's MODULE:FACTORY, built (the model, and its own batches and loss if it brings them)."""
    setup = user_model.build(model)
    if not isinstance(setup.model, keras.Model):
        raise TypeError(f"{model} returned a {type(setup.model).__name__}; expected a Keras model.")
    return setup


def _model(model: str, cfg: dict) -> keras.Model:
    return _user(model).model if ":" in model else _built_in(model, cfg)


def _built_in(model: str, cfg: dict) -> keras.Model:
    if model == "mlp":
        sizes = cfg["sizes"]
        inputs = keras.Input((sizes[0],))
        x = inputs
        for i, units in enumerate(sizes[1:]):
            x = _dense(units, f"dense{i}", activation="relu" if i < len(sizes) - 2 else None)(x)
    elif model == "cnn":
        inputs = keras.Input((8, 8, 1))
        x = _conv(cfg["channels"][0], 3, "conv1", bias=True, activation="relu")[0](inputs)
        x = _conv(cfg["channels"][1], 3, "conv2", bias=True, activation="relu")[0](x)
        x = keras.layers.Flatten()(keras.layers.MaxPooling2D(2)(x))  # (height, width, channel) order
        x = _dense(cfg["classes"], "head")(x)
    elif model in ("transformer", "gpt2"):
        if model == "gpt2":  # token embedding, causal blocks, logits for every token
            inputs = keras.Input((cfg["seq"],), dtype="int32")
            x = keras.layers.Embedding(cfg["vocab"], cfg["d_model"], embeddings_initializer="zeros",
                                       name="tok")(inputs)
        else:
            inputs = keras.Input((8, 8))
            x = _dense(cfg["d_model"], "embed")(inputs)
        x = AddPosition(name="pos")(x)
        for i in range(cfg["blocks"]):
            x = EncoderBlock(f"block{i}", cfg, causal=model == "gpt2")(x)
        x = _ln("ln")(x)
        if model == "transformer":
            x = keras.layers.GlobalAveragePooling1D()(x)
        x = _dense(cfg["vocab"] if model == "gpt2" else cfg["classes"], "head")(x)
    else:
        return _resnet(cfg)
    return keras.Model(inputs, x)


def load(net: keras.Model, w: dict) -> keras.Model:
    """Sets the shared initial weights, layer by layer (by name); every weight must find its layer.
    A user's model takes the weights its first build had (`user_weights`), in Keras's order."""
    if not w:
        return net
    if all(key.startswith(USER_PREFIX) for key in w):
        given = [w[f"{USER_PREFIX}{i}"] for i in range(len(w))]
        shapes = [tuple(v.shape) for v in net.weights]
        if [g.shape for g in given] != shapes:
            raise RuntimeError(f"The user's Keras model has weights of shapes {shapes} on Keras's "
                               f"{keras.backend.backend()} backend, where its first build had "
                               f"{[g.shape for g in given]}; its factory must build the same model on every backend.")
        net.set_weights(given)
        return net
    left = dict(w)
    names = {_name(key.rsplit(".", 1)[0]): key.rsplit(".", 1)[0] for key in w}  # Keras name -> ours

    def take(layer, name: str, keys: tuple) -> None:
        layer.set_weights([left.pop(f"{name}.{k}") for k in keys if f"{name}.{k}" in left])

    for layer in net.layers:
        if isinstance(layer, EncoderBlock):
            for p in "qkvo":
                take(getattr(layer.attn, p), f"{layer.key}.{p}", ("kernel", "bias"))
            for sub in ("ln1", "ln2"):
                take(getattr(layer, sub), f"{layer.key}.{sub}", ("scale", "bias"))
            for sub in ("mlp1", "mlp2"):
                take(getattr(layer, sub), f"{layer.key}.{sub}", ("kernel", "bias"))
        elif isinstance(layer, AddPosition):
            layer.set_weights([left.pop("pos")])
        elif isinstance(layer, keras.layers.Embedding):
            take(layer, names[layer.name], ("embedding",))
        elif isinstance(layer, (keras.layers.BatchNormalization, keras.layers.LayerNormalization)):
            take(layer, names[layer.name], ("scale", "bias", "mean", "var"))
        elif layer.weights:
            take(layer, names[layer.name], ("kernel", "bias"))
    if left:
        raise RuntimeError(f"The Keras model has no layer for the shared weights {sorted(left)}.")
    return net


def _loss(setup: UserSetup | None = None):
    """The compiled loss: cross entropy of the logits on class targets, or a user's own
    ``loss(outputs, targets)`` (Keras calls a loss with the targets first)."""
    if setup is not None and setup.loss is not None:
        user_loss = setup.loss
        return lambda y_true, y_pred: user_loss(y_pred, y_true)
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def user_weights(net: keras.Model) -> dict:
    """A user's Keras model's weights, named for the weights file every Keras backend loads."""
    return {f"{USER_PREFIX}{i}": np.asarray(v) for i, v in enumerate(net.get_weights())}


class _Keras(Trainer):
    def __init__(self, model: keras.Model, setup: UserSetup | None = None):
        self.model = model
        self._loss = None
        self.user_batches = setup.batches if setup else None  # a user's own data, or None: digits

    def step(self, x, y) -> None:
        self._loss = self.model.train_on_batch(x, y, return_dict=True)["loss"]

    def last_loss(self) -> float:
        return float(self._loss)

    def predict(self, x) -> np.ndarray:
        logits = user_model.logits_of(self.model(x, training=False))
        return keras.ops.convert_to_numpy(keras.ops.cast(logits, "float32"))

    def memory(self) -> dict:
        def pairs(variables):
            return [(tuple(v.shape), v.dtype) for v in variables]
        return memory(pairs(self.model.trainable_weights), pairs(self.model.weights),
                      pairs(self.model.optimizer.variables))

    def skipped_steps(self) -> int:
        return getattr(self.model.optimizer, "num_skipped_steps", 0)

    def loss_scale(self):
        opt = self.model.optimizer  # a wrapper that does not scale (an update recipe's) has none
        unscaled = str(getattr(opt, "loss_scaling", "")).startswith(("no scaling", "pass-through"))
        return None if unscaled else getattr(opt, "loss_scale", None)


def _float_weights(ours: keras.Model, native: keras.Model) -> list:
    """Ours's weights in native's ``weights`` order: fp8 layers made on each side in another
    order hold their variables in another order, so they are matched layer by layer, then by name."""
    match = {}
    for mine, theirs in zip(ours._flatten_layers(), native._flatten_layers()):
        by_name = {v.name: v for v in mine._trainable_variables + mine._non_trainable_variables}
        match.update({id(v): by_name[v.name] for v in theirs._trainable_variables + theirs._non_trainable_variables})
    return [keras.ops.convert_to_numpy(match[id(v)]) for v in native.weights]


def trainers(model: str, cfg: dict, policy: str, weights: dict, device: str, compile: bool = False,
             tf32: bool = False):
    """(ours, native); `compile` asks Keras for jit_compile=True, else Keras's own default
    ("auto": XLA on JAX and TensorFlow where the model allows, eager on torch). A user's
    factory is called for each side, under each side's global policy."""
    pin_tf32(keras.backend.backend(), device, tf32)
    jit = True if compile else "auto"
    user = ":" in model
    mp.set_global_policy(policy)  # ours: the one line a Keras script adds
    setup = _user(model) if user else None
    ours = mp.apply_policy(load(setup.model if user else _built_in(model, cfg), weights), policy)
    start = ours.get_weights()  # a user's factory initialises at random: native starts from these
    ours.compile(keras.optimizers.SGD(learning_rate(model), momentum=MOMENTUM), _loss(setup), jit_compile=jit)  # wraps under float16
    mp.set_global_policy(None)
    fp8 = mp.Policy(policy).float8_recipe
    own = mp.Policy(model_part(policy)).source.name  # Keras's own: no fp8, no update recipe of ours
    keras.config.set_dtype_policy(own)
    native = load(_user(model).model if user else _built_in(model, cfg), weights)
    if fp8 is not None:
        keras_float8(native)
        start = _float_weights(ours, native)
    native.set_weights(start)
    sgd = keras.optimizers.SGD(learning_rate(model), momentum=MOMENTUM)
    # Keras's compile wraps mixed_float16 by itself; pure float16 is wrapped here, as ours is
    scaled = mp.Policy(policy).needs_loss_scaling
    native.compile(keras.optimizers.LossScaleOptimizer(sgd) if scaled else sgd, _loss(setup), jit_compile=jit)
    keras.config.set_dtype_policy("float32")
    native_side = _Keras(native, setup)
    native_side.recipe = (f"Keras dtype policy {own!r}"
                          + (", model.quantize('float8') but the head" if fp8 is not None else "")
                          + (" + keras LossScaleOptimizer" if scaled else ""))
    return _Keras(ours, setup), native_side


def network(model: str, cfg: dict, weights: dict, device: str) -> keras.Model:
    """The bench model in float32, no policy (what `mixedpolicy inspect` looks at)."""
    return load(_model(model, cfg), weights)


def loss(net: keras.Model, x: np.ndarray, y: np.ndarray):
    return _loss()(y, keras.ops.cast(net(x, training=True), "float32"))


def user_loss(setup: UserSetup, net: keras.Model, batch: tuple, training: bool = True):
    """The loss of `net` (a user's model) on one of its own (inputs, targets) batches, in
    training mode as on torch and Flax (what `mixedpolicy inspect` takes the gradients of)."""
    x, y = batch
    return _loss(setup)(y, net(x, training=training))


def check_user(setup: UserSetup) -> float:
    """The loss of a user's model on its first batch: what the bench checks before any run."""
    return float(keras.ops.convert_to_numpy(user_loss(setup, setup.model, setup.batches[0], training=False)))
