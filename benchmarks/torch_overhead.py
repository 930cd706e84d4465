"""Overhead of mixedpolicy against hand-written torch.autocast + GradScaler, same model.

Both training steps run in one process, interleaved (ours, native, ours, ...), each
timed over `--steps` steps after a warm-up; the figure is the median of `--repeats`
ratios. On CPUs without bf16/fp16 hardware half precision is slower than float32:
the ratio, not the absolute time, is what measures mixedpolicy.

    python benchmarks/torch_overhead.py [--device cuda] [--repeats 9]
"""

import argparse
import time

import torch
from _interleave import HEADER, interleave

import mixedpolicy as mp

HALF = {"mixed_bfloat16": torch.bfloat16, "mixed_float16": torch.float16}


def model_and_data(device, width, batch, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, 10)).to(device)
    x = torch.randn(batch, 64, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    return model, x, y


def ours(policy, device, width, batch):
    model, x, y = model_and_data(device, width, batch)
    mp.apply_policy(model, policy)
    opt = mp.LossScaleOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3))

    def step():
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()
    return step


def native(policy, device, width, batch):
    model, x, y = model_and_data(device, width, batch)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    dtype = HALF.get(policy)
    scaler = torch.amp.GradScaler(device)

    def step():
        with torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None):
            out = model(x)
        loss = torch.nn.functional.cross_entropy(out.float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return step


def timed(step, steps, device):
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--policies", default="float32,mixed_bfloat16,mixed_float16")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=128)
    args = parser.parse_args(argv)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    print(f"torch {torch.__version__}, device {args.device}, model MLP 64-{args.width}-{args.width}-10, "
          f"batch {args.batch}, {args.steps} steps x {args.repeats} repeats, interleaved")
    print(f"{'policy':16s} {HEADER}")
    results = {}
    for policy in args.policies.split(","):
        a = ours(policy, args.device, args.width, args.batch)
        b = native(policy, args.device, args.width, args.batch)
        for _ in range(3):
            a(), b()  # warm-up
        comparison = interleave(lambda: timed(a, args.steps, args.device),
                                lambda: timed(b, args.steps, args.device), args.repeats)
        results[policy] = comparison.ratio
        print(comparison.row(f"{policy:16s}"))
    return results


if __name__ == "__main__":
    main()
