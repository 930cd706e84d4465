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

import functools
import itertools
from typing import Any, Iterator

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


# -- stochastic rounding after any optimizer's step ------------------------------------------
# murmur3's finaliser and the golden-ratio step: the counter-based hash the optax and Keras rules
# use, so one model rounds alike on torch, optax and Keras. Here in int32 arithmetic, whose
# products wrap modulo 2**32 as the rules' masked arithmetic does (right shifts masked to be
# logical), over all of a step's parameters at once: a handful of ops per step, not per parameter
_MASK, _GOLDEN, _M1, _M2, _VARIABLE, _SEED = 0xFFFFFFFF, 0x9E3779B1, 0x85EBCA6B, 0xC2B2AE35, 668265261, 0x5EED
_SLICED = {"cpu"}  # devices where a parameter's terms are added slice by slice (small ops are cheap)
_CHUNK = 1 << 24  # elements hashed at once: bounds the int32 temporaries (and keeps indices < 2**31)
STEP_KEY = "stochastic_rounding_step"  # in the first param group: saved and loaded with the optimizer
KAHAN_KEY = "kahan_compensation"  # per bfloat16 parameter, in the optimizer's state


def _int32(value: int) -> int:
    """The int32 with the bits of the uint32 `value`."""
    value &= _MASK
    return value - (1 << 32) if value >= 1 << 31 else value


def _mix_(h: Any, tmp: Any) -> Any:
    """murmur3's 32-bit finaliser, in place on an int32 tensor (`tmp`: scratch of its size)."""
    import torch

    for shift, mask, factor in ((16, 0xFFFF, _int32(_M1)), (13, 0x7FFFF, _int32(_M2)), (16, 0xFFFF, None)):
        h.bitwise_xor_(torch.bitwise_right_shift(h, shift, out=tmp).bitwise_and_(mask))  # a logical shift
        if factor is not None:
            h.mul_(factor)
    return h


def random_bits16_all(sizes: list, indices: list, step: Any, device: Any = None, seed: int = _SEED) -> list:
    """16 random bits per element of each of several flat tensors (int32, one tensor each);
    `step` a Python int or an integer tensor on `device` (read there). No host sync and no copy
    from the host: what does not change from step to step is built once per device."""
    return [bits for h, chunk_sizes in _bits_by_chunk(sizes, indices, step, device, seed)
            for bits in h.split(chunk_sizes)]


def _bits_by_chunk(sizes: list, indices: list, step: Any, device: Any = None, seed: int = _SEED) -> Iterator:
    """`random_bits16_all`'s bits as they are made: (one int32 tensor for consecutive
    parameters, their sizes), chunk after chunk."""
    import torch

    if torch.is_tensor(step):
        step_term = step.to(device=device, dtype=torch.int32) * _int32(_GOLDEN)
    else:
        step_term = _int32(int(step) * _GOLDEN)  # an int32 scalar: added as a kernel argument
    where = torch.device(device or "cpu")
    sliced = where.type in _SLICED
    for total, chunk_sizes, terms, on_device in _chunks(tuple(sizes), tuple(indices), str(where), seed, _CHUNK,
                                                        sliced):
        h = torch.arange(total, dtype=torch.int32, device=where).mul_(_int32(_GOLDEN))
        tmp = torch.empty_like(h)  # one scratch tensor for both finalisers
        for stage in (0, 1):  # the element's hash input, then the finalised value plus the start
            if sliced:  # a CPU: each parameter's term added to its slice (an op each)
                for offset, size, term in zip(*terms[stage]):
                    piece = h[offset:offset + size]
                    piece.add_(term).add_(step_term) if torch.is_tensor(step_term) else piece.add_(
                        _int32(term + step_term))
            else:  # one op for all: the terms repeated to each element
                shift, counts = on_device[stage], on_device[2]
                h.add_(shift.add(step_term).repeat_interleave(counts, output_size=total))
            _mix_(h, tmp)
        yield h.bitwise_and_(0xFFFF), chunk_sizes


