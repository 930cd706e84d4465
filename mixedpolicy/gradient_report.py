"""Is float16 safe for this model, with which loss scale, and which layers should stay float32?

`inspect_gradients(model, loss_fn, batches)` runs a few batches forward and backward and
reports, per layer (the paths `describe` and `PolicyMap` use), the magnitudes of its
weights and their gradients and, where the framework exposes them cheaply (PyTorch's module
hooks), of the activations and the activations' gradients: a histogram over log2 |x|,
the largest |x|, and for float16 and bfloat16 the exact counts that would overflow, become
subnormal or be flushed to zero, at scale 1 and at the loss scale asked about. Each
backend computes these on the device with the framework's own casts and moves one small
vector per layer to the host (`layout` says what it holds).

`GradientReport.recommend()` proposes the largest power-of-two static loss scale that
overflows nothing seen (with a safety margin), and the layers whose values fall outside
float16 even then as a ready `PolicyMap` override; `plot()` draws the histogram of the
mixed-precision paper's figure with float16's limits, before and after scaling.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, NamedTuple, Sequence

import numpy as np

from mixedpolicy.ranges import BINS, EMAX, EMIN, GRADIENTS, LIMITS, RangeStats


class Recommendation(NamedTuple):
    """A static loss scale, and the layers to keep in float32 with it."""

    loss_scale: float
    overrides: dict      # path -> "float32", ready for PolicyMap / apply_policy overrides
    reasons: dict        # path -> why it stays in float32


class GradientReport:
    """What `inspect_gradients` saw: one `RangeStats` per (layer, kind)."""

    def __init__(self, rows: Iterable[RangeStats], scales: Sequence[float], framework: str, batches: int):
        self.rows = list(rows)
        self.scales = tuple(float(s) for s in scales)
        self.framework, self.batches = framework, batches

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, path: str, kind: str = "weight_grad") -> RangeStats:
        for r in self.rows:
            if r.path == path and r.kind == kind:
                return r
        raise KeyError(f"No {kind} row for {path!r}; the report has: "
                       f"{', '.join(sorted({r.path for r in self.rows}))}.")

    def amax(self, kinds: Sequence[str] = ("weight_grad", "activation_grad")) -> float:
        return max((r.amax for r in self.rows if r.kind in kinds), default=0.0)

    def recommend(self, margin: float = 8.0, max_flushed: float = 0.01) -> Recommendation:
        """The largest power-of-two scale at which the largest gradient seen, times `margin`,
        stays finite in float16 (at least 1; the default margin, three powers of two, leaves
        room for the gradients' growth once training moves the weights); and the layers that stay in float32: those
        whose weights or activations overflow float16, whose gradients overflow even at scale 1, or
        more than `max_flushed` of whose gradients still flush to zero at that scale.

        Raises:
          ValueError: margin < 1 or max_flushed outside [0, 1].
        """
        if not margin >= 1 or not 0 <= max_flushed <= 1:
            raise ValueError(f"Received margin={margin!r}, max_flushed={max_flushed!r}; expected "
                             f"margin >= 1 and max_flushed from 0 to 1.")
        top = LIMITS["float16"][0]
        reasons: dict = {}
        # gradients too large for float16 even at scale 1 keep their layer in float32 and
        # do not hold the others' scale down
        for r in self.rows:
            if r.kind not in GRADIENTS and r.amax > top:  # its weights or outputs, cast as they are
                reasons.setdefault(r.path, f"{r.kind}s reach {r.amax:.3g} > float16's {top:g}")
            elif r.kind in GRADIENTS and r.amax * margin > top:
                reasons.setdefault(r.path, f"gradients reach {r.amax:.3g}: beyond float16's {top:g} "
                                           f"at scale 1 with the margin")
        kept = [r.amax for r in self.rows if r.kind in GRADIENTS and r.path not in reasons]
        amax = max(kept, default=0.0)
        scale = 1.0 if amax <= 0 else 2.0 ** max(0, math.floor(math.log2(top / (amax * margin))))
        scale = min(scale, 2.0**24)
        for r in self.rows:
            if r.kind in GRADIENTS and r.path not in reasons and r.flushed_at(scale) > max_flushed:
                reasons[r.path] = (f"{r.flushed_at(scale):.1%} of its {r.kind.replace('_', ' ')}s flush to "
                                   f"zero in float16 at scale {scale:g}")
        return Recommendation(scale, {p: "float32" for p in reasons}, reasons)

    def float8(self) -> list:
        """fp8 what-if: per layer, the fractions of its weights and outputs (e4m3: its matmul's
        and the next one's operands) and output gradients (e5m2) that become subnormal or zero
        under per-tensor current scaling and under per-row scaling (``row_subnormal``,
        ``row_flushed``), a lower bound to a power of two's resolution (see
        `mixedpolicy.float8_ranges`); ``mixedpolicy.float8_ranges.table(report.float8())`` prints them."""
        from mixedpolicy.float8_ranges import what_if

        return what_if(self.rows, EMIN)

    def recommend_float8(self, source: Any = "mixed_bfloat16", max_flushed: float = 0.01) -> Recommendation:
        """The layers to keep out of fp8, in `source` precision (the fp8 policy's source): those
        more than `max_flushed` of whose output gradients flush to zero in e5m2 under
        per-tensor scaling; ``overrides`` goes into a `PolicyMap` over the fp8 policy
        (``loss_scale`` is 1: per-tensor scales replace a loss scale in fp8).

        Raises:
          ValueError: max_flushed outside [0, 1], or `source` is not a policy.
        """
        from mixedpolicy.float8_ranges import keep_out
        from mixedpolicy.policy import as_policy

        name = as_policy(source, what="source").name
        overrides, reasons = keep_out(self.float8(), name, max_flushed)
        return Recommendation(1.0, overrides, reasons)

    def __str__(self) -> str:
        """One row per (layer, kind): the float16/bfloat16 fractions at the loss scale asked
        about (weights and activations, which the loss scale does not touch, at 1)."""
        scale = self.scales[-1]
        header = ("path", "kind", "values", "max |x|", "min |x|>0", "at scale",
                  "f16 overflow", "f16 subnormal", "f16 zero", "bf16 zero")
        cells = [header]
        for r in self.rows:
            nonzero = np.nonzero(r.hist)[0]
            low = f"2^{EMIN + int(nonzero[0])}" if nonzero.size else "-"
            at = scale if r.kind in GRADIENTS else 1.0
            f16, bf16 = r.fractions[("float16", at)], r.fractions[("bfloat16", at)]
            cells.append((r.path or "(root)", r.kind, str(r.size), f"{r.amax:.3g}", low, f"{at:g}",
                          f"{f16[0]:.2%}", f"{f16[1]:.2%}", f"{f16[2]:.2%}", f"{bf16[2]:.2%}"))
        widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)

    def plot(self, path: str, scale: float | None = None, kinds: Sequence[str] = ("weight_grad", "activation_grad")) -> str:
        """A PNG like the mixed-precision paper's figure: the histogram of log2 |x| over every
        layer's values of `kinds`, with float16's overflow, smallest normal and smallest
        subnormal marked, before and after scaling by `scale` (default: the recommended)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        scale = self.recommend().loss_scale if scale is None else scale
        hist = sum((r.hist for r in self.rows if r.kind in kinds), np.zeros(BINS, np.int64))
        total = max(int(hist.sum()), 1)
        exps = np.arange(EMIN, EMAX)
        shift = math.log2(scale)
        fig, ax = plt.subplots(figsize=(10, 4))
        used = np.nonzero(hist)[0]
        lo = min(-30, EMIN + int(used[0]) - 2) if used.size else -30
        hi = max(18, EMIN + int(used[-1]) + int(shift) + 3) if used.size else 18
        ax.bar(exps + 0.5, hist / total, width=1.0, alpha=0.5, label="scale 1")
        ax.bar(exps + shift + 0.5, hist / total, width=1.0, alpha=0.5, label=f"scale {scale:g}")
        top, tiny, smallest = LIMITS["float16"]
        for x, text, style in ((math.log2(top), "float16 overflow", "-"), (math.log2(tiny), "smallest normal", "--"),
                               (math.log2(smallest), "smallest subnormal (below: 0)", ":")):
            ax.axvline(x, color="red", linestyle=style, linewidth=1)
            ax.text(x, ax.get_ylim()[1] * 0.95, text, rotation=90, va="top", ha="right", fontsize=8, color="red")
        ax.set_xlim(lo, hi)
        ax.set_xlabel("log2 |x|")
        ax.set_ylabel("fraction of values")
        ax.set_title(f"|x| of {', '.join(k.replace('_', ' ') for k in kinds)}, {self.framework}, "
                     f"{self.batches} batch(es)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


def _check_scales(loss_scale: Any) -> tuple:
    scales = [1.0]
    if loss_scale is not None:
        if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)) or not (
                loss_scale > 0 and math.isfinite(loss_scale)):
            raise ValueError(f"Received loss_scale={loss_scale!r}; expected a finite number > 0 "
                             f"(the scale to check besides 1), or None.")
        if float(loss_scale) != 1.0:
            scales.append(float(loss_scale))
    return tuple(scales)


def inspect_gradients(model: Any, loss_fn: Any, batches: Any, *, loss_scale: float | None = None,
                      activations: bool = True) -> GradientReport:
    """Per-layer ranges of gradients (and activations) over a few batches, for a policy choice.

    Args:
      model: a torch.nn.Module, a Flax NNX or Equinox module, a Keras 3 model, or a JAX
        pytree of parameters (linen's ``params``, plain functions' weights).
      loss_fn: ``loss_fn(model, batch) -> scalar loss`` (for a pytree: ``loss_fn(params,
        batch)``), computed as training computes it.
      batches: one batch or a list of batches (whatever `loss_fn` takes).
      loss_scale: a scale to check besides 1 (the current one, or a proposal).
      activations: also the activations and their gradients where the framework exposes
        them cheaply (PyTorch's hooks; ignored elsewhere).

    Returns:
      A `GradientReport`: print it, ``recommend()``, ``plot(path)``.

    Raises:
      TypeError: `model` is none of those, or `loss_fn` is not callable.
      ValueError: no batch, or a bad `loss_scale`.
    """
    from mixedpolicy import _registry

    scales = _check_scales(loss_scale)
    batches = list(batches) if isinstance(batches, list) else [batches]
    if not batches:
        raise ValueError("Received no batches; expected one batch or a list of them.")
    if not callable(loss_fn):
        raise TypeError(f"Received loss_fn of type {type(loss_fn).__name__}; expected a function "
                        f"loss_fn(model, batch) -> scalar loss (for a pytree of parameters: "
                        f"loss_fn(params, batch)), the loss as training computes it.")
    adapter = _registry.model_adapter(model)
    pytrees = _registry.pytree_range_stats() if adapter is None else None
    if adapter is not None:
        vectors = adapter.range_stats(model, loss_fn, batches, scales, activations)
        framework = _registry.framework_of(model) or ""
    elif pytrees is not None:  # a pytree of parameters, where a framework takes those (JAX)
        framework, pytree_stats = pytrees
        vectors = pytree_stats(model, loss_fn, batches, scales)
    else:
        raise TypeError(f"Received a model of type {type(model).__name__}; expected a torch.nn.Module, "
                        f"a Flax NNX or Equinox module, a Keras 3 model or a JAX pytree of parameters.")
    rows = [RangeStats.from_vector(path, kind, v, scales) for (path, kind), v in vectors.items()]
    return GradientReport(rows, scales, framework, len(batches))
