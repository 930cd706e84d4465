"""fp8 matmuls in a policy: which recipe scales them, in which 8-bit formats.

A `Policy` whose ``float8_recipe`` is set runs its matmul layers (torch ``Linear``, Keras
``Dense`` / ``EinsumDense``) in fp8 on each framework's own fp8 path; every other operation,
the variables and the outputs keep the policy's dtypes (its *source* precision). The
recipes, named as the anchors name them:

- ``"tensorwise"``: current scaling, one scale per tensor computed from this step's
  amax (torchao's ``tensorwise``, Transformer Engine's ``Float8CurrentScaling``);
- ``"delayed"``: one scale per tensor from the largest amax of the last
  ``amax_history_len`` steps, less ``margin`` powers of two (Keras's ``float8`` quantization,
  Transformer Engine's ``DelayedScaling``; Keras keeps 1024 steps and no margin, the defaults);
- ``"rowwise"``, ``"rowwise_with_gw_hp"``: one scale per row (torchao's recipes of those names);
- ``"mxfp8"``: one scale per block of 32 (torchao's MX training).

Forward operands travel in ``float8_e4m3fn``; gradients in ``float8_e5m2`` for the
per-tensor recipes and ``float8_e4m3fn`` for the per-row and block ones (each as its anchor).

>>> Float8Recipe("delayed")
Float8Recipe('delayed', amax_history_len=1024, margin=0)
>>> Float8Recipe("tensorwise").backward_dtype
'float8_e5m2'
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from mixedpolicy._dtypes import canonical_float8_dtype, show

RECIPES = ("tensorwise", "delayed", "rowwise", "rowwise_with_gw_hp", "mxfp8")
#: (forward format, gradient format) of each recipe, as its anchor has them
FORMATS = {"tensorwise": ("float8_e4m3fn", "float8_e5m2"), "delayed": ("float8_e4m3fn", "float8_e5m2"),
           "rowwise": ("float8_e4m3fn", "float8_e4m3fn"),
           "rowwise_with_gw_hp": ("float8_e4m3fn", "float8_e4m3fn"),
           "mxfp8": ("float8_e4m3fn", "float8_e4m3fn")}
#: what Keras keeps for delayed scaling
DELAYED_DEFAULTS = {"amax_history_len": 1024, "margin": 0}
#: the source policies Keras's ``float8_from_<source>`` names take
KERAS_SOURCES = ("float32", "float16", "bfloat16", "mixed_float16", "mixed_bfloat16")
_SPELLINGS = {"current": "tensorwise", "dynamic": "tensorwise", "per_tensor": "tensorwise",
              "mx": "mxfp8", "per_row": "rowwise"}


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class Float8Recipe:
    """How a policy's fp8 matmuls are scaled, and in which formats.

    Args:
      recipe: one of ``"tensorwise"``, ``"delayed"``, ``"rowwise"``,
        ``"rowwise_with_gw_hp"``, ``"mxfp8"`` (see the module docstring).
      forward_dtype: the format of the forward operands (default ``float8_e4m3fn``).
      backward_dtype: the format of the output gradients (default: the recipe's anchor's).
      amax_history_len: ``"delayed"`` only: the steps of amax history (default 1024).
      margin: ``"delayed"`` only: powers of two of headroom below the format's maximum (default 0).

    Raises:
      ValueError: an unknown recipe or format, or a setting the recipe does not take.
      TypeError: a setting of the wrong type.
    """

    recipe: str
    forward_dtype: str
    backward_dtype: str
    amax_history_len: int | None
    margin: int | None

    def __init__(self, recipe: str, *, forward_dtype: Any = None, backward_dtype: Any = None,
                 amax_history_len: int | None = None, margin: int | None = None):
        if not isinstance(recipe, str):
            raise TypeError(f"Received float8_recipe={show(recipe)} of type {type(recipe).__name__}; "
                            f"expected one of {list(RECIPES)}.")
        key = recipe.strip().lower().replace("-", "_")
        key = _SPELLINGS.get(key, key)
        if key not in RECIPES:
            raise ValueError(f"Received float8_recipe={show(recipe)}, which is not an fp8 recipe "
                             f"mixedpolicy knows. Expected one of {list(RECIPES)} ('tensorwise': "
                             f"current scaling, 'delayed': scales from an amax history).")
        forward, backward = FORMATS[key]
        if forward_dtype is not None:
            forward = canonical_float8_dtype(forward_dtype, what="forward_dtype")
        if backward_dtype is not None:
            backward = canonical_float8_dtype(backward_dtype, what="backward_dtype")
        if key != "delayed":
            given = [n for n, v in (("amax_history_len", amax_history_len), ("margin", margin)) if v is not None]
            if given:
                raise ValueError(f"Received {', '.join(given)} with float8_recipe={key!r}; only the "
                                 f"'delayed' recipe keeps an amax history. Use float8_recipe='delayed' "
                                 f"or leave {' and '.join(given)} out.")
            if (forward, backward) != FORMATS[key] and key != "tensorwise":
                raise ValueError(f"Received the formats {forward}/{backward} with float8_recipe={key!r}, "
                                 f"whose anchor (torchao) runs {FORMATS[key][0]}/{FORMATS[key][1]} only. "
                                 f"Leave forward_dtype and backward_dtype out, or use 'tensorwise'.")
        else:
            amax_history_len = _count(amax_history_len, "amax_history_len", DELAYED_DEFAULTS["amax_history_len"], 1)
            margin = _count(margin, "margin", DELAYED_DEFAULTS["margin"], 0)
        object.__setattr__(self, "recipe", key)
        object.__setattr__(self, "forward_dtype", forward)
        object.__setattr__(self, "backward_dtype", backward)
        object.__setattr__(self, "amax_history_len", amax_history_len)
        object.__setattr__(self, "margin", margin)

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in self._settings().items())
        return f"Float8Recipe({self.recipe!r}{extra})"

    def _settings(self) -> dict:
        """The settings besides the recipe: the history of 'delayed', formats off the anchor's."""
        out: dict = {}
        if self.recipe == "delayed":
            out.update(amax_history_len=self.amax_history_len, margin=self.margin)
        forward, backward = FORMATS[self.recipe]
        if self.forward_dtype != forward:
            out["forward_dtype"] = self.forward_dtype
        if self.backward_dtype != backward:
            out["backward_dtype"] = self.backward_dtype
        return out

    @property
    def is_keras_default(self) -> bool:
        """Whether Keras's ``float8_from_<source>`` names mean exactly this recipe."""
        return self == Float8Recipe("delayed")

    def name_parts(self) -> list[str]:
        """The ``key=value`` parts this recipe adds to a policy name in jmp's grammar."""
        parts = [f"float8={self.recipe}"]
        for k, v in self._settings().items():
            if self.recipe == "delayed" and k in DELAYED_DEFAULTS and v == DELAYED_DEFAULTS[k]:
                continue
            parts.append(f"{'float8_forward' if k == 'forward_dtype' else 'float8_backward' if k == 'backward_dtype' else k}={v}")
        return parts

    def get_config(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "forward_dtype": self.forward_dtype,
                "backward_dtype": self.backward_dtype, "amax_history_len": self.amax_history_len,
                "margin": self.margin}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "Float8Recipe":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown or "recipe" not in config:
            raise ValueError(f"Received the fp8 recipe config {show(dict(config))}; expected the "
                             f"keys {sorted(known)} ('recipe' required), as get_config() writes.")
        settings = {k: v for k, v in config.items() if k != "recipe" and v is not None}
        return cls(config["recipe"], **settings)


