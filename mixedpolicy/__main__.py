"""`python -m mixedpolicy` / the `mixedpolicy` console script: bench, inspect, describe."""

from __future__ import annotations

import argparse
import sys

_COMMANDS = {
    "bench": "the same model on several frameworks under each policy, against their own AMP",
    "inspect": "per-layer gradient ranges of a bench model: a safe loss scale, layers to keep float32",
    "describe": "the per-layer policy table of your own model (MODULE:FACTORY)",
}


def _top() -> argparse.ArgumentParser:
    from mixedpolicy import __version__

    p = argparse.ArgumentParser(prog="mixedpolicy", description="One mixed-precision vocabulary for JAX, "
                                "PyTorch, TensorFlow and Keras 3. Each command has its own --help.")
    p.add_argument("--version", action="version", version=f"mixedpolicy {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, text in _COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    return p


def _describe(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mixedpolicy describe",
                                description="Builds your model with FACTORY() from MODULE (a module path or a "
                                            ".py file; a factory of the bench's that returns a dict gives its "
                                            "'model') and prints mixedpolicy's per-layer table, after "
                                            "putting --policy on it if given.")
    p.add_argument("target", metavar="MODULE:FACTORY")
    p.add_argument("--policy", default=None, help="a policy in any spelling mixedpolicy accepts")
    args = p.parse_args(argv)
    import mixedpolicy as mp
    from mixedpolicy.bench.user_model import init_linen, is_linen, load_factory, unpack

    try:
        policy = None if args.policy is None else mp.Policy(args.policy)
        # the global policy first, as a script sets it: a Keras model the factory builds
        # (a functional or Sequential one is built as it is defined) takes its dtypes
        mp.set_global_policy(policy)
        # a bench factory's dict (the model with its own batches and loss) too: its model
        setup = unpack(load_factory(args.target)(), args.target, named=args.target)
        model, linen = setup.model, is_linen(setup.model)
        if linen and policy is None:
            raise ValueError(f"Received {args.target}, whose factory returns a Flax linen module: describe "
                             f"reads a linen module through the policy put on it (apply_policy), so give one: "
                             f"--policy mixed_bfloat16, say.")
        if policy is not None:
            model = mp.apply_policy(model, policy)
        if linen:
            init_linen(model, setup, args.target)
        print(mp.describe(model))
    except (ValueError, TypeError, ImportError) as err:
        print(f"mixedpolicy describe: error: {err}", file=sys.stderr)
        return 2
    finally:
        mp.set_global_policy(None)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and not argv[0].startswith("-") and argv[0] not in _COMMANDS:
        print(f"mixedpolicy: error: unknown command {argv[0]!r}; expected one of: "
              f"{', '.join(_COMMANDS)} (mixedpolicy --help).", file=sys.stderr)
        return 2
    if not argv or argv[0].startswith("-"):
        try:
            _top().parse_args(argv)
        except SystemExit as done:  # --help, --version: argparse's exit status
            return int(done.code or 0)
        _top().print_help()
        return 2
    command, rest = argv[0], argv[1:]
    if command == "bench":
        from mixedpolicy.bench.cli import main as bench

        return bench(rest)
    if command == "inspect":
        from mixedpolicy.bench.inspect_cli import main as inspect

        return inspect(rest)
    return _describe(rest)


if __name__ == "__main__":
    sys.exit(main())
