"""Gradients reduced in the policy's reduce dtype over tf.distribute replicas (mirrored_worker.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require_module


@pytest.mark.slow
def test_mirrored_strategy_reduces_in_the_reduce_dtype_and_skips_together():
    """On two logical CPUs: float32 is the strategy's own sum bit for bit; bfloat16 and float16
    (pre-divided) equal the sums computed by hand in those dtypes; a PolicyMap resolves by
    variable path; float8 is refused naming what TensorFlow carries; a Keras custom loop and
    `fit` with our optimizer sum once, in bfloat16; an overflow on one replica makes both
    skip (asserts in mirrored_worker.py); bytes per step 4 : 2 : 2."""
    require_module("tensorflow")
    require_module("keras")
    worker = Path(__file__).with_name("mirrored_worker.py")
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([sys.executable, str(worker)], capture_output=True, text=True, timeout=300,
                          cwd=worker.parent, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures == {"float32": 40, "bfloat16": 20, "float16": 20}  # 4x2 kernel + 2 bias


def test_a_tf_module_takes_the_reduce_dtypes_tensorflow_carries_and_refuses_the_others():
    tf = require_module("tensorflow")
    import mixedpolicy as mp

    class Net(tf.Module):
        def __init__(self):
            super().__init__()
            self.w = tf.Variable(tf.ones((2, 2)))

        def __call__(self, x):
            return x @ self.w

    net = mp.apply_policy(Net(), mp.Policy("mixed_bfloat16", reduce_dtype="bfloat16"))
    assert mp.describe(net)[0].reduce_dtype == "bfloat16"
    mp.remove_policy(net)
    with pytest.raises(ValueError, match=r"float8_e4m3fn, which mixedpolicy cannot carry through "
                                         r"tf.distribute \(it carries float32, bfloat16, float16"):
        mp.apply_policy(net, mp.Policy("mixed_bfloat16", reduce_dtype="e4m3"))
    g = tf.constant([1.0 + 2.0**-12, 3.0])
    # one replica (no strategy): nothing travels, nothing is rounded
    assert mp.tensorflow.all_reduce([g], [net.w], "params=float32,compute=bfloat16,reduce=bfloat16")[0] is g
    with tf.distribute.MirroredStrategy(["/cpu:0"]).scope():
        with pytest.raises(RuntimeError, match="cross-replica context; call it inside strategy.run"):
            mp.tensorflow.all_reduce([g], [net.w])
    assert mp.tensorflow.bytes_per_step([net.w], "float32") == 16


def test_a_class_key_that_decides_a_reduce_dtype_is_refused_by_name():
    tf = require_module("tensorflow")
    import mixedpolicy as mp

    class Block(tf.Module):
        pass

    policy = mp.PolicyMap("float32", {Block: mp.Policy("float32", reduce_dtype="bfloat16")})
    with pytest.raises(ValueError, match=r"layer-class keys \[.*Block'?\] for reducing gradients through "
                                         r"tf.distribute.*by path or glob"):
        mp.tensorflow.bytes_per_step([tf.Variable(tf.ones(2))], policy)


def test_a_class_key_reaches_the_layers_of_the_model_given_and_paths_are_describes():
    """One layer chain for every engine: with model=, a tf.Module's gradients resolve at the
    paths `describe` prints for it ("body.0"), and a class key sets the reduce dtype of that
    class's layers, as under DDP and JAX; a variable of another model is refused."""
    tf = require_module("tensorflow")
    import mixedpolicy as mp

    class Dense(tf.Module):
        def __init__(self, a, b):
            super().__init__()
            self.w = tf.Variable(tf.ones((a, b)), name="w")
            self.b = tf.Variable(tf.zeros(b), name="b")

    class Norm(tf.Module):
        def __init__(self, n):
            super().__init__()
            self.scale = tf.Variable(tf.ones(n), name="scale")

    class Net(tf.Module):
        def __init__(self):
            super().__init__()
            self.body = [Dense(4, 8), Norm(8)]
            self.head = Dense(8, 2)

    net = Net()
    variables = net.trainable_variables
    f32 = mp.tensorflow.bytes_per_step(variables, "float32")
    by_class = mp.PolicyMap("float32", {Dense: mp.Policy("float32", reduce_dtype="bfloat16")})
    dense_values = 4 * 8 + 8 + 8 * 2 + 2  # both Dense layers' kernels and biases
    assert mp.tensorflow.bytes_per_step(variables, by_class, model=net) == f32 - 2 * dense_values
    by_path = mp.PolicyMap("float32", {"head": mp.Policy("float32", reduce_dtype="bfloat16")})
    assert {row.path for row in mp.describe(net)} >= {"head", "body.0", "body.1"}
    assert mp.tensorflow.bytes_per_step(variables, by_path, model=net) == f32 - 2 * (8 * 2 + 2)
    # without the model, the same key names the variables' own names: nothing is called "head"
    assert mp.tensorflow.bytes_per_step(variables, by_path) == f32
    with pytest.raises(ValueError, match=r"not in model=Net"):
        mp.tensorflow.bytes_per_step([tf.Variable(tf.ones(3))], by_class, model=net)
    with pytest.raises(TypeError, match=r"Received model=.*expected the tf.Module or Keras model"):
        mp.tensorflow.bytes_per_step(variables, by_class, model=[1, 2])
    # under a strategy's replica context the same resolution runs (one replica: nothing travels)
    strategy = tf.distribute.get_strategy()
    grads = [tf.ones_like(v) for v in variables]
    out = strategy.run(lambda: mp.tensorflow.all_reduce(grads, variables, by_class, model=net))
    assert all(tf.reduce_all(a == b) for a, b in zip(out, grads))