@functools.lru_cache(maxsize=16)
def _chunks(sizes: tuple, indices: tuple, device: str, seed: int, chunk: int, sliced: bool) -> tuple:
    """The parameters in chunks of at most `chunk` elements (a larger one alone), each as (its
    elements, its parameters' sizes, the hash's per-parameter terms without the step's as
    (offsets, sizes, terms) for each stage, and unless `sliced` the terms and sizes as tensors
    on `device`): int32 arithmetic wraps as the hash's uint32 arithmetic does."""
    import torch

    chunks, i = [], 0
    while i < len(sizes):
        j, total = i + 1, sizes[i]
        while j < len(sizes) and total + sizes[j] <= chunk:
            total, j = total + sizes[j], j + 1
        # start_p = step * golden + base_p; element k of parameter p hashes k * golden + start_p,
        # over the chunk its flat position times golden plus (start_p - offset_p * golden), mod 2**32
        bases = [(index * _VARIABLE + seed) & 0x7FFFFFFF for index in indices[i:j]]
        offsets = [0, *itertools.accumulate(sizes[i:j - 1])]
        shifts, starts = [_int32(b - o * _GOLDEN) for b, o in zip(bases, offsets)], [_int32(b) for b in bases]
        terms = ((offsets, sizes[i:j], shifts), (offsets, sizes[i:j], starts))
        on_device = None if sliced else (
            *torch.tensor([shifts, starts], dtype=torch.int32).to(device), torch.tensor(sizes[i:j]).to(device))
        chunks.append((total, list(sizes[i:j]), terms, on_device))
        i = j
    return tuple(chunks)


def random_bits16(shape: tuple, step: int, index: int, device: Any = None, seed: int = _SEED) -> Any:
    """16 random bits per element (int32 in [0, 65536)): the hash of the element's position, the
    step, the parameter's index and the seed that the optax and Keras rules draw."""
    size = 1
    for d in shape:
        size *= int(d)
    return random_bits16_all([size], [index], step, device, seed)[0].reshape(shape)


def stochastic_round_bfloat16(x: Any, bits16: Any) -> Any:
    """float32 `x` rounded into bfloat16 up or down with the probability of its remainder."""
    import torch

    pattern = x.float().view(torch.int32)
    cut = (pattern + bits16) & -65536  # 0xFFFF0000 as int32
    return cut.view(torch.float32).to(torch.bfloat16)  # exact: the low half is zero


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
            for i, view, g in zip(on, views, grads):
                p = widened[i][0]
                p.grad, p.data = None, view
                p.grad = None if g is None else wide[id(g)] if id(g) in wide else g.float()
            flats[device] = (flat, on, views)
        step_of_class = type(optimizer).step
        try:
            result = step_of_class(optimizer) if closure is None else step_of_class(optimizer, closure)
        finally:
            count = optimizer.param_groups[0][STEP_KEY]
            for device, (flat, on, views) in flats.items():
                olds = [widened[i][2] for i in on]
                if self.rounding == "stochastic":  # on the float32 buffer, chunk by chunk, in place
                    sizes = [widened[i][0].numel() for i in on]
                    start = 0
                    for h, _ in _bits_by_chunk(sizes, on, count, device):
                        flat[start:start + h.numel()].view(torch.int32).add_(h).bitwise_and_(-65536)
                        start += h.numel()
                if self.rounding == "kahan":  # what nearest rounding dropped is added back next step
                    for i, new in zip(on, views):
                        p, old = widened[i][0], widened[i][2]
                        state = optimizer.state[p]
                        before = old.float()
                        update = new - before + state.get(KAHAN_KEY, torch.zeros_like(old)).float()
                        old.copy_(before + update)  # to the nearest bfloat16
                        state[KAHAN_KEY] = (update - (old.float() - before)).to(torch.bfloat16)
                else:  # the weights in their own storage (stochastic: exact, the low half is zero)
                    torch._foreach_copy_(olds, views)
                for i, old in zip(on, olds):
                    widened[i][0].data, widened[i][0].grad = old, widened[i][1]
            _retype(_moment_slots(optimizer, params), getattr(torch, self.state_dtype))
            optimizer.param_groups[0][STEP_KEY] = count + 1
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
