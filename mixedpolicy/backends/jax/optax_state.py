"""The state of the optax `LossScaleOptimizer` (optax.py): its types, and a saved state's scale
and counters taken by a wrapper of another policy."""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from mixedpolicy._warnings import note_scale_read
from mixedpolicy.loss_scale import DynamicLossScale, LossScale

_log = logging.getLogger("mixedpolicy")


def _value(x: Any) -> Any:
    """The array inside an ``nnx.Variable`` (nnx.Optimizer wraps state leaves), or `x`."""
    if isinstance(x, jax.Array) or not hasattr(x, "get_value"):
        return x
    return x.get_value()


def _inner_field(state: Any, name: str) -> Any:
    """A field of the wrapped transformation's state read through the wrapper's (the states'
    ``__getattr__``): helpers that read their own state by attribute, such as optax's
    ``schedule_free_eval_params`` (``state.b1``, ``state.z``), take the wrapper's state as theirs."""
    if name.startswith("__") or name == "inner_state":  # (copy's and pickle's probes, a state half made)
        raise AttributeError(name)
    try:
        return getattr(state.inner_state, name)
    except AttributeError:
        raise AttributeError(f"{type(state).__name__!r} object has no attribute {name!r}, nor has its "
                             f"inner_state ({type(state.inner_state).__name__})") from None


class LossScaleState(NamedTuple):
    """The state of an optax `LossScaleOptimizer`.

    The scale and the three counters travel in one int32 array, ``counts``: every array of
    an optimizer state costs on each call of a jitted step (about 9 us under ``nnx.jit`` on
    a CPU, 5% of a 0.2 ms MLP step), and these are read rarely. The scale is kept there as
    its float32 bit pattern, exactly. All of them are read as fields.

    Attributes:
      inner_state: the wrapped transformation's state (its fields read through this one too).
      counts: ``[counter, last_step_skipped, num_skipped_steps, the scale's float32 bits]``,
        int32.
      loss_scale: the current scale, a float32 scalar.
      counter: finite steps since the scale last changed, an int32 scalar.
      last_step_skipped: whether the last update was skipped, a bool scalar.
      num_skipped_steps: how many updates were skipped so far, an int32 scalar.
    """

    inner_state: Any
    counts: Any

    __getattr__ = _inner_field

    @property
    def loss_scale(self) -> Any:
        note_scale_read()  # (a loop that scales by hand is not warned of as one that forgot to)
        return jax.lax.bitcast_convert_type(_value(self.counts)[..., 3], jnp.float32)

    @property
    def counter(self) -> Any:
        return _value(self.counts)[..., 0]

    @property
    def last_step_skipped(self) -> Any:
        return _value(self.counts)[..., 1] == 1

    @property
    def num_skipped_steps(self) -> Any:
        return _value(self.counts)[..., 2]

    def with_loss_scale(self, loss_scale: Any) -> "LossScaleState":
        """This state with another scale (the counters kept), e.g. to resume from a scale
        recorded elsewhere."""
        return self._replace(counts=pack_counts(loss_scale, self.counter, self.last_step_skipped,
                                                self.num_skipped_steps))


def pack_counts(loss_scale: Any, counter: Any, skipped: Any, num_skipped: Any) -> Any:
    """The ``counts`` array of a `LossScaleState`: the three counters and the scale's bits."""
    bits = jax.lax.bitcast_convert_type(jnp.asarray(loss_scale, jnp.float32), jnp.int32)
    return jnp.stack([jnp.asarray(counter, jnp.int32), jnp.asarray(skipped, jnp.int32),
                      jnp.asarray(num_skipped, jnp.int32), bits])


class PassThroughState(NamedTuple):
    """The state of a pass-through `LossScaleOptimizer` (a policy that needs no scaling):
    the inner state alone, read like a `LossScaleState` (scale 1, nothing skipped).

    It carries no array of its own: each array of an optimizer state costs on every call of
    a jitted step (about 10 us under ``nnx.jit`` on a CPU, 5% of a small MLP's step), and a
    pass-through adds nothing to the step. A state saved under one policy moves to a wrapper
    of another with `LossScaleTransformation.adopt_state`.

    Attributes:
      inner_state: the wrapped transformation's state (its fields read through this one too).
    """

    inner_state: Any

    __getattr__ = _inner_field

    @property
    def loss_scale(self) -> Any:
        return jnp.float32(1.0)

    @property
    def counter(self) -> Any:
        return jnp.int32(0)

    @property
    def last_step_skipped(self) -> Any:
        return jnp.bool_(False)

    @property
    def num_skipped_steps(self) -> Any:
        return jnp.int32(0)


_STATES = (LossScaleState, PassThroughState)


def adopted_scale(saved: Any, fresh: Any, loss_scale: LossScale) -> Any:
    """`fresh` (a wrapper's new state around the adopted inner state) with what `saved` held of
    the scale, as the torch wrapper loads a checkpoint: a dynamic scale goes on from the saved
    one, except a scale of 1 with no growth count (what a wrapper that scales nothing keeps),
    which leaves this wrapper's own initial scale; a wrapper that scales nothing (or a static
    scale) keeps its own, and says so once where the saved one differed; the skip counts go
    along wherever the new state keeps them. Reads the saved scale on the host."""
    if not isinstance(saved, LossScaleState):
        return fresh
    scale, counter = float(saved.loss_scale), int(saved.counter)
    if isinstance(loss_scale, DynamicLossScale) and not (scale == 1.0 and counter == 0):
        return LossScaleState(fresh.inner_state, saved.counts)
    keeps_counts = isinstance(fresh, LossScaleState)  # (a pass-through's state is the inner one alone)
    skipped = int(saved.num_skipped_steps)
    never_scaled = scale == 1.0 and counter == 0
    if not isinstance(loss_scale, DynamicLossScale) and scale != float(fresh.loss_scale) and not never_scaled:
        _log.warning("Adopted an optimizer state whose loss scale is %g into a LossScaleOptimizer with %s: "
                     "the scale is dropped; %s.", scale,
                     "no scaling" if float(fresh.loss_scale) == 1.0 else f"a static scale of {float(fresh.loss_scale):g}",
                     "the inner state and the skip counts are kept" if keeps_counts else
                     f"the inner state is kept, and its skip count ({skipped}) dropped: a pass-through keeps none")
    elif not keeps_counts and skipped:
        _log.warning("Adopted an optimizer state that counted %d skipped steps into a pass-through "
                     "LossScaleOptimizer (skip_nonfinite=False), which keeps no count: the count is dropped; "
                     "the inner state is kept.", skipped)
    if not keeps_counts:
        return fresh
    return fresh._replace(counts=pack_counts(fresh.loss_scale, fresh.counter, saved.last_step_skipped,
                                             saved.num_skipped_steps))
