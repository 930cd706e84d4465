"""`mixedpolicy inspect`: the gradient ranges of a bench model, and the loss scale they allow.

Builds one of the bench's models (its shared initial weights, float32, no policy) on one
framework, or a user's `MODULE:FACTORY`, runs `--batches` digits batches (or the first
`--batches` of the factory's own, with its loss) through `mixedpolicy.inspect_gradients`, prints
the per-layer table and the recommendation (a static loss scale and the layers to keep in
float32), and writes the histogram figure. A Keras framework runs in a process of its own
(Keras picks its backend per process).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys

from mixedpolicy.bench import data, models, runners

FRAMEWORKS = tuple(r.framework for r in runners.RUNNERS if r.inspects)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mixedpolicy inspect",
                                description="Per-layer gradient (and, on torch, activation) ranges of a bench "
                                            "model on digits: is float16 safe, with which loss scale, and which "
                                            "layers should stay float32?")
    p.add_argument("--model", default="mlp",
                   help=f"one of: {', '.join(models.MODELS)}, or your own MODULE:FACTORY, as `mixedpolicy bench "
                        f"--model` takes it (a torch, Flax NNX or Keras model from digits' 64 features to 10 "
                        f"logits, or a dict with its own batches and loss; its framework inferred; default: "
                        f"%(default)s)")
    p.add_argument("--framework", default=None, choices=FRAMEWORKS,
                   help="for a built-in model (default: torch)")
    p.add_argument("--batches", type=int, default=2,
                   help="batches to look at: digits', or a factory's own (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="of the digits batches (default: 64; a factory's own batches keep their size)")
    p.add_argument("--loss-scale", type=float, default=2.0**15,
                   help="the scale to check besides 1 (default: 32768, the dynamic scale's start)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="inspect-results", help="folder for the PNG (default: %(default)s)")
    return p


def _framework(args: argparse.Namespace) -> str:
    """The framework to inspect on: --framework for a built-in model (torch by default); a
    user's MODULE:FACTORY's own, inferred as the bench infers it.

    Raises:
      ValueError: the model is neither, or --framework names another framework than a user's model's.
    """
    from mixedpolicy.bench.spec import resolve_model, user_model_info

    model = resolve_model(args.model)
    if not models.is_user(model):
        return args.framework or "torch"
    info = user_model_info(model, [args.framework] if args.framework else [], flag="--framework")
    return info.frameworks[0]


def _own_batches(model: str):
    """A user's factory's `UserSetup` where it brings its own batches, else None."""
    from mixedpolicy.bench import user_model

    if not models.is_user(model):
        return None
    setup = user_model.build(model)
    return setup if setup.batches is not None else None


def _digits(args: argparse.Namespace, runner) -> tuple:
    """The model in float32 (a bench model from its shared weights, or a user's) and
    `--batches` digits batches of `--batch-size`."""
    cfg = models.config(args.model, "cpu")
    net = runner.network(args.model, cfg, models.init_weights(args.model, cfg, args.seed), "cpu")
    x_train, y_train, _, _ = data.digits(args.seed)
    x = models.inputs(args.model, x_train, cfg)
    y = models.targets(args.model, x, y_train)
    prepare = getattr(runner, "prepare", lambda model, x: x)
    order = data.batch_order(len(x), args.batch_size or 64, args.batches, args.seed)
    return net, [(prepare(args.model, x[i]), y[i]) for i in order]


_FLOAT32_MAX = 3.4028234663852886e38


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    for name, value in (("batches", args.batches), ("batch-size", args.batch_size)):
        if value is not None and value < 1:
            print(f"mixedpolicy inspect: error: Received --{name} {value}; expected a whole number >= 1.",
                  file=sys.stderr)
            return 2
    try:
        if not (math.isfinite(args.loss_scale) and 0 < args.loss_scale <= _FLOAT32_MAX):
            raise ValueError(f"Received --loss-scale {args.loss_scale}; expected a finite number > 0 "
                             f"(the scale to check besides 1, e.g. 32768), at most float32's largest "
                             f"{_FLOAT32_MAX:.4g} (the gradients it scales are float32 or narrower).")
        if not 0 <= args.seed < 2**31:
            raise ValueError(f"Received --seed {args.seed}; expected a whole number from 0 to 2**31 - 1.")
        args.framework = _framework(args)
        from mixedpolicy.bench.outputs import check_out

        check_out(args.out)
    except ValueError as err:
        print(f"mixedpolicy inspect: error: {err}", file=sys.stderr)
        return 2
    backend = runners.runner(args.framework).keras_backend
    if backend and os.environ.get("KERAS_BACKEND") != backend:  # Keras: a process on that backend
        env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
        return subprocess.run([sys.executable, "-m", "mixedpolicy", "inspect", *(argv or sys.argv[2:])],
                              env=env).returncode
    setup = _own_batches(args.model)
    if setup is not None and args.batch_size is not None:
        print(f"mixedpolicy inspect: error: Received --batch-size {args.batch_size} for --model {args.model}, "
              f"whose factory brings its own batches (their size is the batch size); drop --batch-size.",
              file=sys.stderr)
        return 2
    try:
        if setup is None:
            from sklearn.datasets import load_digits  # noqa: F401
    except ImportError:
        print("mixedpolicy inspect: error: it looks at scikit-learn's digits; pip install "
              "'mixedpolicy[bench]' (or scikit-learn).", file=sys.stderr)
        return 2
    import mixedpolicy as mp

    runner = runners.load(args.framework)
    if setup is not None:  # a factory with its own batches (and loss): the first --batches of them
        net, batches = setup.model, setup.batches[:args.batches]
        report = mp.inspect_gradients(net, lambda m, b: runner.user_loss(setup, m, b), batches,
                                      loss_scale=args.loss_scale)
    else:
        try:
            net, batches = _digits(args, runner)
        except ValueError as err:  # more samples asked for than digits has
            print(f"mixedpolicy inspect: error: {err}", file=sys.stderr)
            return 2
        report = mp.inspect_gradients(net, lambda m, b: runner.loss(m, *b), batches, loss_scale=args.loss_scale)
    advice = report.recommend()
    print(report)
    print(f"\nrecommended static loss scale: {advice.loss_scale:g} "
          f"(mp.LossScaleOptimizer(opt, loss_scale=mp.StaticLossScale({advice.loss_scale:g})))")
    if advice.overrides:
        print(f"keep in float32: {advice.overrides}")
        for path, why in advice.reasons.items():
            print(f"  {path}: {why}")
    else:
        print("every layer fits float16 at that scale: no override needed")
    name = args.model.rpartition(":")[2] if models.is_user(args.model) else args.model
    png = os.path.join(args.out, f"inspect_{name}_{args.framework}.png")
    try:
        print(f"wrote {report.plot(png, advice.loss_scale)}")
    except ImportError:
        print("(matplotlib is not installed: no figure; pip install 'mixedpolicy[bench]')", file=sys.stderr)
    return 0
