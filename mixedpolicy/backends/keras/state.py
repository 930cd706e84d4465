"""A policy's optimizer state dtype on Keras (jax, torch, tensorflow), inside the optimizer.

Keras's optimizers keep each moment in its variable's dtype and compute with it as it is stored.
`install` makes the inner optimizer of a `LossScaleOptimizer` keep its per-variable state
(momentums, velocities...) in the policy's ``optimizer_state_dtype`` instead: ``"bfloat16"`` or
``"float32"`` as variables of that dtype, ``"int8"`` 8-bit block-quantized
(`mixedpolicy.quantized_state`, the same codes as the optax rule's: a moment of 4096 values or
more, a multiple of 256, as uint8 codes and a float32 scale per block; smaller ones in float32).

Keras's own ``update_step`` runs unchanged on stand-ins: each moment the optimizer reads is a
variable of its model variable's dtype without storage of its own (a scalar placeholder, never
saved, not among ``optimizer.variables``), given the stored state's value for one
``update_step`` in a ``StatelessScope``; what the step assigns to it is stored back (rounded to
the state dtype, or quantized), what it assigns to anything else is assigned there. So the
state takes its dtype's bytes between steps, and a step computes in the variable's dtype, as
Keras's optimizers do, one variable at a time (on Keras's torch backend the per-variable path,
not its ``torch._foreach`` one).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
from keras import ops
from keras.src.backend.common.stateless_scope import StatelessScope
from keras.src.backend.common.variables import Variable as KerasVariable

from mixedpolicy import quantized_state

# per-variable optimizer variables kept as Keras makes them: the rounding rule's Kahan
# compensation (updates.py, read in update_step), and what Keras reads outside update_step
# (the EMA of the weights, the gradient accumulators)
_KAHAN = "kahan_compensation"
KEPT = (_KAHAN, "average", "gradient_accumulator")


class KerasArrays:
    """`quantized_state`'s array namespace over ``keras.ops`` (any backend)."""

    uint8, int32, float32 = "uint8", "int32", "float32"
    reshape, abs, where, clip, take = ops.reshape, ops.abs, ops.where, ops.clip, ops.take
    ones_like = ops.ones_like

    @staticmethod
    def max(x: Any, axis: Any = None) -> Any:
        return ops.max(x, axis=axis)

    @staticmethod
    def astype(x: Any, dtype: str) -> Any:
        return ops.cast(x, dtype)

    @staticmethod
    def asarray(x: Any) -> Any:
        return ops.convert_to_tensor(np.asarray(x))

    @staticmethod
    def top_bits(m: Any, shift: int) -> Any:
        """The float32 pattern of non-negative `m` shifted right by `shift`, as int32."""
        return ops.right_shift(ops.view(ops.cast(m, "float32"), "int32"), shift)


class TorchArrays:
    """The same namespace over torch on one device, for Keras's torch backend, where a
    ``keras.ops`` call costs tens of microseconds and a torch one a few."""

    def __init__(self, device: Any):
        import torch

        self.torch, self.device = torch, device
        self.uint8, self.int32, self.float32 = torch.uint8, torch.int32, torch.float32
        self.reshape, self.abs, self.where, self.clip = torch.reshape, torch.abs, torch.where, torch.clip
        self.ones_like = torch.ones_like

    def max(self, x: Any, axis: Any = None) -> Any:
        return self.torch.amax(x, dim=axis)

    def astype(self, x: Any, dtype: Any) -> Any:
        return x.to(dtype)

    def asarray(self, x: Any) -> Any:
        return self.torch.as_tensor(np.asarray(x), device=self.device)

    def take(self, table: Any, index: Any) -> Any:
        return self.torch.take(table, index.long())

    def top_bits(self, m: Any, shift: int) -> Any:
        return m.float().view(self.torch.int32) >> shift


def _quantize(x: Any) -> tuple[Any, Any, Any]:
    """(codes, block scales, 1 where the signed map was taken else 0) of float32 `x`."""
    flat = ops.reshape(x, (-1,))
    signed = ops.any(flat < 0)
    if keras.backend.backend() == "torch":
        xp = TorchArrays(flat.device)
        if flat.device.type == "cpu":  # a host read costs nothing there: one map's codes
            codes, absmax = quantized_state.quantize(xp, flat, bool(signed))
        else:  # no sync: both maps, one chosen on the device
            (cs, s_abs), (cu, u_abs) = (quantized_state.quantize(xp, flat, sign) for sign in (True, False))
            codes, absmax = xp.where(signed, cs, cu), xp.where(signed, s_abs, u_abs)
    else:
        codes, absmax = ops.cond(signed, lambda: quantized_state.quantize(KerasArrays, flat, True),
                                 lambda: quantized_state.quantize(KerasArrays, flat, False))
    return ops.reshape(codes, x.shape), absmax, ops.cast(signed, "int32")


