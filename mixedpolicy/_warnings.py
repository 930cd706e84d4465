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


#: Whether code outside mixedpolicy has read a wrapper's loss scale (optax's state, Keras's
#: optimizer): such a loop may scale its loss by hand, so an update that comes while the wrapper's
#: ``scale_loss`` was never called is not taken for a loop that forgot to scale.
SCALE_READ_BY_USER = [False]


def note_scale_read(*passing: str) -> None:
    """Notes, in `SCALE_READ_BY_USER`, a read of a loss scale by the code that called the reader
    (the caller of this function's caller) where it is outside mixedpolicy and `passing`."""
    if not SCALE_READ_BY_USER[0] and str(sys._getframe(2).f_globals.get("__name__", "")).partition(".")[0] not in {
            "mixedpolicy", *passing}:
        SCALE_READ_BY_USER[0] = True
