"""fp8 against bf16 on torch by layer size: ``python -m mixedpolicy.bench.float8_sweep``.

The bench compares frameworks on whole models; this sweep answers the question an fp8 user
asks first: from which matmul size on does fp8 pay, and what does mixedpolicy's set-up cost
against torchao's own? Each size builds one stack of transformer MLP blocks (LayerNorm,
Linear d -> 4d, GELU, Linear 4d -> d) with a d -> d head (or, with ``--model gpt2``, the
bench's GPT-2; with ``--model linear``, one ``nn.Linear(K, N)`` per ``--shapes KxN``: the
question `float8_auto_filter`'s thresholds answer), copies it once per side with the same weights,
and times a training step (forward, backward, SGD) of each side by side, interleaved, median of
repeats:

- ``bf16``: ``mp.apply_policy(net, "mixed_bfloat16")``;
- ``fp8``: ``mp.apply_policy(net, "p=f32,c=bf16,float8=<recipe>")`` (the built-in rules keep
  the head and the norms out of fp8);
- ``torchao``: torchao's own ``convert_to_float8_training`` with the same filter, under
  ``torch.autocast`` in bf16: what a user writes by hand;
- with ``--auto-filter on`` (the default for gpt2), ``fp8 auto``: the fp8 policy in a
  ``PolicyMap(..., float8_auto_filter=True)``, and ``torchao auto``: torchao's conversion of
  the same layers (the auto filter's sizes as its module filter).

It prints, per size, ``fp8 / bf16`` (the speed-up; above 1 means fp8 is faster) and
``fp8 / torchao`` (mixedpolicy's overhead; 1 means none), and the same two for the auto
filter, each the median of the per-round ratios with its interquartile range, and writes
them to ``--out`` as JSON. On a CPU fp8 is emulated (the numbers say nothing about speed
there); on an H100 or H200 with ``--compile on`` these are the figures of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from typing import Any, Callable

from mixedpolicy.bench.outputs import check_out_file
from mixedpolicy.float8 import too_small_to_gain


def block_stack(d: int, layers: int, seed: int = 0) -> Any:
    """``layers`` transformer MLP blocks of width ``d`` and a d -> d head, seeded."""
    import torch

    nn = torch.nn
    torch.manual_seed(seed)
    blocks: list[Any] = []
    for _ in range(layers):
        blocks += [nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)]
    return nn.Sequential(*blocks, nn.Linear(d, d))


def _nets(base: Any, recipe: str, auto_filter: bool, one_layer: bool = False) -> dict[str, tuple[Any, bool]]:
    """The sides, each (net, whether its step runs under torch.autocast in bf16). With
    `one_layer`, `base` is the layer alone: no built-in rule keeps it out (it would be the
    head), and no torchao side (ours is torchao's conversion: `fp8 / torchao` is the blocks')."""
    import mixedpolicy as mp
    from mixedpolicy.bench.runners.float8 import torchao_float8

    fp8 = mp.Policy(f"p=f32,c=bf16,float8={recipe}")
    nets = {"bf16": (mp.apply_policy(copy.deepcopy(base), "mixed_bfloat16"), False),
            "fp8": (mp.apply_policy(copy.deepcopy(base), mp.PolicyMap(fp8, builtin_rules=not one_layer)), False)}
    if not one_layer:
        nets["torchao"] = (torchao_float8(copy.deepcopy(base), recipe), True)
    if auto_filter:
        nets["fp8 auto"] = (mp.apply_policy(copy.deepcopy(base), mp.PolicyMap(fp8, float8_auto_filter=True)), False)
        nets["torchao auto"] = (torchao_float8(copy.deepcopy(base), recipe, auto_filter=True), True)
    return nets


def _sides(nets: dict[str, tuple[Any, bool]], batch: tuple, loss: Callable, device: str,
           compile_on: bool) -> dict[str, Callable[[], Any]]:
    import torch

    x, y = batch
    if compile_on:  # each size compiles afresh: no recompile limit reached, no shape turned dynamic
        torch._dynamo.reset()
    steps = {}
    for name, (net, autocast) in nets.items():
        net.to(device)
        opt = torch.optim.SGD(net.parameters(), lr=1e-4)
        run = torch.compile(net) if compile_on else net

        def step(run: Any = run, opt: Any = opt, autocast: bool = autocast) -> Any:
            with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                out = run(x)
            value = loss(out, y)
            value.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return value.detach()

        steps[name] = step
    return steps


def _sync(device: str) -> None:
    if device == "cuda":
        __import__("torch").cuda.synchronize()


def _block_time(step: Callable[[], Any], n: int, device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    for _ in range(n):
        step()
    _sync(device)
    return (time.perf_counter() - start) / n


def _spread(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return statistics.median(values), q[0], q[2]


def measure(d: int, layers: int, recipe: str, device: str, compile_on: bool, repeats: int,
            warmup: int, min_block_time: float, tokens: int = 8192, auto_filter: bool = False) -> dict:
    """One size of the block stack: each side's median step time and the ratios, with their spread."""
    import torch

    base = block_stack(d, layers)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, d, generator=g).to(device)
    steps = _sides(_nets(base, recipe, auto_filter), (x, None), lambda out, _y: out.float().pow(2).mean(),
                   device, compile_on)
    return {"model": f"{layers} MLP blocks", "d_model": d, "layers": layers, "recipe": recipe,
            **_timed(steps, repeats, warmup, min_block_time, device)}


