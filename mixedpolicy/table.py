"""The per-layer table that `describe` returns."""

from __future__ import annotations

from typing import Iterable, NamedTuple

from mixedpolicy.policy import Policy

NOT_APPLIED = "no policy applied"  # the source of a layer no policy was put on


def unapplied_source(policy: Policy, own: str) -> str:
    """The source of a layer no policy was put on: `NOT_APPLIED` where it computes in float32 over
    float32 variables, else `own`, what set its dtypes (Keras's dtype policy, Flax's dtype=)."""
    plain = policy.variable_dtype == policy.compute_dtype == policy.output_dtype == "float32"
    return NOT_APPLIED if plain else own


class LayerPolicy(NamedTuple):
    """One row of `describe`: a layer, its policy and where that policy came from.

    ``runs_float8`` is False for a layer whose policy has an fp8 recipe but that has no
    matmul of its own to run in fp8 (a dropout, an activation, a container): its ``float8``
    cell then reads ``"-"``, while ``policy`` keeps what was applied to it.

    ``quantized`` names how the layer's weights are stored as integers where a framework's
    own quantization did that (Keras's ``model.quantize("int8")``: ``"int8"``, ``"int4/128"``,
    ``"gptq"``...), else None; ``policy`` is then what the layer computes in around them.
    """

    path: str
    layer_type: str
    policy: Policy
    source: str
    runs_float8: bool = True
    quantized: str | None = None

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

    @property
    def update_rounding(self) -> str:
        """How its variables' updates are rounded (``"nearest"``, ``"stochastic"``, ``"kahan"``)."""
        return self.policy.update_rounding

    @property
    def optimizer_state_dtype(self) -> str:
        """What the optimizer keeps its variables' moments in."""
        return self.policy.optimizer_state_dtype

    @property
    def float8(self) -> str:
        """The fp8 recipe its matmuls run under (``"tensorwise"``...), or ``"-"`` where none does."""
        recipe = self.policy.float8_recipe
        return "-" if recipe is None or not self.runs_float8 else recipe.recipe


class PolicyTable(tuple):
    """A tuple of `LayerPolicy` rows that prints as an aligned table.

    >>> rows = PolicyTable([LayerPolicy("fc", "Linear", Policy("mixed_bfloat16"), "global policy")])
    >>> print(rows)
    path  type    variable  compute   output    reduce   source
    fc    Linear  float32   bfloat16  bfloat16  float32  global policy
    """

    _HEADER = ("path", "type", "variable", "compute", "output", "reduce", "source")

    def __new__(cls, rows: Iterable[LayerPolicy] = ()) -> "PolicyTable":
        if isinstance(rows, (str, bytes)) or not hasattr(rows, "__iter__"):
            raise TypeError(f"Received rows of type {type(rows).__name__}; expected LayerPolicy rows, "
                            f"as describe(model) returns them.")
        rows = tuple(rows)
        for row in rows:
            if not isinstance(row, LayerPolicy):
                raise TypeError(f"Received a row of type {type(row).__name__} in a PolicyTable; expected "
                                f"LayerPolicy rows, as describe(model) returns them.")
        return super().__new__(cls, rows)

    def _rows(self, path: str) -> tuple[tuple, list[tuple]]:
        """(header, cells): an fp8 column after reduce where any layer runs fp8 matmuls, a
        quantized column where any layer's weights are integers; rounding and state columns where
        any layer's policy asks the optimizer for an update recipe."""
        fp8 = any(r.policy.float8_recipe is not None for r in self)
        quantized = any(r.quantized is not None for r in self)
        updates = any(not r.policy.updates_as_the_optimizer_does for r in self)
        header = (self._HEADER[:6] + ("fp8",) * fp8 + ("quantized",) * quantized + ("rounding", "state") * updates
                  + self._HEADER[6:])
        return header, [(path.format(r.path or "(root)"), r.layer_type, r.variable_dtype, r.compute_dtype,
                         r.output_dtype, r.reduce_dtype, *((r.float8,) * fp8), *((r.quantized or "-",) * quantized),
                         *((r.update_rounding, r.optimizer_state_dtype) * updates), r.source) for r in self]

    def __str__(self) -> str:
        header, rows = self._rows("{}")
        cells = [header] + rows
        widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
                         for row in cells)

    def to_markdown(self) -> str:
        """The same table in Markdown."""
        header, rows = self._rows("`{}`")
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
