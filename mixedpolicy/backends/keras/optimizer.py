"""`LossScaleOptimizer` for Keras 3: Keras's own, with a bounded scale and visible skips.

A subclass of ``keras.optimizers.LossScaleOptimizer`` that keeps its interface, its variables
(``dynamic_scale``, ``step_counter``) and its behaviour in ``model.fit`` and custom loops on the
jax, torch and tensorflow backends, and changes what made Keras's unsafe:

- the scale moves by the shared `mixedpolicy.DynamicLossScale` algorithm, bounded to
  ``[min_scale, max_scale]`` (Keras's halves without a floor, reaches 0 after about 150
  overflows, and the next finite step turns the weights into -inf);
- a skipped step is counted: ``last_step_skipped`` and ``num_skipped_steps`` are optimizer
  variables (saved and restored with the model, like the scale);
- ``apply`` in eager JAX code decides in Python, not in a traced ``jax.lax.cond`` (Keras's fails);
- under ``tf.distribute`` the finiteness flag is all-reduced over the replicas (one replica's
  overflow makes every replica skip);
- under ``tf.distribute`` gradients are summed over the replicas in the reduce dtype of
  ``reduce_policy`` (each variable's for a `PolicyMap`) before the check, not in float32;
- the scaled loss is computed in float32.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
from keras import ops
from keras.src.saving import object_registration as _registry  # the name a class saves under

from mixedpolicy._adapter import OptimizerAdapter
from mixedpolicy._scale_checks import anchor_names
from mixedpolicy._warnings import note_scale_read
from mixedpolicy.backends.keras.reduce import (all_finite, already_summed, check_gradients, check_loss,
                                               check_reduce_policy, finite_on_every_replica, is_concrete,
                                               reduce_to_config, sum_across_replicas)
from mixedpolicy.backends.keras.updates import KerasUpdates, rounding_to_config
from mixedpolicy.backends.keras.policy_maps import policies_in
from mixedpolicy.backends.keras.stateless import StatelessScaling
from mixedpolicy.backends.keras.saving import (SkipCounters, SkipCounts, constructor_arguments, load_keras_layout,
                                               prepared_for_checkpoints, save_keras_layout, to_numpy)
from mixedpolicy.policy import Policy
from mixedpolicy.scope import global_policy
from mixedpolicy.loss_scale import DynamicLossScale, LossScale, NoLossScale, StaticLossScale, is_pass_through, summary


@keras.saving.register_keras_serializable(package="mixedpolicy")
class LossScaleOptimizer(SkipCounters, StatelessScaling, keras.optimizers.LossScaleOptimizer):
    """Keras's ``LossScaleOptimizer`` with a bounded scale and skip counters.

    Made by `mixedpolicy.LossScaleOptimizer` from a Keras 3 optimizer, and by
    ``model.compile`` under a float16 policy set through mixedpolicy.

    Args:
      inner_optimizer: the Keras optimizer to wrap.
      initial_scale, dynamic_growth_steps, growth_factor, backoff_factor, min_scale,
        max_scale: as for `mixedpolicy.DynamicLossScale`.
      dynamic: True, as Keras accepts it; False is refused as Keras refuses it (pass
        ``loss_scale=mp.StaticLossScale(scale)`` for a fixed scale).
      loss_scale: a `DynamicLossScale` or `StaticLossScale` instead of the settings; a
        `NoLossScale(skip_nonfinite=False)` makes a pass-through (what
        `mixedpolicy.LossScaleOptimizer` gives under a policy that needs no scaling), and
        `NoLossScale()` a static scale of 1 that still skips non-finite steps.
      reduce_policy: a `Policy`, its name or a `PolicyMap` whose reduce dtypes the gradients
        are summed in across ``tf.distribute`` replicas (float32, bfloat16, float16; see
        `mixedpolicy.tensorflow.all_reduce`); None, or reduce dtypes all float32: Keras's own
        float32 sum. Other backends refuse a reduce dtype other than float32.
      name, **kwargs: as Keras's: a base-optimizer argument (``clipnorm``...) is a
        ValueError saying it belongs on the inner optimizer.
    """

    def __init__(self, inner_optimizer: Any, initial_scale: float = 2.0**15,
                 dynamic_growth_steps: int = 2000, *, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, min_scale: float = 1.0, max_scale: float = 2.0**24,
                 dynamic: bool = True, loss_scale: LossScale | None = None, name: str | None = None,
                 reduce_policy: Any = None, **kwargs: Any):
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"Received inner_optimizer of type {type(inner_optimizer).__name__}; "
                            f"expected a Keras 3 optimizer such as keras.optimizers.Adam().")
        if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
            raise TypeError("Received a LossScaleOptimizer to wrap; it already scales the loss. "
                            "Wrap the inner optimizer once.")
        if not dynamic:
            raise ValueError(
                "LossScaleOptimizer no longer supports `dynamic=False`. Instead, simply set "
                "`loss_scale_factor` directly on the `inner_optimizer` (Keras's own answer), or "
                "pass loss_scale=mp.StaticLossScale(scale) to keep skipping non-finite steps.")
        if loss_scale is None:
            loss_scale = DynamicLossScale(
                loss_scale=initial_scale, dynamic_growth_steps=dynamic_growth_steps,
                growth_factor=growth_factor, backoff_factor=backoff_factor,
                min_scale=min_scale, max_scale=max_scale)
        if not isinstance(loss_scale, LossScale):
            raise TypeError(f"Received loss_scale={loss_scale!r:.80}; a Keras LossScaleOptimizer "
                            f"takes a DynamicLossScale, a StaticLossScale or a NoLossScale.")
        pass_through = is_pass_through(loss_scale)
        if isinstance(loss_scale, NoLossScale) and not pass_through:
            loss_scale = StaticLossScale(1.0)  # the same steps: scale 1, a non-finite one skipped
        steps = getattr(loss_scale, "dynamic_growth_steps", dynamic_growth_steps)
        try:
            super().__init__(inner_optimizer, initial_scale=float(loss_scale.loss_scale),
                             dynamic_growth_steps=steps, name=name, **kwargs)
        except ValueError as err:
            if "does not support arguments" not in str(err):
                raise
            raise ValueError(f"{err} Settings of the optimizer itself (learning_rate, momentum...) belong to "
                             f"the inner optimizer: pass them, then wrap it.{anchor_names(kwargs)}") from None
        self._scale_settings = loss_scale
        self._unit_scale = isinstance(loss_scale, StaticLossScale) and float(loss_scale.loss_scale) == 1.0
        self._pass_through = pass_through
        self._reduce_policy = check_reduce_policy(reduce_policy)
        self._skip_store = SkipCounts(self)
        if type(self) is LossScaleOptimizer and not self._settings_config():
            self.__class__ = _SavedAsKeras  # Keras's own can express it: saved under Keras's name

    def build(self, var_list: Any) -> None:
        self._build_skip_counters()
        # the inner one first, tracked (Keras's own build runs untracked: Nadam's _u_product was
        # left out of what JAX's stateless step updates), and once, whether it checks `built` or not
        inner, own_build = self.inner_optimizer, vars(self.inner_optimizer).get("build")
        with prepared_for_checkpoints(inner):  # its moments known: checkpoints of another recipe
            inner.build(var_list)
        inner.build = lambda _: None
        try:
            super().build(var_list)
        finally:
            del inner.build
            if own_build is not None:
                inner.build = own_build

    @property
    def loss_scale(self) -> float:
        """The current scale (reading it syncs with the device)."""
        note_scale_read("keras")  # (a loop that scales by hand is not warned of as one that forgot to)
        return float(to_numpy(self.dynamic_scale)) if self.built else float(self.initial_scale)

    @property
    def loss_scaling(self) -> str:
        """What this wrapper does to a step (a static scale of 1 takes the same steps as none)."""
        return summary(NoLossScale(not self._pass_through) if self._pass_through or self._unit_scale
                       else self._scale_settings)

    def scale_loss(self, loss: Any) -> Any:
        """Returns ``loss * loss_scale`` in float32; differentiate this (a pass-through: `loss`)."""
        check_loss(loss)
        if self._pass_through:
            return loss
        if self._unit_scale:  # 1 (NoLossScale): nothing to multiply, forward or backward
            return ops.cast(loss, "float32")
        return ops.multiply(ops.cast(loss, "float32"), self._live_scale(loss))

    # -- the step ------------------------------------------------------------
    def check_finite(self, grads: Any) -> Any:
        check_gradients(grads, None)  # (a list of tensors: Keras's own method takes the same)
        return self._finite(grads)

    def _finite(self, grads: Any) -> Any:  # (`apply` checked the gradients already)
        return finite_on_every_replica(all_finite(grads))

    def _unscale(self, grads: Any, trainable_variables: Any) -> list:
        """Divides by the scale in float32 (float64 for float64 gradients); each keeps its dtype.
        A static scale of 1 (what `NoLossScale` becomes) divides nothing: ops saved each step."""
        if self._unit_scale:  # numpy gradients become tensors, as a division makes them (Keras's torch needs that)
            return [g if g is None or ops.is_tensor(g) else ops.convert_to_tensor(g) for g in grads]
        self._warn_if_never_scaled()

        def unscale(g):
            wide = "float64" if keras.backend.standardize_dtype(g.dtype) == "float64" else "float32"
            return ops.cast(ops.divide(ops.cast(g, wide), ops.cast(self.dynamic_scale, wide)), g.dtype)

        return [g if g is None or self._overwrite_variable_with_gradient(v) else unscale(g)
                for g, v in zip(grads, trainable_variables)]

    def _update_scale(self, finite: Any, counted: bool = False) -> None:
        """Assigns the next scale and growth counter, and the skip counters unless a branch that
        ran only on a skipped step counted it (`counted`; else a select, no branch)."""
        if isinstance(self._scale_settings, DynamicLossScale):
            state = self._scale_settings.with_state(self.dynamic_scale.value, self.step_counter.value)
            state = state.adjust(finite)
            self.dynamic_scale.assign(state.loss_scale)
            self.step_counter.assign(ops.cast(state.counter, self.step_counter.dtype))
        if not counted:
            self._skips.assign(ops.where(finite, self._skips.value, self._skipped_counts()))

    def apply(self, grads: Any, trainable_variables: Any = None) -> None:
        if trainable_variables is None and not self.built:
            raise ValueError("Received gradients without trainable_variables, and this optimizer is not built yet: "
                             "pass them on the first call, opt.apply(grads, model.trainable_variables).")
        if trainable_variables is not None and not isinstance(trainable_variables, (list, tuple)):
            trainable_variables = list(trainable_variables)  # an iterable, as Keras's own apply takes it
        variables = trainable_variables if trainable_variables is not None else self._trainable_variables
        check_gradients(grads, variables)
        grads, summed = sum_across_replicas(grads, variables, self._reduce_policy)
        with already_summed(self.inner_optimizer, summed):
            if not self._pass_through:
                return super().apply(grads, trainable_variables)
            if not self.built:
                with keras.name_scope(self.name, caller=self):
                    self.build(trainable_variables)
            self.inner_optimizer.apply(grads, trainable_variables=trainable_variables)

    def stateless_apply(self, optimizer_variables: Any, grads: Any, trainable_variables: Any) -> Any:
        if not self.built:
            raise ValueError(f"To call `stateless_apply`, {type(self).__name__} must be built: "
                             f"call optimizer.build(trainable_variables) first.")
        check_gradients(grads, trainable_variables)  # as `apply` checks them
        own = len(self._variables)
        if self._pass_through:  # the inner step, nothing added
            new_trainable, new_inner = self.inner_optimizer.stateless_apply(
                list(optimizer_variables[own:]), grads, trainable_variables)
            return new_trainable, list(optimizer_variables[:own]) + list(new_inner)
        mapping = list(zip(self.variables, optimizer_variables))
        old_trainable, old_inner = list(trainable_variables), list(optimizer_variables[own:])
        with keras.StatelessScope(state_mapping=mapping) as scope:
            finite = self._finite(grads)
            concrete = is_concrete(finite)
            if concrete and not bool(to_numpy(finite)):
                new_trainable, new_inner = old_trainable, old_inner
            else:
                def apply_inner():  # unscaled in the branch: XLA fuses it into the update's kernels
                    return self.inner_optimizer.stateless_apply(self.inner_optimizer.variables,
                                                                self._unscale(grads, self._trainable_variables),
                                                                trainable_variables)

                if concrete:
                    new_trainable, new_inner = apply_inner()
                else:  # traced (jax.jit): a cond, so XLA can update the donated buffers in place
                    new_trainable, new_inner = ops.cond(
                        finite, apply_inner, lambda: (list(old_trainable), list(old_inner)))
            self._update_scale(finite)
        new_own = [scope.get_current_value(v) for v in self._variables]
        return new_trainable, new_own + new_inner

    def _common_apply(self, grads: Any, trainable_variables: Any = None) -> None:
        finite = self._finite(grads)
        tvs = trainable_variables or self._trainable_variables

        def apply_inner():
            self.inner_optimizer.apply(self._unscale(grads, tvs), trainable_variables=trainable_variables)

        # the skip counted in its own branch: a step applied (in a TensorFlow graph, ~2 us an op)
        # spends nothing on the counters
        if is_concrete(finite):
            (apply_inner if bool(to_numpy(finite)) else self._count_skip)()
        else:
            ops.cond(finite, apply_inner, self._count_skip)
        self._update_scale(finite, counted=True)

    def _stateful_handle_finite_grads(self, grads: Any, trainable_variables: Any) -> None:
        # Keras's merge_call path under tf.distribute calls this per replica.
        tvs = trainable_variables or self._trainable_variables
        self.inner_optimizer.apply(self._unscale(grads, tvs), trainable_variables=trainable_variables)
        self._update_scale(ops.convert_to_tensor(True), counted=True)

    def _stateful_handle_non_finite_grads(self) -> None:
        self._count_skip()
        self._update_scale(ops.convert_to_tensor(False), counted=True)

    # -- saving --------------------------------------------------------------
    def save_own_variables(self, store: Any) -> None:
        """Keras's own layout (what ``keras.optimizers.LossScaleOptimizer`` reads); the skip
        counters go beside it, under ``_skip_store``."""
        save_keras_layout(self, store)

    def load_own_variables(self, store: Any) -> None:
        """Reads Keras's layout or this class's older one, across state recipes (`load_keras_layout`)."""
        if not load_keras_layout(self, store):
            super().load_own_variables(store)  # Keras's warning: nothing or a mismatch

    def get_config(self) -> dict:
        """Keras's own four keys, then the settings Keras's own cannot express (only those set)."""
        return {**super().get_config(), **self._settings_config()}

    def _settings_config(self) -> dict:
        """`get_config`'s keys beyond Keras's four (none for a default wrapper), without serializing
        the inner optimizer (whose variables Keras reads by a call NumPy 2 deprecates: not at construction)."""
        config = dict(rounding_to_config(self.inner_optimizer))
        reduce_config = reduce_to_config(self._reduce_policy)
        if reduce_config is not None:
            config["reduce_policy"] = reduce_config
        cfg = self._scale_settings
        if self._pass_through:
            config["pass_through"] = True
        elif isinstance(cfg, DynamicLossScale):
            for key, default in _DEFAULTS.items():
                if getattr(cfg, key) != default:
                    config[key] = getattr(cfg, key)
        else:
            config["static"] = True
        return config

    @classmethod
    def from_config(cls, config: dict, custom_objects: Any = None) -> "LossScaleOptimizer":
        """Reads this class's configs and Keras's own (its current and its older layout)."""
        inner, config, loss_scale = constructor_arguments(config, custom_objects)
        return cls(inner, **config) if loss_scale is None else cls(inner, loss_scale=loss_scale, **config)


class _SavedAsKeras(LossScaleOptimizer):
    """A wrapper with settings Keras's own LossScaleOptimizer can express.

    Saved as ``{"module": "keras.optimizers", "class_name": "LossScaleOptimizer",
    "registered_name": "LossScaleOptimizer"}``: with mixedpolicy imported, that name is
    registered to `LossScaleOptimizer` above, so the file loads back as this class; in plain
    Keras, the name is Keras's own class, which reads the same config and variables.
    """


_SavedAsKeras.__module__ = "keras.optimizers"
_SavedAsKeras.__name__ = _SavedAsKeras.__qualname__ = "LossScaleOptimizer"
keras.saving.get_custom_objects()["LossScaleOptimizer"] = LossScaleOptimizer
_registry.GLOBAL_CUSTOM_NAMES[_SavedAsKeras] = "LossScaleOptimizer"


# The settings Keras's own LossScaleOptimizer has no word for, with DynamicLossScale's defaults.
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DynamicLossScale)
             if f.name in ("growth_factor", "backoff_factor", "min_scale", "max_scale")}


class KerasOptimizers(KerasUpdates, OptimizerAdapter):
    """A Keras optimizer comes back as this module's `LossScaleOptimizer`."""

    takes_optimizer_options = takes_reduce_policy = True
    blind_to = ("keras", "tensorflow")  # (a Keras model's compile then says nothing more)

    def is_optimizer(self, obj: Any) -> bool:
        return isinstance(obj, keras.optimizers.Optimizer)

    def follow_policies(self, wrapper: Any, policies: tuple) -> None:
        wrapper.__dict__["_followed_policies"] = policies  # what compile reads (untracked by Keras)

    def wrap_optimizer(self, optimizer: Any, loss_scale: Any, axis_name: Any = None, **options: Any) -> Any:
        if axis_name is not None:
            raise TypeError(f"Received axis_name={axis_name!r} for a Keras optimizer; axis_name "
                            f"names a JAX replica axis. Keras agrees across replicas by itself.")
        return LossScaleOptimizer(optimizer, loss_scale=loss_scale, **options)

    def policies_of(self, optimizer: Any) -> tuple[Any, str] | None:
        # Keras's global dtype policy (each of a DTypePolicyMap's), where one computes in float16
        # (set through Keras itself); else, or where mixedpolicy's says the same and more
        # (state=int8...), mixedpolicy's decides. A quantized Keras policy is left out: its float
        # source is not what runs
        found = [Policy.from_keras(p) for p in policies_in(keras.config.dtype_policy())
                 if getattr(p, "quantization_mode", None) in (None, "float8")]
        ours = global_policy()
        same = len(found) == 1 and (ours.variable_dtype, ours.compute_dtype) == (found[0].variable_dtype, found[0].compute_dtype)
        return (tuple(found), "Keras's global dtype policy") if any(p.needs_loss_scaling for p in found) and not same else None

    def optimizer_from_config(self, config: dict, custom_objects: Any = None) -> Any:
        if "inner_optimizer" not in config:
            return None
        return LossScaleOptimizer.from_config(config, custom_objects)
