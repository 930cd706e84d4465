"""Saving a Keras `LossScaleOptimizer`: the skip counters in a group of their own.

The optimizer's own group then holds exactly the variables Keras's own
``keras.optimizers.LossScaleOptimizer`` reads, so a ``.keras`` file written with
mixedpolicy's wrapper loads in plain Keras.
"""

from __future__ import annotations

import weakref
from typing import Any

from keras import ops
from keras.src.saving.keras_saveable import KerasSaveable


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
            store["0"] = ops.convert_to_numpy(owner._skips)

    def load_own_variables(self, store: Any) -> None:
        owner = self._owner()
        if owner is not None and owner.built and "0" in store.keys():
            owner._skips.assign(store["0"])


def keras_variables(optimizer: Any) -> list:
    """The wrapper's variables in the order Keras's own LossScaleOptimizer has them (no counters)."""
    return [v for v in optimizer.variables if v is not optimizer._skips]


def save_keras_layout(optimizer: Any, store: Any) -> None:
    """Writes the wrapper's variables as Keras's own LossScaleOptimizer does."""
    for i, variable in enumerate(keras_variables(optimizer)):
        store[str(i)] = variable.numpy() if hasattr(variable, "numpy") else variable


def load_keras_layout(optimizer: Any, store: Any) -> bool:
    """Reads Keras's layout, or the one mixedpolicy wrote before (the counters at index 2).

    Returns False, reading nothing, where the optimizer is not built or the store holds
    another number of variables (Keras's own warning then says so).

    Raises:
      ValueError: the scale read is not a finite number > 0.
    """
    if not optimizer.built:
        return False
    ours = keras_variables(optimizer)
    if len(store.keys()) == len(optimizer.variables):
        ours = optimizer.variables
    elif len(store.keys()) != len(ours):
        return False
    for i, variable in enumerate(ours):
        variable.assign(store[str(i)])
    scale = float(ops.convert_to_numpy(optimizer.dynamic_scale))
    if not (scale > 0 and scale < float("inf")):
        raise ValueError(
            f"Received a checkpoint whose loss scale is {scale}; expected a finite number > 0 "
            f"(a scale of 0, NaN or inf turns the weights into NaN at the next step). The "
            f"file was written by an optimizer whose scale had collapsed; load the model with "
            f"compile=False and compile it with a fresh LossScaleOptimizer.")
    return True


def constructor_arguments(config: dict, custom_objects: Any = None) -> tuple[Any, dict, Any]:
    """(inner optimizer, keyword arguments, loss scale or None) for a LossScaleOptimizer from
    its config: this package's configs and Keras's own (its current and its older layout)."""
    import keras

    from mixedpolicy.loss_scale import NoLossScale, StaticLossScale

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
