"""Every change mixedpolicy makes to Keras's own modules, in one place, and how to undo it.

Three, each because Keras offers no hook for it:

- Keras's ``dtype_policy()`` (what a layer built with ``dtype=None`` takes) is wrapped so
  that mixedpolicy knows every global policy object a layer was built with (a policy not
  among them was written by the user, and wins over a map's default) and so that a thread
  that never set a Keras policy sees the one mixedpolicy's global policy maps to (Keras keeps
  its global policy per thread; mixedpolicy's is process-wide);
- the name ``compile`` checks a mixed_float16 model's optimizer against and wraps a plain one
  with: it warns of a pass-through ``LossScaleOptimizer`` of mixedpolicy's (one that scales
  nothing) compiled into that model, and, while mixedpolicy's global policy computes in
  float16, wraps with mixedpolicy's ``LossScaleOptimizer`` instead of Keras's
  (`mixedpolicy.backends.keras.compile.use_bounded_loss_scale_in_compile`);
- while it asks the optimizer for an update recipe (rounding, state dtype), Keras's
  ``Trainer.compile`` wraps a plain optimizer in that ``LossScaleOptimizer``, which carries
  the recipe out (`mixedpolicy.backends.keras.compile.carry_updates_in_compile`).

`install` puts the first two in place when Keras is imported with mixedpolicy loaded (and again
whenever mixedpolicy sets a Keras global policy); `uninstall` gives Keras all three back
(``mp.keras.uninstall()``), leaving Keras's modules as they were before mixedpolicy.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from keras.src.backend.common import global_state
from keras.src.dtype_policies import dtype_policy as _keras_dtype_policy
from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer as _KerasLossScaleOptimizer
from keras.src.trainers import trainer as _keras_trainer

# Every Keras global DTypePolicy object seen: a layer built with dtype=None holds the very
# object in force then, so a policy object not among these was written by the user.
# (DTypePolicy defines __eq__ without __hash__: kept by id, weakly.)
seen_globals: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
process_policy: list = [None]  # the Keras policy mixedpolicy's global policy maps to
_keras_own = _keras_dtype_policy.dtype_policy  # Keras's function, as Keras defined it
_keras_loss_scale_optimizer = _KerasLossScaleOptimizer  # the class Keras's compile names
_lock = threading.Lock()


def note_global() -> None:
    """Remembers the Keras global policy object in force in this thread."""
    current = global_state.get_global_attribute("dtype_policy", None)
    if current is not None:
        seen_globals[id(current)] = current


def _dtype_policy_for_this_thread() -> Any:
    """Keras's ``dtype_policy()``: notes each global policy object it hands to a layer, and
    falls back on mixedpolicy's global in a thread that set none."""
    if global_state.get_global_attribute("dtype_policy", None) is None and process_policy[0] is not None:
        global_state.set_global_attribute("dtype_policy", process_policy[0])
    policy = _keras_own()
    seen_globals[id(policy)] = policy
    return policy


def installed() -> bool:
    """Whether Keras's ``dtype_policy()`` is mixedpolicy's wrapper now."""
    return _keras_dtype_policy.dtype_policy is _dtype_policy_for_this_thread


def install() -> None:
    """Wraps Keras's ``dtype_policy()`` and checks ``compile``'s optimizer (idempotent)."""
    from mixedpolicy.backends.keras.compile import _CheckInCompile

    with _lock:
        if not installed():
            _keras_dtype_policy.dtype_policy = _dtype_policy_for_this_thread
        if _keras_trainer.LossScaleOptimizer is _keras_loss_scale_optimizer:
            _keras_trainer.LossScaleOptimizer = _CheckInCompile
    note_global()


def uninstall() -> None:
    """Gives Keras its own ``dtype_policy()``, ``compile`` and ``compile``'s ``LossScaleOptimizer`` back.

    Layers built after this in a thread that never set a Keras policy take Keras's default
    there (as in plain Keras), ``compile`` wraps float16 models in Keras's own
    ``LossScaleOptimizer``, and Keras's global policy stays whatever was last set in each
    thread. Policies already on layers, and models given `apply_policy`, are unchanged.
    `mp.set_global_policy` installs the wrapper again.
    """
    from mixedpolicy.backends.keras.compile import carry_updates_in_compile, use_bounded_loss_scale_in_compile

    with _lock:
        _keras_dtype_policy.dtype_policy = _keras_own
        process_policy[0] = None
    use_bounded_loss_scale_in_compile(False)
    carry_updates_in_compile(False)
    _keras_trainer.LossScaleOptimizer = _keras_loss_scale_optimizer
