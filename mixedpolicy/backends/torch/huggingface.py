"""The Hugging Face ``Trainer`` under a mixedpolicy policy: a subclass that takes ``policy=``.

`trainer_class(transformers)` builds, once, a subclass of ``transformers.Trainer``:

- the policy (or `PolicyMap`) goes on the model before anything else sees it;
- the optimizer the Trainer makes (or the one given in ``optimizers=``) is wrapped in a
  `LossScaleOptimizer` that follows the policy, and handed to Accelerate as its scaler: the
  Accelerator's ``backward`` scales the loss with it, the accelerated optimizer's ``step`` asks
  it to step, so ``optimizer_step_was_skipped`` is true on a skipped step and the LR scheduler
  waits, as it does for Accelerate's own ``GradScaler``;
- gradients are unscaled before the Trainer clips them or reads their norm.

The policy decides the compute dtype, so ``TrainingArguments(fp16=True)`` / ``bf16=True`` are
refused (they would wrap the whole forward in an autocast of their own).
"""

from __future__ import annotations

from typing import Any

import torch

from mixedpolicy.backends.torch.optimizer import TorchLossScaleOptimizer
from mixedpolicy.backends.torch.scaler_view import GradScalerView
from mixedpolicy.policy_map import as_policy_map
from mixedpolicy.scope import global_policy

_built: dict = {}


class PolicyTrainer:
    """``transformers.Trainer`` training under a mixedpolicy policy, with loss scaling where
    it computes in float16 and a non-finite step skipped under every policy.

    Takes what ``transformers.Trainer`` takes, plus ``policy`` (a `Policy`, its name or a
    `PolicyMap`; None: the global policy), ``overrides`` (per-layer, as for `PolicyMap`) and
    the scale settings of `LossScaleOptimizer` (``initial_scale``, ``dynamic_growth_steps``,
    ``loss_scale``...) in ``scale_settings``. Leave ``fp16`` and ``bf16`` off in
    ``TrainingArguments``: the policy decides the dtypes.

    Raises:
      ValueError: ``fp16=True`` or ``bf16=True`` in the arguments; a bad policy.
    """

    def __init__(self, model: Any = None, args: Any = None, *rest: Any, policy: Any = None,
                 overrides: Any = None, scale_settings: dict | None = None, **kwargs: Any):
        policy_map = as_policy_map(policy, overrides)
        default = policy_map.default or global_policy()
        if args is not None and (getattr(args, "fp16", False) or getattr(args, "bf16", False)):
            raise ValueError(
                f"Received TrainingArguments(fp16={args.fp16}, bf16={args.bf16}) with a mixedpolicy "
                f"policy ({default.name}): both would put the whole forward under "
                f"an autocast of their own and override the per-layer policy. Set fp16=False and "
                f"bf16=False; the policy decides the dtypes (policy='mixed_float16' scales the "
                f"loss as fp16=True would).")
        if scale_settings is not None and not isinstance(scale_settings, dict):
            raise TypeError(f"Received scale_settings of type {type(scale_settings).__name__}; "
                            f"expected a dict such as {{'initial_scale': 2**16}}.")
        self.policy_map = policy_map
        self.scale_settings = dict(scale_settings or {})
        if model is not None:
            from mixedpolicy.api import apply_policy

            model = apply_policy(model, policy_map)
        super().__init__(model, args, *rest, **kwargs)

    def create_optimizer(self, model: Any = None) -> Any:
        optimizer = super().create_optimizer(model) if model is not None else super().create_optimizer()
        if not isinstance(optimizer, TorchLossScaleOptimizer):
            from mixedpolicy.optimizer import LossScaleOptimizer

            settings = dict(self.scale_settings)
            if "loss_scale" not in settings:  # the policy decides, its default the global one
                settings["policy"] = (self.policy_map if self.policy_map.default
                                      else self.policy_map.with_default(global_policy()))
            optimizer = LossScaleOptimizer(optimizer, **settings)
        self.optimizer = optimizer
        self.accelerator.scaler = GradScalerView(optimizer)
        return optimizer

    @property
    def loss_scale_optimizer(self) -> TorchLossScaleOptimizer | None:
        """The `LossScaleOptimizer` this Trainer steps (None before training made one)."""
        scaler = self.accelerator.scaler
        return scaler.optimizer if isinstance(scaler, GradScalerView) else None

    def _unscale(self) -> None:
        scaler = self.accelerator.scaler
        if isinstance(scaler, GradScalerView):
            scaler.unscale_()

    def _clip_grad_norm(self, model: Any) -> Any:
        self._unscale()  # clip the true gradients, not the scaled ones
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        if grad_norm is None:
            self._unscale()  # the logged norm is the true one
        return super()._get_grad_norm(model, grad_norm=grad_norm)


def trainer_class(transformers: Any) -> type:
    """The ``transformers.Trainer`` subclass (built once per process): `PolicyTrainer` over it."""
    if "trainer" not in _built:
        _built["trainer"] = type("Trainer", (PolicyTrainer, transformers.Trainer),
                                 {"__module__": "mixedpolicy.huggingface", "__qualname__": "Trainer",
                                  "__doc__": PolicyTrainer.__doc__})
    return _built["trainer"]
