"""A policy's stochastic rounding on Keras (jax, torch, tensorflow), inside the optimizer.

Keras's optimizers write every update through their own ``assign_add`` / ``assign_sub``, which
round the new value to the nearest one of the variable's dtype: a bfloat16 weight loses every
update below half its step. `install` gives the inner optimizer of a `LossScaleOptimizer`
versions of the two that, for the model's bfloat16 variables, add in float32 and round the sum
stochastically into bfloat16 (the optimizer's own variables, its moments, are written as
before). The rounding adds to the float32 pattern 16 random bits and cuts the low 16, as torchao
and the optax rule do; the bits come from a counter-based hash (murmur3's finaliser) of the
element's index, the variable's index, the step and a seed, in `keras.ops` integer arithmetic:
no random state to thread through ``stateless_apply``, and the same bits on every backend, so
one model rounds alike on jax, torch and tensorflow.
"""

from __future__ import annotations

import warnings
from typing import Any

import keras
import ml_dtypes
import numpy as np
from keras import ops
from keras.backend import standardize_dtype

from mixedpolicy._dtypes import HALF_DTYPES
from mixedpolicy._warnings import user_stacklevel
from mixedpolicy.backends.keras.state import install as install_state, per_variable_path

_SEED = 0x5EED
# murmur3's constants and the golden-ratio step, as signed 32-bit integers (the arithmetic wraps)
_GOLDEN, _M1, _M2, _VARIABLE = -1640531535, -2048144789, -1028477387, 668265261


def _shift_right(h: Any, k: int) -> Any:
    """Logical right shift of int32 `h` (ops.right_shift is arithmetic on signed integers)."""
    return ops.bitwise_and(ops.right_shift(h, k), (1 << (32 - k)) - 1)


def _mix(h: Any) -> Any:
    h = ops.bitwise_xor(h, _shift_right(h, 16))
    h = ops.multiply(h, ops.convert_to_tensor(_M1, "int32"))
    h = ops.bitwise_xor(h, _shift_right(h, 13))
    h = ops.multiply(h, ops.convert_to_tensor(_M2, "int32"))
    return ops.bitwise_xor(h, _shift_right(h, 16))


def random_bits16(shape: tuple, step: Any, index: int, seed: int = _SEED) -> Any:
    """16 uniform random bits per element (int32 in [0, 65536)), a function of the element's
    position, `step`, the variable's `index` and `seed`."""
    size = 1
    for d in shape:
        size *= int(d)
    position = ops.reshape(ops.arange(size, dtype="int32"), shape)
    start = ops.add(ops.multiply(ops.cast(step, "int32"), ops.convert_to_tensor(_GOLDEN, "int32")),
                    ops.convert_to_tensor((index * _VARIABLE + seed) & 0x7FFFFFFF, "int32"))
    h = _mix(ops.add(ops.multiply(position, ops.convert_to_tensor(_GOLDEN, "int32")), start))
    return ops.bitwise_and(_mix(ops.add(h, start)), 0xFFFF)


def stochastic_round_bfloat16(x: Any, bits16: Any) -> Any:
    """float32 `x` rounded into bfloat16 up or down with the probability of its remainder, the
    16 random bits given."""
    pattern = ops.view(ops.cast(x, "float32"), "int32")
    cut = ops.bitwise_and(ops.add(pattern, bits16), -65536)  # 0xFFFF0000
    return ops.cast(ops.view(cut, "float32"), "bfloat16")  # exact: the low half is zero


def _update_count(optimizer: Any) -> Any:
    """The optimizer's updates so far, the backend's tensor (a variable's value; under
    ``gradient_accumulation_steps`` Keras's ``iterations`` is already a tensor, its micro-steps
    divided): the step the rounding's bits are drawn for."""
    return getattr(optimizer.iterations, "value", optimizer.iterations)


def _compensations(optimizer: Any, variables: Any) -> None:
    """Kahan's compensation, one optimizer variable per bfloat16 model variable (zeros), made
    with the optimizer's own variables so that they are saved and threaded through
    ``stateless_apply`` with them."""
    optimizer._mixedpolicy_kahan = {
        optimizer._var_key(v): optimizer.add_variable_from_reference(v, "kahan_compensation")
        for v in variables if standardize_dtype(v.dtype) == "bfloat16"}


