"""Raw TensorFlow: policies on tf.Module, the loss-scale optimizer in GradientTape loops and
under MirroredStrategy with two logical CPUs (in a fresh process: devices are set at start-up)."""

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import require_module

pytestmark = pytest.mark.slow  # starts processes of its own (see docs/contributing.md)

BODY = textwrap.dedent("""
    import os, warnings
    os.environ["KERAS_BACKEND"] = "tensorflow"
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import numpy as np
    import keras
    import mixedpolicy as mp

    class Dense(tf.Module):
        def __init__(self, i, o, seed):
            super().__init__()
            self.w = tf.Variable(tf.random.stateless_normal((i, o), (seed, 0)) * 0.3)
            self.b = tf.Variable(tf.zeros(o))

        def __call__(self, x):
            return x @ self.w + self.b

    class MLP(tf.Module):
        def __init__(self):
            super().__init__()
            self.hidden = Dense(8, 16, 1)
            self.head = Dense(16, 3, 2)

        def __call__(self, x):
            return self.head(tf.nn.relu(self.hidden(x)))

    x = tf.random.stateless_normal((4, 8), (3, 0))

    # per-module policies; float32 variables; math in the compute dtype, also under XLA
    m = mp.apply_policy(MLP(), "mixed_bfloat16", {"head": "float32"})
    rows = {r.path: r for r in mp.describe(m)}
    assert rows["hidden"].compute_dtype == "bfloat16" and rows["head"].source == "map key 'head'"
    assert m.hidden(x).dtype == tf.bfloat16 and m(x).dtype == tf.float32
    assert tf.function(m, jit_compile=True)(x).dtype == tf.float32
    assert isinstance(m.hidden, Dense) and type(m.hidden).__name__ == "Dense"
    assert all(v.dtype == tf.float32 for v in m.trainable_variables)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(m(x))
    assert all(g.dtype == tf.float32 for g in tape.gradient(loss, m.trainable_variables))

    # the same math as casting by hand
    plain = MLP()
    def by_hand(x):
        h = tf.nn.relu(tf.cast(x, tf.bfloat16) @ tf.cast(plain.hidden.w, tf.bfloat16)
                       + tf.cast(plain.hidden.b, tf.bfloat16))
        return tf.cast(h, tf.float32) @ plain.head.w + plain.head.b
    np.testing.assert_array_equal(m(x).numpy(), by_hand(x).numpy())

    # float32 is plain TensorFlow: no class is swapped, results bit for bit
    f32 = mp.apply_policy(MLP(), "float32")
    assert type(f32) is MLP and type(f32.hidden) is Dense
    np.testing.assert_array_equal(f32(x).numpy(), MLP()(x).numpy())

    # pure policies store the variables in half precision; remove_policy restores them
    pure = mp.apply_policy(MLP(), "bfloat16")
    assert pure.hidden.w.dtype == tf.bfloat16 and pure(x).dtype == tf.bfloat16
    mp.remove_policy(pure)
    assert pure.hidden.w.dtype == tf.float32 and type(pure.hidden) is Dense
    assert {r.source for r in mp.describe(pure)} == {"no policy applied"}

    # clear errors
    half = MLP()
    half.hidden.w = tf.Variable(tf.zeros((8, 16), tf.float16))
    try:
        mp.apply_policy(half, "mixed_float16")
        raise AssertionError("expected a ValueError")
    except ValueError as err:
        assert "'hidden.w' is already float16" in str(err), err
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mp.apply_policy(MLP(), "mixed_float16", {"hiden": "float32"})
    assert any("'hiden' matches no layer path" in str(w.message) and "hidden" in str(w.message)
               for w in caught)

    # the loss-scale optimizer in a GradientTape loop under tf.function
    model = mp.apply_policy(MLP(), "mixed_float16")
    opt = mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=1024.0)

    @tf.function
    def step(x, poison):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.cast(model(x), tf.float32) ** 2)
            loss = loss * tf.where(poison, np.inf, 1.0)   # multiplicative poison
            scaled = opt.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    before = [v.numpy() for v in model.trainable_variables]
    step(x, tf.constant(True))
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, model.trainable_variables))
    assert opt.num_skipped_steps == 1 and opt.loss_scale == 512.0 and int(opt.iterations.numpy()) == 0
    step(x, tf.constant(False))
    assert opt.num_skipped_steps == 1 and int(opt.iterations.numpy()) == 1 and not opt.last_step_skipped

    # MirroredStrategy over two logical CPUs: replica 1 overflows, both skip
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = mp.apply_policy(MLP(), "mixed_float16")
        opt = mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=1024.0)
        opt.build(model.trainable_variables)

    @tf.function
    def distributed_step(x, poison):
        def replica(x, poison):
            rid = tf.distribute.get_replica_context().replica_id_in_sync_group
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.cast(model(x), tf.float32) ** 2)
                loss = loss * tf.where(tf.logical_and(poison, tf.equal(rid, 1)), np.inf, 1.0)
                scaled = opt.scale_loss(loss)
            grads = tape.gradient(scaled, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
        strategy.run(replica, args=(x, poison))

    assert strategy.num_replicas_in_sync == 2
    before = [v.numpy() for v in model.trainable_variables]
    distributed_step(x, tf.constant(True))
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, model.trainable_variables))
    assert opt.num_skipped_steps == 1 and opt.loss_scale == 512.0
    distributed_step(x, tf.constant(False))
    assert opt.num_skipped_steps == 1 and int(opt.iterations.numpy()) == 1
    assert not all(np.array_equal(a, v.numpy()) for a, v in zip(before, model.trainable_variables))

    # (conformance review) four threads calling one module at once leave its variables in place
    import threading
    layer = mp.apply_policy(Dense(8, 8, 1), "mixed_bfloat16")
    errors = []
    def work():
        try:
            for _ in range(50):
                assert layer(tf.ones((2, 8))).dtype == tf.bfloat16
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

    # a reduce dtype tf.distribute cannot carry is refused, nothing applied
    fresh = MLP()
    try:
        mp.apply_policy(fresh, mp.Policy("mixed_bfloat16", reduce_dtype="float8_e5m2"))
        raise AssertionError("expected a ValueError")
    except ValueError as err:
        assert "reduced across replicas in float8_e5m2" in str(err) and "nothing was applied" in str(err), err
    assert fresh.hidden.w.dtype == tf.float32 and "_mixedpolicy" not in vars(fresh)

    # a Keras optimizer cannot see a tf.Module: made without a policy beside a float16 one, the
    # wrapper that scales nothing says so, with the fix; given the policy, it scales
    half = mp.apply_policy(MLP(), "mixed_float16")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        unscaled = mp.LossScaleOptimizer(keras.optimizers.SGD(0.1))
        scaled = mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), policy="mixed_float16")
    said = [str(w.message) for w in caught if "scales nothing" in str(w.message)]
    assert len(said) == 1 and "apply_policy gave MLP 'mixed_float16'" in said[0], said
    assert not unscaled.loss_scaling.startswith("dynamic") and scaled.loss_scaling.startswith("dynamic")
    print("ok")
""")


