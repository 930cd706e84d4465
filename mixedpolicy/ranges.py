"""Range statistics of one tensor: the vector each backend computes on the device.

Per tensor, a histogram over log2 |x|, the count of zeros and non-finite values, the largest
|x|, for float16 and bfloat16 the exact counts that would overflow, become subnormal or
be flushed to zero at each scale asked about, and a histogram over log2 of each |x| relative
to the largest |x| of its row (`ROW_BINS`; what per-row scaling sees; a row is the tensor's
last axis: a token's features, or a weight's input dimension as the backends lay it out
before computing; `layout` says where each lives in the vector).
`numpy_stats` is the reference the backends are tested against; `RangeStats` reads a vector
back. `mixedpolicy.gradient_report` (`inspect_gradients`, `GradientReport`) builds on them.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

#: log2 bins: bin i holds |x| in [2^(EMIN+i), 2^(EMIN+i+1)); below EMIN (only float64 has
#: such values) falls in bin 0, above EMAX in the last.
EMIN, EMAX = -160, 130
BINS = EMAX - EMIN
#: the formats each report checks, and their limits
FORMATS = ("float16", "bfloat16")
LIMITS = {  # largest finite, smallest normal, smallest subnormal
    "float16": (65504.0, 2.0**-14, 2.0**-24),
    "bfloat16": (3.3895313892515355e38, 2.0**-126, 2.0**-133),
}
#: what a row holds: a layer's own weights (their values), its weights' gradients, its
#: outputs and its outputs' gradients; the loss scale multiplies the gradients only
KINDS = ("weight", "weight_grad", "activation", "activation_grad")
GRADIENTS = ("weight_grad", "activation_grad")
_HEAD = 4  # count, zeros, nonfinite, amax
#: per-row bins: bin j holds |x| / (its row's max |x|) in [2^-(j+1), 2^-j) (1 itself in bin 0);
#: the last also everything smaller (below what any fp8 or 16-bit format keeps of a row)
ROW_BINS = 48


def layout(scales: Sequence[float]) -> int:
    """The length of one tensor's stats vector: count, zeros, non-finite, max |x|, the BINS
    log2 counts, for each scale and each of `FORMATS`: overflow, subnormal, flushed, then
    the ROW_BINS per-row relative counts."""
    return _HEAD + BINS + 3 * len(FORMATS) * len(scales) + ROW_BINS


def rows(shape: tuple) -> tuple:
    """The 2-D shape whose rows `stats` scales one by one: the last axis is a row (a scalar or
    an empty tensor: one row)."""
    last = int(shape[-1]) if shape else 1
    size = int(np.prod(shape)) if shape else 1
    return (size // last, last) if last else (1, 0)


def numpy_stats(x: Any, scales: Sequence[float]) -> np.ndarray:
    """The stats vector of `x` computed with numpy and ml_dtypes (the reference the device
    versions are tested against, and TensorFlow's path)."""
    import ml_dtypes

    x = np.asarray(x, dtype=np.float32)
    a = np.abs(x).reshape(-1)
    finite = np.isfinite(a)
    a = np.where(finite, a, np.float32(0))
    nz = a > 0
    _, e = np.frexp(a)
    bins = np.clip(e.astype(np.int64) - 1 - EMIN, 0, BINS - 1)
    hist = np.bincount(bins[nz], minlength=BINS)
    out = [a.size, int(np.sum(~nz & finite)), int(np.sum(~finite)), float(a.max()) if a.size else 0.0]
    out += hist.tolist()
    with np.errstate(over="ignore"):
        for s in scales:
            y = a * np.float32(s)
            for fmt, dt in zip(FORMATS, (np.float16, ml_dtypes.bfloat16)):
                r = y.astype(dt).astype(np.float32)
                tiny = LIMITS[fmt][1]
                out += [int(np.sum(np.isinf(r) & nz)), int(np.sum((r != 0) & (np.abs(r) < tiny))),
                        int(np.sum((r == 0) & nz))]
    by_row = a.reshape(rows(x.shape))
    top = by_row.max(axis=1, keepdims=True) if by_row.size else by_row
    _, e = np.frexp(np.divide(by_row, top, out=np.zeros_like(by_row), where=by_row > 0).reshape(-1))
    out += np.bincount(np.clip(-e[nz].astype(np.int64), 0, ROW_BINS - 1), minlength=ROW_BINS).tolist()
    return np.asarray(out, np.float64)


def merge(a: np.ndarray | None, b: np.ndarray) -> np.ndarray:
    """Two stats vectors of the same tensor (two batches) as one: counts add, max |x| is the max."""
    if a is None:
        return b.copy()
    out = a + b
    out[3] = max(a[3], b[3])
    return out


class RangeStats(NamedTuple):
    """One layer's values of one kind, over the batches inspected."""

    path: str
    kind: str            # weight_grad, activation or activation_grad
    size: int            # values seen
    zeros: int
    nonfinite: int
    amax: float
    hist: np.ndarray     # BINS counts over log2 |x| (see EMIN)
    fractions: dict      # (format, scale) -> (overflow, subnormal, flushed) as fractions
    row_hist: np.ndarray | None = None  # ROW_BINS counts over log2 |x| / its row's max |x|

    @classmethod
    def from_vector(cls, path: str, kind: str, v: np.ndarray, scales: Sequence[float]) -> "RangeStats":
        size, end = int(v[0]), _HEAD + BINS + 3 * len(FORMATS) * len(scales)
        tail = v[_HEAD + BINS:end].reshape(len(scales), len(FORMATS), 3) / max(size, 1)
        fractions = {(fmt, float(s)): tuple(float(f) for f in tail[i, j])
                     for i, s in enumerate(scales) for j, fmt in enumerate(FORMATS)}
        return cls(path, kind, size, int(v[1]), int(v[2]), float(v[3]), v[_HEAD:_HEAD + BINS].astype(np.int64),
                   fractions, v[end:end + ROW_BINS].astype(np.int64))

    def flushed_at(self, scale: float, fmt: str = "float16") -> float:
        """The fraction of the values (zeros excepted) that become 0 in `fmt` at `scale`, from
        the histogram (exact at the scales inspected, a bin's resolution elsewhere)."""
        upper = 2.0 ** np.arange(EMIN + 1, EMAX + 1) * scale  # each bin's upper edge, scaled
        below = int(self.hist[upper <= LIMITS[fmt][2] / 2].sum())
        return below / max(self.size - self.zeros - self.nonfinite, 1)
