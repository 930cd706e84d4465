"""Keras 3's keras.distribution.DataParallel (JAX backend, two host devices) under a mixedpolicy
policy and LossScaleOptimizer, in a process of its own (the devices are set before JAX starts)."""

import os
import subprocess
import sys

import pytest

from conftest import require_module

BODY = r"""
import numpy as np, keras
import mixedpolicy as mp
from mixedpolicy.backends.keras.optimizer import LossScaleOptimizer

devices = keras.distribution.list_devices("cpu")
assert len(devices) == 2, devices
keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
rng = np.random.default_rng(0)
x = rng.standard_normal((256, 8)).astype("float32")
y = (x.sum(1) > 0).astype("int32")
model = mp.apply_policy(keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu"),
                                          keras.layers.Dense(2)]), "mixed_float16")
model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
history = model.fit(x, y, batch_size=32, epochs=5, verbose=0)
assert isinstance(model.optimizer, LossScaleOptimizer), type(model.optimizer)
assert model.optimizer.loss_scale == 2.0**15 and model.optimizer.num_skipped_steps == 0
assert history.history["accuracy"][-1] > 0.85, history.history
kernel = model.layers[0].kernel
assert kernel.dtype == "float32" and kernel.value.sharding.is_fully_replicated
# the batch is split over the devices, the weights replicated: XLA reduces in float32,
# so a policy asking for another reduce dtype is refused, naming what carries one
try:
    mp.apply_policy(keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)]),
                    mp.Policy("mixed_bfloat16", reduce_dtype="bfloat16"))
    raise AssertionError("a bfloat16 reduce was not refused")
except ValueError as err:
    assert "cannot carry through Keras on jax" in str(err), err
print("ok")
"""


@pytest.mark.slow
def test_data_parallel_on_two_devices_trains_under_a_policy_and_our_loss_scale_optimizer():
    require_module("keras")
    require_module("jax")
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, "-c", BODY], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]
