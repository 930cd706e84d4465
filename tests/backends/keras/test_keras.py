"""Keras 3 under every backend: the global policy set before Keras is imported (a fresh process
per backend, `keras_helper`), and tests/backends/keras/suite in one pytest process per backend
(layers, the loss-scale optimizer, the drop-in regressions, the example)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require_module
from keras_helper import KERAS_BACKENDS, run_under_keras_backends

pytestmark = pytest.mark.slow  # starts processes of its own (see docs/contributing.md)

ROOT = Path(__file__).resolve().parents[3]

_PRELUDE = """
import os, sys, tempfile, warnings
import numpy as np
"""

GLOBAL_POLICY = _PRELUDE + """
import mixedpolicy as mp

# set before Keras is imported: Keras is not imported for it, and follows once it is
mp.set_global_policy("mixed_float16")
assert "keras" not in sys.modules
import importlib.util
assert importlib.util.find_spec("keras") is not None  # a mere lookup does not disarm the hook
assert "keras" not in sys.modules
import keras
assert keras.config.dtype_policy().name == "mixed_float16", keras.config.dtype_policy()
assert keras.layers.Dense(2).dtype_policy.name == "mixed_float16"

# set after the import
mp.set_global_policy("bf16-mixed")
assert keras.config.dtype_policy().name == "mixed_bfloat16"
import threading
built = []  # a layer built in a worker thread follows it, as Keras's own setter reaches threads
worker = threading.Thread(target=lambda: built.append(keras.layers.Dense(2).dtype_policy.name))
worker.start(); worker.join()
assert built == ["mixed_bfloat16"], built
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    mp.set_global_policy("p=f32,c=bf16,o=f32")
assert keras.config.dtype_policy().name == "mixed_bfloat16"
assert "output" in str(caught[0].message), caught
mp.set_global_policy(None)
assert keras.config.dtype_policy().name == "float32"

# a policy_scope is per thread: it does not change Keras's global policy
with mp.policy_scope("mixed_float16"):
    assert keras.config.dtype_policy().name == "float32"

# conversions both ways
assert mp.Policy("mixed_bfloat16").to_keras().name == "mixed_bfloat16"
assert mp.Policy.from_keras(keras.DTypePolicy("mixed_float16")) == mp.Policy("mixed_float16")
print("ok", keras.backend.backend())  # each process really runs the backend asked for
"""

@pytest.fixture(autouse=True)
def _keras():
    require_module("keras")


def test_the_global_policy_set_before_keras_is_imported_under_every_backend():
    # its own process per backend: the import order is the point (Keras imported first, then
    # mixedpolicy: the suite's fresh-process loads in suite/test_drop_in.py check it too)
    out = run_under_keras_backends(GLOBAL_POLICY)
    assert all(out[b].rstrip().endswith(f"ok {b}") for b in KERAS_BACKENDS), out


@pytest.mark.parametrize("backend", KERAS_BACKENDS)
def test_keras_suite_under_each_backend(backend):
    """tests/backends/keras/suite, in one pytest process per Keras backend (as Keras's own CI runs)."""
    env = dict(os.environ, KERAS_BACKEND=backend, MIXEDPOLICY_KERAS_SUITE="1", TF_CPP_MIN_LOG_LEVEL="3")
    # --disable-warnings: Keras's thousands of deprecation warnings would push a failure's
    # traceback out of the tail this test shows
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--disable-warnings",
                           str(ROOT / "tests" / "backends" / "keras" / "suite")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"KERAS_BACKEND={backend}\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"


def test_a_keras_2_object_gets_a_clear_error():
    import mixedpolicy as mp

    Legacy = type("Sequential", (), {"__module__": "tf_keras.src.engine.sequential"})
    with pytest.raises(TypeError, match="Keras 2 object.*Keras 3"):
        mp.apply_policy(Legacy())
    Optimizer = type("Adam", (), {"__module__": "tf_keras.src.optimizers.adam"})
    with pytest.raises(TypeError, match="Keras 2 object.*Keras 3"):
        mp.LossScaleOptimizer(Optimizer())