def measure_linear(k: int, n: int, recipe: str, device: str, compile_on: bool, repeats: int, warmup: int,
                   min_block_time: float, tokens: int = 8192) -> dict:
    """One ``nn.Linear(k, n)`` on ``tokens`` rows, bf16 against fp8: the question the auto filter
    answers for that shape (its answer is the row's ``too_small_to_gain``)."""
    import torch

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(k, n))
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(1)).to(device)
    steps = _sides(_nets(base, recipe, False, one_layer=True), (x, None),
                   lambda out, _y: out.float().pow(2).mean(), device, compile_on)
    return {"model": f"Linear({k}, {n})", "d_model": k, "shape": [k, n], "tokens": tokens, "recipe": recipe,
            "too_small_to_gain": too_small_to_gain(recipe, k, n),
            **_timed(steps, repeats, warmup, min_block_time, device)}


def measure_gpt2(batch_size: int, recipe: str, device: str, compile_on: bool, repeats: int, warmup: int,
                 min_block_time: float, auto_filter: bool = True) -> dict:
    """The bench's gpt2 (GPT-2 small's shape off the CPU) on synthetic tokens, the same sides."""
    import torch

    from mixedpolicy.bench import models
    from mixedpolicy.bench.runners import torch as runner

    cfg = models.config("gpt2", device, "synthetic")
    base = runner.network("gpt2", cfg, models.init_weights("gpt2", cfg, 0), "cpu")
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, cfg["vocab"], (batch_size, cfg["seq"]), generator=g).to(device) for _ in range(2))

    def loss(out: Any, y: Any) -> Any:
        return torch.nn.functional.cross_entropy(out.float().flatten(0, 1), y.flatten())

    steps = _sides(_nets(base, recipe, auto_filter), (x, y), loss, device, compile_on)
    return {"model": "gpt2", "d_model": cfg["d_model"], "layers": cfg["blocks"], "recipe": recipe,
            **_timed(steps, repeats, warmup, min_block_time, device)}


_RATIOS = {"fp8 / bf16": ("bf16", "fp8"), "fp8 / torchao": ("fp8", "torchao"),
           "fp8 auto / bf16": ("bf16", "fp8 auto"), "fp8 auto / torchao auto": ("fp8 auto", "torchao auto")}


