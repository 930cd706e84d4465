"""Loss scales: pure, immutable state machines shared by every backend.

The arithmetic is written once here; the arrays it works on belong to whichever
framework holds the state (numpy by default, a ``jax.Array`` under ``jax.jit``, a
``torch.Tensor`` on the GPU), and the adapter of that framework supplies the few
array operations it needs (`where`, `cast`, `all_finite`).
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any

import numpy as np

from mixedpolicy._registry import array_ops_for as _ops, array_ops_for_tree as _tree_ops
from mixedpolicy._scale_checks import array_dtype_name, check_finite_flag, check_scale, dynamic_settings
from mixedpolicy.trees import all_finite  # noqa: F401  (re-exported: its home before trees.py)


def _like(ops: Any, scale: Any, x: Any) -> Any:
    """The scale as a float32 array of `x`'s framework (and device), if it is not one already."""
    return scale if ops.is_array(scale) else ops.asarray(scale, "float32", like=x)


class LossScale(abc.ABC):
    """The interface of every loss scale: `loss_scale`, `scale`, `unscale`, `adjust`."""

    loss_scale: Any

    def scale(self, tree: Any) -> Any:
        """Returns ``loss * loss_scale`` in float32, for a loss or every floating leaf of a tree."""
        ops = _tree_ops(tree)
        scale = self.loss_scale

        def leaf(x):
            if isinstance(x, float):
                x = np.asarray(x, np.float32)
            elif ops.floating_dtype(x) is None:
                return x
            return ops.cast(x, "float32") * _like(ops, scale, x)

        return ops.tree_map(leaf, tree)

    def unscale(self, grads: Any) -> Any:
        """Divides every floating (and complex) leaf of `grads` by the scale, keeping each leaf's dtype.

        The arithmetic runs in the gradients' framework, whichever framework holds the
        scale; Python floats are divided too.
        """
        ops = _tree_ops(grads)
        scale = self.loss_scale
        inverses: dict = {}  # one reciprocal per width, not one per leaf

        def leaf(g):
            if isinstance(g, (float, complex)):
                return g / float(scale)
            dtype = ops.floating_dtype(g)
            if dtype is None:  # a complex gradient: its two parts; an integer one as it is
                parts = ops.complex_parts(g)
                return g if parts is None else parts[2](leaf(parts[0]), leaf(parts[1]))
            wide = "float64" if dtype == "float64" else "float32"
            if wide not in inverses:
                inverses[wide] = 1.0 / ops.cast(_like(ops, scale, g), wide)
            return ops.cast(ops.cast(g, wide) * inverses[wide], dtype)

        return ops.tree_map(leaf, grads)

    @abc.abstractmethod
    def adjust(self, grads_finite: Any) -> "LossScale":
        """Returns the state for the next step, given whether this step's gradients were finite."""


@dataclasses.dataclass(frozen=True, eq=False)
class NoLossScale(LossScale):
    """No scaling: `scale` and `unscale` return their input, `adjust` returns self.

    Args:
      skip_nonfinite: does a wrapper holding it still check the gradients and skip a
        step that is not finite (True, the default), or is it a pass-through whose step
        is the inner optimizer's step and nothing else (False: what
        `mixedpolicy.LossScaleOptimizer` chooses under a policy that needs no scaling)?

    >>> NoLossScale().scale(3.0)
    3.0
    """

    skip_nonfinite: bool = True

    def __post_init__(self):
        if not isinstance(self.skip_nonfinite, (bool, np.bool_)):
            raise TypeError(f"Received skip_nonfinite={self.skip_nonfinite!r:.60}; expected True "
                            f"(check the gradients and skip a non-finite step) or False (a "
                            f"pass-through: the inner optimizer's step alone).")
        object.__setattr__(self, "skip_nonfinite", bool(self.skip_nonfinite))

    @property
    def loss_scale(self) -> Any:
        return np.asarray(1.0, np.float32)

    def scale(self, loss: Any) -> Any:
        return loss

    def unscale(self, grads: Any) -> Any:
        return grads

    def adjust(self, grads_finite: Any) -> "NoLossScale":
        check_finite_flag(grads_finite)
        return self

    def __eq__(self, other: object) -> bool:
        return type(other) is NoLossScale and other.skip_nonfinite == self.skip_nonfinite

    def __hash__(self) -> int:
        return hash((NoLossScale, self.skip_nonfinite))


