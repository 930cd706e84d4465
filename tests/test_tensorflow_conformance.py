"""Regressions from the conformance review, tf.Module: threads, and remove_policy restoring values.

Runs in a fresh process with KERAS_BACKEND=tensorflow (TensorFlow fixes its devices at start-up).
"""

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import require_module

pytestmark = pytest.mark.slow  # starts processes of its own (see docs/contributing.md)

BODY = textwrap.dedent("""
    import threading
    import numpy as np
    import tensorflow as tf
    import mixedpolicy as mp

    class Dense(tf.Module):
        def __init__(self, i, o, seed):
            super().__init__()
            self.w = tf.Variable(tf.random.stateless_normal((i, o), (seed, 0)) * 0.3)
            self.b = tf.Variable(tf.zeros(o))

        def __call__(self, x):
            return x @ self.w + self.b

    # four threads calling one module at once leave its variables in place
    layer = mp.apply_policy(Dense(8, 8, 1), "mixed_bfloat16")
    x = tf.ones((2, 8))
    errors = []
    def work():
        try:
            for _ in range(50):
                assert layer(x).dtype == tf.bfloat16
        except Exception as err:  # noqa: BLE001
            errors.append(err)
    threads = [threading.Thread(target=work) for _ in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors, errors
    assert len(layer.trainable_variables) == 2, layer.trainable_variables
    assert all(isinstance(v, tf.Variable) for v in (layer.w, layer.b))

    # a pure policy, removed, gives back the unrounded values (trained ones are kept)
    layer = Dense(4, 3, 2)
    before = layer.w.numpy().copy()
    mp.apply_policy(layer, "bfloat16")
    layer.b.assign(tf.constant([0.5, 0.0, 0.0], tf.bfloat16))
    mp.remove_policy(layer)
    assert layer.w.dtype == tf.float32 and np.array_equal(layer.w.numpy(), before)
    assert layer.b.numpy()[0] == 0.5
    print("ok")
""")


def test_tf_module_threads_and_restore():
    require_module("tensorflow")
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-c", BODY], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-4000:]
