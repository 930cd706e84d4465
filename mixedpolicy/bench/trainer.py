"""What every framework runner of `mixedpolicy bench` builds: a `Trainer`, and the TF32 pin.

The runners (`mixedpolicy.bench.runners`: torch, jax, tensorflow, keras) import this and
nothing of the worker, which loads them: no cycle, and the worker (run as ``__main__``)
is never loaded a second time by a runner.
"""

from __future__ import annotations

import abc

import numpy as np


class Trainer(abc.ABC):
    """What a framework runner builds, twice (ours and native)."""

    #: the native side's recipe in words ("torch.autocast(torch.float16) + GradScaler"), for
    #: the report; empty on ours
    recipe: str = ""
    #: a user's own (inputs, targets) batches where its factory brought them; None: the
    #: bench's data set
    user_batches: list | None = None

    @abc.abstractmethod
    def step(self, x: np.ndarray, y: np.ndarray) -> None:
        """One training step on a batch."""

    def steps(self, batches: list) -> None:
        """One training step on each (x, y) batch, in order, the framework's usual way."""
        for x, y in batches:
            self.step(x, y)

    def sync(self) -> None:
        """Waits for the device (frameworks that run eagerly on the CPU need nothing)."""

    @abc.abstractmethod
    def last_loss(self) -> float:
        """The loss of the last step (a host read)."""

    @abc.abstractmethod
    def predict(self, x: np.ndarray) -> np.ndarray:
        """float32 logits of the current weights on inputs `x` (inference mode)."""

    def skipped_steps(self) -> int:
        return 0

    def loss_scale(self) -> float | None:
        return None

    def peak_memory_bytes(self) -> int | None:  # device memory where the framework reports it
        return None


def pin_tf32(backend: str, device: str, allow: bool = False) -> None:
    """TF32 off, so float32 matmuls and convolutions are float32 on GPUs (CPUs have no TF32);
    on where `allow` (the bench's "tf32" baseline: float32 weights, TF32 math on Ampere and
    later).

    JAX's pin is a matmul precision of "highest" (TF32: "tensorfloat32"), which XLA's CPU
    backend refuses for float16 dots, so it is set only off the CPU.
    """
    if backend == "torch":
        import torch

        torch.backends.cuda.matmul.allow_tf32 = allow
        torch.backends.cudnn.allow_tf32 = allow
    elif backend == "jax":
        if device != "cpu":
            import jax

            jax.config.update("jax_default_matmul_precision", "tensorfloat32" if allow else "highest")
    elif backend == "tensorflow":
        import tensorflow as tf

        tf.config.experimental.enable_tensor_float_32_execution(allow)