def install(optimizer: Any, rounding: str) -> Any:
    """Makes `optimizer` round the updates of the model's bfloat16 variables as `rounding` says
    (``"stochastic"``, or ``"kahan"``: a bfloat16 compensation per variable keeps what nearest
    rounding dropped and adds it back at the next step); returns it."""
    if rounding not in ("stochastic", "kahan"):
        raise ValueError(f"Received update_rounding={rounding!r} for a Keras optimizer; expected "
                         f"'stochastic' or 'kahan' (nearest is what Keras does by itself).")
    cls = type(optimizer)
    if rounding == "kahan":
        if optimizer.built:
            _compensations(optimizer, optimizer._trainable_variables)
        else:
            def build(variables: Any) -> None:
                cls.build(optimizer, variables)
                _compensations(optimizer, optimizer._trainable_variables)

            optimizer.build = build

    def rounded(variable: Any, value: Any, sign: int) -> bool:
        key = optimizer._var_key(variable)
        index = getattr(optimizer, "_trainable_variables_indices", {}).get(key)
        if (index is None or standardize_dtype(variable.dtype) != "bfloat16"
                or type(value).__name__ == "IndexedSlices"):
            return False  # the optimizer's own variables (moments), other dtypes, sparse updates
        old = ops.cast(variable, "float32")
        update = ops.multiply(ops.cast(value, "float32"), float(sign))
        if rounding == "kahan":
            compensation = optimizer._mixedpolicy_kahan[key]
            update = ops.add(update, ops.cast(compensation, "float32"))
            new = ops.cast(ops.add(old, update), "bfloat16")  # nearest
            cls.assign(optimizer, compensation, ops.subtract(update, ops.subtract(ops.cast(new, "float32"), old)))
            cls.assign(optimizer, variable, new)
            return True
        step = _update_count(optimizer)  # the backend's tensor
        if keras.backend.backend() == "torch":  # the same bits from the torch rule's hash: far fewer calls
            from mixedpolicy.backends.torch.rounding import random_bits16 as torch_bits

            bits = torch_bits(tuple(variable.shape), step, index, device=step.device)
        else:
            bits = random_bits16(tuple(variable.shape), step, index)
        cls.assign(optimizer, variable, stochastic_round_bfloat16(ops.add(old, update), bits))
        return True

    def assign_add(variable: Any, value: Any) -> None:
        if not rounded(variable, value, 1):
            cls.assign_add(optimizer, variable, value)

    def assign_sub(variable: Any, value: Any) -> None:
        if not rounded(variable, value, -1):
            cls.assign_sub(optimizer, variable, value)

    optimizer.assign_add, optimizer.assign_sub = assign_add, assign_sub
    if hasattr(optimizer, "_parallel_update_step"):
        # Keras's torch optimizers update all variables at once with torch._foreach_* ops, past
        # assign_add / assign_sub: stochastic rounding runs around that update (float32 stand-ins
        # for the bfloat16 variables, one hash for all); Kahan's sum takes Keras's per-variable
        # path (update_step), where its compensations are read and written
        optimizer._backend_update_step = (_parallel_rounded(optimizer) if rounding == "stochastic"
                                          else per_variable_path(optimizer))  # state.py: the per-variable path
    optimizer._mixedpolicy_update_rounding = rounding
    return optimizer


