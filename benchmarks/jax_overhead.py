"""Overhead of mixedpolicy under jax.jit against the same step written by hand, jmp-style.

This is `mixedpolicy bench --frameworks jax`: the bench's Flax NNX model with
`mp.apply_policy` + `mp.LossScaleOptimizer(optax.sgd(...))`, against the same model built
with Flax's `dtype=` / `param_dtype=` and jmp's recipe written by hand (scale the loss,
unscale, `all_finite`, select the update, adjust the scale), both jitted steps in one process,
timed in interleaved blocks (ours, native, native, ours, ...); the figure is the median of the
blocks' ratios. Every bench option applies (`--model`, `--device cuda`, `--repeats`, ...).
On CPUs without bf16/fp16 hardware half precision is slower than float32: the ratio, not
the absolute time, is what measures mixedpolicy.

    python benchmarks/jax_overhead.py [--device cuda] [--model transformer] [--repeats 61]
"""

from mixedpolicy.bench.cli import overhead

if __name__ == "__main__":
    overhead(["jax"])
