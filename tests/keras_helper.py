"""Runs a piece of test code under each Keras backend, one process per backend.

Keras picks its backend once per process (``KERAS_BACKEND``), so a test that must
hold on jax, torch and tensorflow runs its body in three fresh interpreters.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

KERAS_BACKENDS = ("jax", "torch", "tensorflow")


def run_under_keras_backends(code: str, backends=KERAS_BACKENDS, timeout: float = 600) -> dict[str, str]:
    """Runs `code` once per Keras backend; returns each run's stdout.

    Raises:
      AssertionError: a run exited non-zero, with its output in the message.
    """
    results = {}
    for name in backends:
        env = dict(os.environ, KERAS_BACKEND=name, TF_CPP_MIN_LOG_LEVEL="2",
                   JAX_NUMPY_DTYPE_PROMOTION=os.environ.get("JAX_NUMPY_DTYPE_PROMOTION", "strict"))
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise AssertionError(f"under KERAS_BACKEND={name} the code exited {proc.returncode}:\n"
                                 f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr[-4000:]}")
        results[name] = proc.stdout
    return results