def _count(value: Any, what: str, default: int, low: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"Received {what}={show(value)} of type {type(value).__name__}; expected "
                        f"an integer of at least {low}.")
    if value < low:
        raise ValueError(f"Received {what}={value}; expected an integer of at least {low}.")
    return value


def as_float8_recipe(value: Any, *, amax_history_len: int | None = None,
                     margin: int | None = None) -> Float8Recipe | None:
    """A `Float8Recipe` from a recipe name, a recipe, its config or None (no fp8); the
    history settings, where given, replace the recipe's."""
    if value is None:
        if amax_history_len is not None or margin is not None:
            raise ValueError(f"Received amax_history_len={amax_history_len!r}, margin={margin!r} "
                             f"without an fp8 recipe; they belong to float8_recipe='delayed'.")
        return None
    if isinstance(value, Float8Recipe):
        if amax_history_len is None and margin is None:
            return value
        config = value.get_config()
    elif isinstance(value, Mapping):
        config = dict(Float8Recipe.from_config(value).get_config())
    elif isinstance(value, str):
        config = {"recipe": value}
    else:
        raise TypeError(f"Received float8_recipe={show(value)} of type {type(value).__name__}; "
                        f"expected a recipe name ({', '.join(RECIPES)}), a Float8Recipe or its config.")
    if amax_history_len is not None:
        config["amax_history_len"] = amax_history_len
    if margin is not None:
        config["margin"] = margin
    return Float8Recipe.from_config({k: v for k, v in config.items() if v is not None})


