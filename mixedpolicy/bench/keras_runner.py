"""Keras 3 on one backend (set by the worker's KERAS_BACKEND): mixedpolicy against Keras's own
dtype policy and LossScaleOptimizer, one `train_on_batch` step at a time (the step `fit` runs)."""

from __future__ import annotations

import keras
import numpy as np

import mixedpolicy as mp
from mixedpolicy.bench.worker import Trainer

LR = 0.05


def _model(weights: list) -> keras.Model:
    layers = [keras.Input((weights[0].shape[0],))]
    for i in range(0, len(weights) - 2, 2):
        layers.append(keras.layers.Dense(weights[i].shape[1], activation="relu"))
    layers.append(keras.layers.Dense(weights[-1].shape[0]))
    model = keras.Sequential(layers)
    model.set_weights(weights)
    return model


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class _Keras(Trainer):
    def __init__(self, model: keras.Model):
        self.model = model
        self._loss = None

    def step(self, x, y) -> None:
        self._loss = self.model.train_on_batch(x, y, return_dict=True)["loss"]

    def last_loss(self) -> float:
        return float(self._loss)

    def accuracy(self, x: np.ndarray, y: np.ndarray) -> float:
        logits = keras.ops.convert_to_numpy(keras.ops.cast(self.model(x, training=False), "float32"))
        return float(np.mean(np.argmax(logits, 1) == y))

    def skipped_steps(self) -> int:
        return getattr(self.model.optimizer, "num_skipped_steps", 0)

    def loss_scale(self):
        return getattr(self.model.optimizer, "loss_scale", None)


def trainers(policy: str, weights: list, device: str):
    mp.set_global_policy(policy)  # ours: the one line a Keras script adds
    ours = mp.apply_policy(_model(weights), policy)
    ours.compile(keras.optimizers.SGD(LR, momentum=0.9), _loss())  # wraps under float16
    mp.set_global_policy(None)
    keras.config.set_dtype_policy(policy)  # Keras's own
    native = _model(weights)
    sgd = keras.optimizers.SGD(LR, momentum=0.9)
    native.compile(keras.optimizers.LossScaleOptimizer(sgd) if policy == "mixed_float16" else sgd, _loss())
    keras.config.set_dtype_policy("float32")
    return _Keras(ours), _Keras(native)
