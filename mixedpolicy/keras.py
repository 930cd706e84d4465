"""Keras: the callback that logs the loss scale. Importing this module imports Keras."""

from mixedpolicy.backends.keras.callbacks import LossScaleCallback

__all__ = ["LossScaleCallback"]
