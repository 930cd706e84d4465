"""Overhead of mixedpolicy in Keras's model.fit against Keras's own mixed precision, per backend.

Ours: ``mp.set_global_policy(policy)`` before the model is built, ``mp.apply_policy``,
and under ``mixed_float16`` mixedpolicy's bounded ``LossScaleOptimizer``. Keras's:
``keras.config.set_dtype_policy(policy)`` and Keras's own ``LossScaleOptimizer``.
Both models (same architecture, same initial weights) train in one process, their
``fit`` calls interleaved (ours, Keras, Keras, ours, ...), each timed over
`--steps` steps after a warm-up fit that compiles; the figure is the median of
`--repeats` ratios. Each Keras backend runs in its own process. On CPUs without
bf16/fp16 hardware half precision is slower than float32: the ratio, not the
absolute time, is what measures mixedpolicy.

    python benchmarks/keras_overhead.py [--backends jax,torch,tensorflow] [--repeats 9]
"""

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _interleave import HEADER, Comparison, interleave  # noqa: E402

BACKENDS = ("jax", "torch", "tensorflow")


def build(keras, width, seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(width, activation="relu"),
                             keras.layers.Dense(width, activation="relu"), keras.layers.Dense(10),
                             keras.layers.Activation("linear", dtype="float32")])


def run_backend(policies, steps, repeats, width, batch):
    """Times both fits under the current KERAS_BACKEND; returns {policy: (ours, keras, ratios)}."""
    import keras
    import numpy as np

    import mixedpolicy as mp

    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * batch, 64)).astype("float32")
    y = rng.integers(0, 10, steps * batch)
    results = {}
    for policy in policies:
        mp.set_global_policy(policy)
        ours = mp.apply_policy(build(keras, width), policy)
        opt = keras.optimizers.SGD(1e-3)
        ours.compile(mp.LossScaleOptimizer(opt) if mp.Policy(policy).needs_loss_scaling else opt,
                     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        mp.set_global_policy(None)
        keras.config.set_dtype_policy(policy)
        native = build(keras, width)
        native.set_weights(ours.get_weights())
        opt = keras.optimizers.SGD(1e-3)
        native.compile(keras.optimizers.LossScaleOptimizer(opt) if policy == "mixed_float16" else opt,
                       loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        keras.config.set_dtype_policy("float32")

        def timed(model):
            start = time.perf_counter()
            model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
            return (time.perf_counter() - start) / steps

        timed(ours), timed(native)  # compile and warm up
        results[policy] = interleave(lambda: timed(ours), lambda: timed(native), repeats)
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--policies", default="float32,mixed_bfloat16,mixed_float16")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    policies = args.policies.split(",")
    if args.child:
        print(json.dumps(run_backend(policies, args.steps, args.repeats, args.width, args.batch)))
        return None
    print(f"model.fit, MLP 64-{args.width}-{args.width}-10, batch {args.batch}, {args.steps} steps "
          f"x {args.repeats} repeats, interleaved; one process per Keras backend")
    print(f"{'backend':11s} {'policy':16s} {HEADER}   (native: Keras's own)")
    out = {}
    for backend in args.backends.split(","):
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
        child = [a for a in (argv if argv is not None else sys.argv[1:])] + ["--child"]
        proc = subprocess.run([sys.executable, os.path.abspath(__file__)] + child, env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"KERAS_BACKEND={backend} failed:\n{proc.stderr[-3000:]}")
        for policy, fields in json.loads(proc.stdout.strip().splitlines()[-1]).items():
            comparison = Comparison(*fields)
            out[(backend, policy)] = comparison.ratio
            print(comparison.row(f"{backend:11s} {policy:16s}"), flush=True)
    return out


if __name__ == "__main__":
    main()
