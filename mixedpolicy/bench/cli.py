"""`mixedpolicy bench`: the same model on several frameworks, under each policy, side by side.

Every option is checked before any run starts. Then the initial weights are made
once and written to `--out`; each (framework, policy) runs in a process of its own
(`mixedpolicy.bench.worker`) while the terminal shows progress; the results are
written as results.json, report.md and PNG plots, and the table is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from mixedpolicy.bench import data, models, progress, replicas, report, runners
from mixedpolicy.bench.outputs import check_out
from mixedpolicy.bench.ratios import goal
from mixedpolicy.bench.spec import (BASELINES, FRAMEWORKS, MODELS, POLICIES, PURE, RunSpec, memory_policy,
                                    mp_float8, resolve_compile, resolve_frameworks, resolve_model, resolve_policies,
                                    user_model_info)
from mixedpolicy.bench.spec import runs as runs_on


_BANDWIDTH = "1GB/s"  # the replica comparison's modelled link, unless --bandwidth says otherwise


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mixedpolicy bench",
        description="Train the same model (same architecture, initial weights, data order and batch "
                    "size) on several frameworks under each policy; time each step against the same "
                    "policy written by hand with the framework's own tools.")
    p.add_argument("--frameworks", default=None,
                   help=f"comma-separated, any of: {', '.join(FRAMEWORKS)} (default: all installed)")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"comma-separated, in any spelling mixedpolicy accepts (16-mixed, bf16-true...): "
                        f"{', '.join(POLICIES + PURE + BASELINES)} (pure ones against the framework's own "
                        f"pure-precision training; tf32: float32 with "
                        f"TF32 math allowed, a GPU baseline), or an fp8 policy over one of the first "
                        f"three, run where the framework's own fp8 set-up has its recipe "
                        f"(float8_from_mixed_bfloat16: Keras; p=f32,c=bf16,float8=tensorwise: torch); "
                        f"jmp parts stay together, ';' also separates (default: %(default)s)")
    p.add_argument("--model", default="mlp",
                   help=f"one of: {', '.join(MODELS)}, or your own MODULE:FACTORY (a module path or a .py "
                        f"file, and a function of no arguments that returns a fresh torch.nn.Module, Flax NNX "
                        f"module or Keras model taking a batch of digits' 64 float32 features to 10 logits, "
                        f"or a dict with 'model', 'batch' (one (inputs, targets) pair) or 'batches' (an "
                        f"iterable of them) and optionally 'loss' (loss(outputs, targets)); the framework is "
                        f"inferred from the model, every Keras backend for a Keras model; an NNX factory also "
                        f"takes Flax's dtype= and param_dtype= for the hand-written side; see "
                        f"docs/benchmarks.md; default: %(default)s)")
    p.add_argument("--data", default="digits", choices=("digits", "synthetic"),
                   help="digits (scikit-learn's, the quality task) or synthetic (seeded random inputs and "
                        "labels at the model's real size, for speed and memory only; default: %(default)s)")
    p.add_argument("--compile", default="off", metavar="off|on|off,on",
                   help="compile both sides: torch.compile, Keras jit_compile=True, tf.function "
                        "jit_compile=True (JAX steps are always jitted); 'off,on' runs both "
                        "(default: %(default)s)")
    p.add_argument("--steps", type=int, default=80,
                   help="training steps each side takes, after the warm-up, for the loss, accuracy, "
                        "skipped steps and scale (the same schedule on every framework; default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="samples per step (default: 64; a user's factory that brings its own batches sets theirs)")
    p.add_argument("--repeats", type=int, default=31,
                   help="timed pairs of blocks (ours, native), interleaved after the training steps; "
                        "medians are reported (default: %(default)s)")
    p.add_argument("--min-block-time", type=float, default=0.03, metavar="SECONDS",
                   help="each timed block has as many steps as make it last this long "
                        "(default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="intra-op threads per worker on a CPU, pinned in every framework and BLAS "
                        "(0: each framework's own default, one per core; default: %(default)s)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (torch; default: %(default)s)")
    p.add_argument("--out", default="bench-results", help="output folder (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="weights, split and batch order (default: 0)")
    p.add_argument("--replicas", type=int, default=0, metavar="N",
                   help="instead of the framework comparison: the mlp trained data-parallel on N (2 to 64) JAX "
                        "replicas (host devices) under each policy and each --reduce dtype, with bytes "
                        "per step (default: 0, off: the framework comparison)")
    p.add_argument("--reduce", default=None,
                   help="with --replicas: the reduce dtypes to compare (float32, bfloat16, float16, "
                        "float8_e5m2, float8_e4m3fn, table-1/2/4/8), and the study's per-layer "
                        f"'fastest' and adaptive 'adaprec' (default: {','.join(replicas.REDUCE_DEFAULT)})")
    p.add_argument("--bandwidth", default=None,
                   help="with --replicas: the link the communication time is modelled at, and "
                        f"adaprec's cost of a byte (default: {_BANDWIDTH})")
    return p


def _check_positive(args: argparse.Namespace) -> None:
    for name in ("steps", "batch_size", "repeats"):
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"Received --{name.replace('_', '-')} {value}; expected a whole number >= 1.")
    if args.warmup < 0:
        raise ValueError(f"Received --warmup {args.warmup}; expected a whole number >= 0.")
    if not 0 <= args.min_block_time <= 60:
        raise ValueError(f"Received --min-block-time {args.min_block_time}; expected seconds from 0 "
                         f"to 60 (0 times the common schedule's blocks whatever their length).")
    cores = os.cpu_count() or 1
    if not 0 <= args.threads <= cores:
        raise ValueError(f"Received --threads {args.threads}; expected a whole number from 1 to this "
                         f"machine's {cores} cores, or 0 for each framework's own default.")
    if not 0 <= args.seed < 2**31:
        raise ValueError(f"Received --seed {args.seed}; expected a whole number from 0 to 2**31 - 1 "
                         f"(every framework's seeded generators take it).")
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        raise ValueError(f"Received --device {args.device!r}; expected cpu, cuda or cuda:N.")
    if args.device != "cpu" and not has_nvidia_gpu():
        raise ValueError(f"Received --device {args.device}, but this machine has no NVIDIA GPU "
                         f"(no /dev/nvidia0); run with --device cpu.")


def has_nvidia_gpu() -> bool:
    """Does this machine have an NVIDIA GPU (its device files), without importing a framework?"""
    return any(os.path.exists(p) for p in ("/dev/nvidia0", "/dev/nvidiactl"))


def given_options(argv: list[str] | None) -> set[str]:
    """The destinations of the options the command line gives (abbreviated or not), defaults aside."""
    p, unset = parser(), object()
    given = vars(p.parse_args(argv, argparse.Namespace(**dict.fromkeys(vars(p.parse_args([])), unset))))
    return {name for name, value in given.items() if value is not unset}  # (argparse fills in only the absent)


#: the framework comparison's timing options, which the replica comparison does not read
_NOT_FOR_REPLICAS = ("compile", "repeats", "min_block_time", "threads")


def _check_replicas(args: argparse.Namespace, frameworks: tuple, model: str, given: set) -> tuple:
    """The --reduce dtypes where --replicas is on, after checking both; --reduce and --bandwidth
    without --replicas would change nothing, so they are refused, as are the framework
    comparison's timing options with it."""
    if args.replicas < 0 or args.replicas == 1 or args.replicas > 64:
        raise ValueError(f"Received --replicas {args.replicas}; expected a whole number from 2 to 64 "
                         f"(or 0, the default: the framework comparison)"
                         + (": one replica reduces with nobody, so its reduce dtypes would differ in "
                            "nothing but rounding and bytes it never sends." if args.replicas == 1 else "."))
    if not args.replicas:
        given = [f"--{name} {value}" for name, value in (("reduce", args.reduce), ("bandwidth", args.bandwidth))
                 if value is not None]
        if given:
            raise ValueError(f"Received {' and '.join(given)} without --replicas: they set the replica "
                             f"comparison's reduce dtypes and link, and the framework comparison has no "
                             f"replicas. Add --replicas N (e.g. --replicas 4), or drop them.")
        return ()
    idle = [f"--{name.replace('_', '-')} {getattr(args, name)}" for name in _NOT_FOR_REPLICAS if name in given]
    if idle:
        raise ValueError(f"Received {', '.join(idle)} with --replicas: the replica comparison times each "
                         f"policy's steps on JAX host devices once, without the framework comparison's "
                         f"blocks, threads or compilation; drop {'them' if len(idle) > 1 else 'it'}.")
    args.reduce = args.reduce if args.reduce is not None else ",".join(replicas.REDUCE_DEFAULT)
    args.bandwidth = args.bandwidth if args.bandwidth is not None else _BANDWIDTH
    if model != "mlp" or args.device != "cpu" or args.data != "digits":
        raise ValueError(f"Received --replicas with --model {model} --device {args.device} --data "
                         f"{args.data}; the replica comparison trains the mlp on digits on JAX host "
                         f"devices: use --model mlp --device cpu --data digits.")
    if "jax" not in frameworks:
        raise ValueError("Received --replicas, which runs on JAX, but JAX (with optax) is not "
                         "installed or not in --frameworks; pip install 'mixedpolicy[jax]'.")
    from mixedpolicy.adaprec import parse_bandwidth

    parse_bandwidth(args.bandwidth)
    return replicas.resolve_reduce(args.reduce)


