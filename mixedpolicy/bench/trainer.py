"""What every framework runner of `mixedpolicy bench` builds: a `Trainer`, and the TF32 pin.

The runners (`mixedpolicy.bench.runners`: torch, jax, tensorflow, keras) import this and
nothing of the worker, which loads them: no cycle, and the worker (run as ``__main__``)
is never loaded a second time by a runner.
"""

from __future__ import annotations

import abc
import re

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

    def memory(self) -> dict | None:
        """What training holds per parameter, counted from the live arrays (see `memory`)."""
        return None


def itemsize(dtype) -> int:
    """Bytes per element of a dtype or its name ("float32", "bfloat16", "int8", "bool"...)."""
    name = str(getattr(dtype, "name", dtype)).rsplit(".", 1)[-1]
    if name == "bool":
        return 1
    digits = re.search(r"(\d+)", name)
    if not digits:
        raise ValueError(f"Received the dtype {dtype!r}; expected a sized one such as float32 or int8.")
    return max(int(digits.group(1)) // 8, 1)


def memory(parameters: list, weights: list, state: list) -> dict:
    """Bytes of training state, from (shape, dtype) pairs: `parameters` (the trainable ones;
    one gradient each, in its dtype, as every framework makes them), `weights` (every
    variable of the model: parameters, batch statistics) and `state` (the optimizer's, its
    loss scale included where it holds it as arrays)."""
    def size(pairs):
        return sum(int(np.prod(shape, dtype=np.int64)) * itemsize(dtype) for shape, dtype in pairs)

    count = sum(int(np.prod(shape, dtype=np.int64)) for shape, _ in parameters)
    out = {"parameters": count, "weights": size(weights), "gradients": size(parameters), "optimizer_state": size(state)}
    out["bytes_per_parameter"] = (out["weights"] + out["gradients"] + out["optimizer_state"]) / max(count, 1)
    return out


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
