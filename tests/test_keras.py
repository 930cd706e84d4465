"""Keras 3: the global policy whatever the import order, per-layer maps, the loss-scale optimizer.

Every test body runs under each Keras backend (jax, torch, tensorflow), each in a
fresh process (`keras_helper`).
"""

import pytest

from conftest import require_module
from keras_helper import KERAS_BACKENDS, run_under_keras_backends

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
print("ok")
"""

PER_LAYER = _PRELUDE + """
import keras
import mixedpolicy as mp

x = np.random.default_rng(0).normal(size=(4, 8)).astype("float32")

def make(name="net", built=True):
    block = keras.Sequential([keras.layers.Dense(16, name="dense"),
                              keras.layers.LayerNormalization(name="norm")], name="block")
    head = [keras.Input((8,))] if built else []  # with an Input, Sequential builds at once
    return keras.Sequential(head + [keras.layers.Dense(16, name="embed"), block,
                                    keras.layers.Dense(3, name="head")], name=name)

def rows(model):
    return {r.path: r for r in mp.describe(model)}

# before build: path, glob, class, inheritance and the norm rule
model = make(built=False)
mp.apply_policy(model, "mixed_bfloat16", {"net/head": "float32", "*/block": "mixed_float16"})
table = rows(model)
assert table["net/embed"].compute_dtype == "bfloat16" and table["net/embed"].source == "map default"
assert table["net/head"].policy == mp.Policy("float32") and table["net/head"].source == "map key 'net/head'"
assert table["net/block/dense"].compute_dtype == "float16", table
assert "inherited from 'net/block'" in table["net/block/dense"].source
# the norm keeps float32 variables and statistics and hands on the surrounding compute dtype
assert table["net/block/norm"].policy == mp.Policy("mixed_float16"), table["net/block/norm"]
assert table["net/block/norm"].source == "built-in rule: normalization"
assert model(x).dtype == "float32" or str(model(x).dtype).endswith("float32")
embed_out = model.get_layer("embed")(x)
assert keras.backend.standardize_dtype(embed_out.dtype) == "bfloat16"
norm = model.get_layer("block").get_layer("norm")
assert keras.backend.standardize_dtype(norm(keras.ops.ones((2, 16), "float16")).dtype) == "float16"
assert keras.backend.standardize_dtype(norm.gamma.dtype) == "float32"
assert all(keras.backend.standardize_dtype(w.dtype) == "float32" for w in model.weights)

by_class = rows(mp.apply_policy(make(), "mixed_float16", {keras.layers.LayerNormalization: "mixed_float16"}))
assert by_class["net/block/norm"].policy == mp.Policy("mixed_float16")
assert by_class["net/block/norm"].source.startswith("map key keras")

# after build: a mixed policy keeps the float32 variables and applies
built = make()
built(x)
mp.apply_policy(built, "mixed_float16")
assert keras.backend.standardize_dtype(built.get_layer("embed")(x).dtype) == "float16"
# a pure policy would need new variables: refused, nothing changed
try:
    mp.apply_policy(built, "bfloat16")
    raise AssertionError("expected a ValueError")
except ValueError as err:
    assert "cannot change the dtype of existing variables" in str(err), err
assert built.get_layer("embed").dtype_policy.name == "mixed_float16"

# a pure policy before build stores the variables in half precision (norms in float32)
pure = mp.apply_policy(make(built=False), "bfloat16")
pure(x)
assert keras.backend.standardize_dtype(pure.get_layer("embed").kernel.dtype) == "bfloat16"
assert keras.backend.standardize_dtype(pure.get_layer("block").get_layer("norm").gamma.dtype) == "float32"

# remove_policy restores what was there
mp.remove_policy(built)
assert {r.policy.name for r in mp.describe(built)} == {"float32"}
assert {r.source for r in mp.describe(built)} == {"no policy applied"}

# what Keras cannot express is refused with the fix
try:
    mp.apply_policy(make(), "p=f32,c=bf16,o=f32")
    raise AssertionError("expected a ValueError")
except ValueError as err:
    assert "Keras layers output their compute dtype" in str(err)

# a key that matches nothing warns with the nearest paths
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    mp.apply_policy(make(), "mixed_float16", {"net/haed": "float32"})
assert any("'net/haed' matches no layer path" in str(w.message) and "net/head" in str(w.message)
           for w in caught), [str(w.message) for w in caught]