def test_tensorflow_modules_tape_loops_and_mirrored_strategy():
    require_module("tensorflow")
    require_module("keras")
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-c", BODY], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert proc.stdout.rstrip().endswith("ok")


def test_the_finite_check_reads_large_tensors_in_place_and_finds_every_non_finite_value():
    """A float32 tensor of more than `READ_ALONE_FROM` values is read by a product with zeros,
    smaller ones (and other dtypes) through a mask: eager or in a graph, each finds inf, -inf and
    NaN wherever it is, and values at the top of the range are finite."""
    import numpy as np

    tf = require_module("tensorflow")
    from mixedpolicy.backends.tensorflow.arrays import TensorFlowArrays

    check = TensorFlowArrays().all_finite
    shapes = [((300, 256), tf.float32), ((20000,), tf.float64), ((1000, 17), tf.float32), ((4096, 8), tf.bfloat16),
              ((64,), tf.float32)]
    tensors = [tf.fill(shape, tf.constant(3.0e38 if dtype != tf.bfloat16 else 3.3e38, dtype)) for shape, dtype in shapes]
    for run in (check, tf.function(check)):
        assert bool(run(tensors))
        for i, (shape, dtype) in enumerate(shapes):
            for bad in (np.inf, -np.inf, np.nan):
                values = np.ones(shape, np.float64)
                values.reshape(-1)[-1] = bad
                poisoned = list(tensors)
                poisoned[i] = tf.constant(values, dtype)
                assert not bool(run(poisoned)), (shape, dtype, bad)
    # sizes known only at run time (an embedding's gradient values in a graph): through the mask
    unknown = tf.function(check, input_signature=[[tf.TensorSpec([None, 256], tf.float32), tf.TensorSpec(None, tf.float32)]])
    assert bool(unknown([tensors[0], tensors[2]]))
    assert not bool(unknown([tensors[0], tf.constant([[1.0, np.nan]])]))
