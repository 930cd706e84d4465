"""Keras drop-in regressions (conformance review): explicit dtypes, threads, names, norms, saving.

Run by tests/backends/keras/test_keras.py once per Keras backend, in a pytest process of its own
(KERAS_BACKEND is chosen per process); not collected by the main run.
"""

import os
import subprocess
import sys
import tempfile
import textwrap
import threading

import numpy as np
import keras

import mixedpolicy as mp


def test_drop_in():
    """The guide's float32 head, threads, name keys, norms next to raw ops, a fresh-process load."""
    dt = keras.backend.standardize_dtype
    x = np.random.default_rng(0).normal(size=(8, 16)).astype("float32")
    y = np.random.default_rng(1).integers(0, 4, size=(8,))

    # 1. the layer's own dtype="float32" (the guide's float32 softmax) survives a model-wide policy
    def guide_model():
        inputs = keras.Input((16,))
        h = keras.layers.Dense(32, activation="relu", name="dense_1")(inputs)
        h = keras.layers.Dense(4, name="dense_logits")(h)
        outputs = keras.layers.Activation("softmax", dtype="float32", name="predictions")(h)
        return keras.Model(inputs, outputs, name="guide")

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

    # 4. trained with mixedpolicy's LossScaleOptimizer, saved, loaded in a fresh process
    model = mp.apply_policy(guide_model(), "mixed_float16")
    model.compile(mp.LossScaleOptimizer(keras.optimizers.Adam(1e-3), initial_scale=2.0**10,
                                        dynamic_growth_steps=2, min_scale=0.5), "sparse_categorical_crossentropy")
    model.fit(x, y, epochs=3, batch_size=4, verbose=0)
    scale = model.optimizer.loss_scale
    path = os.path.join(tempfile.mkdtemp(), "m.keras")
    model.save(path)
    expected = model.predict(x, verbose=0)
    np.save(path + ".npy", expected)
    code = textwrap.dedent(f"""
        import numpy as np, keras
        import mixedpolicy as mp
        m = keras.saving.load_model({path!r})
        assert isinstance(m.optimizer, mp.LossScaleOptimizer), type(m.optimizer)
        assert m.optimizer.loss_scale == {scale!r}, m.optimizer.loss_scale
        assert m.optimizer._scale_settings.min_scale == 0.5
        assert int(keras.ops.convert_to_numpy(m.optimizer.iterations)) == {int(keras.ops.convert_to_numpy(model.optimizer.iterations))}
        np.testing.assert_allclose(m.predict(np.asarray({x.tolist()!r}, "float32"), verbose=0), np.load({path!r} + ".npy"), rtol=1e-2, atol=1e-3)
        print("loaded")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
    assert out.returncode == 0 and "loaded" in out.stdout, out.stderr[-3000:]


def _load_in_fresh_process(path: str, with_mixedpolicy: bool) -> dict:
    """Loads `path` in a new process (with or without mixedpolicy) and reports its optimizer."""
    code = textwrap.dedent(f"""
        import json, sys, warnings, keras
        {"import mixedpolicy" if with_mixedpolicy else ""}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m = keras.saving.load_model({path!r})
        o = m.optimizer
        print(json.dumps({{
            "mixedpolicy": "mixedpolicy" in sys.modules,
            "type": type(o).__module__ + "." + type(o).__qualname__,
            "is_ours": any(c.__module__.startswith("mixedpolicy") for c in type(o).__mro__),
            "scale": float(keras.ops.convert_to_numpy(o.dynamic_scale)),
            "counter": int(keras.ops.convert_to_numpy(o.step_counter)),
            "iterations": int(keras.ops.convert_to_numpy(o.iterations)),
            "skipped": getattr(o, "num_skipped_steps", None),
            "warnings": [str(w.message) for w in caught if "Skipping" in str(w.message)
                         or "could not be loaded" in str(w.message)],
        }}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
    assert out.returncode == 0, out.stderr[-3000:]
    import json
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_saved_with_keras_expressible_settings_loads_in_plain_keras_and_back_as_ours():
    keras.utils.set_random_seed(0)  # the same weights, hence the same scale trajectory, each run
    x = np.random.default_rng(0).random((16, 4), dtype=np.float32)
    y = np.arange(16) % 3
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(3)])
    mp.apply_policy(model, "mixed_float16")
    opt = mp.LossScaleOptimizer(keras.optimizers.Adam(1e-3), initial_scale=2.0**10,
                                dynamic_growth_steps=3)
    model.compile(opt, "sparse_categorical_crossentropy")
    model.fit(x, y, epochs=2, batch_size=4, verbose=0)
    opt._skips.assign(np.asarray([2, 0], "int32"))  # as if two steps had been skipped
    saved = {"scale": opt.loss_scale, "counter": int(keras.ops.convert_to_numpy(opt.step_counter)),
             "iterations": int(keras.ops.convert_to_numpy(opt.iterations))}
    assert saved["iterations"] > 0 and (saved["scale"], saved["counter"]) != (2.0**10, 0)  # moved
    path = os.path.join(tempfile.mkdtemp(), "portable.keras")
    model.save(path)

    plain = _load_in_fresh_process(path, with_mixedpolicy=False)
    assert not plain["mixedpolicy"] and not plain["is_ours"], plain
    assert plain["type"].endswith("loss_scale_optimizer.LossScaleOptimizer"), plain
    assert {k: plain[k] for k in saved} == saved and plain["warnings"] == [], plain

    ours = _load_in_fresh_process(path, with_mixedpolicy=True)
    assert ours["is_ours"] and ours["skipped"] == 2 and ours["warnings"] == [], ours
    assert {k: ours[k] for k in saved} == saved, ours


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