# compile wraps a plain optimizer in the bounded loss-scale optimizer under any float16
from mixedpolicy.backends.keras_optimizer import LossScaleOptimizer
m = mp.apply_policy(make(), "float32", {"net/embed": "mixed_float16"})
m.compile(optimizer="sgd", loss="mse")
assert isinstance(m.optimizer, LossScaleOptimizer), type(m.optimizer)
mp.set_global_policy("mixed_float16")
g = make("global_net")
assert g.dtype_policy.name == "mixed_float16"
g.compile(keras.optimizers.SGD(0.1), loss="mse")
assert isinstance(g.optimizer, LossScaleOptimizer), type(g.optimizer)
# Keras's own, passed explicitly, is kept as it is
g.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
assert type(g.optimizer) is keras.optimizers.LossScaleOptimizer
mp.set_global_policy(None)
print("ok")
"""

KERAS_OWN_TESTS = _PRELUDE + """
import unittest
import keras.src.optimizers.loss_scale_optimizer_test as keras_tests
from mixedpolicy.backends.keras_optimizer import LossScaleOptimizer

keras_tests.LossScaleOptimizer = LossScaleOptimizer
# Every one of Keras's own tests, through the class and through the factory.
for under_test in (LossScaleOptimizer, mp.LossScaleOptimizer):
    keras_tests.LossScaleOptimizer = under_test
    suite = unittest.TestLoader().loadTestsFromTestCase(keras_tests.LossScaleOptimizerTest)
    result = unittest.TextTestRunner(stream=sys.stdout, verbosity=0).run(suite)
    assert result.wasSuccessful() and result.testsRun >= 25, (under_test, result.failures, result.errors)
# the settings Keras cannot express travel only where they are set, and come back
config = LossScaleOptimizer(keras.optimizers.SGD(0.5), 3.0, 2, name="t", min_scale=0.5).get_config()
assert set(config) == {"name", "inner_optimizer", "initial_scale", "dynamic_growth_steps", "min_scale"}
again = mp.LossScaleOptimizer.from_config(config)
assert (again.initial_scale, again.dynamic_growth_steps, again._config.min_scale) == (3.0, 2, 0.5)
static = LossScaleOptimizer(keras.optimizers.SGD(0.5), loss_scale=mp.StaticLossScale(8.0))
assert LossScaleOptimizer.from_config(static.get_config())._config == mp.StaticLossScale(8.0)
# a config written by Keras's own LossScaleOptimizer reads back, and ours reads in Keras's
own = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.5), 4.0, 3, name="k").get_config()
mine = mp.LossScaleOptimizer.from_config(own)
assert isinstance(mine, LossScaleOptimizer) and (mine.initial_scale, mine.dynamic_growth_steps, mine.name) == (4.0, 3, "k")
theirs = keras.optimizers.LossScaleOptimizer.from_config(mp.LossScaleOptimizer(keras.optimizers.SGD(0.5)).get_config())
assert theirs.initial_scale == 2.0**15
print("ok")
""".replace("import unittest", "import unittest\nimport keras\nimport mixedpolicy as mp")

OPTIMIZER = _PRELUDE + """
import keras
from keras import ops
import mixedpolicy as mp

backend = keras.backend.backend()
opt = mp.LossScaleOptimizer(keras.optimizers.SGD(0.1))
assert isinstance(opt, mp.LossScaleOptimizer) and isinstance(opt, keras.optimizers.LossScaleOptimizer)
try:  # Keras's exception type, with the fix
    mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), learning_rate=0.1)
    raise AssertionError("expected a ValueError")
except ValueError as err:
    assert "belong to the inner optimizer" in str(err), err
named = mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), name="opt", dynamic=True)
assert named.name == "opt"

# 200 overflows in a row, eagerly (Keras's own fails on jax here, and reaches a
# scale of 0 on the others): weights untouched, scale at its floor, no iteration
w = keras.Variable(np.array([1.0, 2.0, 3.0], "float32"))
opt.build([w])
inf = ops.convert_to_tensor(np.array([np.inf, 1.0, 1.0], "float32"))
for _ in range(200):
    opt.apply([inf], [w])