def _dequantize(codes: Any, absmax: Any, signed: Any) -> Any:
    xp = TorchArrays(codes.device) if keras.backend.backend() == "torch" else KerasArrays
    values = quantized_state.dequantize(xp, ops.reshape(codes, (-1,)), absmax, ops.cast(signed, "bool"))
    return ops.reshape(values, codes.shape)


class _Slot:
    """One moment of one variable: its float32 stand-in and the variables that store it."""

    def __init__(self, stand_in: Any, storage: tuple):
        self.stand_in, self.storage = stand_in, storage

    def read(self) -> Any:
        value = self.storage[0].value if len(self.storage) == 1 else _dequantize(*(v.value for v in self.storage))
        return ops.cast(value, self.stand_in.dtype)

    def write(self, assign: Any, value: Any) -> None:
        convert_moment(self.storage, value, assign)


def _stand_in(reference: Any, name: str) -> Any:
    """A variable of the reference's shape and dtype whose own value is a scalar placeholder."""
    variable = keras.Variable(initializer="zeros", shape=reference.shape, dtype=reference.dtype, trainable=False,
                              name=f"{name}_stand_in")
    value = variable._value
    variable._value = value.new_zeros(()) if hasattr(value, "new_zeros") else ops.zeros((), variable.dtype)
    return variable


def install(optimizer: Any, state_dtype: str) -> Any:
    """Makes `optimizer` keep its per-variable state in `state_dtype` (see the module docstring);
    returns it. Composes with `updates.install` (the rounding), installed before it."""
    if state_dtype not in ("float32", "bfloat16", "float16", "int8"):
        raise ValueError(f"Received optimizer_state_dtype={state_dtype!r} for a Keras optimizer; expected "
                         f"'float32', 'bfloat16', 'float16' or 'int8'.")
    cls = type(optimizer)
    slots: dict = {}        # a model variable's key -> its _Slots
    own: dict = {}          # a model variable's key -> its other per-variable state (Kahan's)
    per_variable: set = set()  # ids of every per-variable optimizer variable (stand-ins, storage, own)
    stand_ins: set = set()
    shared: list = []

    def add_variable_from_reference(reference_variable: Any, name: Any = None, initializer: Any = "zeros") -> Any:
        reference, key = reference_variable, optimizer._var_key(reference_variable)
        if name in KEPT:
            variable = cls.add_variable_from_reference(optimizer, reference, name, initializer)
            if name == _KAHAN:
                own.setdefault(key, []).append(variable)
                per_variable.add(id(variable))
            return variable
        label = f"{reference.path.replace('/', '_')}_{name or 'var'}"
        stand_in = _stand_in(reference, label)
        if state_dtype == "int8" and quantized_state.quantizable(tuple(reference.shape)):
            blocks = int(np.prod(reference.shape)) // quantized_state.BLOCK
            storage = (cls.add_variable(optimizer, reference.shape, dtype="uint8", name=f"{label}_codes"),
                       cls.add_variable(optimizer, (blocks,), dtype="float32", name=f"{label}_absmax"),
                       cls.add_variable(optimizer, (), dtype="int32", name=f"{label}_signed"))
        else:
            dtype = "float32" if state_dtype == "int8" else state_dtype
            storage = (cls.add_variable(optimizer, reference.shape, initializer=initializer, dtype=dtype, name=label),)
        slots.setdefault(key, []).append(_Slot(stand_in, storage))
        per_variable.update(map(id, (stand_in, *storage)))
        stand_ins.add(id(stand_in))
        return stand_in

    built_before = optimizer.build

    def build(variables: Any) -> None:
        built_before(variables)
        for key_slots in slots.values():
            for slot in key_slots:  # tracked by Keras through its lists of moments: untracked again
                optimizer._tracker.untrack(slot.stand_in)

    def update_step(gradient: Any, variable: Any, learning_rate: Any) -> None:
        key = optimizer._var_key(variable)
        mine = slots.get(key, [])
        if not shared:  # the optimizer's own variables that are no variable's (iterations...), once
            shared.extend(v for v in optimizer.variables if id(v) not in per_variable)
        others = shared + own.get(key, [])
        if isinstance(variable, KerasVariable):  # TensorFlow hands the tf.Variable, assigned in place
            others.append(variable)
        mapping = [(slot.stand_in, slot.read()) for slot in mine] + [(v, v.value) for v in others]
        with StatelessScope(state_mapping=mapping) as scope:
            given = dict(scope.state_mapping)  # the values as the scope holds them, to tell what changed
            cls.update_step(optimizer, gradient, variable, learning_rate)
        for slot in mine:
            slot.write(lambda v, value: cls.assign(optimizer, v, value), scope.get_current_value(slot.stand_in))
        for v in others:  # only what the step assigned
            new = scope.get_current_value(v)
            if new is not None and new is not given[id(v)]:
                cls.assign(optimizer, v, new)

    assigns = {name: getattr(optimizer, name) for name in ("assign", "assign_add", "assign_sub")}

    def assigner(name: str, combine: Any) -> Any:
        def assign(variable: Any, value: Any) -> None:
            if id(variable) in stand_ins:  # its value lives in update_step's scope
                variable.assign(combine(variable.value, ops.cast(value, variable.dtype)))
            else:
                assigns[name](variable, value)
        return assign

    optimizer.add_variable_from_reference = add_variable_from_reference
    optimizer.build = build
    optimizer.update_step = update_step
    optimizer.assign = assigner("assign", lambda old, value: value)
    optimizer.assign_add = assigner("assign_add", ops.add)
    optimizer.assign_sub = assigner("assign_sub", ops.subtract)
    if hasattr(optimizer, "_parallel_update_step"):  # Keras's torch optimizers: the per-variable path
        optimizer._backend_update_step = per_variable_path(optimizer)
    optimizer._mixedpolicy_state_dtype = state_dtype
    optimizer._mixedpolicy_moments = lambda: [slot.storage for key_slots in slots.values() for slot in key_slots]
    return optimizer


