"""Keras's ``compile`` with mixedpolicy's loss-scale optimizer: per model after `apply_policy`,
and through Keras's own wrapping while the global policy computes in float16."""

from __future__ import annotations

import functools
import threading
import warnings
from typing import Any, Callable

import keras


def compile_with_loss_scale(model: Any, scaled: bool = True, reduce_policy: Any = None,
                            updates: Any = None) -> Callable:
    """``model.compile`` wrapping a plain optimizer in this package's LossScaleOptimizer: with
    a dynamic scale where `scaled`, else a pass-through; reducing in `reduce_policy`'s dtypes;
    updating as the policy `updates` says (stochastic rounding), where one is given."""
    compile_ = type(model).compile

    def compile(*args: Any, optimizer: Any = "rmsprop", **kwargs: Any) -> Any:
        from mixedpolicy.backends.keras.optimizer import LossScaleOptimizer
        from mixedpolicy.loss_scale import NoLossScale

        if args:
            optimizer, args = args[0], args[1:]
        optimizer = keras.optimizers.get(optimizer)
        if updates is not None and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            from mixedpolicy.optimizer import _with_updates
            from mixedpolicy.backends.keras.optimizer import KerasOptimizers

            optimizer = _with_updates(KerasOptimizers(), optimizer, (updates,))  # refused with the fix
        if scaled:
            warn_if_it_scales_nothing(optimizer)
        if kwargs.get("auto_scale_loss", True) and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            scale = {} if scaled else {"loss_scale": NoLossScale(skip_nonfinite=False)}
            optimizer = LossScaleOptimizer(optimizer, name="loss_scale_optimizer", reduce_policy=reduce_policy,
                                           **scale)
        return compile_(model, optimizer, *args, **kwargs)

    compile.__doc__ = compile_.__doc__
    return compile


def warn_if_it_scales_nothing(optimizer: Any) -> None:
    """Warns, once per optimizer, where mixedpolicy's ``LossScaleOptimizer`` that followed
    policies with no float16 compute (a pass-through) is compiled into a model that computes in
    float16: its gradients may underflow unscaled, and nothing else would say so."""
    from mixedpolicy._warnings import user_stacklevel

    state = getattr(optimizer, "__dict__", {})
    followed = state.get("_followed_policies")
    if followed and not any(p.needs_loss_scaling for p in followed) and not optimizer.built \
            and not state.get("_mixedpolicy_warned_unscaled"):
        state["_mixedpolicy_warned_unscaled"] = True
        warnings.warn(
            f"Received a LossScaleOptimizer that scales nothing (it followed "
            f"{', '.join(sorted({p.name for p in followed}))} when it was made) for a model whose policy "
            f"computes in float16: its float16 gradients may underflow to zero unscaled. Make it with "
            f"the model's policy, mp.LossScaleOptimizer(opt, policy=...), or pass the plain optimizer "
            f"to compile, which wraps it with a dynamic scale.", UserWarning, stacklevel=user_stacklevel("keras"))


_patch_lock = threading.Lock()


def use_bounded_loss_scale_in_compile(on: bool = True) -> None:
    """While mixedpolicy's global policy computes in float16, ``model.compile`` under a
    float16 policy wraps with mixedpolicy's loss-scale optimizer; `on=False` gives Keras its own back.

    Keras's ``compile`` wraps a plain optimizer in its own ``LossScaleOptimizer`` when
    the model's policy is ``mixed_float16``; that one has no floor on its scale. The
    name it uses is pointed at mixedpolicy's subclass, which keeps every behaviour of
    Keras's and adds the bounds and the skip counters, for as long as the global policy
    set through mixedpolicy computes in float16 (models given a policy by `apply_policy`
    wrap in their own ``compile``, whatever the global policy).
    """
    from keras.src.trainers import trainer

    with _patch_lock:
        trainer.LossScaleOptimizer = _WrapInCompile if on else _CheckInCompile


_keras_compile: list = []  # Keras's own Trainer.compile while the update patch is on


def carry_updates_in_compile(on: bool = True) -> None:
    """While mixedpolicy's global policy asks the optimizer for an update recipe (stochastic
    rounding, Kahan summation, a state dtype), ``model.compile`` wraps a plain optimizer in
    mixedpolicy's ``LossScaleOptimizer``, which carries it out (following the global policy); a
    model given a policy by `apply_policy` wraps in its own ``compile`` first. Keras's own
    ``compile`` would keep a plain optimizer, rounding every update to nearest and keeping its
    moments in the variables' dtype, whatever the policy said. Under a policy with half-precision
    variables and no recipe the optimizer stays Keras's own, and is warned of where its arithmetic
    there cannot train (Adam's beta_2=0.999 is 1.0 in bfloat16). `on=False` gives Keras its own back."""
    from keras.src.trainers.trainer import Trainer

    with _patch_lock:
        if on and not _keras_compile:
            _keras_compile.append(Trainer.compile)
            own = Trainer.compile

            def compile(self: Any, optimizer: Any = "rmsprop", *args: Any, **kwargs: Any) -> Any:
                import mixedpolicy as mp
                from mixedpolicy.scope import global_policy

                policy = global_policy()
                if optimizer is not None and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
                    if not policy.updates_as_the_optimizer_does:
                        optimizer = mp.LossScaleOptimizer(keras.optimizers.get(optimizer))  # warns as below
                    else:  # half-precision variables: Keras's own arithmetic there, said where it cannot train
                        from mixedpolicy.backends.keras.optimizer import KerasOptimizers

                        optimizer = keras.optimizers.get(optimizer)
                        KerasOptimizers().warn_arithmetic(optimizer, (policy,))
                return own(self, optimizer, *args, **kwargs)

            functools.update_wrapper(compile, own)
            compile.mixedpolicy_patch = True  # type: ignore[attr-defined]
            Trainer.compile = compile
        elif not on and _keras_compile:
            Trainer.compile = _keras_compile.pop()


class _CheckInCompileMeta(type):
    # compile asks "is it a LossScaleOptimizer already?" only of a model whose policy is
    # mixed_float16: one of ours that scales nothing is, and is warned of there.
    def __instancecheck__(cls, obj: Any) -> bool:
        if isinstance(obj, keras.optimizers.LossScaleOptimizer):
            warn_if_it_scales_nothing(obj)
            return True
        return False

    def __call__(cls, optimizer: Any, **kwargs: Any) -> Any:
        return keras.optimizers.LossScaleOptimizer(optimizer, **kwargs)


class _CheckInCompile(metaclass=_CheckInCompileMeta):
    """What ``model.compile`` calls ``LossScaleOptimizer`` with mixedpolicy loaded: Keras's own,
    which a pass-through of ours compiled into a mixed_float16 model is warned of."""


class _WrapInCompileMeta(_CheckInCompileMeta):
    # and, once mixedpolicy's global policy computes in float16, the name that wraps a plain
    # optimizer is mixedpolicy's.
    def __call__(cls, optimizer: Any, **kwargs: Any) -> Any:
        from mixedpolicy.backends.keras.optimizer import LossScaleOptimizer

        return LossScaleOptimizer(optimizer, **kwargs)


class _WrapInCompile(metaclass=_WrapInCompileMeta):
    """What ``model.compile`` calls ``LossScaleOptimizer`` once mixedpolicy has a float16 policy."""
