"""How a policy updates weights and keeps optimizer state: `update_rounding` and
`optimizer_state_dtype`, checked before a `Policy` exists.

A pure bfloat16 policy has no float32 master copy: each update is rounded into bfloat16
weights, and with nearest rounding the updates smaller than half a bfloat16 step vanish
("Revisiting BFloat16 Training", Zamirai et al.). Stochastic rounding (rounding up with the
probability of the remainder, so the rounding is unbiased) or Kahan summation (a bfloat16
compensation buffer) keep them. The optimizer state may be narrower than float32: bfloat16,
or 8-bit block-quantized (``"int8"``, bitsandbytes' and torchao's 8-bit Adam state).
"""

from __future__ import annotations

from typing import Any

from mixedpolicy._dtypes import canonical_dtype, show

#: the ways an update reaches the variables
ROUNDINGS = ("nearest", "stochastic", "kahan")
#: what optimizer state may be kept in besides the variable dtype itself
STATE_DTYPES = ("float32", "bfloat16", "int8")
_STATE_SPELLINGS = {"int8": "int8", "8bit": "int8", "8-bit": "int8", "i8": "int8"}

#: named recipes: name -> (variable and compute dtype, update rounding, optimizer state dtype)
PRESETS = {
    # pure bfloat16, no master copy, stochastic rounding, bfloat16 state: 8 bytes per AdamW parameter
    "bfloat16_stochastic": ("bfloat16", "stochastic", "bfloat16"),
    # the same with 8-bit block-quantized state: about 6 bytes per AdamW parameter
    "bfloat16_stochastic_int8": ("bfloat16", "stochastic", "int8"),
}


def canonical_rounding(value: Any) -> str:
    if not isinstance(value, str) or value.strip().lower() not in ROUNDINGS:
        raise ValueError(f"Received update_rounding={show(value)}; expected one of "
                         f"{', '.join(repr(r) for r in ROUNDINGS)}.")
    return value.strip().lower()


def canonical_state_dtype(value: Any, variable: str) -> str:
    """The optimizer state dtype's canonical name; the variable dtype is always accepted."""
    text = value.strip().lower() if isinstance(value, str) else value
    if isinstance(text, str) and text in _STATE_SPELLINGS:
        return _STATE_SPELLINGS[text]
    dtype = canonical_dtype(value, what="optimizer_state_dtype")
    if dtype not in STATE_DTYPES and dtype != variable:
        raise ValueError(
            f"Received optimizer_state_dtype={show(value)}; expected {', '.join(repr(d) for d in STATE_DTYPES)} "
            f"(8-bit block-quantized) or the variable dtype {variable!r}. float16 state overflows "
            f"Adam's second moment; use 'bfloat16' for 2-byte state.")
    return dtype


def check(variable: str, rounding: str, state: str) -> None:
    """Refuses the combinations no optimizer can carry out, with the fix."""
    if rounding != "nearest" and variable not in ("bfloat16", "float16"):
        raise ValueError(
            f"Received update_rounding={rounding!r} with {variable} variables: it rounds each update "
            f"into half-precision weights kept without a float32 master copy, and these variables "
            f"need no rounding. For bfloat16 weights write Policy('bfloat16', "
            f"update_rounding={rounding!r}) or the preset 'bfloat16_stochastic'; with a float32 "
            f"master (the mixed policies) keep update_rounding='nearest'.")
    if rounding == "stochastic" and variable == "float16":
        raise ValueError(
            "Received update_rounding='stochastic' with float16 variables: stochastic rounding is "
            "offered into bfloat16 (as torchao and the bfloat16 training literature round). For "
            "float16 weights use update_rounding='kahan', or bfloat16 variables.")


def is_default(variable: str, rounding: str, state: str) -> bool:
    """Whether the policy updates as every framework does by itself (nearest, state in the
    variable dtype), so its name needs no memory part."""
    return rounding == "nearest" and state == variable


def preset_for(variable: str, compute: str, output: str, rounding: str, state: str) -> str | None:
    for name, (dtype, r, s) in PRESETS.items():
        if variable == compute == output == dtype and (rounding, state) == (r, s):
            return name
    return None
