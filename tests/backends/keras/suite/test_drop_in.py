"""Keras drop-in regressions (conformance review): explicit dtypes, threads, names, norms, saving.

Run by tests/backends/keras/test_keras.py once per Keras backend, in a pytest process of its own
(KERAS_BACKEND is chosen per process); not collected by the main run.
"""

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading

import numpy as np
import keras

import mixedpolicy as mp


def guide_model():
    """The mixed-precision guide's model: a float32 softmax head of its own."""
    inputs = keras.Input((16,))
    h = keras.layers.Dense(32, activation="relu", name="dense_1")(inputs)
    h = keras.layers.Dense(4, name="dense_logits")(h)
    outputs = keras.layers.Activation("softmax", dtype="float32", name="predictions")(h)
    return keras.Model(inputs, outputs, name="guide")


def test_drop_in():
    """The guide's float32 head, threads, name keys, norms next to raw ops."""
    dt = keras.backend.standardize_dtype
    x = np.random.default_rng(0).normal(size=(8, 16)).astype("float32")

    # 1. the layer's own dtype="float32" (the guide's float32 softmax) survives a model-wide policy
    m = mp.apply_policy(guide_model(), "mixed_float16")
    rows = {r.path: r for r in mp.describe(m)}
    pred = [r for r in rows.values() if r.path.endswith("predictions")][0]
    assert pred.policy == mp.Policy("float32") and "own dtype" in pred.source, pred
    assert dt(m(x).dtype) == "float32"
    assert m.get_layer("dense_1").dtype_policy.name == "mixed_float16"
    # ... unless a key names that layer: by its name, as a Keras user sees it
    m = mp.apply_policy(guide_model(), "mixed_float16", {"predictions": "mixed_float16"})
    assert m.get_layer("predictions").dtype_policy.name == "mixed_float16"
    # describe prints keys that can be pasted back
    again = mp.apply_policy(guide_model(), "float32", {pred.path: "mixed_bfloat16"})
    assert again.get_layer("predictions").dtype_policy.name == "mixed_bfloat16"

    # 2. a layer built in another thread after set_global_policy follows it
    mp.set_global_policy("mixed_bfloat16")
    seen = []
    t = threading.Thread(target=lambda: seen.append(keras.layers.Dense(2).dtype_policy.name))
    t.start(); t.join()
    assert seen == ["mixed_bfloat16"], seen
    mp.set_global_policy(None)
    t = threading.Thread(target=lambda: seen.append(keras.layers.Dense(2).dtype_policy.name))
    t.start(); t.join()
    assert seen[-1] == "float32", seen

    # 3. a norm next to a raw op: x + dense(norm(x)) runs on every backend, in the compute dtype
    class Block(keras.layers.Layer):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.norm = keras.layers.LayerNormalization()
            self.dense = keras.layers.Dense(16)
        def call(self, x):
            h = self.norm(x)
            return h + self.dense(h)

    for policy in ("mixed_float16", "mixed_bfloat16"):
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(16), Block(), keras.layers.Dense(4)])
        mp.apply_policy(model, policy)
        compute = mp.Policy(policy).compute_dtype
        block = model.layers[1]
        assert dt(block(keras.ops.cast(x, compute)).dtype) == compute
        assert dt(block.norm.gamma.dtype) == "float32"
        assert dt(model(x).dtype) == compute