def _main_replicas(args: argparse.Namespace, policies: tuple, reduce_dtypes: tuple, split: tuple) -> int:
    os.makedirs(args.out, exist_ok=True)
    weights_path = os.path.abspath(os.path.join(args.out, "initial_weights_mlp.npz"))
    models.save_weights(weights_path, models.init_weights("mlp", models.config("mlp", "cpu"), args.seed))
    data_path = os.path.abspath(os.path.join(args.out, "digits_split.npz"))
    data.save(data_path, split)
    print(f"mixedpolicy bench: mlp on {args.replicas} JAX replicas, batch {args.batch_size} per replica, "
          f"{args.warmup} warm-up + {args.steps} steps, {len(policies) * len(reduce_dtypes)} runs", flush=True)
    try:
        runs = replicas.run_all(args, policies, reduce_dtypes, data_path, weights_path)
    except RuntimeError as err:
        print(f"\nmixedpolicy bench: error: {err}", file=sys.stderr)
        return 1
    text = replicas.table(runs)
    with open(os.path.join(args.out, "replicas.json"), "w") as f:
        json.dump({"runs": runs}, f, indent=1)
    with open(os.path.join(args.out, "replicas.md"), "w") as f:
        f.write(text + "\n")
    if report.can_plot():
        text += "\n\nwrote " + replicas.plot(runs, os.path.join(args.out, "replicas_curves.png"))
    print()
    print(text)
    return 0