np.testing.assert_array_equal(ops.convert_to_numpy(w), [1.0, 2.0, 3.0])
assert opt.loss_scale == 1.0 and opt.num_skipped_steps == 200 and opt.last_step_skipped
assert int(ops.convert_to_numpy(opt.iterations)) == 0
opt.apply([ops.convert_to_tensor(np.array([1.0, 1.0, 1.0], "float32"))], [w])
np.testing.assert_allclose(ops.convert_to_numpy(w), [0.9, 1.9, 2.9], rtol=1e-6)
assert not opt.last_step_skipped and int(ops.convert_to_numpy(opt.iterations)) == 1

# the scaled loss is float32, whatever the loss dtype
assert keras.backend.standardize_dtype(opt.scale_loss(ops.ones((), "float16")).dtype) == "float32"

# compiled custom loops
def compiled_apply(opt, grads, w):
    if backend == "tensorflow":
        import tensorflow as tf
        tf.function(lambda: opt.apply(grads, [w]))()
    elif backend == "jax":
        import jax
        values, opt_values = jax.jit(opt.stateless_apply)(
            [v.value for v in opt.variables], grads, [w.value])
        w.assign(values[0])
        for v, value in zip(opt.variables, opt_values):
            v.assign(value)
    else:
        opt.apply(grads, [w])

opt2 = mp.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=4.0)
w2 = keras.Variable(np.array([1.0, 2.0, 3.0], "float32"))
opt2.build([w2])
compiled_apply(opt2, [inf], w2)
np.testing.assert_array_equal(ops.convert_to_numpy(w2), [1.0, 2.0, 3.0])
assert opt2.loss_scale == 2.0 and opt2.num_skipped_steps == 1
compiled_apply(opt2, [ops.convert_to_tensor(np.array([2.0, 2.0, 2.0], "float32"))], w2)
np.testing.assert_allclose(ops.convert_to_numpy(w2), [0.9, 1.9, 2.9], rtol=1e-6)
assert opt2.num_skipped_steps == 1 and not opt2.last_step_skipped

# model.fit with one poisoned batch per epoch: that step is skipped, counted, the rest train
# (a first step may also overflow in float16 at the initial scale of 2**15: skipped too)
mp.set_global_policy("mixed_float16")
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 8)).astype("float32")
y = rng.normal(size=(64, 1)).astype("float32")
x[16:32] = np.nan  # the second batch of 16
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
from mixedpolicy.backends.keras_optimizer import LossScaleOptimizer
assert isinstance(model.optimizer, LossScaleOptimizer)
model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
skipped = model.optimizer.num_skipped_steps
assert skipped >= 2, skipped
assert int(ops.convert_to_numpy(model.optimizer.iterations)) + skipped == 8
assert all(np.isfinite(ops.convert_to_numpy(v)).all() for v in model.weights)

# saved and restored with the model
path = os.path.join(tempfile.mkdtemp(), "model.keras")
model.save(path)
loaded = keras.models.load_model(path)
assert type(loaded.optimizer) is LossScaleOptimizer
assert loaded.optimizer.num_skipped_steps == skipped
assert loaded.optimizer.loss_scale == model.optimizer.loss_scale
mp.set_global_policy(None)
print("ok")
"""


@pytest.fixture(autouse=True)
def _keras():
    require_module("keras")


@pytest.mark.parametrize("body", ["GLOBAL_POLICY", "PER_LAYER", "KERAS_OWN_TESTS", "OPTIMIZER"])
def test_under_every_keras_backend(body):
    out = run_under_keras_backends(globals()[body])
    assert all(out[b].rstrip().endswith("ok") for b in KERAS_BACKENDS), out


def test_a_keras_2_object_gets_a_clear_error():
    import mixedpolicy as mp

    Legacy = type("Sequential", (), {"__module__": "tf_keras.src.engine.sequential"})
    with pytest.raises(TypeError, match="Keras 2 object.*Keras 3"):
        mp.apply_policy(Legacy())
    Optimizer = type("Adam", (), {"__module__": "tf_keras.src.optimizers.adam"})
    with pytest.raises(TypeError, match="Keras 2 object.*Keras 3"):
        mp.LossScaleOptimizer(Optimizer())
