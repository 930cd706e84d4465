"""Loss scaling in a stateless Keras step: a custom JAX loop around ``stateless_apply``.

Such a loop carries the optimizer's variables as values: ``stateless_apply`` reads the scale
from them and returns the new one. ``scale_loss`` reads the scale *variable*, which Keras's own
trainer maps to the carried value (a ``keras.StatelessScope``); in a user's ``jax.jit`` step
outside one, the read is a constant of the compiled step, so after the first skipped step the
gradients are scaled by one scale and unscaled by another (Keras's own ``LossScaleOptimizer``
does the same). `StatelessScaling.stateless_scale_loss` reads the carried value, and
``scale_loss`` traced that way warns with the fix.
"""

from __future__ import annotations

import warnings
from typing import Any

import keras
from keras.src.backend.common.stateless_scope import in_stateless_scope

from mixedpolicy import _warnings
from mixedpolicy._warnings import user_stacklevel
from mixedpolicy.loss_scale import DynamicLossScale


def _staged(x: Any) -> bool:
    """Whether `x` is being staged out by ``jax.jit`` (under grad or vmap too): a value whose
    computation runs later, in a compiled program, rather than now."""
    import jax

    while isinstance(x, jax.core.Tracer):
        if type(x).__name__ == "DynamicJaxprTracer":
            return True
        x = getattr(x, "primal", getattr(x, "val", None))  # grad's and vmap's tracers wrap another
    return False


class StatelessScaling:
    """What the Keras `LossScaleOptimizer` adds for stateless steps (a mixin)."""

    def stateless_scale_loss(self, optimizer_variables: Any, loss: Any) -> Any:
        """``scale_loss`` in a stateless step: ``loss`` times the scale held in
        `optimizer_variables` (the values this step passes to ``stateless_apply``, in the
        order of ``optimizer.variables``), not the scale variable's value when the step was
        traced.

        Raises:
          ValueError: the optimizer is not built, or `optimizer_variables` does not hold one
            value per optimizer variable.
        """
        values = list(optimizer_variables)
        if not self.built or len(values) != len(self.variables):
            raise ValueError(
                f"Received {len(values)} optimizer variable values for a LossScaleOptimizer that holds "
                f"{len(self.variables) if self.built else 'none yet (it is not built)'}; pass the values "
                f"this step gives stateless_apply, [v.value for v in optimizer.variables] at the start, "
                f"after optimizer.build(model.trainable_variables).")
        with keras.StatelessScope(state_mapping=list(zip(self.variables, values))):
            return self.scale_loss(loss)

    def _live_scale(self, loss: Any) -> Any:
        """The scale `scale_loss` multiplies by; warns where a compiled step would keep it constant."""
        self.__dict__["_mixedpolicy_scaled_a_loss"] = True  # (`_warn_if_never_scaled`)
        if not self.built:
            return self.initial_scale
        if (keras.backend.backend() == "jax" and isinstance(self._scale_settings, DynamicLossScale)
                and not in_stateless_scope() and _staged(loss)):
            warnings.warn(
                "LossScaleOptimizer.scale_loss was traced in a jax.jit step outside a keras.StatelessScope: "
                "it reads the scale variable once, as a constant of the compiled step, while "
                "stateless_apply changes the scale in the optimizer variables the step carries; after "
                "the first skipped step the gradients would be scaled by one scale and unscaled by "
                "another. Use optimizer.stateless_scale_loss(optimizer_variables, loss) in the step.",
                stacklevel=3)
        return self.dynamic_scale

    def _warn_if_never_scaled(self) -> None:
        """Warns once, at the user's line, where gradients are unscaled while this wrapper's
        ``scale_loss`` was never called: a custom loop that differentiates the plain loss has its
        update divided by the scale (torch's wrapper and GradScaler refuse such a step; Keras's
        trainers call ``scale_loss`` themselves). Once code of the user's has read ``loss_scale`` (to
        scale by hand), nothing is said."""
        seen = self.__dict__
        if seen.get("_mixedpolicy_scaled_a_loss") or seen.get("_mixedpolicy_warned_unscaled") \
                or _warnings.SCALE_READ_BY_USER[0]:
            return
        seen["_mixedpolicy_warned_unscaled"] = True
        warnings.warn(
            f"A LossScaleOptimizer that scales the loss (by {self.initial_scale:g} to start) was given "
            f"gradients to apply, and its scale_loss was never called: where these are the gradients "
            f"of the plain loss, dividing them by the loss scale makes the update that many times too "
            f"small (torch's GradScaler refuses such a step). Differentiate optimizer.scale_loss(loss) "
            f"(in a stateless JAX step, optimizer.stateless_scale_loss(optimizer_variables, loss)); "
            f"model.fit does this itself.", UserWarning,
            stacklevel=user_stacklevel("keras", "jax", "tensorflow", "torch"))