def is_pass_through(loss_scale: LossScale) -> bool:
    """Does a wrapper holding `loss_scale` add nothing to its inner optimizer's step?"""
    return isinstance(loss_scale, NoLossScale) and not loss_scale.skip_nonfinite


def summary(loss_scale: LossScale) -> str:
    """One line on what a wrapper holding `loss_scale` does to each step (its ``loss_scaling``).

    >>> summary(NoLossScale(skip_nonfinite=False))
    "pass-through: the inner optimizer's step, nothing added (no scaling, no finiteness check)"
    """
    if is_pass_through(loss_scale):
        return "pass-through: the inner optimizer's step, nothing added (no scaling, no finiteness check)"
    if isinstance(loss_scale, NoLossScale):
        return "no scaling; a step whose gradients are not all finite is skipped"
    if isinstance(loss_scale, StaticLossScale):
        return (f"static loss scale {float(np.asarray(loss_scale.loss_scale)):g}; a step whose "
                f"gradients are not all finite is skipped")
    if not isinstance(loss_scale, DynamicLossScale):
        return f"{type(loss_scale).__name__}: a loss scale of one's own"
    return (f"dynamic loss scale in [{loss_scale.min_scale:.10g}, {loss_scale.max_scale:.10g}], x"
            f"{loss_scale.growth_factor:g} after {loss_scale.dynamic_growth_steps} finite steps, x"
            f"{loss_scale.backoff_factor:g} and the step skipped on a non-finite gradient")


@dataclasses.dataclass(frozen=True, eq=False)
class StaticLossScale(LossScale):
    """A fixed scale: `adjust` returns self whatever the gradients.

    Args:
      loss_scale: the scale, a finite number > 0.

    >>> float(StaticLossScale(128.0).scale(np.float32(0.5)))
    64.0
    """

    loss_scale: Any = 2.0**15

    def __post_init__(self):
        object.__setattr__(self, "loss_scale", check_scale(self.loss_scale, "loss_scale"))

    def adjust(self, grads_finite: Any) -> "StaticLossScale":
        check_finite_flag(grads_finite)
        return self

    def __eq__(self, other: object) -> bool:
        return (type(other) is StaticLossScale
                and bool(np.asarray(other.loss_scale) == np.asarray(self.loss_scale)))

    def __hash__(self) -> int:
        return hash(StaticLossScale)


