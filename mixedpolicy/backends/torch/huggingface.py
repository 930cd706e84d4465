"""Hugging Face's ``Trainer`` and Accelerate's ``Accelerator`` under a mixedpolicy policy:
subclasses that take ``policy=``.

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

`accelerator_class(accelerate)` builds the same for a loop written with ``accelerate.Accelerator``:
``prepare`` puts the policy on each model and wraps each optimizer, the wrapper is Accelerate's
scaler (``backward`` scales, ``clip_grad_norm_`` unscales first, ``step_was_skipped`` reports a
skip), and ``save_state`` / ``load_state`` carry the scale; ``mixed_precision`` other than "no"
is refused as ``fp16=True`` is.
"""

from __future__ import annotations

from typing import Any

import torch

from mixedpolicy.backends.torch.optimizer import TorchLossScaleOptimizer
from mixedpolicy.backends.torch.scaler_view import GRADSCALER_INITIAL_SCALE, GradScalerView
from mixedpolicy.loss_scale import DynamicLossScale
from mixedpolicy.policy_map import as_policy_map
from mixedpolicy.scope import global_policy
from mixedpolicy.table import NOT_APPLIED

_built: dict = {}


class PolicyTrainer:
    """``transformers.Trainer`` training under a mixedpolicy policy, with loss scaling where
    it computes in float16 and a non-finite step skipped under every policy.

    Takes what ``transformers.Trainer`` takes, plus ``policy`` (a `Policy`, its name or a
    `PolicyMap`; None: the global policy), ``overrides`` (per-layer, as for `PolicyMap`) and
    the scale settings of `LossScaleOptimizer` (``initial_scale``, ``dynamic_growth_steps``,
    ``loss_scale``...) in ``scale_settings``; the scale starts from ``GradScaler``'s 2**16, as the
    Trainer's own ``fp16`` does. Leave ``fp16`` and ``bf16`` off in
    ``TrainingArguments``: the policy decides the dtypes.

    Raises:
      ValueError: ``fp16=True``, ``bf16=True``, ``fp16_full_eval=True`` or ``bf16_full_eval=True``
        in the arguments; a bad policy.
    """

    def __init__(self, model: Any = None, args: Any = None, *rest: Any, policy: Any = None,
                 overrides: Any = None, scale_settings: dict | None = None, **kwargs: Any):
        policy_map = as_policy_map(policy, overrides)
        if args is not None and (getattr(args, "fp16", False) or getattr(args, "bf16", False)):
            _refuse_native_precision(f"TrainingArguments(fp16={args.fp16}, bf16={args.bf16})",
                                     "Set fp16=False and bf16=False", policy_map.default or global_policy())
        full_eval = [f for f in ("fp16_full_eval", "bf16_full_eval") if getattr(args, f, False)]
        if full_eval:  # the Trainer casts the whole model for evaluate(), and leaves it cast
            raise ValueError(
                f"Received TrainingArguments({full_eval[0]}=True) with a mixedpolicy policy "
                f"({(policy_map.default or global_policy()).name}): evaluate() would cast every "
                f"parameter to {'float16' if full_eval[0].startswith('fp16') else 'bfloat16'}, the "
                f"layers the policy keeps in float32 included, and leave the model so for training. Set "
                f"{full_eval[0]}=False: evaluation computes as the policy says, as training does (a "
                f"pure policy such as 'bfloat16' keeps the weights in half precision throughout).")
        self.policy_map = policy_map
        self.scale_settings = _scale_settings(scale_settings)
        if model is not None:
            model = _with_policy(model, policy_map)
        super().__init__(model, args, *rest, **kwargs)
        if model is not None:
            _carry_to_fsdp(self.accelerator, model, not _names_nothing(policy_map))

    def create_optimizer(self, model: Any = None) -> Any:
        optimizer = super().create_optimizer(model) if model is not None else super().create_optimizer()
        optimizer = self.optimizer = _wrapped(optimizer, self.policy_map, self.scale_settings)
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


def _names_nothing(policy_map: Any) -> bool:
    """Whether the user gave neither a policy nor overrides."""
    return policy_map.default is None and not policy_map.overrides


def _with_policy(model: Any, policy_map: Any) -> Any:
    """`model` under `policy_map` (its default the global policy); given neither a policy nor
    overrides, a model that carries one already (``mp.apply_policy`` before) keeps it. Its
    outputs come back in float32 (see below)."""
    from mixedpolicy.api import apply_policy, describe

    if not (_names_nothing(policy_map) and any(row.source != NOT_APPLIED for row in describe(model))):
        model = apply_policy(model, policy_map)
    # the model's half-precision outputs in float32, as Accelerate's own mixed precision gives
    # them to the Trainer and to a loop: a loss computed outside the model runs in float32
    if isinstance(model, torch.nn.Module) and _outputs_in_float32 not in model._forward_hooks.values():
        model.register_forward_hook(_outputs_in_float32)
    return model


