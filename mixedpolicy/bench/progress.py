"""What the terminal shows while the bench runs: one line per run and, on a terminal with
`rich` installed, a live progress bar with the time left (ETA) and a table that fits the
terminal's width. Without a terminal (a log, CI) or without rich: plain lines, the same words."""

from __future__ import annotations

import sys
from typing import Any


def _rich() -> Any:
    if not sys.stdout.isatty():
        return None
    try:
        import rich.console
        import rich.progress
    except ImportError:
        return None
    return rich


class Runs:
    """``with Runs(total) as shown``: `start` a run, say it is `done`, or `fail`."""

    def __init__(self, total: int):
        self.total = total
        self.rich = _rich()
        self.bar: Any = None

    def __enter__(self) -> "Runs":
        if self.rich is not None:
            p = self.rich.progress
            self.bar = p.Progress(p.TextColumn("{task.description}"), p.BarColumn(), p.MofNCompleteColumn(),
                                  p.TimeElapsedColumn(), p.TextColumn("left"), p.TimeRemainingColumn())
            self.bar.__enter__()
            self.task = self.bar.add_task("runs", total=self.total)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def start(self, i: int, name: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=f"[{i}/{self.total}] {name}")
        else:
            print(f"  [{i}/{self.total}] {name} ...", end="", flush=True)

    def done(self, i: int, name: str, text: str) -> None:
        if self.bar is not None:
            self.bar.console.print(f"  [{i}/{self.total}] {name} ... {text}", markup=False, highlight=False)
            self.bar.advance(self.task)
        else:
            print(f" {text}", flush=True)

    def fail(self, text: str) -> None:
        if self.bar is None:
            print()
        print(text, file=sys.stderr)


def print_table(plain: str, runs: list) -> None:
    """The results table: on a terminal narrower than it, split into tables of whole columns
    that fit (each repeating the framework and policy); elsewhere (a log, CI) `plain`."""
    import shutil

    if not sys.stdout.isatty():
        print(plain)
        return
    from mixedpolicy.bench.report import columns as table_columns

    width = shutil.get_terminal_size((120, 24)).columns
    chosen = table_columns(runs)
    cells = [[h for h, _ in chosen]] + [[cell(r) for _, cell in chosen] for r in runs]
    widths = [max(len(row[i]) for row in cells) for i in range(len(chosen))]
    key, rest = [0, 1], list(range(2, len(chosen)))
    while rest:
        part = list(key)
        while rest and sum(widths[i] + 2 for i in part + [rest[0]]) <= width or len(part) == len(key):
            part.append(rest.pop(0))
            if not rest:
                break
        for row in cells:
            print("  ".join(row[i].rjust(widths[i]) if i > 1 else row[i].ljust(widths[i]) for i in part).rstrip())
        print()
