"""fp8 what-if from the ranges `inspect_gradients` saw: what per-tensor scaling would lose.

Under per-tensor current scaling (the ``tensorwise`` recipe) each tensor is multiplied by
``fp8_max / amax`` before the cast, so nothing overflows; what is lost are the values
that land below the format's smallest normal (subnormal: fewer bits) or below half its
smallest subnormal (flushed to zero). Activations travel in e4m3, gradients in e5m2 (the
recipe's formats): a layer's output gradient is the e5m2 operand of its own backward
matmuls; its output is the e4m3 input of the *next* matmul, whichever layer that is, so
only the gradients decide which layers `keep_out` names (the outputs and the weights, the
third operand, in e4m3 too, are shown, for the user to read against the model's order;
a layer's weights row holds all its own parameters, the bias too). The fractions come from each tensor's log2 histogram and its largest
|x| over the batches inspected, to a power of two's resolution (a bin counts as lost only
when its upper edge is, so the figures are a lower bound); a batch whose own amax is
smaller scales its values up further, so it loses less than this says. Under per-row
scaling (the ``rowwise`` recipes) each row is scaled by its own max |x|: the per-row
figures come from each value's log2 relative to its row's max, to the same resolution (a
row: a token's features for the outputs and their gradients, what one output multiplies
for the weights, `mixedpolicy.ranges.rows`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

#: largest finite, smallest normal, smallest subnormal of the fp8 formats
FLOAT8_LIMITS = {"float8_e4m3fn": (448.0, 2.0**-6, 2.0**-9), "float8_e5m2": (57344.0, 2.0**-14, 2.0**-16)}
#: which format each kind of value travels in under the per-tensor recipes
FORMAT_OF = {"weight": "float8_e4m3fn", "activation": "float8_e4m3fn", "activation_grad": "float8_e5m2"}


class Float8Loss(NamedTuple):
    """One layer's values of one kind under per-tensor fp8 scaling."""

    path: str
    kind: str
    format: str
    subnormal: float  # fraction of the nonzero finite values that become subnormal
    flushed: float    # fraction that become zero
    row_subnormal: float = float("nan")  # the same under per-row scaling (nan: not measured)
    row_flushed: float = float("nan")


def what_if(rows: Any, emin: int) -> list[Float8Loss]:
    """A `Float8Loss` per `RangeStats` row with values, in the rows' order (`emin`: the log2 of
    the histogram's first bin's lower edge, `mixedpolicy.ranges.EMIN`)."""
    out = []
    for r in rows:
        fmt = FORMAT_OF.get(r.kind)
        nonzero = r.size - r.zeros - r.nonfinite
        if fmt is None or nonzero <= 0 or not r.amax > 0:
            continue
        top, tiny, smallest = FLOAT8_LIMITS[fmt]
        scaled = 2.0 ** np.arange(emin + 1, emin + 1 + len(r.hist)) * (top / r.amax)  # bins' upper edges
        flushed = int(r.hist[scaled <= smallest / 2].sum())
        below_normal = int(r.hist[scaled <= tiny].sum())
        row = (float("nan"), float("nan"))
        if getattr(r, "row_hist", None) is not None and len(r.row_hist):
            upper = 2.0 ** -np.arange(len(r.row_hist)) * top  # each relative bin's upper edge, scaled
            row_flushed = int(r.row_hist[upper <= smallest / 2].sum())
            row = ((int(r.row_hist[upper <= tiny].sum()) - row_flushed) / nonzero, row_flushed / nonzero)
        out.append(Float8Loss(r.path, r.kind, fmt, (below_normal - flushed) / nonzero, flushed / nonzero, *row))
    return out


def keep_out(losses: list[Float8Loss], source: Any, max_flushed: float) -> tuple[dict, dict]:
    """({path: source} overrides for the layers more than `max_flushed` of whose output
    gradients flush to zero in e5m2, {path: why}), ready for a `PolicyMap` over an fp8 policy."""
    if not 0 <= max_flushed <= 1:
        raise ValueError(f"Received max_flushed={max_flushed!r}; expected a fraction from 0 to 1.")
    reasons: dict = {}
    for loss in losses:
        if loss.kind == "activation_grad" and loss.flushed > max_flushed and loss.path not in reasons:
            reasons[loss.path] = (f"{loss.flushed:.1%} of its {loss.kind.replace('_', ' ')}s flush to zero in "
                                  f"{loss.format} under per-tensor scaling")
    return {path: source for path in reasons}, reasons


def table(losses: list[Float8Loss]) -> str:
    header = ("path", "kind", "format", "subnormal", "zero", "row subnormal", "row zero")
    cells = [header] + [(x.path or "(root)", x.kind, x.format, f"{x.subnormal:.2%}", f"{x.flushed:.2%}",
                         f"{x.row_subnormal:.2%}", f"{x.row_flushed:.2%}") for x in losses]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)