def _carry_to_fsdp(accelerator: Any, model: Any, applied: bool) -> None:
    """Under Accelerate's FSDP plugin, the ``MixedPrecision`` FSDP wraps `model` with is the one
    its policies say: the regions compute, FSDP reduce-scatters in the reduce dtype (Accelerate
    would make one from ``mixed_precision``, which is refused here, so the policy's reduce dtype
    would be lost). Refused before Accelerate wraps, the policy taken off again where it was
    `applied` here (a model that carried its own keeps it)."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is None or not isinstance(model, torch.nn.Module):
        return
    from mixedpolicy.backends.torch.lightning_fsdp import accelerate_mixed_precision

    try:
        plugin.mixed_precision_policy = accelerate_mixed_precision(model, plugin)
    except ValueError:
        if applied:
            from mixedpolicy.api import remove_policy

            remove_policy(model)
        raise


def _wrapped(optimizer: Any, policy_map: Any, scale_settings: dict) -> TorchLossScaleOptimizer:
    """`optimizer` in a `LossScaleOptimizer` that follows `policy_map` (its default the global
    policy), or the policies its parameters carry where the user named none, unless
    `scale_settings` set the scale; a wrapper is taken as it is."""
    if isinstance(optimizer, TorchLossScaleOptimizer):
        return optimizer
    from mixedpolicy.optimizer import SCALE_SETTINGS, LossScaleOptimizer, trainer_scale_settings

    settings = dict(scale_settings)
    scale = trainer_scale_settings({k: settings.pop(k, None) for k in SCALE_SETTINGS}, GRADSCALER_INITIAL_SCALE)
    settings.update({k: v for k, v in scale.items() if v is not None})
    policy_decides = "loss_scale" not in settings and not any(k in settings for k in SCALE_SETTINGS)
    if "loss_scale" not in settings and not _names_nothing(policy_map):
        settings["policy"] = policy_map if policy_map.default else policy_map.with_default(global_policy())
    wrapper = LossScaleOptimizer(optimizer, **settings)
    if policy_decides and isinstance(wrapper._scale_settings, DynamicLossScale):
        # the policy chose to scale: from GradScaler's start, where the Trainer's own fp16 starts
        wrapper._set_scale_state(DynamicLossScale(loss_scale=GRADSCALER_INITIAL_SCALE), None)
    return wrapper


def _refuse_native_precision(received: str, where: str, default: Any) -> None:
    raise ValueError(
        f"Received {received} with a mixedpolicy policy ({default.name}): it would put the whole "
        f"forward under an autocast of its own and override the per-layer policy. {where}; the "
        f"policy decides the dtypes (policy='mixed_float16' scales the loss as fp16 would).")


def _scale_settings(scale_settings: Any) -> dict:
    from mixedpolicy.optimizer import check_trainer_scale_settings

    return check_trainer_scale_settings(scale_settings, "scale_settings")


class PolicyAccelerator:
    """``accelerate.Accelerator`` under a mixedpolicy policy, for a loop written with Accelerate.

    Takes what ``accelerate.Accelerator`` takes, plus ``policy``, ``overrides`` and
    ``scale_settings`` as `mixedpolicy.huggingface.Trainer` takes them. ``prepare`` puts the
    policy on each model before Accelerate wraps it and each optimizer in a
    `LossScaleOptimizer` that follows it (one given already wrapped is kept), which is then
    Accelerate's scaler: ``accelerator.backward(loss)`` scales the loss, ``clip_grad_norm_``
    and ``unscale_gradients`` unscale first, the prepared optimizer's ``step`` skips a
    non-finite step (``step_was_skipped`` is then true, and a prepared scheduler waits) and
    ``save_state`` / ``load_state`` carry the scale.

    Raises:
      ValueError: ``mixed_precision`` (an argument, ``accelerate launch``'s configuration or
        ``ACCELERATE_MIXED_PRECISION``) other than "no"; a second optimizer where one of them
        scales the loss (one loss scale cannot serve two: see the message); a bad policy.
    """

    def __init__(self, *args: Any, policy: Any = None, overrides: Any = None,
                 scale_settings: dict | None = None, **kwargs: Any):
        self.policy_map = as_policy_map(policy, overrides)
        self.scale_settings = _scale_settings(scale_settings)
        asked = kwargs.get("mixed_precision", args[2] if len(args) > 2 else None)
        if asked is not None and str(asked) != "no":  # refused before Accelerate's state is set
            _refuse_native_precision(f"mixed_precision={str(asked)!r}", "Leave mixed_precision at 'no'",
                                     self.policy_map.default or global_policy())
        super().__init__(*args, **kwargs)
        if str(self.state.mixed_precision) != "no":  # from accelerate launch's configuration
            _refuse_native_precision(f"mixed_precision={str(self.state.mixed_precision)!r}",
                                     "Leave mixed_precision at 'no' (the argument, accelerate launch's "
                                     "configuration and ACCELERATE_MIXED_PRECISION)",
                                     self.policy_map.default or global_policy())
        self.loss_scale_optimizers: list = []

    def prepare_model(self, model: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(model, "_is_accelerate_prepared", False):
            model = _with_policy(model, self.policy_map)
            _carry_to_fsdp(self, model, not _names_nothing(self.policy_map))
        return super().prepare_model(model, *args, **kwargs)

    def prepare_optimizer(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(optimizer, "_is_accelerate_prepared", False):
            return super().prepare_optimizer(optimizer, *args, **kwargs)
        wrapper = _wrapped(optimizer, self.policy_map, self.scale_settings)
        wrappers = [*self.loss_scale_optimizers, wrapper]
        scaling = [w for w in wrappers if w.is_enabled()]
        if len(wrappers) > 1 and scaling:
            raise ValueError(
                f"Received a second optimizer for an Accelerator whose optimizer "
                f"{'' if scaling[0] is wrapper else 'already '}scales the loss "
                f"({scaling[0].loss_scaling}): accelerator.backward(loss) scales by one scale, and "
                f"the other optimizer's gradients would stay scaled. Give one optimizer all the "
                f"parameters, or keep the loss unscaled (a bfloat16 or float32 policy), or call "
                f"each wrapper's opt.scale_loss(loss).backward() yourself in place of "
                f"accelerator.backward.")
        self.loss_scale_optimizers.append(wrapper)
        if self.scaler is None or len(wrappers) == 1:
            self.scaler = GradScalerView(wrapper)  # Accelerate's prepared optimizer steps through it
        return super().prepare_optimizer(wrapper, *args, **kwargs)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        chosen = self.loss_scale_optimizers if optimizer is None else (
            list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer])
        for opt in chosen:
            while not isinstance(opt, TorchLossScaleOptimizer) and hasattr(opt, "optimizer"):
                opt = opt.optimizer  # Accelerate's AcceleratedOptimizer around the wrapper
            if isinstance(opt, TorchLossScaleOptimizer) and isinstance(self.scaler, GradScalerView):
                self.scaler.unscale_(opt)


def _outputs_in_float32(module: Any, args: Any, output: Any) -> Any:
    from accelerate.utils import convert_to_fp32

    return convert_to_fp32(output)


def _subclass(name: str, ours: type, theirs: type) -> type:
    """`ours` over the library's class `theirs`, as ``mixedpolicy.huggingface.<name>`` (built
    once per process)."""
    key = (name, theirs)
    if key not in _built:
        _built[key] = type(name, (ours, theirs), {"__module__": "mixedpolicy.huggingface", "__qualname__": name,
                                                  "__doc__": ours.__doc__})
    return _built[key]


def accelerator_class(accelerate: Any) -> type:
    """The ``accelerate.Accelerator`` subclass: `PolicyAccelerator` over it."""
    return _subclass("Accelerator", PolicyAccelerator, accelerate.Accelerator)


def trainer_class(transformers: Any, base: Any = None) -> type:
    """`PolicyTrainer` over `base`, ``transformers.Trainer`` or a subclass of it
    (``Seq2SeqTrainer``, TRL's ``SFTTrainer``, a Trainer of one's own), named as `base` is.

    Raises:
      TypeError: `base` is no subclass of ``transformers.Trainer``.
    """
    base = transformers.Trainer if base is None else base
    if not (isinstance(base, type) and issubclass(base, transformers.Trainer)):
        raise TypeError(f"Received {base!r:.80} ({type(base).__name__}); expected transformers.Trainer or a "
                        f"subclass of it (Seq2SeqTrainer, trl's SFTTrainer, your own), e.g. "
                        f"mixedpolicy.huggingface.trainer_class(Seq2SeqTrainer).")
    if issubclass(base, PolicyTrainer):
        return base  # under a policy already
    return _subclass(base.__name__, PolicyTrainer, base)
