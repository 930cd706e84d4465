"""Saving a Keras `LossScaleOptimizer`: the skip counters in a group of their own.

The optimizer's own group then holds exactly the variables Keras's own
``keras.optimizers.LossScaleOptimizer`` reads, so a ``.keras`` file written with
mixedpolicy's wrapper loads in plain Keras.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from typing import Any

import keras
import numpy as np
from keras import ops
from keras.src.saving.keras_saveable import KerasSaveable

from mixedpolicy.backends.keras import state
from mixedpolicy.loss_scale import StaticLossScale

_log = logging.getLogger("mixedpolicy")


def to_numpy(x: Any) -> Any:
    """`keras.ops.convert_to_numpy` of an eager value, but a torch or TensorFlow tensor (or a Keras
    variable's) read by its own ``.numpy()``: Keras's ``np.array(...)`` of those warns under NumPy 2
    (their ``__array__`` takes no ``copy``), an error in a suite that turns warnings into errors,
    where Keras's own loss-scale optimizer trains without reading any."""
    value = x.value if isinstance(x, keras.Variable) else x  # a Keras variable: its backend tensor
    if hasattr(value, "detach"):  # torch: no bfloat16 in NumPy's own dtypes
        value = value.detach().cpu()
        value = value.float() if str(value.dtype) == "torch.bfloat16" else value
    return value.numpy() if callable(getattr(value, "numpy", None)) else ops.convert_to_numpy(value)


class SkipCounters:
    """A Keras `LossScaleOptimizer`'s skip counters, one int32 variable ``[num_skipped_steps, the
    attempt skipped last]`` (each variable costs in Keras's JAX trainer), an attempt numbered by
    the inner optimizer's iterations plus the steps skipped: a step applied touches neither."""

    def _build_skip_counters(self) -> None:
        self._skips = self.add_variable(shape=(2,), dtype="int32", initializer="zeros",
                                        aggregation="none", name="skipped_steps")

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last step was skipped for a non-finite gradient."""
        if not self.built:
            return False
        total, attempt = (int(v) for v in to_numpy(self._skips))
        return total > 0 and attempt == int(to_numpy(self.inner_optimizer._iterations)) + total

    @property
    def num_skipped_steps(self) -> int:
        """How many steps were skipped so far."""
        return int(to_numpy(self._skips)[0]) if self.built else 0

    def _skipped_counts(self) -> Any:
        """The counters once the step under way is counted as skipped."""
        total = ops.add(self._skips.value[0], 1)
        return ops.stack([total, ops.add(ops.cast(self.inner_optimizer._iterations.value, "int32"), total)])

    def _count_skip(self) -> None:
        self._skips.assign(self._skipped_counts())

    def _read_earlier_counters(self) -> None:
        """Counters loaded from a file written before 2026-11-28 (``[skipped, 1 if the last step
        was]``, an attempt below the count) in today's form."""
        total, last = (int(v) for v in to_numpy(self._skips))
        if last < total or (total == 0 and last):
            iterations = int(to_numpy(self.inner_optimizer._iterations))
            self._skips.assign(np.asarray([total, iterations + total if last == 1 else 0], np.int32))


class SkipCounts(KerasSaveable):
    """Saves a wrapper's skip counters in a group of their own (``optimizer/_skip_store``), so
    the optimizer's group holds exactly what Keras's own LossScaleOptimizer reads."""

    def __init__(self, optimizer: Any):
        self._owner = weakref.ref(optimizer)

    def _obj_type(self) -> str:
        return "Optimizer"  # picks which attributes Keras walks; this object has none to walk

    def save_own_variables(self, store: Any) -> None:
        owner = self._owner()
        if owner is not None and owner.built:
            store["0"] = to_numpy(owner._skips)
            store["1"] = np.asarray(_scales(owner), np.int32)  # whether the scale in the file was used

    def load_own_variables(self, store: Any) -> None:
        """The counters; and, after the optimizer's own group was read (a child is loaded after
        its parent), a scale that a wrapper scaling nothing saved leaves a scaling one its own
        initial scale, and a scale loaded into a wrapper that scales nothing is dropped, said
        once (as the torch wrapper does)."""
        owner = self._owner()
        if owner is None or not owner.built or "0" not in store.keys():
            return
        owner._skips.assign(store["0"])
        owner._read_earlier_counters()
        if "1" not in store.keys():
            return
        loaded, own = float(to_numpy(owner.dynamic_scale)), float(owner.initial_scale)
        saved_scaled = bool(store["1"])
        static = isinstance(owner._scale_settings, StaticLossScale) and _scales(owner)  # keeps its own (torch, optax)
        if saved_scaled == _scales(owner) and not (static and loaded != own):
            return
        if saved_scaled and loaded != own and (static or not _scales(owner)):
            _log.warning("Loaded a checkpoint whose loss scale is %g into a LossScaleOptimizer %s: the scale "
                         "is dropped; the inner optimizer's state and the skip counts are kept.%s", loaded,
                         f"with a static scale of {own:g}" if static else f"that scales nothing ({owner.loss_scaling})",
                         "" if static else " Compile under a float16 policy (or pass initial_scale=...) to go on "
                         "scaling.")
        owner.dynamic_scale.assign(own)
        owner.step_counter.assign(ops.zeros((), owner.step_counter.dtype))


def _scales(optimizer: Any) -> bool:  # (a pass-through scales nothing either)
    return not optimizer.loss_scaling.startswith(("no scaling", "pass-through"))


def keras_variables(optimizer: Any) -> list:
    """The wrapper's variables in the order Keras's own LossScaleOptimizer has them (no counters)."""
    return [v for v in optimizer.variables if v is not optimizer._skips]


def save_keras_layout(optimizer: Any, store: Any) -> None:
    """Writes the wrapper's variables as Keras's own LossScaleOptimizer does."""
    for i, variable in enumerate(keras_variables(optimizer)):
        store[str(i)] = variable.numpy() if hasattr(variable, "numpy") else variable


def load_keras_layout(optimizer: Any, store: Any) -> bool:
    """Reads Keras's layout, or the one mixedpolicy wrote before (the counters at index 2).

    A checkpoint whose optimizer kept its moments in another dtype, or 8-bit, or with(out) a
    Kahan compensation (`Policy.optimizer_state_dtype`, ``update_rounding="kahan"``), is
    converted to this optimizer's recipe: moments rounded to nearest or block-quantized, a
    compensation this optimizer keeps starts at zero, one it does not keep is dropped; one
    warning names both recipes.

    Returns False, reading nothing, where the optimizer is not built or the store holds
    another layout (Keras's own warning then says so).

    Raises:
      ValueError: the scale read is not a finite number > 0.
    """
    if not optimizer.built:
        return False
    entries = [store[str(i)] for i in range(len(store.keys()))]
    plan = _read_across_recipes(optimizer.inner_optimizer, keras_variables(optimizer), entries)
    if plan is None and len(entries) == len(optimizer.variables):
        plan = [(variable, entry) for variable, entry in zip(optimizer.variables, entries)], None
    if plan is None:
        return False
    assignments, changed = plan
    _assign(assignments)
    optimizer._read_earlier_counters()
    if changed:
        _log.warning("LossScaleOptimizer.load_own_variables: the optimizer state was saved as %s; %s keeps "
                     "it as %s, so it was converted (moments rounded to nearest into a float dtype, "
                     "block-quantized into int8; a Kahan compensation the checkpoint lacks starts at "
                     "zero, one this optimizer does not keep is dropped).", *changed)
    scale = float(to_numpy(optimizer.dynamic_scale))
    if not (scale > 0 and scale < float("inf")):
        raise ValueError(
            f"Received a checkpoint whose loss scale is {scale}; expected a finite number > 0 "
            f"(a scale of 0, NaN or inf turns the weights into NaN at the next step). The "
            f"file was written by an optimizer whose scale had collapsed; load the model with "
            f"compile=False and compile it with a fresh LossScaleOptimizer.")
    return True


def prepared_for_checkpoints(inner: Any) -> Any:
    """A context in which a wrapper builds its inner optimizer: the moments it makes are
    recorded (for `state.moments`, where `state.install` did not take over making them), and
    the inner optimizer then reads its own group of a checkpoint across recipes too (Keras
    loads it after the wrapper's, which holds the same variables and said what it converted)."""
    made: list = []
    recording = not hasattr(inner, "_mixedpolicy_moments")
    own = vars(inner).get("add_variable_from_reference")
    make = inner.add_variable_from_reference

    def add_variable_from_reference(reference_variable: Any, name: Any = None, initializer: Any = "zeros") -> Any:
        variable = make(reference_variable, name, initializer)
        made.extend([] if name in state.KEPT else [(variable,)])
        return variable

    @contextlib.contextmanager
    def building() -> Any:
        if recording:
            inner.add_variable_from_reference = add_variable_from_reference
        try:
            yield
        finally:
            if recording:
                del inner.add_variable_from_reference
                if own is not None:
                    inner.add_variable_from_reference = own
                inner._mixedpolicy_moments = lambda: list(made)
        inner.load_own_variables = functools.partial(_load_inner, inner)

    return building()


def _load_inner(inner: Any, store: Any) -> None:
    plan = _read_across_recipes(inner, inner.variables, [store[str(i)] for i in range(len(store.keys()))])
    if plan is None:
        type(inner).load_own_variables(inner, store)  # Keras's own, and its warning on a mismatch
        return
    _assign(plan[0])


def _assign(assignments: list) -> None:
    for target, value in assignments:
        if isinstance(target, tuple):
            state.convert_moment(target, state.read_moment(value))
        else:
            target.assign(value)


def _read_across_recipes(inner: Any, variables: list, entries: list) -> tuple | None:
    """([(variable or a moment's storage, what to store)], None or (saved recipe, the inner
    optimizer's class, its recipe)) for `variables` (the wrapper's, in Keras's order, or its
    inner optimizer's) from a checkpoint's arrays, or None where they do not fit."""
    slots = {id(storage[0]): storage for storage in state.moments(inner)}
    kahan = {id(v) for v in getattr(inner, "_mixedpolicy_kahan", {}).values()}
    assignments: list = []
    saved: set = set()
    ours: set = set()
    i = 0
    parts = {id(v) for storage in slots.values() for v in storage[1:]}
    for variable in variables:
        if id(variable) in parts:
            continue  # an 8-bit moment's scales and flag: read with its codes
        entry = entries[i] if i < len(entries) else None
        if id(variable) in kahan:
            if entry is None:  # a compensation the checkpoint did not keep: zeros, as built
                ours.add("a Kahan compensation")
                assignments.append((variable, ops.zeros(variable.shape, variable.dtype)))
                continue
            saved.add("a Kahan compensation")
            ours.add("a Kahan compensation")
        if entry is None or tuple(entry.shape) != tuple(variable.shape):
            return None
        storage = slots.get(id(variable))
        if storage is None:
            assignments.append((variable, entry))
            i += 1
            continue
        width = 3 if str(entry.dtype) == "uint8" else 1
        if i + width > len(entries):
            return None
        kind, mine = "int8" if width == 3 else str(entry.dtype), state.stored_kind(storage)
        saved.add(kind)
        ours.add(mine)
        if kind == mine:
            assignments.extend(zip(storage, entries[i:i + width]))
        else:
            assignments.append((storage, entries[i:i + width]))
        i += width
    rest = entries[i:]
    if rest and not all(str(e.dtype) == "bfloat16" for e in rest):
        return None  # more than a compensation this optimizer does not keep
    saved.update(["a Kahan compensation"] if rest else [])
    changed = (_recipe(saved), type(inner).__name__, _recipe(ours)) if saved != ours else None
    return assignments, changed


def _recipe(kinds: set) -> str:
    return "+".join(sorted(kinds - {"a Kahan compensation"})) + (
        ", with a Kahan compensation" if "a Kahan compensation" in kinds else "")


def constructor_arguments(config: dict, custom_objects: Any = None) -> tuple[Any, dict, Any]:
    """(inner optimizer, keyword arguments, loss scale or None) for a LossScaleOptimizer from
    its config: this package's configs and Keras's own (its current and its older layout)."""
    import keras

    from mixedpolicy.loss_scale import NoLossScale, StaticLossScale

    if not isinstance(config, dict) or "inner_optimizer" not in config:
        raise (ValueError if isinstance(config, dict) else TypeError)(
            f"Received {type(config).__name__} {config!r:.80} as a LossScaleOptimizer's config; expected "
            f"the dict its get_config() returns, with the wrapped optimizer's config under "
            f"'inner_optimizer'.")
    config = dict(config)
    inner = keras.saving.deserialize_keras_object(config.pop("inner_optimizer"), custom_objects=custom_objects)
    rounding = config.pop("update_rounding", None)
    if rounding is not None:  # saved by a wrapper whose optimizer rounded its updates (docs/memory.md)
        from mixedpolicy.backends.keras.updates import install

        install(inner, rounding)
    state_dtype = config.pop("optimizer_state_dtype", None)
    if state_dtype is not None:  # ... or stored its state in another dtype
        from mixedpolicy.backends.keras.state import install as install_state

        install_state(inner, state_dtype)
    if "reduce_policy" in config:  # saved as a policy's config
        from mixedpolicy.backends.keras.reduce import reduce_from_config

        config["reduce_policy"] = reduce_from_config(config["reduce_policy"])
    if config.pop("pass_through", False):
        for key in ("initial_scale", "dynamic_growth_steps"):
            config.pop(key, None)
        return inner, config, NoLossScale(skip_nonfinite=False)
    static = config.pop("static", False)
    dynamic = config.pop("dynamic", True)  # this class's configs from before said dynamic=False
    if static or dynamic is False:
        scale = StaticLossScale(config.pop("initial_scale", 2.0**15))
        config.pop("dynamic_growth_steps", None)
        return inner, config, scale
    return inner, config, None