def _parallel_rounded(optimizer: Any) -> Any:
    """Keras's own torch._foreach_* update with each bfloat16 model variable's value swapped for
    a float32 copy for its length; the results are then rounded stochastically into the
    variables with the bits the per-variable rule draws (the torch rule's hash, all at once)."""
    import torch

    from mixedpolicy.backends.torch.rounding import random_bits16_all
    from mixedpolicy.backends.torch.rounding import stochastic_round_bfloat16 as round_torch

    cls = type(optimizer)

    def update_all(grads: Any, trainable_variables: Any, learning_rate: Any) -> None:
        indices = getattr(optimizer, "_trainable_variables_indices", {})
        halves = [(v, indices[optimizer._var_key(v)]) for v in trainable_variables
                  if standardize_dtype(v.dtype) == "bfloat16" and optimizer._var_key(v) in indices]
        with torch.no_grad():
            kept = [v._value for v, _ in halves]
            for (v, _), value in zip(halves, kept):
                v._value = value.float()
            try:
                cls._parallel_update_step(optimizer, grads, trainable_variables, learning_rate)
            finally:
                wide = [v._value for v, _ in halves]
                for (v, _), value in zip(halves, kept):
                    v._value = value
            if halves:
                bits = random_bits16_all([w.numel() for w in wide], [i for _, i in halves],
                                         _update_count(optimizer), wide[0].device)  # no host sync
                for value, w, b in zip(kept, wide, bits):
                    value.copy_(round_torch(w, b.view(w.shape)))

    return update_all


def rounding_to_config(optimizer: Any) -> dict:
    """The wrapper's config entries for the rounding `install` and the state dtype `state.install`
    gave its inner optimizer (none if none): a saved model's optimizer rounds and stores alike once
    loaded, its Kahan variables and its stored state loaded too."""
    config = {}
    rounding = getattr(optimizer, "_mixedpolicy_update_rounding", None)
    if rounding is not None:
        config["update_rounding"] = rounding
    state_dtype = getattr(optimizer, "_mixedpolicy_state_dtype", None)
    if state_dtype is not None:
        config["optimizer_state_dtype"] = state_dtype
    return config


class KerasUpdates:
    """What the Keras optimizer adapter carries of a policy's update recipe (see above)."""

    def update_refusal(self, optimizer: Any, policy: Any) -> str | None:
        # the rounding and the state's storage go inside Keras's optimizer (state.py); the state's
        # storage is made with the optimizer's variables, so before they are
        if policy.optimizer_state_dtype != policy.variable_dtype and getattr(optimizer, "built", False):
            return ("it is already built, its state made in its variables' dtype; wrap a fresh "
                    "optimizer, before its first step")
        return None

    def with_updates(self, optimizer: Any, policy: Any) -> Any:
        if policy.update_rounding != "nearest":
            install(optimizer, policy.update_rounding)
        if policy.optimizer_state_dtype != policy.variable_dtype:
            install_state(optimizer, policy.optimizer_state_dtype)
        return optimizer

    def warn_arithmetic(self, optimizer: Any, policies: tuple) -> None:
        """Keras computes an update in the variable's dtype (its torch optimizers in the first
        variable's): a decay rate such as Adam's beta_2=0.999 is 1.0 in bfloat16, so ``1 - beta_2**t``
        is 0 and so is every update, with or without mixedpolicy. Said once, with the fix; not
        where the stochastic rounding on torch hands Keras float32 stand-ins."""
        stand_ins = keras.backend.backend() == "torch" and hasattr(optimizer, "_parallel_update_step")
        for policy in policies:
            on_stand_ins = stand_ins and policy.update_rounding == "stochastic" \
                and policy.optimizer_state_dtype == policy.variable_dtype  # else the per-variable path
            if policy.variable_dtype not in HALF_DTYPES or on_stand_ins:
                continue
            half = ml_dtypes.bfloat16 if policy.variable_dtype == "bfloat16" else np.float16
            below = 1 - float(ml_dtypes.finfo(half).epsneg)  # the largest value below 1
            for name in ("beta_1", "beta_2"):
                rate = getattr(optimizer, name, None)
                if isinstance(rate, float) and 0 < rate < 1 and float(np.asarray(rate, half)) == 1.0:
                    warnings.warn(
                        f"Received {type(optimizer).__name__}({name}={rate}) under the policy "
                        f"{policy.name!r}: Keras computes the update in the variables' dtype, where "
                        f"{name}={rate} rounds to 1.0, so every update is 0 and the model does not "
                        f"train (Keras does the same without mixedpolicy). Give {name} <= {below} "
                        f"(the largest {policy.variable_dtype} below 1), or keep float32 variables "
                        f"(a mixed policy such as 'mixed_{policy.variable_dtype}').",
                        stacklevel=user_stacklevel("keras", "keras_hub"))
                    return