#: the state of a delayed-scaling layer where a framework keeps it as named variables (Flax NNX),
#: Keras's names with a prefix: a scale (shape ()) and an amax history each, for the input, the
#: kernel and the output gradient
DELAYED_STATE = tuple(f"float8_{operand}_{what}" for operand in ("inputs", "kernel", "outputs_grad")
                      for what in ("scale", "amax_history"))


def check_source(compute_dtype: str, variable_dtype: str) -> None:
    """Refuses a source precision fp8 matmuls cannot run from."""
    if compute_dtype == "float64" or variable_dtype == "float64":
        raise ValueError("Received an fp8 recipe on a float64 policy; fp8 matmuls take float32, "
                         "bfloat16 or float16 operands. Use a float32 or mixed source policy, such "
                         "as 'float8_from_mixed_bfloat16'.")


def too_small_to_gain(recipe: str, in_features: int, out_features: int) -> bool:
    """Whether an ``in_features -> out_features`` matmul is below the sizes where fp8 training
    outran bf16 for ``recipe``: a heuristic for H100-class GPUs that
    `PolicyMap(float8_auto_filter=True)` applies (a key still puts any layer in fp8).

    Per tensor (``"tensorwise"``, ``"delayed"``): kept out where either size is 1024 or less, or
    both are 2048 or less. Measured on an H200 (docs/benchmarks.md, 2026-11-28): the GPU time of
    one ``nn.Linear``'s compiled forward and backward on 8192 rows, fp8 against bf16, over sizes
    768 to 8192: the shapes kept out ran at 0.87-1.01x but 8192 -> 768 and 8192 -> 1024
    (1.06x, 1.08x: a gain left aside), those let through at 1.04-1.30x but 2048 -> 3072 (1.01x).
    torchao's auto filter, which keeps out only ``in <= 4096`` with ``out <= 1024``, passes
    768 -> 3072 (0.91x there), and GPT-2 small under it ran at 0.94x of bf16. Per row and per
    block: torchao's H100 thresholds (``out <= 2048``, ``in <= 1024``, or ``out <= 4096`` with
    ``in <= 2048``), not yet measured here."""
    if recipe not in RECIPES:
        raise ValueError(f"Received recipe={show(recipe)}; expected one of {', '.join(RECIPES)}.")
    for name, value in (("in_features", in_features), ("out_features", out_features)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"Received {name}={show(value)}; expected a positive integer (a matmul's size).")
    k, n = in_features, out_features
    if recipe in ("tensorwise", "delayed"):
        return k <= 1024 or n <= 1024 or (k <= 2048 and n <= 2048)
    return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)
