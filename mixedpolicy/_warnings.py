"""Warnings at the user's line: the stack level of the first frame outside mixedpolicy."""

from __future__ import annotations

import sys


def user_stacklevel(*passing: str) -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` called by this function's caller point
    at the first frame outside mixedpolicy and the `passing` packages (top-level names such as
    ``"jax"``, whose tracing calls us under ``jax.jit``): the user's line, or their trainer's."""
    skipped = {"mixedpolicy", *passing}
    frame, level = sys._getframe(1), 1  # (the caller of warnings.warn: stacklevel 1)
    while frame is not None and str(frame.f_globals.get("__name__", "")).partition(".")[0] in skipped:
        frame, level = frame.f_back, level + 1
    return level