def _timed(steps: dict[str, Callable[[], Any]], repeats: int, warmup: int, min_block_time: float,
           device: str) -> dict:
    """Interleaved blocks of each side; ratios are the medians of the per-round ratios (a speed-up
    over bf16 above 1 is faster; an overhead against torchao of 1 is none)."""
    first = {name: float(step()) for name, step in steps.items()}  # the same weights and data
    for _ in range(warmup):
        for step in steps.values():
            step()
    n = max(1, round(min_block_time / max(_block_time(steps["bf16"], 1, device), 1e-6)))
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            times[name].append(_block_time(step, n, device))
    row: dict = {"steps_per_block": n, "first_loss": first,
                 "ms": {k: 1e3 * statistics.median(v) for k, v in times.items()}}
    for name, (num, den) in _RATIOS.items():
        if num in times and den in times:
            mid, lo, hi = _spread([a / b for a, b in zip(times[num], times[den])])
            row[name] = {"median": mid, "q1": lo, "q3": hi}
    if device == "cuda":
        row["gpu_ms"] = {name: kernel_ms(step, 10) for name, step in steps.items()}
        row["fp8 / bf16 (gpu time)"] = row["gpu_ms"]["bf16"] / row["gpu_ms"]["fp8"]
    return row


def kernel_ms(step: Callable[[], Any], n: int) -> float:
    """The GPU's busy time per step: the sum of the CUDA kernels' own times over ``n`` steps, as
    the profiler's table totals them. Unlike the wall clock it leaves out the host's launch time,
    which rules a small layer's step alone but hides behind the kernels in a model that keeps
    the GPU busy: the figure a per-layer choice (the auto filter) needs."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    total = sum(e.self_device_time_total for e in prof.key_averages()
                if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False))
    return total / 1e3 / n


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mixedpolicy.bench.float8_sweep",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--model", choices=("blocks", "gpt2", "linear"), default="blocks",
                   help="blocks: stacks of transformer MLP blocks at each --sizes; gpt2: the bench's gpt2 "
                        "(GPT-2 small's shape off the CPU), which also times float8_auto_filter; linear: one "
                        "nn.Linear per --shapes (default: blocks)")
    p.add_argument("--shapes", default=None,
                   help="linear: in_features x out_features, comma-separated (default: 768x3072,3072x768,4096x4096)")
    p.add_argument("--sizes", default=None,
                   help="blocks: d_model values, comma-separated (default: 1024,2048,4096,8192)")
    p.add_argument("--layers", type=int, default=None, help="blocks: MLP blocks per stack (default: 2)")
    p.add_argument("--tokens", type=int, default=None, help="blocks, linear: rows per step (default: 8192)")
    p.add_argument("--batch-size", type=int, default=None, help="gpt2: sequences per step (default: 8)")
    p.add_argument("--auto-filter", choices=("off", "on"), default=None,
                   help="blocks, gpt2: also time fp8 under PolicyMap(float8_auto_filter=True) against torchao on "
                        "the same layers (default: on for gpt2, off for blocks)")
    p.add_argument("--recipe", default="tensorwise", help="torchao's recipe: tensorwise, rowwise, rowwise_with_gw_hp")
    p.add_argument("--device", default="cuda", help="cuda or cpu (default: cuda)")
    p.add_argument("--compile", choices=("off", "on"), default="on", help="torch.compile every side (default: on)")
    p.add_argument("--repeats", type=int, default=15, help="interleaved rounds (default: 15)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per side (default: 3)")
    p.add_argument("--min-block-time", type=float, default=0.05, help="seconds per timed block (default: 0.05)")
    p.add_argument("--out", default=None, help="write the rows to this JSON file")
    return p


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(s <= 0 or s % 16 for s in sizes):
        raise ValueError(f"--sizes {text!r}: expected positive multiples of 16 (fp8 kernels need them), "
                         "comma-separated, e.g. --sizes 1024,4096")
    return sizes


def _shapes(text: str) -> list[tuple[int, int]]:
    shapes: list[tuple[int, int]] = []
    for item in text.split(","):
        try:
            k, n = _sizes(item.strip().replace("x", ","))
        except ValueError:
            break
        shapes.append((k, n))
    else:
        if shapes:
            return shapes
    raise ValueError(f"--shapes {text!r}: expected in_features x out_features pairs of positive multiples "
                     "of 16, comma-separated, e.g. --shapes 768x3072,4096x4096")


#: the options each --model reads, with their defaults; one given for another model is refused
_MODEL_OPTIONS = {"blocks": {"sizes": "1024,2048,4096,8192", "layers": 2, "tokens": 8192, "auto_filter": "off"},
                  "linear": {"shapes": "768x3072,3072x768,4096x4096", "tokens": 8192},
                  "gpt2": {"batch_size": 8, "auto_filter": "on"}}
_COUNTS = {"layers": 1, "tokens": 1, "batch_size": 1, "repeats": 1, "warmup": 0}  # the least each may be


def _check_options(args: argparse.Namespace) -> None:
    """Fills in the chosen model's defaults; refuses an option it does not read (it would do
    nothing) and a count or time out of range."""
    own = _MODEL_OPTIONS[args.model]
    for name in sorted({n for opts in _MODEL_OPTIONS.values() for n in opts} - set(own)):
        if getattr(args, name) is not None:
            users = [m for m, opts in _MODEL_OPTIONS.items() if name in opts]
            raise ValueError(f"--{name.replace('_', '-')} is for --model {' or '.join(users)}; --model {args.model} "
                             f"does not read it. Drop it, or pick that model.")
    for name, default in own.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    for name, least in _COUNTS.items():
        value = getattr(args, name, None)
        if value is not None and value < least:
            raise ValueError(f"--{name.replace('_', '-')} {value}: expected a whole number >= {least}")
    if not 0 <= args.min_block_time <= 60:
        raise ValueError(f"--min-block-time {args.min_block_time}: expected seconds from 0 to 60")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    import mixedpolicy as mp

    try:
        _check_options(args)
        check_out_file(args.out)
        sizes = _sizes(args.sizes) if args.model == "blocks" else []
        shapes = _shapes(args.shapes) if args.model == "linear" else []
        mp.Policy(f"p=f32,c=bf16,float8={args.recipe}")
        if args.recipe not in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
            raise ValueError(f"--recipe {args.recipe!r}: torchao trains with tensorwise, rowwise or "
                             "rowwise_with_gw_hp; pick one of those")
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: torch sees no CUDA GPU here; pass --device cpu (emulated fp8)")
    except ValueError as err:
        print(f"float8_sweep: error: {err}", file=sys.stderr)
        return 2
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    auto = args.auto_filter == "on"
    what = {"gpt2": f"gpt2, batch {args.batch_size}", "linear": f"one Linear, {args.tokens} tokens"}.get(
        args.model, f"{args.layers} MLP blocks, {args.tokens} tokens")
    print(f"# {where}, torch {torch.__version__}, {args.recipe}, {what}, compile {args.compile}; "
          f"ratios: median [q1, q3] of {args.repeats} interleaved rounds")
    rows = []
    common = (args.recipe, args.device, args.compile == "on", args.repeats, args.warmup, args.min_block_time)
    runs: list[Callable[[], dict]] = (
        [lambda: measure_gpt2(args.batch_size, *common, auto_filter=auto)] if args.model == "gpt2" else
        [lambda k=k, n=n: measure_linear(k, n, *common, tokens=args.tokens) for k, n in shapes]
        if args.model == "linear" else
        [lambda d=d: measure(d, args.layers, *common, tokens=args.tokens, auto_filter=auto) for d in sizes])
    for run in runs:
        row = run()
        rows.append(row)
        times = ", ".join(f"{k} {v:.2f} ms" for k, v in row["ms"].items())
        ratios = ", ".join(f"{k} {row[k]['median']:.3f} [{row[k]['q1']:.3f}, {row[k]['q3']:.3f}]"
                           for k in _RATIOS if k in row)
        label = (f"{row['shape'][0]} -> {row['shape'][1]} (auto filter: "
                 f"{'keeps it out' if row['too_small_to_gain'] else 'fp8'})" if "shape" in row
                 else f"d_model {row['d_model']}")
        if "gpu_ms" in row:
            ratios += ", gpu time " + ", ".join(f"{k} {v:.3f} ms" for k, v in row["gpu_ms"].items())
            ratios += f": fp8 / bf16 {row['fp8 / bf16 (gpu time)']:.3f}"
        print(f"{label}: {times}\n    {ratios}", flush=True)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": where, "torch": torch.__version__, "compile": args.compile, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