def _load_in_fresh_process(paths: list, with_mixedpolicy: bool) -> list:
    """Loads each of `paths` in one new process (Keras imported first, then mixedpolicy or not)
    and reports each model's optimizer. With mixedpolicy, the process also checks the global
    policy where Keras was imported first: it reaches Keras and a layer built in a worker thread
    (the import order the main run's fresh processes do not cover; see test_keras.py)."""
    code = textwrap.dedent(f"""
        import numpy as np, json, sys, threading, warnings, keras
        {"import mixedpolicy as mp" if with_mixedpolicy else ""}
        report = []
        for path in {paths!r}:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                m = keras.saving.load_model(path)
            o = getattr(m, "optimizer", None)  # a model never compiled has none
            report.append({{
                "mixedpolicy": "mixedpolicy" in sys.modules,
                "classes": sorted({{type(layer).__name__ for layer in m._flatten_layers()}}),
                "predictions": m.predict(np.load(path + ".x.npy"), verbose=0).tolist(),
                "warnings": [str(w.message) for w in caught if "Skipping" in str(w.message)
                             or "could not be loaded" in str(w.message)],
            }})
            if o is not None:
                report[-1].update({{
                    "type": type(o).__module__ + "." + type(o).__qualname__,
                    "is_ours": any(c.__module__.startswith("mixedpolicy") for c in type(o).__mro__),
                    "scale": float(keras.ops.convert_to_numpy(o.dynamic_scale)),
                    "counter": int(keras.ops.convert_to_numpy(o.step_counter)),
                    "iterations": int(keras.ops.convert_to_numpy(o.iterations)),
                    "skipped": getattr(o, "num_skipped_steps", None),
                    "min_scale": getattr(getattr(o, "_scale_settings", None), "min_scale", None),
                }})
        if {with_mixedpolicy!r}:
            mp.set_global_policy("mixed_float16")
            built = []
            worker = threading.Thread(target=lambda: built.append((keras.layers.Dense(2).dtype_policy.name,
                                                                   keras.config.dtype_policy().name)))
            worker.start(); worker.join()
            assert built == [("mixed_float16", "mixed_float16")], built
            mp.set_global_policy(None)
            assert keras.layers.Dense(2).dtype_policy.name == "float32"
        print(json.dumps(report))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _save(model, x) -> tuple:
    """Saves `model` with the inputs and predictions a fresh process checks it against."""
    path = os.path.join(tempfile.mkdtemp(), f"{model.name}.keras")
    model.save(path)
    np.save(path + ".x.npy", x)
    return path, model.predict(x, verbose=0)


def test_saved_models_load_in_fresh_processes_with_and_without_mixedpolicy():
    """A model trained with mixedpolicy's LossScaleOptimizer loads in a fresh process: settings
    Keras can express (scale, counters) load in plain Keras as Keras's own optimizer and back as
    ours with the skip count; settings it cannot (min_scale) keep mixedpolicy's class; fp8
    tensorwise layers load as such, computing what they computed."""
    keras.utils.set_random_seed(0)  # the same weights, hence the same scale trajectory, each run
    x = np.random.default_rng(0).random((16, 4), dtype=np.float32)
    y = np.arange(16) % 3
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(3)], name="portable")
    mp.apply_policy(model, "mixed_float16")
    opt = mp.LossScaleOptimizer(keras.optimizers.Adam(1e-3), initial_scale=2.0**10,
                                dynamic_growth_steps=3)
    model.compile(opt, "sparse_categorical_crossentropy")
    model.fit(x, y, epochs=2, batch_size=4, verbose=0)
    opt._skips.assign(np.asarray([2, 0], "int32"))  # as if two steps had been skipped
    saved = {"scale": opt.loss_scale, "counter": int(keras.ops.convert_to_numpy(opt.step_counter)),
             "iterations": int(keras.ops.convert_to_numpy(opt.iterations))}
    assert saved["iterations"] > 0 and (saved["scale"], saved["counter"]) != (2.0**10, 0)  # moved
    portable, _ = _save(model, x)

    # the guide's model with a setting Keras's own LossScaleOptimizer has no field for
    x8 = np.random.default_rng(0).normal(size=(8, 16)).astype("float32")
    guide = mp.apply_policy(guide_model(), "mixed_float16")
    guide.compile(mp.LossScaleOptimizer(keras.optimizers.Adam(1e-3), initial_scale=2.0**10,
                                        dynamic_growth_steps=2, min_scale=0.5), "sparse_categorical_crossentropy")
    guide.fit(x8, np.random.default_rng(1).integers(0, 4, size=(8,)), epochs=3, batch_size=4, verbose=0)
    guide_saved = {"scale": guide.optimizer.loss_scale,
                   "iterations": int(keras.ops.convert_to_numpy(guide.optimizer.iterations))}
    guide_path, guide_predictions = _save(guide, x8)
    # a model with fp8 tensorwise layers (mixedpolicy's classes, registered when it is imported)
    keras.utils.set_random_seed(0)
    fp8 = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, name="up"), keras.layers.Dense(4, name="head")],
                           name="fp8")
    mp.apply_policy(fp8, mp.Policy("mixed_bfloat16", float8_recipe="tensorwise"))
    fp8_path, fp8_predictions = _save(fp8, x8)

    (plain,) = _load_in_fresh_process([portable], with_mixedpolicy=False)
    assert not plain["mixedpolicy"] and not plain["is_ours"], plain
    assert plain["type"].endswith("loss_scale_optimizer.LossScaleOptimizer"), plain
    assert {k: plain[k] for k in saved} == saved and plain["warnings"] == [], plain

    ours, loaded, tensorwise = _load_in_fresh_process([portable, guide_path, fp8_path], with_mixedpolicy=True)
    assert "Float8TensorwiseDense" in tensorwise["classes"] and tensorwise["warnings"] == [], tensorwise
    np.testing.assert_allclose(tensorwise["predictions"], fp8_predictions, rtol=1e-2, atol=1e-3)  # another process's program
    assert ours["is_ours"] and ours["skipped"] == 2 and ours["warnings"] == [], ours
    assert {k: ours[k] for k in saved} == saved, ours
    assert loaded["is_ours"] and loaded["min_scale"] == 0.5 and loaded["warnings"] == [], loaded
    assert {k: loaded[k] for k in guide_saved} == guide_saved, loaded
    np.testing.assert_allclose(loaded["predictions"], guide_predictions, rtol=1e-2, atol=1e-3)


def test_settings_keras_cannot_express_keep_mixedpolicys_name():
    opt = mp.LossScaleOptimizer(keras.optimizers.SGD(), min_scale=0.5)
    assert type(opt).__module__.startswith("mixedpolicy")
    config = keras.saving.serialize_keras_object(opt)
    assert config["registered_name"] == "mixedpolicy>LossScaleOptimizer", config
    default = keras.saving.serialize_keras_object(mp.LossScaleOptimizer(keras.optimizers.SGD(), policy="mixed_float16"))
    assert (default["module"], default["registered_name"]) == ("keras.optimizers", "LossScaleOptimizer")
    # a config Keras's own wrote (registered_name None) still builds Keras's own class
    own = keras.saving.serialize_keras_object(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))
    assert type(keras.saving.deserialize_keras_object(own)) is keras.optimizers.LossScaleOptimizer
