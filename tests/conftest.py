"""Fixtures shared by the whole suite.

- ``backend``: parametrised over every adapter mixedpolicy ships, so a failure
  reads ``test_x[torch]``. A backend named in ``MIXEDPOLICY_EXPECT_BACKENDS``
  (``make test`` sets it) that cannot be imported fails; others are skipped.
- every test leaves the global policy as it found it.
- JAX runs with strict dtype promotion, so a silent float16 -> float32 upcast fails.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import mmap
import os

import pytest

os.environ.setdefault("JAX_NUMPY_DTYPE_PROMOTION", "strict")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# One intra-op thread per process: `make test` runs two pytest workers on a 2-core machine, and
# a framework's own thread pool on top of them (torch's OpenMP threads, TensorFlow's and XLA's
# pools) oversubscribes the cores, where spinning threads slow a step many times over. Set
# before any framework is imported; the processes tests start inherit it. A test that needs
# more threads sets them itself.
for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
    os.environ.setdefault(_name, "1")


def _xla_flags() -> str:
    """XLA:CPU set to compile fast: most of a JAX test's time is compiling small programs it runs
    a few times, and a clean clone (CI) starts with an empty compilation cache. LLVM at its
    lowest optimization level (the Keras-on-JAX suite 196 -> 145 s, with the one thread above),
    and XLA's older loop emitters where this jaxlib still has them (the MLIR fusion emitters
    cost a third more to compile a small program: the JAX flax, optax and memory tests 59 -> 43 s
    with an empty cache). XLA aborts the process on a flag it does not know, so that one is added
    only for the jaxlib 0.10 this project pins (constraints.txt) and only where its library names
    it: jaxlib 0.11.2's library still holds the name but its parser refuses the flag, and every
    JAX test died at its first compile on the GPU machine's jaxlib. The numerics are IEEE either
    way, and no test compares programs compiled under different flags."""
    flags = "--xla_cpu_multi_thread_eigen=false --xla_backend_optimization_level=0"
    found = importlib.util.find_spec("jaxlib")
    library = os.path.join(list(found.submodule_search_locations or [""])[0], "libjax_common.so") if found else ""
    try:
        pinned = importlib.metadata.version("jaxlib").split(".")[:2] == ["0", "10"]
    except importlib.metadata.PackageNotFoundError:
        pinned = False
    if pinned and os.path.isfile(library):
        with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as text:
            if text.find(b"xla_cpu_use_fusion_emitters") >= 0:
                flags += " --xla_cpu_use_fusion_emitters=false"
    return flags


if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = _xla_flags()
# XLA's compiled programs, shared on disk by the suite's processes (the pytest workers and every
# process a test starts inherit it): bench tests compile the same steps again in each run (the
# native side and the float32 reference: a second JAX run 11 -> 5 s), and compiling is most of
# their time on a CPU. The cache is keyed on the program, the flags and the versions, so a hit runs
# the very executable a fresh compile would give; .cache/ is ignored by git.
_JAX_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "jax")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _JAX_CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

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
    # a float16 model one test made (kept alive by a cycle until the collector runs) does not
    # make the next test's pass-through wrapper warn
    mixedpolicy.api._FLOAT16.clear()


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace):
    import numpy as np

    doctest_namespace["np"] = np
    doctest_namespace["mp"] = mixedpolicy


def pytest_collection_modifyitems(config, items):
    """The tests that start processes of their own (marked slow: a Keras backend's suite, the
    bench, DDP ranks) first, in their order: xdist's work stealing hands a worker that runs out
    the queued tests from the end of another's queue, so the long ones are shared out early and
    neither worker is left finishing a minute-long test alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


_MODULES_FROZEN = [0]  # len(sys.modules) when the collector last froze what there was


def pytest_runtest_setup(item):
    """What a framework's import makes (TensorFlow, Keras, transformers: millions of objects)
    lives as long as the process, and tests import frameworks as they need them: once a test
    has imported a few hundred modules more, `gc.freeze` takes everything alive out of the
    collector's passes. Keras calls `gc.collect()` each time a layer drops a variable attribute
    (10 times in one `model.quantize`), Accelerate at each Hugging Face Trainer's start and end:
    over the unfrozen heap of a worker that had run a few hundred tests a call took 0.3-0.6 s
    (24 such in the Trainer tests: 15 s -> 0.6 s). Cyclic garbage made after a freeze is still
    collected; what a freeze holds (the few that happen, after imports) stays for the process."""
    import gc
    import sys

    if len(sys.modules) > _MODULES_FROZEN[0] + 200:
        gc.freeze()
        _MODULES_FROZEN[0] = len(sys.modules)
