"""Overhead of mixedpolicy against hand-written torch.autocast + GradScaler, same model.

This is `mixedpolicy bench --frameworks torch`: the bench's PyTorch model trained with
mixedpolicy (`apply_policy` + `LossScaleOptimizer`) and with `torch.autocast` +
`torch.amp.GradScaler` written by hand, in one process, timed in interleaved blocks (ours,
native, native, ours, ...); the figure is the median of the blocks' ratios. Every bench
option applies (`--model`, `--device cuda`, `--repeats`, `--policies`, `--out`, ...). On
CPUs without bf16/fp16 hardware half precision is slower than float32: the ratio, not the
absolute time, is what measures mixedpolicy.

    python benchmarks/torch_overhead.py [--device cuda] [--model transformer] [--repeats 61]
"""

from mixedpolicy.bench.cli import overhead

if __name__ == "__main__":
    overhead(["torch"])
