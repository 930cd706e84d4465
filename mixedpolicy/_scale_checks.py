"""Validation of loss-scale settings and flags: what a scale, a counter and a finiteness flag may be.

Every refusal says what was received, what is expected and how to fix it. Values
that are framework arrays are checked for their dtype and, where they can be read
without tracing, for their value; a traced array (under ``jax.jit``) passes.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np

_F32_MAX = float(np.finfo(np.float32).max)


def array_dtype_name(value: Any) -> str:
    """The plain dtype name of an array of any framework ("" for none): "float32", "bool"..."""
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return ""
    name = getattr(dtype, "name", None)
    return name if isinstance(name, str) else str(dtype).rpartition(".")[2]


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)


class FlagError(TypeError, AssertionError):
    """A finiteness flag that is no boolean scalar: a TypeError, and the AssertionError jmp raises."""


def float_scale(value: Any, what: str) -> Any:
    """`value`, an integer array (jmp warns and goes on) taken as a float32 scalar with jmp's
    warning where its value can be read; anything else as it is."""
    dtype = array_dtype_name(value)
    if not dtype.startswith(("int", "uint")) or is_number(value):
        return value
    warnings.warn(f"Expected floating type for {what}, got {dtype}: it is taken as float32 (the "
                  f"scale is kept in float32); pass a float32 array or a Python number.", stacklevel=5)
    try:
        return np.asarray(float(value), np.float32)
    except Exception:  # traced (jax.jit): its dtype is the caller's
        return value


def check_scale(value: Any, what: str) -> Any:
    """Validates a scale; returns a float32 numpy scalar, or a framework array as given.

    A framework array is checked for its dtype and, where its value can be read
    without tracing (outside ``jax.jit``), for its value; a traced one passes. An integer
    array is taken as float32 with jmp's warning (`float_scale`).
    """
    value = float_scale(value, what)
    dtype = array_dtype_name(value)
    if dtype in ("float16", "bfloat16"):
        raise ValueError(
            f"Received {what} as a {dtype} value; the scale is kept in float32 whatever the "
            f"compute dtype (float16 overflows above 65504, and the scale grows past that). "
            f"Pass a Python number such as 2**15, or a float32 array.")
    if dtype and not is_number(value) and not dtype.startswith("float"):
        raise TypeError(f"Received {what} as an array of dtype {dtype}; expected a float32 scalar "
                        f"or a Python number such as 2**15 (the scale is kept in float32).")
    if isinstance(value, bool) or not (is_number(value) or hasattr(value, "dtype")):
        raise TypeError(f"Received {what}={value!r:.80} of type {type(value).__name__}; "
                        f"expected a positive number such as 2**15.")
    framework_array = not isinstance(value, (int, float, np.generic, np.ndarray))
    shape = tuple(getattr(value, "shape", ()))
    if shape not in ((), (1,)):
        raise ValueError(f"Received {what} of shape {shape}; expected a scalar.")
    try:
        number = float(value) if framework_array else float(np.asarray(value))
    except Exception:  # a traced array (jax.jit): checked where it was made
        return value
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"Received {what}={number!r}; expected a finite number > 0. "
                         f"A scale of 0, NaN or inf would turn the gradients into NaN.")
    if number > _F32_MAX:
        raise ValueError(f"Received {what}={number!r}, larger than float32 can hold "
                         f"({_F32_MAX:.3g}); the scale is kept in float32.")
    if float(np.float32(number)) == 0.0:
        raise ValueError(f"Received {what}={number!r}, which rounds to 0 in float32 (the "
                         f"smallest float32 above 0 is about 1.4e-45); a scale of 0 would turn "
                         f"the weights into NaN. Choose a value of at least 2**-126 (~1.2e-38).")
    return value if framework_array else np.asarray(number, np.float32)


def check_finite_flag(grads_finite: Any, what: str = "grads_finite") -> Any:
    """Refuses what cannot be a 'were the gradients finite' flag (None, NaN, a list...)."""
    if isinstance(grads_finite, (bool, np.bool_)):
        return grads_finite
    shape = tuple(getattr(grads_finite, "shape", (None,)))
    if array_dtype_name(grads_finite) == "bool" and shape in ((), (1,)):
        return grads_finite
    raise FlagError(
        f"Received {what}={grads_finite!r:.80} of type {type(grads_finite).__name__}; "
        f"expected boolean scalar: True, False, or a bool array of shape () such as the "
        f"result of all_finite(grads).")


def dynamic_settings(jmp: dict, ours: dict, start: Any = None) -> dict:
    """A dynamic scale's five settings, from its keywords and jmp's spellings (``period``,
    ``factor``: growth by it and backoff by its inverse, ``min_loss_scale``), each given once.

    With a jmp spelling, as in jmp, the scale has no ceiling but float32's, and a floor of 0
    (jmp's "no floor") becomes float32's smallest normal number: the scale never reaches 0.
    """
    for jmp_name, name in (("period", "dynamic_growth_steps"), ("factor", "growth_factor"),
                           ("factor", "backoff_factor"), ("min_loss_scale", "min_scale")):
        if jmp[jmp_name] is not None and ours[name] is not None:
            raise TypeError(f"Received {jmp_name}={jmp[jmp_name]!r} (jmp's spelling) and "
                            f"{name}={ours[name]!r}; give it once.")
    settings = dict(ours)
    if jmp["period"] is not None:
        settings["dynamic_growth_steps"] = jmp["period"]
    if jmp["factor"] is not None:
        factor = jmp["factor"]
        settings["growth_factor"], settings["backoff_factor"] = factor, 1.0 / float(check_scale(factor, "factor"))
    floor = float_scale(jmp["min_loss_scale"], "min_loss_scale")
    if floor is not None:
        zero = is_number(floor) or hasattr(floor, "dtype") and getattr(floor, "shape", None) == ()
        settings["min_scale"] = float(np.finfo(np.float32).tiny) if zero and float(floor) == 0 else floor
    with_jmp = any(v is not None for v in jmp.values())
    defaults = dict(dynamic_growth_steps=2000, growth_factor=2.0, backoff_factor=0.5, min_scale=1.0,
                    max_scale=_F32_MAX if with_jmp else 2.0**24)
    # bounds left to their defaults hold an initial scale `start` given outside them (GradScaler and
    # Keras start anywhere: a port of init_scale=2.0**30 is not refused for a default ceiling)
    first = _plain_scale(start)
    if first is not None and settings["max_scale"] is None and not with_jmp:
        defaults["max_scale"] = max(defaults["max_scale"], first)
    if first is not None and settings["min_scale"] is None:
        defaults["min_scale"] = min(defaults["min_scale"], first)
    return {k: default if settings[k] is None else settings[k] for k, default in defaults.items()}


def _plain_scale(value: Any) -> float | None:
    """`value` as a float where it is a plain finite number > 0 (a Python or numpy number, a
    one-element numpy array); None otherwise (an array of a framework, a tracer, a bad value:
    checked, and named, where the scale is checked)."""
    if isinstance(value, np.ndarray) and value.size == 1:
        value = value.reshape(()).item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        return None
    value = float(value)
    return value if math.isfinite(value) and value > 0 else None


#: the anchors' names for the wrapper's settings (GradScaler, jmp, tf.keras), and ours
_ANCHOR_NAMES = {
    "init_scale": "initial_scale= (GradScaler's init_scale)",
    "growth_interval": "dynamic_growth_steps= (GradScaler's growth_interval)",
    "period": "dynamic_growth_steps= (jmp's period)",
    "factor": "growth_factor= (jmp's factor, which also sets the back-off to 1/factor: pass "
              "backoff_factor= too)",
    "min_loss_scale": "min_scale= (jmp's min_loss_scale)",
    "enabled": "loss_scale=mp.NoLossScale() for GradScaler's enabled=False (no scaling; a non-finite "
               "step is still skipped)",
    "dynamic": "loss_scale=mp.StaticLossScale(scale) for tf.keras's dynamic=False",
}


def anchor_names(unexpected: Any) -> str:
    """A sentence naming our setting for each of `unexpected` that is another library's name ("" if none)."""
    ours = [f"for {name}= pass {_ANCHOR_NAMES[name]}" for name in sorted(unexpected) if name in _ANCHOR_NAMES]
    return f" Here, {'; '.join(ours)}." if ours else ""
