"""Gradients reduced over two logical CPUs of a tf.distribute.MirroredStrategy (run by
test_tensorflow_reduce.py in a process of its own: the logical devices are set before
TensorFlow starts). Asserts here; prints the bytes per step as one JSON line."""

import json
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import ml_dtypes  # noqa: E402

import mixedpolicy as mp  # noqa: E402

for bad in (1.5, None):  # what is not two lists is refused with what was expected
    try:
        mp.tensorflow.all_reduce(bad, [tf.Variable(1.0)])
        raise AssertionError(f"all_reduce took grads={bad!r}")
    except TypeError as err:
        assert "expected a list, the gradients" in str(err), err
    for call in (lambda: mp.tensorflow.all_reduce([1.0], bad), lambda: mp.tensorflow.bytes_per_step(bad),
                 lambda: mp.tensorflow.bytes_per_step(["w"])):
        try:
            call()
            raise AssertionError(f"took variables={bad!r}")
        except TypeError as err:
            assert "as model.trainable_variables gives" in str(err), err

strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
rng = np.random.default_rng(0)
# per-replica gradients with many bits below bfloat16's and float16's precision
local = [rng.standard_normal((5, 3)).astype(np.float32) * 1e-2 for _ in range(2)]


def per_replica(ctx):
    return tf.constant(local[ctx.replica_id_in_sync_group])


def reduced(policy, dtype_of_variable=None):
    with strategy.scope():
        v = tf.Variable(np.zeros((5, 3), np.float32), name="layer/kernel")

    def fn(g):
        return mp.tensorflow.all_reduce([g], [v], policy)[0]

    g = strategy.experimental_distribute_values_from_function(per_replica)
    out = strategy.experimental_local_results(strategy.run(fn, args=(g,)))
    assert all(np.array_equal(out[0].numpy(), o.numpy()) for o in out)  # every replica the same
    return out[0].numpy()


# float32: the strategy's own SUM, bit for bit
plain = strategy.experimental_local_results(strategy.run(
    lambda g: tf.distribute.get_replica_context().all_reduce("sum", [g])[0],
    args=(strategy.experimental_distribute_values_from_function(per_replica),)))[0].numpy()
assert np.array_equal(reduced("mixed_bfloat16"), plain)
# bfloat16: each replica's gradient rounded to bfloat16, summed in bfloat16
bf = [x.astype(ml_dtypes.bfloat16) for x in local]
assert np.array_equal(reduced(mp.Policy("mixed_bfloat16", reduce_dtype="bfloat16")),
                      (bf[0] + bf[1]).astype(np.float32))
# float16: divided by the replica count before the cast, multiplied back after
h = [(x / 2).astype(np.float16) for x in local]
assert np.array_equal(reduced(mp.Policy("mixed_float16", reduce_dtype="float16")),
                      (h[0] + h[1]).astype(np.float32) * 2)
# a PolicyMap resolves by the variable's path: "layer" travels in bfloat16
by_path = mp.PolicyMap("float32", {"layer": mp.Policy("float32", reduce_dtype="bfloat16")})
assert np.array_equal(reduced(by_path), (bf[0] + bf[1]).astype(np.float32))
# float8 cannot travel through TensorFlow's collectives: refused, naming what can
try:
    reduced(mp.Policy("mixed_bfloat16", reduce_dtype="float8_e5m2"))
    raise AssertionError("float8 was not refused")
except ValueError as err:
    assert "carries float32, bfloat16, float16" in str(err), err


# Keras, custom loop: apply_gradients in the replica context; our optimizer sums in bfloat16
# (once: Keras's own float32 sum is left out), a plain Keras optimizer in float32.
def model_and_grads():
    x = rng.standard_normal((8, 4)).astype(np.float32)
    y = rng.standard_normal((8, 2)).astype(np.float32)
    return x, y


x, y = model_and_grads()


def train_once(make_optimizer, policy=None, poison=False):
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="dense")])
        model.set_weights([np.full((4, 2), 0.1, np.float32), np.zeros(2, np.float32)])
        if policy is not None:
            mp.apply_policy(model, policy)
        opt = make_optimizer()
        # built here, as Keras's own LossScaleOptimizer must be too: its integer variables
        # cannot be created inside strategy.run under tf.function
        opt.build(model.trainable_variables)

    def step(xs, ys):
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        if poison:  # one replica overflows
            xs = tf.where(tf.equal(replica, 1), xs * np.inf, xs)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum((tf.cast(model(xs), tf.float32) - ys) ** 2)
            scaled = opt.scale_loss(loss) if hasattr(opt, "scale_loss") else loss
        grads = tape.gradient(scaled, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    batch = next(iter(strategy.experimental_distribute_dataset(data)))
    strategy.run(tf.function(step), args=batch)
    return model, opt


def halves_grads():
    """Each replica's own gradient of the kernel (4 samples each), computed on the host."""
    w = np.full((4, 2), 0.1, np.float32)
    return [2 * x[i:i + 4].T @ (x[i:i + 4] @ w - y[i:i + 4]) for i in (0, 4)]


policy = mp.Policy("mixed_bfloat16", reduce_dtype="bfloat16")
ours, opt = train_once(lambda: mp.LossScaleOptimizer(keras.optimizers.SGD(1.0), policy=policy,
                                                     skip_nonfinite=False), policy)
assert opt.loss_scaling.startswith("pass-through") and opt._reduce_policy is not None
plain_model, _ = train_once(lambda: keras.optimizers.SGD(1.0), policy)
g = halves_grads()
kernel = ours.get_weights()[0]
summed_f32 = np.full((4, 2), 0.1, np.float32) - plain_model.get_weights()[0]
# bfloat16 compute makes both differ from the host figures; the reduce must differ from float32
assert not np.array_equal(kernel, plain_model.get_weights()[0])
assert np.allclose(0.1 - kernel, summed_f32, rtol=2e-2), (0.1 - kernel, summed_f32)
assert np.allclose(summed_f32, g[0] + g[1], rtol=5e-2)  # one sum, not two (Keras's left out)
# compile's optimizer: apply_policy with a reduce dtype makes compile wrap it with ours
with strategy.scope():
    compiled = mp.apply_policy(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]), policy)
    compiled.compile(keras.optimizers.SGD(0.1), "mse")
assert compiled.optimizer._reduce_policy is not None, type(compiled.optimizer)
compiled.fit(x, y, batch_size=8, epochs=2, verbose=0)
assert np.isfinite(compiled.get_weights()[0]).all()

# an overflow on one replica makes every replica skip, with a float16 reduce
fp16 = mp.Policy("mixed_float16", reduce_dtype="float16")
poisoned, opt16 = train_once(lambda: mp.LossScaleOptimizer(keras.optimizers.SGD(1.0), policy=fp16), fp16,
                             poison=True)
assert opt16.num_skipped_steps == 1 and opt16.loss_scale == 2.0**14, (opt16.num_skipped_steps, opt16.loss_scale)
assert np.array_equal(poisoned.get_weights()[0], np.full((4, 2), 0.1, np.float32))

variables = ours.trainable_variables
print(json.dumps({d: mp.tensorflow.bytes_per_step(variables, mp.Policy("float32", reduce_dtype=d))
                  for d in ("float32", "bfloat16", "float16")}))