def _load_digits(seed: int) -> tuple:
    try:
        return data.digits(seed)
    except ImportError as err:
        raise ValueError(f"the bench trains on scikit-learn's digits data set, but scikit-learn "
                         f"cannot be imported ({err}); install it: pip install "
                         f"'mixedpolicy[bench]' (or scikit-learn).") from None


def run_one(spec: RunSpec) -> dict:
    held = runners.cores(spec.framework, spec.device, spec.threads)
    proc = subprocess.run([sys.executable, "-m", "mixedpolicy.bench.worker", json.dumps(spec._asdict())],
                          env=runners.environment(spec.framework, spec.device, spec.threads), capture_output=True,
                          text=True, preexec_fn=None if held is None else lambda: os.sched_setaffinity(0, held))
    if proc.returncode != 0:
        raise RuntimeError(f"The {spec.framework} run under {spec.policy} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _sizes(cfg: dict) -> str:
    return ", ".join(f"{k} {'x'.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in cfg.items())


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        frameworks = resolve_frameworks(args.frameworks)
        policies = resolve_policies(args.policies)
        model = resolve_model(args.model)
        user = None
        if models.is_user(model):
            models.config(model, args.device, args.data)  # a user's model trains on digits or its own data
            user = user_model_info(model, frameworks if args.frameworks else [], policies)
            frameworks = user.frameworks
        if user and user.own_data and args.batch_size is not None:
            raise ValueError(f"Received --batch-size {args.batch_size} with --model {model}, whose factory "
                             f"brings its own batches (their size is the batch size); drop --batch-size, or "
                             f"change the batches the factory returns.")
        args.batch_size = 64 if args.batch_size is None else args.batch_size
        compiles = resolve_compile(args.compile)
        _check_positive(args)
        split = _load_digits(args.seed) if args.data == "digits" and not (user and user.own_data) else None
        if split is not None and args.batch_size * max(args.replicas, 1) > len(split[0]):
            raise ValueError(f"Received --batch-size {args.batch_size} on {max(args.replicas, 1)} "
                             f"replica(s), more than the {len(split[0])} training samples; choose at "
                             f"most {len(split[0]) // max(args.replicas, 1)}.")
        reduce_dtypes = _check_replicas(args, frameworks, model, given_options(argv))
        if not any(runs_on(f, p) for f in frameworks for p in policies):
            raise ValueError(f"Received --policies {args.policies!r} with --frameworks "
                             f"{','.join(frameworks)}: no framework there trains these fp8 recipes with "
                             f"its own tools (torch: tensorwise, rowwise, rowwise_with_gw_hp; Keras: "
                             f"delayed) or these update recipes with the bench's SGD (torch: stochastic "
                             f"rounding and Kahan; JAX and Keras: those and 8-bit state). Add such a "
                             f"framework or policy.")
        if args.replicas and any(mp_float8(p) or memory_policy(p) for p in policies):
            raise ValueError("Received fp8 policies or update recipes with --replicas; the replica "
                             "comparison runs the float and mixed policies. Drop them there.")
        check_out(args.out)
    except ValueError as err:
        print(f"mixedpolicy bench: error: {err}", file=sys.stderr)
        return 2
    if args.replicas:
        return _main_replicas(args, policies, reduce_dtypes, split)
    with_plots = report.can_plot()
    if not with_plots:
        print("mixedpolicy bench: matplotlib is not installed, so no PNG plots will be written "
              "(pip install 'mixedpolicy[bench]'); the table, results.json and report.md will be.",
              file=sys.stderr)
    os.makedirs(args.out, exist_ok=True)
    weights_path = os.path.join(args.out, f"initial_weights_{model if not models.is_user(model) else 'user'}.npz")
    cfg = {} if user and user.own_data else models.config(model, args.device, args.data)
    models.save_weights(weights_path, user.weights if user else models.init_weights(model, cfg, args.seed))
    data_path = ""
    if split is not None:
        data_path = os.path.abspath(os.path.join(args.out, "digits_split.npz"))
        data.save(data_path, split)
    specs = [RunSpec(f, p, model, args.batch_size, args.steps, args.repeats, args.warmup, args.device,
                     os.path.abspath(weights_path), args.seed, args.min_block_time, data_path, args.data, c,
                     args.threads)
             for f in frameworks for c in compiles for p in policies if runs_on(f, p)]
    for p in policies:
        left = [f for f in frameworks if not runs_on(f, p)]
        if left and memory_policy(p):  # an update recipe ours does not carry with SGD there
            print(f"mixedpolicy bench: {p} is not run on {', '.join(left)}: ours does not train the "
                  f"bench's SGD with that update recipe there (see docs/memory.md)", file=sys.stderr)
        elif left:  # an fp8 recipe the framework's own tools have no set-up for
            print(f"mixedpolicy bench: {p} is not run on {', '.join(left)}: no fp8 set-up of "
                  f"{'their' if len(left) > 1 else 'its'} own trains with that recipe to compare "
                  f"with (see docs/float8.md)", file=sys.stderr)
    fed = ("its own batches" if user and user.own_data else f"{args.data}, batch {args.batch_size}")
    print(f"mixedpolicy bench: {model}{f' ({_sizes(cfg)})' if cfg else ''} on {fed}, {args.warmup} warm-up + "
          f"{args.steps} training steps, {args.repeats} timed pairs of blocks of at least {args.min_block_time} s, "
          f"{len(specs)} runs (one process each)", flush=True)
    runs, start, load_at_start = [], time.perf_counter(), report.load_average()
    with progress.Runs(len(specs)) as shown:
        for i, spec in enumerate(specs, 1):
            name = f"{spec.framework}{' compiled' if spec.compile else ''} {spec.policy}"
            shown.start(i, name)
            t0 = time.perf_counter()
            try:
                record = run_one(spec)
            except RuntimeError as err:
                shown.fail(f"mixedpolicy bench: error: {err}")
                return 1
            record["overhead_goal"] = goal(args.device)  # what the table's flag and the notes hold it to
            runs.append(record)
            accuracy = "-" if record["accuracy"] is None else f"{record['accuracy']:.3f}"
            shown.done(i, name, f"{record['step_time_s']['median'] * 1e3:.2f} ms/step, accuracy {accuracy}, "
                                f"overhead {record['overhead_vs_native']:.3f} ({time.perf_counter() - t0:.0f} s)")
    results = {"environment": {**report.environment(args, frameworks, runs), "load_average_at_start": load_at_start,
                               "model_config": cfg}, "runs": runs}
    paths = report.write(results, args.out, with_plots)
    print()
    progress.print_table(report.table(runs), runs)
    for line in report.wide(runs) + report.above_goal(runs, results["environment"]["device"]):
        print(line, file=sys.stderr)
    print(f"\n{len(runs)} runs in {time.perf_counter() - start:.0f} s; wrote " + ", ".join(paths))
    return 0
