"""Layer kinds and the built-in rules of `PolicyMap` (its rule 2).

An adapter classifies each layer (`LayerInfo.kind`); a kind may carry a rule that raises the
precision its layers get from the policy around them:

- ``"normalization"``: statistics, scale and shift in float32 under a half-precision policy;
- ``"loss"``: computed and output in float32 under a half-precision policy;
- ``"keep_float32"`` and ``"keep_float32_over_float16"``: layers the model itself declares it
  keeps in float32 when its other weights are stored in half precision (in bfloat16 or float16,
  or in float16 alone). transformers models declare them (``_keep_in_fp32_modules_strict`` and
  ``_keep_in_fp32_modules``: mixture-of-experts routers, T5's ``wo``...), and
  ``from_pretrained(dtype=...)`` keeps them in float32; so does a policy whose variables are
  half precision. Their weights are float32 and they compute as their own code does with
  float32 weights: float32, their outputs in float32 unless their code casts them back;
- under an fp8 policy, embeddings, norms, the output head, matmuls whose dimensions are not
  multiples of 16 and layers with no fp8 path keep the source precision.
"""

from __future__ import annotations

from typing import Any

from mixedpolicy.policy import Policy

NORMALIZATION = "normalization"
LOSS = "loss"
KEEP_FLOAT32 = "keep_float32"  # kept in float32 by the model where its weights are bfloat16 or float16
KEEP_FLOAT32_OVER_FLOAT16 = "keep_float32_over_float16"  # ... where its weights are float16
# Kinds fp8 keeps in the source precision (what the anchors keep there), besides norms and losses.
EMBEDDING = "embedding"
HEAD = "head"  # the output head: the model's last matmul layer
SMALL_MATMUL = "small_matmul"  # a matmul whose dimensions are not multiples of 16 (fp8 GPU kernels)
NO_FLOAT8 = "no_float8"  # a layer with weights and no fp8 path in its framework (a convolution...)
FLOAT8_KEPT = {EMBEDDING: "embeddings", HEAD: "the output head", NORMALIZATION: "norms",
               LOSS: "losses", SMALL_MATMUL: "matmuls whose dimensions are not multiples of 16",
               NO_FLOAT8: "layers without an fp8 path", KEEP_FLOAT32: "layers the model keeps in float32",
               KEEP_FLOAT32_OVER_FLOAT16: "layers the model keeps in float32"}
#: The kinds whose layers the model keeps in float32 by its own declaration (see above).
MODEL_KEPT = (KEEP_FLOAT32, KEEP_FLOAT32_OVER_FLOAT16)
_HALVES = ("float16", "bfloat16")


def _changed(policy: Policy, **dtypes: str) -> Policy:
    """`policy` with other dtypes; a reduce dtype it did not set follows the new variables."""
    fields: dict[str, Any] = {"variable_dtype": policy.variable_dtype, "compute_dtype": policy.compute_dtype,
                              "output_dtype": policy.output_dtype,
                              "reduce_dtype": policy.reduce_dtype if policy.reduce_dtype != policy.variable_dtype else None}
    return Policy(None, **{**fields, **dtypes})  # no fp8: the rules keep their layers out of it


def _rule_normalization(policy: Policy) -> Policy | None:
    if policy.compute_dtype not in _HALVES:
        return None
    # Statistics in float32; so are the (tiny) scale and shift, which a float32
    # computation needs in float32 even under a pure half-precision policy.
    variable = "float32" if policy.variable_dtype in _HALVES else policy.variable_dtype
    return _changed(policy, compute_dtype="float32", variable_dtype=variable)


def _rule_loss(policy: Policy) -> Policy | None:
    if policy.compute_dtype not in _HALVES:
        return None
    return _changed(policy, compute_dtype="float32", output_dtype="float32")


def _kept_where(halves: tuple) -> Any:
    def rule(policy: Policy) -> Policy | None:
        if policy.variable_dtype not in halves:
            return None
        return _changed(policy, variable_dtype="float32", compute_dtype="float32", output_dtype="float32")
    return rule


_RULES = {NORMALIZATION: _rule_normalization, LOSS: _rule_loss, KEEP_FLOAT32: _kept_where(_HALVES),
          KEEP_FLOAT32_OVER_FLOAT16: _kept_where(("float16",))}


def builtin_rule(kind: str | None, policy: Policy) -> Policy | None:
    """The policy the built-in rule of `kind` gives a layer that `policy` would otherwise reach,
    or None where no rule changes it."""
    rule = _RULES.get(kind) if kind is not None else None
    return None if rule is None else rule(policy)
