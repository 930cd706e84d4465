"""`python -m mixedpolicy` / the `mixedpolicy` console script."""

from __future__ import annotations

import sys

_COMMANDS = ("bench",)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: mixedpolicy bench [options]   (mixedpolicy bench --help for the options)")
        return 0 if argv else 2
    if argv[0] != "bench":
        print(f"mixedpolicy: error: unknown command {argv[0]!r}; expected one of: "
              f"{', '.join(_COMMANDS)}.", file=sys.stderr)
        return 2
    from mixedpolicy.bench.cli import main as bench

    return bench(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
