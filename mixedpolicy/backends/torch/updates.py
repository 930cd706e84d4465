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


_SUBCLASS_KINDS = {"OptimState8bit": "int8", "OptimState4bit": "int4", "OptimStateFp8": "float8"}
_UNSIGNED = ("exp_avg_sq", "max_exp_avg_sq")  # torchao's unsigned 8-bit moments


def _kind(value: Any) -> str:
    return _SUBCLASS_KINDS.get(type(value).__name__, str(value.dtype).replace("torch.", ""))


def state_kinds(state_dict: dict) -> set:
    """The forms a saved ``optimizer.state_dict()`` keeps its moments in ("float32", "int8"...)."""
    import torch

    return {_kind(v) for per_param in state_dict.get("state", {}).values() if isinstance(per_param, dict)
            for k, v in per_param.items() if k != "step" and torch.is_tensor(v) and v.is_floating_point()}


def reconcile(optimizer: Any) -> set:
    """Brings each loaded moment to the form `optimizer` keeps it in, which torch's
    ``load_state_dict`` does not: 8-bit state loaded into a float optimizer is dequantized,
    float state loaded into torchao's 8-bit optimizer is quantized into its buffers (torch's load
    has already rounded plain tensors to the parameter's dtype). Returns the forms now kept."""
    import torch

    kept = set()
    eight_bit = _is_torchao(optimizer) and type(optimizer).__name__ in _EIGHT_BIT
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for key, value in list(state.items()):
                if key == "step" or not torch.is_tensor(value) or not value.is_floating_point():
                    continue
                if type(value).__name__ in _SUBCLASS_KINDS and not eight_bit:
                    value = state[key] = value.dequantize().to(p.dtype)
                elif eight_bit and type(value) is torch.Tensor:
                    buffer = optimizer._new_buffer(p, key not in _UNSIGNED)
                    if type(buffer) is not torch.Tensor:  # large enough to quantize, as torchao does
                        buffer.copy_(value)
                        value = state[key] = buffer
                kept.add(_kind(value))
    return kept
