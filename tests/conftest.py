"""Fixtures shared by the whole suite.

- ``backend``: parametrised over every adapter mixedpolicy ships, so a failure
  reads ``test_x[torch]``. A backend named in ``MIXEDPOLICY_EXPECT_BACKENDS``
  (``make test`` sets it) that cannot be imported fails; others are skipped.
- every test leaves the global policy as it found it.
- JAX runs with strict dtype promotion, so a silent float16 -> float32 upcast fails.
"""

from __future__ import annotations

import importlib
import os

import pytest

os.environ.setdefault("JAX_NUMPY_DTYPE_PROMOTION", "strict")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import mixedpolicy  # noqa: E402
from mixedpolicy import _registry  # noqa: E402

# tests/backends/keras/suite runs once per Keras backend, started by tests/backends/keras/test_keras.py with
# MIXEDPOLICY_KERAS_SUITE set (Keras picks its backend per process); the main run skips it.
collect_ignore = [] if os.environ.get("MIXEDPOLICY_KERAS_SUITE") else ["backends/keras/suite"]
# The *_worker.py scripts run as processes of their own (two DDP ranks, four JAX host devices,
# a MirroredStrategy): --doctest-modules would import them, running their whole body in the
# pytest process (half a minute per xdist worker) and leaving their XLA_FLAGS behind.
collect_ignore_glob = ["*_worker.py"]


def expected_backends() -> set[str]:
    raw = os.environ.get("MIXEDPOLICY_EXPECT_BACKENDS", "numpy")
    return {name.strip() for name in raw.split(",") if name.strip()}


def require_module(module: str, backend: str | None = None):
    """Imports a framework, failing if CI expects it and skipping otherwise."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        if (backend or module) in expected_backends():
            pytest.fail(f"backend {backend or module!r} is expected "
                        f"(MIXEDPOLICY_EXPECT_BACKENDS) but {module!r} failed to import: {err}")
        pytest.skip(f"{module} is not installed")


@pytest.fixture(params=_registry.array_backends())
def backend(request):
    """The array operations of one framework, its framework imported."""
    name = request.param
    require_module(_registry.entry(name).gate, name)
    return _registry.array_ops(name)


@pytest.fixture(autouse=True)
def _restore_global_policy():
    before = mixedpolicy.global_policy()
    yield
    mixedpolicy.set_global_policy(before)


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace):
    import numpy as np

    doctest_namespace["np"] = np
    doctest_namespace["mp"] = mixedpolicy
