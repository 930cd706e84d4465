"""Raw TensorFlow (tf.Module, GradientTape, tf.function): mixedpolicy against casts written by
hand and TensorFlow's own (Keras) LossScaleOptimizer."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import mixedpolicy as mp
from mixedpolicy.bench.models import (BN_EPSILON, BN_MOMENTUM, LN_EPSILON, MOMENTUM, learning_rate,
                                      resnet_blocks, stem_stride)
from mixedpolicy.bench.trainer import Trainer, memory, pin_tf32

if keras.backend.backend() != "tensorflow":  # its optimizers are Keras's, on TensorFlow tensors
    raise ImportError(f"The tensorflow bench runner needs Keras on its TensorFlow backend, but this "
                      f"process runs Keras on {keras.backend.backend()!r}; start it with "
                      f"KERAS_BACKEND=tensorflow (mixedpolicy.bench.runners.environment does).")

_COMPUTE = {"float32": tf.float32, "mixed_bfloat16": tf.bfloat16, "mixed_float16": tf.float16,
            "bfloat16": tf.bfloat16, "float16": tf.float16}
_PURE = ("bfloat16", "float16")


# `compute` is set only in the hand-written version: each module casts its inputs and its
# variables to it by hand (norm modules to float32, as mixedpolicy's built-in rule does).

class _Layer(tf.Module):
    def __init__(self, compute=None):
        super().__init__()
        self.compute = compute

    def _c(self, x):
        return x if self.compute is None else tf.cast(x, self.compute)


class Dense(_Layer):
    def __init__(self, w: dict, name: str, compute=None):
        super().__init__(compute)
        self.w, self.b = tf.Variable(w[f"{name}.kernel"]), tf.Variable(w[f"{name}.bias"])

    def __call__(self, x):
        return self._c(x) @ self._c(self.w) + self._c(self.b)


class Conv(_Layer):
    def __init__(self, w: dict, name: str, stride: int = 1, compute=None):
        super().__init__(compute)
        self.w = tf.Variable(w[f"{name}.kernel"])
        self.b = tf.Variable(w[f"{name}.bias"]) if f"{name}.bias" in w else None
        pad = self.w.shape[0] // 2  # symmetric, as PyTorch pads
        self.stride, self.padding = stride, [[0, 0], [pad, pad], [pad, pad], [0, 0]]

    def __call__(self, x):
        y = tf.nn.conv2d(self._c(x), self._c(self.w), self.stride, self.padding)
        return y if self.b is None else y + self._c(self.b)


class LayerNorm(_Layer):
    def __init__(self, w: dict, name: str, compute=None):
        super().__init__(compute and tf.float32)
        self.scale, self.bias = tf.Variable(w[f"{name}.scale"]), tf.Variable(w[f"{name}.bias"])

    def __call__(self, x):
        x = self._c(x)
        mean, var = tf.nn.moments(x, axes=[-1], keepdims=True)
        return tf.nn.batch_normalization(x, mean, var, self.bias, self.scale, LN_EPSILON)


class BatchNorm(_Layer):
    def __init__(self, w: dict, name: str, compute=None):
        super().__init__(compute and tf.float32)
        self.scale, self.bias = tf.Variable(w[f"{name}.scale"]), tf.Variable(w[f"{name}.bias"])
        self.mean = tf.Variable(w[f"{name}.mean"], trainable=False)
        self.var = tf.Variable(w[f"{name}.var"], trainable=False)

    def __call__(self, x, training: bool):
        x = self._c(x)
        if training:
            mean, var = tf.nn.moments(x, axes=[0, 1, 2])
            n = tf.cast(tf.size(x) // tf.shape(x)[-1], x.dtype)
            self.mean.assign(BN_MOMENTUM * self.mean + (1 - BN_MOMENTUM) * mean)
            self.var.assign(BN_MOMENTUM * self.var + (1 - BN_MOMENTUM) * var * n / (n - 1))
        else:
            mean, var = self.mean, self.var
        return tf.nn.batch_normalization(x, mean, var, self.bias, self.scale, BN_EPSILON)


class MLP(tf.Module):
    def __init__(self, w: dict, cfg: dict, compute=None):
        super().__init__()
        self.layers = [Dense(w, f"dense{i}", compute) for i in range(len(cfg["sizes"]) - 1)]

    def __call__(self, x, training: bool = False):
        for layer in self.layers[:-1]:
            x = tf.nn.relu(layer(x))
        return self.layers[-1](x)


class CNN(tf.Module):
    def __init__(self, w: dict, cfg: dict, compute=None):
        super().__init__()
        self.conv1, self.conv2 = Conv(w, "conv1", compute=compute), Conv(w, "conv2", compute=compute)
        self.head = Dense(w, "head", compute)

    def __call__(self, x, training: bool = False):
        x = tf.nn.relu(self.conv2(tf.nn.relu(self.conv1(x))))
        x = tf.nn.max_pool2d(x, 2, 2, "VALID")
        return self.head(tf.reshape(x, [tf.shape(x)[0], -1]))


class Attention(tf.Module):
    def __init__(self, w: dict, name: str, heads: int, compute=None, causal: bool = False):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.q, self.k, self.v, self.o = (Dense(w, f"{name}.{p}", compute) for p in "qkvo")

    def __call__(self, x):
        batch, tokens, d = x.shape[0] or tf.shape(x)[0], x.shape[1], x.shape[2]

        def split(t):  # (batch, tokens, d) -> (batch, heads, tokens, d / heads)
            return tf.transpose(tf.reshape(t, [batch, tokens, self.heads, d // self.heads]), [0, 2, 1, 3])

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        scores = tf.matmul(q, k, transpose_b=True) / tf.cast(tf.sqrt(float(d // self.heads)), q.dtype)
        scores = tf.cast(scores, tf.float32)  # the softmax in float32
        if self.causal:  # a token sees itself and those before it
            seen = tf.linalg.band_part(tf.ones((tokens, tokens), tf.bool), -1, 0)
            scores = tf.where(seen, scores, tf.constant(-np.inf, tf.float32))
        weights = tf.cast(tf.nn.softmax(scores), v.dtype)
        out = tf.transpose(tf.matmul(weights, v), [0, 2, 1, 3])
        return self.o(tf.reshape(out, [batch, tokens, d]))


class EncoderBlock(tf.Module):
    def __init__(self, w: dict, name: str, cfg: dict, compute=None, causal: bool = False):
        super().__init__()
        self.ln1, self.ln2 = LayerNorm(w, f"{name}.ln1", compute), LayerNorm(w, f"{name}.ln2", compute)
        self.attn = Attention(w, f"{name}", cfg["heads"], compute, causal)
        self.mlp1, self.mlp2 = Dense(w, f"{name}.mlp1", compute), Dense(w, f"{name}.mlp2", compute)

    def __call__(self, x):
        x = x + tf.cast(self.attn(self.ln1(x)), x.dtype)
        return x + tf.cast(self.mlp2(tf.nn.gelu(self.mlp1(self.ln2(x)), approximate=False)), x.dtype)


class Transformer(tf.Module):
    def __init__(self, w: dict, cfg: dict, compute=None):
        super().__init__()
        self.embed = Dense(w, "embed", compute)
        self.pos = tf.Variable(w["pos"])
        self.blocks = [EncoderBlock(w, f"block{i}", cfg, compute) for i in range(cfg["blocks"])]
        self.ln = LayerNorm(w, "ln", compute)
        self.head = Dense(w, "head", compute)

    def __call__(self, x, training: bool = False):
        h = self.embed(x)
        h = h + tf.cast(self.pos, h.dtype)  # (under a policy, self.pos reads in the compute dtype)
        for block in self.blocks:
            h = block(h)
        return self.head(tf.reduce_mean(self.ln(h), axis=1))


class Decoder(tf.Module):
    """gpt2: token embedding plus positions, causal blocks, logits for every token."""

    def __init__(self, w: dict, cfg: dict, compute=None):
        super().__init__()
        self.tok, self.pos = tf.Variable(w["tok.embedding"]), tf.Variable(w["pos"])
        self.blocks = [EncoderBlock(w, f"block{i}", cfg, compute, causal=True) for i in range(cfg["blocks"])]
        self.ln = LayerNorm(w, "ln", compute)
        self.head = Dense(w, "head", compute)

    def __call__(self, x, training: bool = False):
        h = tf.gather(tf.cast(self.tok, tf.float32), x)  # a float32 stream, as in PyTorch
        h = h + tf.cast(self.pos, h.dtype)[:x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))


class Block(tf.Module):
    """A basic block (two 3x3 convolutions), or a bottleneck one (1x1, 3x3 with the stride,
    1x1) where the weights have a third convolution."""

    def __init__(self, w: dict, name: str, stride: int, compute=None):
        super().__init__()
        strides = (1, stride, 1) if f"{name}.conv3.kernel" in w else (stride, 1)
        self.convs = [Conv(w, f"{name}.conv{i + 1}", s, compute) for i, s in enumerate(strides)]
        self.bns = [BatchNorm(w, f"{name}.bn{i + 1}", compute) for i in range(len(strides))]
        has_proj = f"{name}.proj.kernel" in w
        self.proj = Conv(w, f"{name}.proj", stride, compute) if has_proj else None
        self.proj_bn = BatchNorm(w, f"{name}.proj_bn", compute) if has_proj else None

    def __call__(self, x, training: bool):
        out = x
        for i, (conv, bn) in enumerate(zip(self.convs, self.bns)):
            out = bn(conv(out), training)
            out = tf.nn.relu(out) if i < len(self.convs) - 1 else out
        short = x if self.proj is None else self.proj_bn(self.proj(x), training)
        return tf.nn.relu(out + tf.cast(short, out.dtype))


class ResNet(tf.Module):
    def __init__(self, w: dict, cfg: dict, compute=None):
        super().__init__()
        self.stem = Conv(w, "stem", stem_stride(cfg), compute=compute)
        self.stem_bn = BatchNorm(w, "stem_bn", compute)
        self.pool = cfg.get("stem") == "imagenet"
        self.blocks = [Block(w, name, stride, compute) for name, _, _, stride in resnet_blocks(cfg)]
        self.head = Dense(w, "head", compute)

    def __call__(self, x, training: bool = False):
        x = tf.nn.relu(self.stem_bn(self.stem(x), training))
        if self.pool:  # 3x3, stride 2, padding 1: zeros pad as PyTorch's -inf does after a ReLU
            x = tf.nn.max_pool2d(tf.pad(x, [[0, 0], [1, 1], [1, 1], [0, 0]]), 3, 2, "VALID")
        for block in self.blocks:
            x = block(x, training)
        return self.head(tf.reduce_mean(x, axis=[1, 2]))


_MODELS = {"mlp": MLP, "cnn": CNN, "transformer": Transformer, "resnet": ResNet, "resnet50": ResNet,
           "gpt2": Decoder}


class _Tf(Trainer):
    def __init__(self, model: tf.Module, optimizer, compile: bool = False):
        self.model, self.opt = model, optimizer
        self._loss = None
        scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)

        @tf.function(jit_compile=compile or None)
        def step(x, y):
            with tf.GradientTape() as tape:
                logits = tf.cast(self.model(x, training=True), tf.float32)
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
                target = self.opt.scale_loss(loss) if scaled else loss
            grads = tape.gradient(target, self.model.trainable_variables)
            self.opt.apply_gradients(zip(grads, self.model.trainable_variables))
            return loss

        self._step = step

    def step(self, x, y) -> None:
        self._loss = self._step(x, y)

    def last_loss(self) -> float:
        return float(self._loss)

    def predict(self, x: np.ndarray) -> np.ndarray:
        return tf.cast(self.model(tf.constant(x)), tf.float32).numpy()

    def memory(self) -> dict:
        def pairs(variables):
            return [(tuple(v.shape), v.dtype) for v in variables]
        return memory(pairs(self.model.trainable_variables), pairs(self.model.variables), pairs(self.opt.variables))

    def skipped_steps(self) -> int:
        return getattr(self.opt, "num_skipped_steps", 0)

    def loss_scale(self):
        if getattr(self.opt, "loss_scaling", "").startswith(("pass-through", "no scaling")):
            return None  # no scale: the policy needs none (the other frameworks' rows say "-" too)
        return getattr(self.opt, "loss_scale", None)


def trainers(model: str, cfg: dict, policy: str, weights: dict, device: str, compile: bool = False,
             tf32: bool = False):
    """(ours, native), each step a tf.function; `compile` asks XLA to compile it
    (jit_compile=True)."""
    pin_tf32("tensorflow", device, tf32)
    scaled = mp.Policy(policy).needs_loss_scaling
    ours_opt = keras.optimizers.SGD(learning_rate(model), momentum=MOMENTUM)
    # one training loop for every policy: a pass-through where the policy needs no scaling
    ours = _Tf(mp.apply_policy(_MODELS[model](weights, cfg), policy),
               mp.LossScaleOptimizer(ours_opt, policy=policy), compile)
    native_opt = keras.optimizers.SGD(learning_rate(model), momentum=MOMENTUM)
    # A float32 hand-written model casts nothing; a mixed one casts inputs and variables; a
    # pure one makes its variables in the half dtype (norm layers' in float32, as ours).
    compute = None if policy == "float32" else _COMPUTE[policy]
    made = _pure_weights(weights, compute) if policy in _PURE else weights
    native = _Tf(_MODELS[model](made, cfg, compute),
                 keras.optimizers.LossScaleOptimizer(native_opt) if scaled else native_opt, compile)
    native.recipe = ("float32" if compute is None else
                     f"{'variables made in' if policy in _PURE else 'inputs and variables cast to'} "
                     f"{compute.name} by hand" + (" + keras LossScaleOptimizer" if scaled else ""))
    return ours, native


def _pure_weights(weights: dict, dtype) -> dict:
    """The shared weights in `dtype`, but the norm layers' (those with a scale), which stay float32."""
    norms = {k.rsplit(".", 1)[0] for k in weights if k.endswith(".scale")}
    return {k: v if k.rsplit(".", 1)[0] in norms else v.astype(dtype.as_numpy_dtype) for k, v in weights.items()}
