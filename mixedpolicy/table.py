"""The per-layer table that `describe` returns."""

from __future__ import annotations

from typing import NamedTuple

from mixedpolicy.policy import Policy


class LayerPolicy(NamedTuple):
    """One row of `describe`: a layer, its policy and where that policy came from."""

    path: str
    layer_type: str
    policy: Policy
    source: str

    @property
    def variable_dtype(self) -> str:
        return self.policy.variable_dtype

    @property
    def compute_dtype(self) -> str:
        return self.policy.compute_dtype

    @property
    def output_dtype(self) -> str:
        return self.policy.output_dtype

    @property
    def reduce_dtype(self) -> str:
        return self.policy.reduce_dtype


class PolicyTable(tuple):
    """A tuple of `LayerPolicy` rows that prints as an aligned table.

    >>> rows = PolicyTable([LayerPolicy("fc", "Linear", Policy("mixed_bfloat16"), "global policy")])
    >>> print(rows)
    path  type    variable  compute   output    reduce   source
    fc    Linear  float32   bfloat16  bfloat16  float32  global policy
    """

    _HEADER = ("path", "type", "variable", "compute", "output", "reduce", "source")

    def __str__(self) -> str:
        cells = [self._HEADER] + [
            (r.path or "(root)", r.layer_type, r.variable_dtype, r.compute_dtype,
             r.output_dtype, r.reduce_dtype, r.source) for r in self]
        widths = [max(len(row[i]) for row in cells) for i in range(len(self._HEADER))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
                         for row in cells)

    def to_markdown(self) -> str:
        """The same table in Markdown."""
        lines = ["| " + " | ".join(self._HEADER) + " |", "|" + "---|" * len(self._HEADER)]
        for r in self:
            lines.append(f"| `{r.path or '(root)'}` | {r.layer_type} | {r.variable_dtype} | "
                         f"{r.compute_dtype} | {r.output_dtype} | {r.reduce_dtype} | {r.source} |")
        return "\n".join(lines)
