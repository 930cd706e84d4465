"""The bench's framework runners, in one table: what each needs, where it lives, how it starts.

Each runner module builds a `Trainer` pair (ours and the framework's own AMP) with
``trainers(model, cfg, policy, weights, device)`` and pins its own TF32. A worker process
runs one; `environment` is what that process is started with (Keras picks its backend per
process, so a Keras runner's backend is set here, never inside a running test).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NamedTuple


class Runner(NamedTuple):
    framework: str            # the name --frameworks takes
    packages: tuple           # what must be installed (checked without importing)
    module: str               # the runner module
    keras_backend: str = ""   # KERAS_BACKEND of its worker process, where Keras runs
    inspects: bool = True     # its module builds the model alone (`network`) for `mixedpolicy inspect`

    @property
    def backend(self) -> str:
        """The framework that computes: torch, jax or tensorflow (Keras's backend)."""
        return self.keras_backend or self.framework


RUNNERS = (
    Runner("torch", ("torch",), "mixedpolicy.bench.runners.torch"),
    Runner("jax", ("jax", "flax", "optax"), "mixedpolicy.bench.runners.jax"),
    # TensorFlow's optimizers are Keras's: Keras on its TensorFlow backend
    Runner("tensorflow", ("tensorflow", "keras"), "mixedpolicy.bench.runners.tensorflow", "tensorflow",
           inspects=False),
    Runner("keras-jax", ("keras", "jax"), "mixedpolicy.bench.runners.keras", "jax"),
    Runner("keras-torch", ("keras", "torch"), "mixedpolicy.bench.runners.keras", "torch"),
    Runner("keras-tensorflow", ("keras", "tensorflow"), "mixedpolicy.bench.runners.keras", "tensorflow"),
)
FRAMEWORKS = tuple(r.framework for r in RUNNERS)


def runner(framework: str) -> Runner:
    """The row of `framework`.

    Raises:
      ValueError: no runner has that name.
    """
    for row in RUNNERS:
        if row.framework == framework:
            return row
    raise ValueError(f"Received framework {framework!r}; expected one of: {', '.join(FRAMEWORKS)}.")


def load(framework: str) -> ModuleType:
    """The runner module of `framework` (importing it and its framework)."""
    return importlib.import_module(runner(framework).module)


#: the variables through which each framework (and the BLAS beneath) reads its thread counts
_THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TF_NUM_INTRAOP_THREADS")


def environment(framework: str, device: str, threads: int = 1) -> dict:
    """The environment of a worker process running `framework` on `device`.

    On a CPU its intra-op threads are pinned to `threads` (0 leaves each framework's default):
    torch's OpenMP pool, the BLAS libraries', TensorFlow's pools and XLA's Eigen pool would
    otherwise each start one thread per core and fight every other process on a small
    machine (a torch step ran 20x slower beside one busy core).
    """
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    if device == "cpu":  # on a GPU machine too: JAX and Keras would otherwise take the GPU
        env.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
    backend = runner(framework).keras_backend
    # Keras on torch: a training step's backward crashes (SIGSEGV) in torch 2.13 with one OpenMP
    # thread on an AVX2 CPU (seen 2026-11-25); its threads stay the default, as results.json says
    if device == "cpu" and threads and backend != "torch":
        env.update({name: str(threads) for name in _THREAD_VARIABLES}, TF_NUM_INTEROP_THREADS="1")
        if threads == 1:  # XLA:CPU's Eigen pool: one thread
            flags = env.get("XLA_FLAGS", "")
            if "xla_cpu_multi_thread_eigen" not in flags:
                env["XLA_FLAGS"] = (flags + " --xla_cpu_multi_thread_eigen=false").strip()
    if backend:
        env["KERAS_BACKEND"] = backend
    return env


def cores(framework: str, device: str, threads: int = 1) -> set | None:
    """The CPU cores a worker process of `framework` is held to, or None where it is not held.

    XLA:CPU runs a step's independent kernels, and JAX dispatches the next step, on threads
    that no thread count limits (the Eigen flag above bounds one pool of them): a JAX step on
    a 2-core machine ran on both, and its interleaved ratios spread 0.82-1.72 where one core
    gives 0.98-1.19. A JAX or Keras-on-JAX worker asked for `threads` threads is held to as many
    cores (the last ones: the first tends to take the interrupts), from its start, so every
    thread it makes inherits them.
    """
    if device != "cpu" or not threads or runner(framework).backend != "jax" or not hasattr(os, "sched_getaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    return set(allowed[-threads:]) if len(allowed) > threads else None