_TOP = float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True, eq=False)
class DynamicLossScale(LossScale):
    """A loss scale that finds the largest scale that keeps gradients finite.

    The algorithm (the same as Keras, ``torch.amp.GradScaler`` and jmp, plus bounds)::

        for each step:
            grads = unscale(grads of scale(loss))
            if all_finite(grads):
                counter += 1
                if counter == dynamic_growth_steps:
                    counter = 0
                    loss_scale = min(loss_scale * growth_factor, max_scale)
            else:                          # the caller skips this step's update
                counter = 0
                loss_scale = max(loss_scale * backoff_factor, min_scale)

    Unlike Keras and torch, the scale never leaves ``[min_scale, max_scale]``: a long
    run of overflows cannot drive it to 0 and turn the weights into NaN.

    Args:
      loss_scale: the initial scale (Keras calls it ``initial_scale``).
      counter: finite steps since the last change of scale.
      dynamic_growth_steps: finite steps in a row before the scale grows.
      growth_factor: factor applied on growth, > 1.
      backoff_factor: factor applied on overflow, in (0, 1).
      min_scale: the floor, > 0 (may be below 1); by default 1.0, or the initial scale where
        that is below 1.
      max_scale: the ceiling, at least the initial scale; by default 2**24, or the initial scale
        where that is above.
      period, factor, min_loss_scale: jmp's spellings, in jmp's order (``dynamic_growth_steps``,
        ``growth_factor = 1 / backoff_factor``, ``min_scale``; ``min_loss_scale=0``, jmp's "no
        floor", keeps the scale above float32's smallest normal number); with any of them, as
        jmp, no ceiling but float32's. The other settings are keywords.

    Raises:
      ValueError, TypeError: a setting is out of range or of the wrong type.

    >>> s = DynamicLossScale(loss_scale=8.0, dynamic_growth_steps=2)
    >>> s = s.adjust(True).adjust(True)
    >>> float(s.loss_scale), int(s.counter)
    (16.0, 0)
    >>> float(s.adjust(False).loss_scale)
    8.0
    """

    loss_scale: Any = 2.0**15
    counter: Any = 0
    dynamic_growth_steps: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float = 1.0
    max_scale: float = 2.0**24

    def __init__(self, loss_scale: Any = 2.0**15, counter: Any = 0, period: Any = None, factor: Any = None,
                 min_loss_scale: Any = None, *, dynamic_growth_steps: Any = None, growth_factor: Any = None,
                 backoff_factor: Any = None, min_scale: Any = None, max_scale: Any = None):
        settings = dynamic_settings(dict(period=period, factor=factor, min_loss_scale=min_loss_scale),
                                    dict(dynamic_growth_steps=dynamic_growth_steps, growth_factor=growth_factor,
                                         backoff_factor=backoff_factor, min_scale=min_scale, max_scale=max_scale),
                                    start=loss_scale)
        for name, value in dict(settings, loss_scale=loss_scale, counter=counter).items():
            object.__setattr__(self, name, value)
        self.__post_init__()

    period = property(lambda self: self.dynamic_growth_steps, doc="jmp's name of `dynamic_growth_steps`.")
    factor = property(lambda self: self.growth_factor, doc="jmp's name of `growth_factor`.")
    min_loss_scale = property(lambda self: self.min_scale, doc="jmp's name of `min_scale`.")

    def __post_init__(self):
        steps = self.dynamic_growth_steps
        if isinstance(steps, (float, np.floating)) and float(steps).is_integer():  # jmp's period=5.
            object.__setattr__(self, "dynamic_growth_steps", steps := int(steps))
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
            raise ValueError(f"Received dynamic_growth_steps={steps!r}; expected a whole "
                             f"number >= 1 (Keras and torch use 2000; jmp calls it period).")
        for name, low, high, hint in (
            ("growth_factor", 1.0, math.inf, "a number > 1, such as 2.0 (jmp's factor: growth_factor)"),
            ("backoff_factor", 0.0, 1.0, "a number in (0, 1), such as 0.5"),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) \
                    or not low < float(value) < high:
                raise ValueError(f"Received {name}={value!r}; expected {hint}.")
        min_scale = float(check_scale(self.min_scale, "min_scale"))
        max_scale = float(check_scale(self.max_scale, "max_scale"))
        if min_scale > max_scale:
            raise ValueError(f"Received min_scale={min_scale} > max_scale={max_scale}; "
                             f"expected min_scale <= max_scale.")
        scale = check_scale(self.loss_scale, "loss_scale")
        if isinstance(scale, np.ndarray) and not min_scale <= float(scale) <= max_scale:
            raise ValueError(f"Received loss_scale={float(scale)}, outside [min_scale, "
                             f"max_scale] = [{min_scale}, {max_scale}]; widen the bounds or "
                             f"choose an initial scale inside them.")
        counter = self.counter
        if isinstance(counter, (int, np.integer)) and not isinstance(counter, bool):
            if not 0 <= counter < 2**31:
                raise ValueError(f"Received counter={counter}; expected a count from 0 to 2**31 - 1.")
            counter = np.asarray(counter, np.int32)
        elif isinstance(counter, bool) or "int" not in array_dtype_name(counter):
            raise TypeError(f"Received counter={counter!r:.80} of type {type(counter).__name__}; "
                            f"expected a whole number >= 0 (finite steps since the scale last "
                            f"changed), or an integer array.")
        object.__setattr__(self, "loss_scale", scale)
        object.__setattr__(self, "counter", counter)
        object.__setattr__(self, "dynamic_growth_steps", int(steps))
        for name in ("growth_factor", "backoff_factor"):
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "min_scale", min_scale)
        object.__setattr__(self, "max_scale", max_scale)

    def adjust(self, grads_finite: Any) -> "DynamicLossScale":
        """Returns the next state; this one is left unchanged.

        Args:
          grads_finite: a boolean scalar (array or Python bool): were all gradients finite?
        """
        check_finite_flag(grads_finite)
        # the flag's framework, when it is an array (a traced one under jit), else the scale's
        ops = _ops(grads_finite)
        if ops.name == "numpy":
            ops = _ops(self.loss_scale)
        finite = ops.asarray(grads_finite, "bool", like=self.loss_scale)
        scale, count = self.loss_scale, self.counter
        if ops.name != "numpy" and _ops(scale).name == "numpy":  # a state made on the host, a framework's
            scale, count = ops.asarray(scale, "float32", like=finite), ops.asarray(count, "int32", like=finite)
        counter = ops.where(finite, count + 1, ops.zeros_like(count))
        grow = finite & (counter >= self.dynamic_growth_steps)
        grown = scale * self.growth_factor  # past float32 (inf): kept where it was, as jmp keeps it
        grown = ops.where(grown > self.max_scale, ops.full_like(scale, self.max_scale) if self.max_scale < _TOP
                          else scale, grown)
        shrunk = scale * self.backoff_factor
        shrunk = ops.where(shrunk < self.min_scale, ops.full_like(scale, self.min_scale), shrunk)
        new_scale = ops.where(grow, grown, ops.where(finite, scale, shrunk))
        new_counter = ops.where(grow, ops.zeros_like(counter), counter)
        return self.with_state(new_scale, new_counter)

    def with_state(self, loss_scale: Any, counter: Any) -> "DynamicLossScale":
        """These settings at another state: the scale and counter an optimizer keeps.

        A framework's optimizer holds the two arrays in its own state (optax's
        ``LossScaleState``, Keras's variables, torch tensors); this puts them back
        beside the settings, so `adjust` steps them. Nothing is checked or copied: the
        arrays may be traced (under ``jit``) or on a device, and stay there.

        >>> s = DynamicLossScale(loss_scale=8.0, dynamic_growth_steps=2)
        >>> float(s.with_state(np.float32(4.0), np.int32(1)).adjust(True).loss_scale)
        8.0
        """
        new = object.__new__(DynamicLossScale)
        for field in dataclasses.fields(self):
            object.__setattr__(new, field.name, getattr(self, field.name))
        object.__setattr__(new, "loss_scale", loss_scale)
        object.__setattr__(new, "counter", counter)
        return new

    def _settings(self) -> tuple:
        return (self.dynamic_growth_steps, self.growth_factor, self.backoff_factor,
                self.min_scale, self.max_scale)

    def __eq__(self, other: object) -> bool:
        if type(other) is not DynamicLossScale or other._settings() != self._settings():
            return False
        return (bool(np.asarray(other.loss_scale) == np.asarray(self.loss_scale))
                and bool(np.asarray(other.counter) == np.asarray(self.counter)))

    def __hash__(self) -> int:
        return hash((DynamicLossScale, self._settings()))