def moments(optimizer: Any) -> list:
    """The storage of each per-variable moment of `optimizer` (a tuple of one variable, or of an
    8-bit moment's codes, block scales and sign flag), in the order Keras saves them; empty where
    the optimizer was built before mixedpolicy saw it."""
    found = getattr(optimizer, "_mixedpolicy_moments", None)
    return found() if found is not None else []


def stored_kind(storage: tuple) -> str:
    """What a moment is stored as: ``"int8"`` or its float dtype."""
    return "int8" if len(storage) == 3 else keras.backend.standardize_dtype(storage[0].dtype)


def convert_moment(storage: tuple, value: Any, assign: Any = None) -> None:
    """Stores a moment's float value in `storage` (rounded to nearest, or block-quantized),
    through `assign(variable, part)` (default: the variable's own)."""
    assign = assign or (lambda variable, part: variable.assign(part))
    if len(storage) == 1:
        assign(storage[0], ops.cast(value, storage[0].dtype))
        return
    for variable, part in zip(storage, _quantize(ops.cast(value, "float32"))):
        assign(variable, part)


def read_moment(parts: list) -> Any:
    """A moment's float32 value from what a checkpoint holds for it (one array, or three)."""
    if len(parts) == 1:
        return ops.cast(ops.convert_to_tensor(parts[0]), "float32")
    return _dequantize(*(ops.convert_to_tensor(np.asarray(p)) for p in parts))


def per_variable_path(optimizer: Any) -> Any:
    """Keras's per-variable update (``update_step`` for each variable), in place of its torch
    optimizers' ``torch._foreach_*`` one: the optimizer's own backend-neutral
    ``_backend_update_step`` (Nadam's updates its ``_u_product`` there), else Keras's base one."""
    import torch

    neutral = next(klass for klass in type(optimizer).__mro__ if "_backend_update_step" in vars(klass)
                   and not klass.__module__.startswith("keras.src.backend.torch"))

    def update_each(grads: Any, trainable_variables: Any, learning_rate: Any) -> None:
        with torch.no_grad():
            neutral._backend_update_step(optimizer, grads, trainable_variables, learning_rate)

    return update_each
