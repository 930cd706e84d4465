"""A policy's update rounding and optimizer state dtype on torch: torchao's optimizers, or a rule.

torch's own optimizers round each update to the nearest value of the parameter's dtype and keep
their state in it. torchao's Adam family adds the rest: ``bf16_stochastic_round=True`` (the update
computed in float32, then rounded stochastically into bfloat16 weights) and 8-bit block-quantized
state (``Adam8bit`` / ``AdamW8bit``). The wrapper takes these as they are (its scaling and its skip
of non-finite steps compose with them). Any other optimizer gets a rule around its step (`install`):
the step runs on float32 copies, then the weights are rounded back (stochastically) and the
moments stored in the state dtype, torchao's arithmetic around any optimizer; it costs float32
copies of the bfloat16 parameters, gradients and moments for the length of the step.
"""

from __future__ import annotations

from typing import Any

from mixedpolicy.backends.torch.rounding import round_flat_

_EIGHT_BIT = ("Adam8bit", "AdamW8bit")


def _is_torchao(optimizer: Any) -> bool:
    return type(optimizer).__module__.startswith("torchao.optim")


def _state_dtypes(optimizer: Any, policy: Any) -> set:
    """What the optimizer keeps its moments in, for parameters in the policy's variable dtype."""
    if _is_torchao(optimizer) and type(optimizer).__name__ in _EIGHT_BIT:
        return {"int8"}
    return {policy.variable_dtype}  # torch's optimizers (and torchao's _AdamW): the parameter's dtype


def refusal(optimizers: list, policy: Any) -> str | None:
    """None where the policy's update recipe can be carried out with these optimizers (torchao's
    own, or the rule `install` adds to any other); else what is wrong and what does it."""
    rounding, state = policy.update_rounding, policy.optimizer_state_dtype
    for opt in optimizers:
        name = type(opt).__name__
        if _is_torchao(opt) and rounding == "kahan":
            return (f"{name} rounds inside its own step, where no Kahan compensation can reach; use "
                    f"a torch optimizer (the rule around it sums with Kahan's compensation)")
        if _is_torchao(opt):
            sr = bool(getattr(opt, "bf16_stochastic_round", False))
            if (rounding == "stochastic") != sr:
                return (f"{name} rounds each update {'stochastically' if sr else 'to nearest'}; give it "
                        f"bf16_stochastic_round={rounding == 'stochastic'}")
            if state not in _state_dtypes(opt, policy):
                kept = sorted(_state_dtypes(opt, policy))[0]
                return f"{name} keeps its state in {kept}, the policy asks for {state}"
        elif state == "int8":
            return (f"{name} keeps float state; 8-bit block-quantized state is torchao's: use "
                    f"torchao.optim.AdamW8bit(params, bf16_stochastic_round=True)")
    return None


def carried_by_itself(optimizers: list) -> bool:
    """torchao's optimizers carry their recipe themselves (checked by `refusal`)."""
    return all(_is_torchao(o) for o in optimizers)


_SUBCLASS_KINDS = {"OptimState8bit": "int8", "OptimState4bit": "int4", "OptimStateFp8": "float8"}
_UNSIGNED = ("exp_avg_sq", "max_exp_avg_sq")  # torchao's unsigned 8-bit moments


def _kind(value: Any) -> str:
    return _SUBCLASS_KINDS.get(type(value).__name__, str(value.dtype).replace("torch.", ""))


def state_kinds(state_dict: dict) -> set:
    """The forms a saved ``optimizer.state_dict()`` keeps its moments in ("float32", "int8"...)."""
    import torch

    return {_kind(v) for per_param in state_dict.get("state", {}).values() if isinstance(per_param, dict)
            for k, v in per_param.items() if k != "step" and torch.is_tensor(v) and v.is_floating_point()}


def reconcile(optimizer: Any, saved: dict) -> set:
    """Brings each loaded moment to the form `optimizer` keeps it in, which torch's
    ``load_state_dict`` does not: 8-bit state loaded into a float optimizer is dequantized,
    float state loaded into torchao's 8-bit optimizer is quantized into its buffers, and under the
    rule `install` adds, the moments are read again from `saved` (the state dict just loaded) in
    the rule's state dtype, where torch's load rounded them to the parameter's dtype. Returns the
    forms now kept."""
    import torch

    kept = set()
    eight_bit = _is_torchao(optimizer) and type(optimizer).__name__ in _EIGHT_BIT
    rule_dtype = getattr(optimizer, "_mixedpolicy_state_dtype", None)
    ids = [i for group in saved.get("param_groups", []) for i in group.get("params", [])]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p, saved_id in zip(params, ids):
        state, keys = _moments(optimizer, p)
        for key in keys if rule_dtype is not None else []:
            value = saved.get("state", {}).get(saved_id, {}).get(key)
            if torch.is_tensor(value) and type(value) is torch.Tensor:
                state[key] = value.to(device=p.device, dtype=rule_dtype)
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


# -- the rule around any optimizer's step -----------------------------------------------------
STEP_KEY = "stochastic_rounding_step"  # in the first param group: saved and loaded with the optimizer
KAHAN_KEY = "kahan_compensation"  # per bfloat16 parameter, in the optimizer's state


