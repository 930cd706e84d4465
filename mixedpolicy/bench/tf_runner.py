"""Raw TensorFlow (tf.Module, GradientTape, tf.function): mixedpolicy against casts written by
hand and TensorFlow's own (Keras) LossScaleOptimizer."""

from __future__ import annotations

import os

os.environ["KERAS_BACKEND"] = "tensorflow"  # TensorFlow's optimizers are Keras's

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import mixedpolicy as mp  # noqa: E402
from mixedpolicy.bench.worker import Trainer  # noqa: E402

LR = 0.05
_COMPUTE = {"float32": tf.float32, "mixed_bfloat16": tf.bfloat16, "mixed_float16": tf.float16}


class Dense(tf.Module):
    def __init__(self, w: np.ndarray, b: np.ndarray, compute=None):
        super().__init__()
        self.w, self.b = tf.Variable(w), tf.Variable(b)
        self.compute = compute  # set only in the hand-written version

    def __call__(self, x):
        if self.compute is None:
            return x @ self.w + self.b
        c = self.compute
        return tf.cast(x, c) @ tf.cast(self.w, c) + tf.cast(self.b, c)


class MLP(tf.Module):
    def __init__(self, weights: list, compute=None):
        super().__init__()
        self.layers = [Dense(weights[i], weights[i + 1], compute) for i in range(0, len(weights), 2)]

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = tf.nn.relu(layer(x))
        return self.layers[-1](x)


class _Tf(Trainer):
    def __init__(self, model: MLP, optimizer):
        self.model, self.opt = model, optimizer
        self._loss = None
        scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                logits = tf.cast(self.model(x), tf.float32)
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

    def accuracy(self, x: np.ndarray, y: np.ndarray) -> float:
        logits = tf.cast(self.model(tf.constant(x)), tf.float32)
        return float(np.mean(np.argmax(logits.numpy(), 1) == y))

    def skipped_steps(self) -> int:
        return getattr(self.opt, "num_skipped_steps", 0)

    def loss_scale(self):
        return getattr(self.opt, "loss_scale", None)


def trainers(policy: str, weights: list, device: str):
    tf.config.experimental.enable_tensor_float_32_execution(False)  # pinned: no TF32
    scaled = mp.Policy(policy).needs_loss_scaling
    ours_opt = keras.optimizers.SGD(LR, momentum=0.9)
    ours = _Tf(mp.apply_policy(MLP(weights), policy),
               mp.LossScaleOptimizer(ours_opt) if scaled else ours_opt)
    native_opt = keras.optimizers.SGD(LR, momentum=0.9)
    # A float32 hand-written model casts nothing; a mixed one casts inputs and variables.
    native = _Tf(MLP(weights, None if policy == "float32" else _COMPUTE[policy]),
                 keras.optimizers.LossScaleOptimizer(native_opt) if scaled else native_opt)
    return ours, native
