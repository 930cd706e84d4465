"""Where the bench's commands write: refused before any run when it cannot be written, so that
minutes of measurement are never lost at the end."""

from __future__ import annotations

import os


def check_out(out: str) -> None:
    """Refuses an --out that is a file or cannot be made or written, before any run (then makes it)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"Received --out {out!r}, which is a file; expected a folder (new or "
                         f"existing) for what the command writes (results, report, plots).")
    parent = out
    while not os.path.exists(parent):
        parent = os.path.dirname(os.path.abspath(parent))
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"Received --out {out!r}, but {parent!r} cannot be written; choose a "
                         f"folder you can write to.")
    try:  # made now, the last check: a folder the system refuses (/proc, a full disk) is said here
        os.makedirs(out, exist_ok=True)
    except OSError as err:
        raise ValueError(f"Received --out {out!r}, which cannot be made ({err.strerror}); choose a "
                         f"folder you can write to.") from None


def check_out_file(out: str | None, flag: str = "--out") -> None:
    """Refuses a JSON output path that is a folder or whose folder cannot be written, before any
    run (nothing is written yet); None: no file asked for."""
    if out is None:
        return
    if os.path.isdir(out):
        raise ValueError(f"Received {flag} {out!r}, which is a folder; expected a file name for the JSON "
                         f"rows, e.g. {os.path.join(out, 'rows.json')!r}.")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK) or (
            os.path.exists(out) and not os.access(out, os.W_OK)):
        raise ValueError(f"Received {flag} {out!r}, which cannot be written (its folder {parent!r} is "
                         f"missing or read-only, or the file is); choose a path you can write to.")
