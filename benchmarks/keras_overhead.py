"""Overhead of mixedpolicy in Keras against Keras's own mixed precision, per backend.

This is `mixedpolicy bench --frameworks keras-jax,keras-torch,keras-tensorflow`: one Keras
functional model per backend (each in its own process), ours built under
`mp.set_global_policy(policy)` + `mp.apply_policy` (and mixedpolicy's bounded
`LossScaleOptimizer` under `mixed_float16`), Keras's under `keras.config.set_dtype_policy`
and Keras's own `LossScaleOptimizer`, both trained with `train_on_batch` in one process,
timed in interleaved blocks (ours, Keras, Keras, ours, ...); the figure is the median of the
blocks' ratios. Every bench option applies (`--model`, `--repeats`, `--policies`, ...).

    python benchmarks/keras_overhead.py [--model cnn] [--repeats 61]
"""

from mixedpolicy.bench.cli import overhead

if __name__ == "__main__":
    overhead(["keras-jax", "keras-torch", "keras-tensorflow"])
