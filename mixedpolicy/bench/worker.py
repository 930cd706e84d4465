"""One (framework, policy) run of `mixedpolicy bench`, in a process of its own.

    python -m mixedpolicy.bench.worker '<RunSpec as JSON>'

prints one JSON line: the run's record. Two trainers are built from the same
initial weights: ours (mixedpolicy) and native (the framework's own tools, written
by hand). Both take the same batches in the same order; after `warmup` steps each
(compilation excluded), they are timed in blocks of `steps` steps, interleaved
(ours, native, native, ours, ...), the device synchronised before each timer read.
"""

from __future__ import annotations

import abc
import json
import math
import os
import resource
import statistics
import sys
import time
import numpy as np

from mixedpolicy.bench import models
from mixedpolicy.bench.data import batch_order, digits
from mixedpolicy.bench.spec import RunSpec


class Trainer(abc.ABC):
    """What a framework runner builds, twice (ours and native)."""

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

    def accuracy(self, x: np.ndarray, y: np.ndarray) -> float:
        """Accuracy of the current weights on (x, y)."""
        return float(np.mean(np.argmax(self.predict(x), -1) == y))

    def skipped_steps(self) -> int:
        return 0

    def loss_scale(self) -> float | None:
        return None

    def peak_memory_bytes(self) -> int | None:  # device memory where the framework reports it
        return None


def pin_tf32(backend: str, device: str) -> None:
    """TF32 off, so float32 matmuls and convolutions are float32 on GPUs (CPUs have no TF32).

    JAX's pin is a matmul precision of "highest", which XLA's CPU backend refuses for
    float16 dots, so it is set only off the CPU.
    """
    if backend == "torch":
        import torch

        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    elif backend == "jax":
        if device != "cpu":
            import jax

            jax.config.update("jax_default_matmul_precision", "highest")
    elif backend == "tensorflow":
        import tensorflow as tf

        tf.config.experimental.enable_tensor_float_32_execution(False)


def _runner(framework: str):
    if framework == "torch":
        from mixedpolicy.bench import torch_runner as runner
    elif framework == "jax":
        from mixedpolicy.bench import jax_runner as runner
    elif framework == "tensorflow":
        from mixedpolicy.bench import tf_runner as runner
    else:
        from mixedpolicy.bench import keras_runner as runner
    return runner


def data(spec: RunSpec, runner) -> tuple:
    """x_train, y_train, x_test, y_test in the model's input shape, laid out for the framework."""
    x_train, y_train, x_test, y_test = digits(spec.seed)
    prepare = getattr(runner, "prepare", lambda model, x: x)
    return (prepare(spec.model, models.inputs(spec.model, x_train)), y_train,
            prepare(spec.model, models.inputs(spec.model, x_test)), y_test)


def build(spec: RunSpec, runner) -> tuple:
    """(ours, native): the two trainers of the run, from the shared initial weights."""
    cfg = models.config(spec.model, spec.device)
    return runner.trainers(spec.model, cfg, spec.policy, models.load_weights(spec.weights), spec.device)


def run(spec: RunSpec) -> dict:
    """The run's record. Its quality figures (loss curve, final loss, accuracy, skipped
    steps, loss scale) come from the same schedule on every framework: `warmup` steps,
    then `repeats` interleaved blocks of `steps` steps. Its timings come from those blocks,
    unless a block took less than `min_block_s`: short blocks are mostly timer and
    scheduler noise, so the run then goes on with `repeats` more interleaved blocks, each
    made long enough, and times those instead (`timed_steps_per_block` says which)."""
    runner = _runner(spec.framework)
    x_train, y_train, x_test, y_test = data(spec, runner)
    ours, native = build(spec, runner)
    cursor = {"ours": 0, "native": 0}
    order = batch_order(len(x_train), spec.batch_size, spec.warmup + spec.repeats * spec.steps, spec.seed)

    def advance(name: str, trainer: Trainer, n: int) -> float:
        nonlocal order
        if cursor[name] + n > len(order):  # the same order, longer (it extends its prefix)
            order = batch_order(len(x_train), spec.batch_size, 2 * (cursor[name] + n), spec.seed)
        batches = [(x_train[i], y_train[i]) for i in order[cursor[name]:cursor[name] + n]]
        trainer.sync()
        start = time.perf_counter()
        trainer.steps(batches)
        trainer.sync()
        cursor[name] += n
        return (time.perf_counter() - start) / n

    def interleaved(steps: int, losses: list | None = None) -> tuple[list, list]:
        t_ours, t_native = [], []
        for r in range(spec.repeats):
            if r % 2 == 0:
                a, b = advance("ours", ours, steps), advance("native", native, steps)
            else:
                b, a = advance("native", native, steps), advance("ours", ours, steps)
            t_ours.append(a)
            t_native.append(b)
            if losses is not None:
                losses.append([cursor["ours"], ours.last_loss()])
        return t_ours, t_native

    if spec.warmup:
        advance("ours", ours, spec.warmup)
        advance("native", native, spec.warmup)
    losses: list = []
    t_ours, t_native = interleaved(spec.steps, losses)
    quality = {
        "final_loss": losses[-1][1],
        "loss_curve": losses,
        "accuracy": ours.accuracy(x_test, y_test),
        "native_accuracy": native.accuracy(x_test, y_test),
        "skipped_steps": ours.skipped_steps(),
        "final_loss_scale": ours.loss_scale(),
    }
    timed_steps = spec.steps
    block_s = min(statistics.median(t_ours), statistics.median(t_native)) * spec.steps
    if block_s < spec.min_block_s:
        timed_steps = spec.steps * math.ceil(spec.min_block_s / block_s)
        t_ours, t_native = interleaved(timed_steps)
    median = statistics.median(t_ours)
    peak = ours.peak_memory_bytes()
    if peak is None:  # on the CPU: the process's peak resident memory (both trainers)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "framework": spec.framework, "policy": spec.policy, "model": spec.model,
        "batch_size": spec.batch_size, "steps": spec.steps, "repeats": spec.repeats,
        "timed_steps_per_block": timed_steps,
        "step_time_s": {"median": median, "min": min(t_ours), "max": max(t_ours)},
        "native_step_time_s": {"median": statistics.median(t_native), "min": min(t_native),
                               "max": max(t_native)},
        "throughput_samples_per_s": spec.batch_size / median,
        "peak_memory_bytes": int(peak),
        **quality,
        "overhead_vs_native": statistics.median(a / b for a, b in zip(t_ours, t_native)),
        "overhead_ratios": [a / b for a, b in zip(t_ours, t_native)],
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    spec = RunSpec(**json.loads(argv[0]))
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    print(json.dumps(run(spec)), flush=True)


if __name__ == "__main__":
    main()