def _moments(optimizer: Any, p: Any) -> Any:
    """(state dict, keys of its per-element floating moments) of parameter `p`."""
    import torch

    state = optimizer.state.get(p, {})
    return state, [k for k, v in state.items() if k not in ("step", KAHAN_KEY) and torch.is_tensor(v)
                   and v.is_floating_point() and v.shape == p.shape]


class _RoundedStep:
    """The step `install` puts on an optimizer: an object holding the optimizer (not a closure),
    so ``copy.deepcopy`` gives the copy a step of its own and the optimizer still pickles."""

    def __init__(self, optimizer: Any, policy: Any):
        self.optimizer, self.rounding, self.state_dtype = optimizer, policy.update_rounding, policy.optimizer_state_dtype

    def __call__(self, closure: Any = None) -> Any:
        import torch

        optimizer = self.optimizer
        params = [p for group in optimizer.param_groups for p in group["params"]]
        _retype(_moment_slots(optimizer, params), torch.float32)
        widened = [(p, p.grad, p.data) for p in params if p.dtype == torch.bfloat16]
        flats = {}  # device -> (one float32 buffer of its bfloat16 parameters, their places in widened, views)
        for device in {p.device for p, _, _ in widened}:
            on = [i for i, (p, _, _) in enumerate(widened) if p.device == device]
            flat = torch.empty(sum(widened[i][0].numel() for i in on), dtype=torch.float32, device=device)
            views = [v.view(widened[i][0].shape) for i, v in zip(on, flat.split([widened[i][0].numel() for i in on]))]
            torch._foreach_copy_(views, [widened[i][2] for i in on])
            grads = [widened[i][1] for i in on]
            dense = [g for g in grads if g is not None and not g.is_sparse]
            wide = dict(zip(map(id, dense), _copies(dense, torch.float32)))
            flats[device] = (flat, on, views, [None if g is None else wide[id(g)] if id(g) in wide else g.float()
                                               for g in grads])
        for flat, on, views, wide_grads in flats.values():  # only once every copy is made: nothing fails here
            for i, view, g in zip(on, views, wide_grads):
                p = widened[i][0]
                p.grad, p.data = None, view
                p.grad = g
        step_of_class = type(optimizer).step
        try:
            result = step_of_class(optimizer) if closure is None else step_of_class(optimizer, closure)
        finally:
            count = optimizer.param_groups[0][STEP_KEY]
            try:
                for device, (flat, on, views, _) in flats.items():
                    if self.rounding == "stochastic":  # on the float32 buffer, in place
                        round_flat_(flat, [widened[i][0].numel() for i in on], on, count, device)
                    if self.rounding == "kahan":  # what nearest rounding dropped is added back next step
                        for i, new in zip(on, views):
                            p, old = widened[i][0], widened[i][2]
                            state = optimizer.state[p]
                            before = old.float()
                            update = new - before + state.get(KAHAN_KEY, torch.zeros_like(old)).float()
                            old.copy_(before + update)  # to the nearest bfloat16
                            state[KAHAN_KEY] = (update - (old.float() - before)).to(torch.bfloat16)
                    else:  # the weights in their own storage (stochastic: exact, the low half is zero)
                        torch._foreach_copy_([widened[i][2] for i in on], views)
                optimizer.param_groups[0][STEP_KEY] = count + 1
            finally:  # whatever failed above, the parameters are their own bfloat16 tensors again
                for p, grad, old in widened:
                    p.data, p.grad = old, grad
                _retype(_moment_slots(optimizer, params), getattr(torch, self.state_dtype))
        return result


def _moment_slots(optimizer: Any, params: list) -> list:
    """(state, key) of every per-element floating moment of `params`."""
    return [(state, key) for p in params for state, keys in (_moments(optimizer, p),) for key in keys]


def _copies(tensors: list, dtype: Any) -> list:
    """`tensors` in `dtype`, new tensors filled by one foreach copy."""
    import torch

    out = [torch.empty_like(t, dtype=dtype) for t in tensors]
    if out:
        torch._foreach_copy_(out, tensors)
    return out


def _retype(slots: list, dtype: Any) -> None:
    """Each (state, key)'s tensor in `dtype` (those already in it stay as they are)."""
    slots = [(state, key) for state, key in slots if state[key].dtype != dtype]
    for (state, key), copy in zip(slots, _copies([state[key] for state, key in slots], dtype)):
        state[key] = copy


def install(optimizer: Any, policy: Any) -> Any:
    """Gives `optimizer` a step that updates as `policy` says: the inner step runs on float32
    copies of the bfloat16 parameters, their gradients and every parameter's moments, then the
    weights are rounded back into bfloat16 (stochastically under ``update_rounding="stochastic"``,
    with a Kahan compensation under ``"kahan"``) and the moments stored in
    ``optimizer_state_dtype``. Returns it."""
    import torch

    optimizer.param_groups[0].setdefault(STEP_KEY, 0)
    optimizer.step = _RoundedStep(optimizer, policy)
    optimizer._mixedpolicy_state_dtype = getattr(torch, policy.optimizer_state_dtype)  # a loaded state's dtype
    return optimizer


class TorchUpdates:
    """What the torch optimizer adapter carries of a policy's update recipe (see above)."""

    def update_refusal(self, optimizer: Any, policy: Any) -> str | None:
        return refusal(list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer], policy)

    def with_updates(self, optimizer: Any, policy: Any) -> Any:
        inners = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        if not carried_by_itself(inners):
            for opt in inners:
                install(opt, policy)
        return optimizer
