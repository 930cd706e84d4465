"""Whether a torch optimizer carries out a policy's update rounding and optimizer state dtype.

torch's own optimizers round each update to the nearest value of the parameter's dtype and keep
their state in it. torchao's Adam family adds the rest: ``bf16_stochastic_round=True`` (the update
computed in float32, then rounded stochastically into bfloat16 weights) and 8-bit block-quantized
state (``Adam8bit`` / ``AdamW8bit``). The wrapper takes these as they are (its scaling and its skip
of non-finite steps compose with them) and refuses an optimizer that would silently do otherwise.
"""

from __future__ import annotations

from typing import Any

_EIGHT_BIT = ("Adam8bit", "AdamW8bit")


def _is_torchao(optimizer: Any) -> bool:
    return type(optimizer).__module__.startswith("torchao.optim")


def _state_dtypes(optimizer: Any, policy: Any) -> set:
    """What the optimizer keeps its moments in, for parameters in the policy's variable dtype."""
    if _is_torchao(optimizer) and type(optimizer).__name__ in _EIGHT_BIT:
        return {"int8"}
    return {policy.variable_dtype}  # torch's optimizers (and torchao's _AdamW): the parameter's dtype


def refusal(optimizers: list, policy: Any) -> str | None:
    """None where every optimizer carries the policy's update recipe out; else what is wrong and
    the optimizer that does it."""
    rounding, state = policy.update_rounding, policy.optimizer_state_dtype
    for opt in optimizers:
        name = type(opt).__name__
        sr = bool(getattr(opt, "bf16_stochastic_round", False)) and _is_torchao(opt)
        if rounding == "kahan":
            return (f"torch has no Kahan-summation optimizer mixedpolicy can hand this to ({name} "
                    f"rounds to nearest); use update_rounding='stochastic' with torchao's "
                    f"_AdamW(..., bf16_stochastic_round=True)")
        if (rounding == "stochastic") != sr:
            want = ("torchao.optim._AdamW(params, bf16_stochastic_round=True) (or AdamW8bit(..., "
                    "bf16_stochastic_round=True) for 8-bit state)" if rounding == "stochastic" else
                    f"{name} without bf16_stochastic_round")
            return f"{name} rounds each update {'stochastically' if sr else 'to nearest'}; use {want}"
        if state not in _state_dtypes(opt, policy):
            kept = sorted(_state_dtypes(opt, policy))[0]
            want = ("torchao.optim.AdamW8bit (or Adam8bit)" if state == "int8" else
                    "an optimizer that keeps its state in the parameters' dtype")
            return (f"{name} keeps its state in {kept}, the policy asks for {state}; use {want}"
                    + (", or a policy without state=" if state != policy.variable_dtype else ""))
    return None
