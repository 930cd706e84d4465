"""A Keras callback that puts the loss scale and skipped steps into ``logs``."""

from __future__ import annotations

from typing import Any

import keras

from mixedpolicy.telemetry import metrics


class LossScaleCallback(keras.callbacks.Callback):
    """Adds ``loss_scale``, ``skipped_steps`` and ``last_step_skipped`` to the logs of every
    `every_n_steps`-th training batch and of every epoch, so ``keras.callbacks.TensorBoard``
    (placed after it), ``CSVLogger`` and the progress bar show them. Models whose optimizer
    is not a LossScaleOptimizer are left as they are."""

    def __init__(self, every_n_steps: int = 50):
        super().__init__()
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"Received every_n_steps={every_n_steps!r}; expected a whole number >= 1.")
        self.every_n_steps = every_n_steps

    def _add(self, logs: Any) -> None:
        from mixedpolicy.backends.keras.optimizer import LossScaleOptimizer

        # (reading `self.model` puts back the values Keras's JAX trainer holds apart during fit)
        optimizer = getattr(self.model, "optimizer", None)
        if logs is None or not isinstance(optimizer, LossScaleOptimizer):
            return  # not mixedpolicy's: nothing to add
        logs.update(metrics(optimizer))

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if batch % self.every_n_steps == 0:
            self._add(logs)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self._add(logs)
