"""Keras: the callback that logs the loss scale, and the undo of mixedpolicy's changes to
Keras's modules (`uninstall`). Importing this module imports Keras."""

from mixedpolicy.backends.keras.callbacks import LossScaleCallback
from mixedpolicy.backends.keras.patches import install, installed, uninstall

__all__ = ["LossScaleCallback", "install", "installed", "uninstall"]
