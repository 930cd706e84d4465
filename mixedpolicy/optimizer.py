"""`LossScaleOptimizer`: one name that wraps any supported framework's optimizer with loss
scaling that follows the policy, handing it to that framework's wrapper."""

from __future__ import annotations

import abc
import logging
import warnings
from typing import Any, Mapping

from mixedpolicy import _registry
from mixedpolicy._scale_checks import anchor_names, check_scale
from mixedpolicy._warnings import user_stacklevel
from mixedpolicy.api import _no_adapter, _policies_in, float16_models
from mixedpolicy.loss_scale import DynamicLossScale, LossScale, NoLossScale, summary
from mixedpolicy.policy import as_policy
from mixedpolicy.policy_map import PolicyMap
from mixedpolicy.scope import global_policy

_log = logging.getLogger("mixedpolicy")


def _followed_policies(adapter: Any, inner: Any, policy: Any) -> tuple:
    """The policies the optimizer runs under, read off its own arguments and state only.

    `policy` when given (a policy, its name or a `PolicyMap`); else what the framework
    knows of its variables (torch: the policies `apply_policy` put on them; Keras: its
    global dtype policy); else the global policy. No other live object decides: an optax
    or TensorFlow optimizer cannot see its model, so one whose model computes in float16
    under a float32 global policy is given ``policy=``.
    """
    if policy is None:
        known = adapter.policies_of(inner)
        return known[0] if known is not None else (global_policy(),)
    if isinstance(policy, PolicyMap):
        return _policies_in(policy)
    return (as_policy(policy, what="policy"),)


def _warn_blind(adapter: Any, followed: tuple) -> bool:
    """Warns that a wrapper made without a policy scales nothing while a model its optimizer cannot
    see (an optax transformation's Flax or Equinox model) computes in float16; True if it did."""
    models = float16_models(adapter.blind_to)
    if models:
        names = ", ".join(sorted({p.name for p in followed})) or "float32"
        warnings.warn(
            f"This LossScaleOptimizer follows {names!r} (the global policy) and scales nothing, while a "
            f"model in this process computes in float16 (apply_policy gave {models[-1]}); an optimizer "
            f"of this kind cannot see its model, so float16 gradients may underflow to zero unscaled. "
            f"Pass the model's policy, LossScaleOptimizer(opt, policy=...), or make it the global "
            f"policy; policy={names!r} says no scaling is meant.", UserWarning, stacklevel=user_stacklevel())
    return bool(models)


def _with_updates(adapter: Any, inner: Any, policies: tuple) -> Any:
    """`inner`, carrying out the update rounding and optimizer state dtype the policies ask for
    (the framework's own optimizer, or a rule the adapter adds); refused, before anything is
    wrapped, where it would update otherwise."""
    adapter.warn_arithmetic(inner, policies)
    asked = [p for p in policies if not p.updates_as_the_optimizer_does]
    recipes = sorted({(p.update_rounding, p.optimizer_state_dtype) for p in asked})
    if len(recipes) > 1:
        raise ValueError(
            f"Received policies asking one optimizer for the update recipes (rounding, state) {recipes} "
            f"({', '.join(p.name for p in asked)}); an optimizer rounds and stores one way. Give "
            f"the layers one recipe, or their parameters optimizers of their own.")
    for p in asked:
        why = adapter.update_refusal(inner, p)
        if why is not None:
            raise ValueError(
                f"Received {type(inner).__name__} under the policy {p.name!r}, which asks for "
                f"update_rounding={p.update_rounding!r} and optimizer_state_dtype={p.optimizer_state_dtype!r}: "
                f"{why}. Or train under a policy without them (e.g. {p.variable_dtype!r}).")
    return adapter.with_updates(inner, asked[0]) if asked else inner


#: the scale settings LossScaleOptimizer takes (the trainers' plugins take them too)
SCALE_SETTINGS = ("initial_scale", "dynamic_growth_steps", "growth_factor", "backoff_factor", "min_scale",
                  "max_scale")


def _check_skip_nonfinite(skip_nonfinite: bool, given: dict, loss_scale: Any) -> None:
    """Refuses ``skip_nonfinite=False`` beside a scale, where it would do nothing."""
    if not skip_nonfinite and (given or (loss_scale is not None and loss_scale != NoLossScale(skip_nonfinite=False))):
        if isinstance(loss_scale, NoLossScale):
            raise TypeError(f"Received skip_nonfinite=False together with loss_scale={loss_scale!r}, which says "
                            f"the opposite; the loss_scale given is used as it is. Pass "
                            f"loss_scale=mp.NoLossScale(skip_nonfinite=False) alone for the inner "
                            f"optimizer's step as it is, or drop skip_nonfinite=False.")
        named = sorted(given) or [f"loss_scale={type(loss_scale).__name__}(...)"]
        raise TypeError(
            f"Received skip_nonfinite=False together with {', '.join(named)}. skip_nonfinite=False "
            f"makes a pass-through where no scale is chosen; a loss scale skips every step whose "
            f"scaled gradients overflowed, whatever skip_nonfinite says, so here it would do "
            f"nothing. Drop skip_nonfinite=False to scale, or drop {', '.join(named)} for the "
            f"inner optimizer's step as it is (loss_scale=mp.NoLossScale(skip_nonfinite=False)).")


def scale_from_settings(settings: Mapping[str, Any], loss_scale: Any = None, policy: Any = None,
                        skip_nonfinite: bool = True) -> LossScale | None:
    """The loss scale that `LossScaleOptimizer`'s scale settings (`SCALE_SETTINGS`, None ones
    left out) and `loss_scale` describe, checked; None where neither is given (the policy
    decides). Where a trainer's plugin takes the settings, it calls this before anything changes.

    Raises:
      TypeError: `loss_scale` is no `LossScale`, or came with settings or a policy;
        ``skip_nonfinite=False`` came with a scale it cannot apply to (it would do nothing).
      ValueError: a setting is out of range.
    """
    given = {k: v for k, v in settings.items() if v is not None}
    if loss_scale is not None and not isinstance(loss_scale, LossScale):
        raise TypeError(f"Received loss_scale={loss_scale!r:.80} of type {type(loss_scale).__name__}; expected "
                        f"a DynamicLossScale, StaticLossScale or NoLossScale: mp.StaticLossScale(2**15) "
                        f"for a fixed scale, mp.DynamicLossScale() for one that adapts, or no loss_scale "
                        f"at all to let the policy decide.")
    _check_skip_nonfinite(skip_nonfinite, given, loss_scale)
    if loss_scale is not None:
        if given or policy is not None:
            named = sorted([*given, *(["policy"] if policy is not None else [])])
            raise TypeError(f"Received loss_scale={loss_scale!r} together with {named}; the "
                            f"loss_scale given is used as it is. Pass one or the other.")
        return loss_scale
    if not given:
        return None
    if "initial_scale" in given:  # named as the caller named it, before DynamicLossScale's own checks
        check_scale(given["initial_scale"], "initial_scale")
    return DynamicLossScale(**{"loss_scale" if k == "initial_scale" else k: v for k, v in given.items()})


def trainer_scale_settings(settings: Mapping[str, Any], initial_scale: float) -> dict:
    """A trainer plugin's scale `settings` with `initial_scale` (the scale the trainer's own
    float16 path starts from) where some are given but not that one; none given stay none, so
    that the policy still decides whether to scale."""
    settings = dict(settings)
    if any(v is not None for v in settings.values()) and settings.get("initial_scale") is None:
        settings["initial_scale"] = initial_scale
    return settings


def check_trainer_scale_settings(settings: Any, where: str) -> dict:
    """A trainer's ``scale_settings`` dict (`SCALE_SETTINGS`, ``loss_scale``, ``skip_nonfinite``),
    checked as `LossScaleOptimizer` would check them at the first step, but up front."""
    if settings is None:
        return {}
    if not isinstance(settings, Mapping):
        raise TypeError(f"Received {where} of type {type(settings).__name__}; expected a dict such as "
                        f"{{'initial_scale': 2**16}}.")
    known = (*SCALE_SETTINGS, "loss_scale", "skip_nonfinite")
    unknown = sorted(str(k) for k in settings if k not in known)
    if unknown:
        raise TypeError(f"Received {where} with {unknown}; expected only {', '.join(known)} (what "
                        f"LossScaleOptimizer takes besides its policy). Settings such as learning_rate "
                        f"belong to the optimizer.{anchor_names(unknown)}")
    if not isinstance(settings.get("skip_nonfinite", True), bool):
        raise TypeError(f"Received skip_nonfinite={settings['skip_nonfinite']!r:.60}; expected True or False.")
    scale_from_settings({k: settings.get(k) for k in SCALE_SETTINGS}, settings.get("loss_scale"),
                        skip_nonfinite=settings.get("skip_nonfinite", True))
    return dict(settings)


class LossScaleOptimizer(abc.ABC):
    """Wraps an optimizer of any supported framework with loss scaling that follows the policy.

    Returns the wrapper that fits the framework's idiom (a ``torch.optim``-like
    optimizer, an ``optax.GradientTransformation``, a Keras optimizer). Every wrapper
    exposes ``loss_scale``, ``last_step_skipped``, ``num_skipped_steps`` and
    ``loss_scaling`` (one line on what it chose). ``isinstance(x, LossScaleOptimizer)``
    is true for each of them (an abstract base class: ``LossScaleOptimizer.register``
    adds a wrapper class of one's own).

    What it does to a step:

    - with `loss_scale`, or any of the scale settings below: that scale (a bounded
      dynamic one for the settings): a step whose gradients are not all finite is
      skipped whole and a dynamic scale backs off;
    - otherwise it follows the policy the optimizer runs under: `policy` when given,
      else what the framework knows of its variables (torch: the policies
      `apply_policy` put on the modules owning its parameters; Keras: its global
      dtype policy too), else the global policy. Where any of those computes in
      float16, a bounded `DynamicLossScale` with the defaults below; else (float32,
      bfloat16) no scaling, but the same safety: a step whose gradients are not all
      finite is skipped and counted (inside the compiled step under ``jax.jit`` and
      Keras, through the fused optimizers' on-device flag in torch), and the wrapper
      refuses what the scaling wrapper refuses (torch: half-precision master weights
      the policy does not store, ``unscale_()`` twice), so one loop behaves alike under
      every policy string. ``skip_nonfinite=False`` makes it a pass-through whose step
      is exactly the inner optimizer's step, nothing added.

    Args:
      inner: the optimizer to wrap.
      initial_scale: the first loss scale (default 2**15, Keras's).
      dynamic_growth_steps: finite steps in a row before the scale grows (default 2000).
      growth_factor, backoff_factor, min_scale, max_scale: see `DynamicLossScale`
        (defaults 2, 0.5, 1, 2**24).
      loss_scale: a ready `LossScale` (`DynamicLossScale`, `StaticLossScale`,
        `NoLossScale`) used as it is, instead of the settings above and the policy.
      policy: the policy (a `Policy`, its name, or a `PolicyMap`) whose compute dtypes
        decide whether to scale; None reads it as described above.
      skip_nonfinite: where no scaling is chosen: skip a step whose gradients are not
        all finite (True, the default), or hand every step to the inner optimizer as it
        is (False). False beside scale settings or a `loss_scale` that scales is refused
        (a scale skips overflowed steps; it would do nothing).
      axis_name: JAX only: the ``pmap`` / ``shard_map`` axis over which replicas agree
        to skip a step.
      **kwargs: Keras only: what ``keras.optimizers.LossScaleOptimizer`` takes besides
        (``name``, ``dynamic=True``); its base-optimizer arguments are refused as Keras
        refuses them (ValueError: set them on the inner optimizer).

    Raises:
      TypeError: `inner` is not an optimizer of an installed framework, an argument
        that belongs to the inner optimizer was passed here, or `loss_scale` came with
        scale settings or a policy.
      ValueError: a setting is out of range.
    """

    @classmethod
    def __subclasshook__(cls, sub: type) -> Any:
        # every framework's wrapper class named in the registry, once its module is loaded;
        # `LossScaleOptimizer.register(cls)` adds a wrapper of one's own
        if cls is LossScaleOptimizer and issubclass(sub, _registry.loss_scale_wrapper_types()):
            return True
        return NotImplemented

    def __new__(cls, inner: Any, initial_scale: float | None = None, dynamic_growth_steps: int | None = None,
                *, growth_factor: float | None = None, backoff_factor: float | None = None,
                min_scale: float | None = None, max_scale: float | None = None,
                loss_scale: LossScale | None = None, policy: Any = None,
                skip_nonfinite: bool = True, axis_name: Any = None, **kwargs: Any):
        adapter = _registry.optimizer_adapter(inner)
        if kwargs and not (adapter is not None and adapter.takes_optimizer_options):
            raise TypeError(
                f"LossScaleOptimizer received unexpected arguments {sorted(kwargs)}. Settings "
                f"such as learning_rate or weight_decay belong to the inner optimizer: pass "
                f"them when you create it, then wrap it. The wrapper takes initial_scale, "
                f"dynamic_growth_steps, growth_factor, backoff_factor, min_scale, max_scale, "
                f"loss_scale, policy, skip_nonfinite and axis_name.{anchor_names(kwargs)}")
        if not isinstance(skip_nonfinite, bool):
            raise TypeError(f"Received skip_nonfinite={skip_nonfinite!r:.60}; expected True or False.")
        by_hand = loss_scale is not None  # a LossScale given as it is: scales as given
        # checked before dispatch: a bad setting is named first
        loss_scale = scale_from_settings(dict(
            initial_scale=initial_scale, dynamic_growth_steps=dynamic_growth_steps, growth_factor=growth_factor,
            backoff_factor=backoff_factor, min_scale=min_scale, max_scale=max_scale),
            loss_scale, policy, skip_nonfinite)
        if adapter is None:
            raise _no_adapter(inner, "optimizer")
        # followed with scale settings or a scale given too: they choose the scale, the policy
        # still says which half-precision weights are its own (a pure policy's), so that adding
        # a setting to a loop that runs under a policy never turns it into a refused one; a
        # NoLossScale given by hand checks no weights (the documented way around the check)
        policies = _followed_policies(adapter, inner, policy)
        followed = () if by_hand and isinstance(loss_scale, NoLossScale) else policies
        inner = _with_updates(adapter, inner, policies)
        warned = False
        if loss_scale is None:
            if any(p.needs_loss_scaling for p in followed):
                loss_scale = DynamicLossScale()
            else:
                loss_scale = NoLossScale(skip_nonfinite=skip_nonfinite)
                warned = policy is None and _warn_blind(adapter, followed)
            _log.info("LossScaleOptimizer(%s): %s, following the policy", type(inner).__name__,
                      summary(loss_scale))
        if getattr(adapter, "takes_reduce_policy", False):  # Keras: it carries reduce dtypes itself
            reduce_policy = policy if policy is not None else global_policy()
            chosen = None if isinstance(reduce_policy, PolicyMap) else as_policy(reduce_policy)
            if chosen is not None and chosen.reduce_dtype in ("float32", chosen.variable_dtype):
                reduce_policy = None  # what Keras does by itself (a pure policy's gradients are its dtype)
            if reduce_policy is not None:
                kwargs["reduce_policy"] = reduce_policy
        # torch takes them as it is made (a pure policy's half weights are its own, scaled or not)
        made_with = bool(followed) and getattr(adapter, "takes_followed_policies", False)
        if made_with:
            kwargs["followed"] = followed
        if kwargs:  # a framework's own options (Keras: name, dynamic, its base arguments)
            wrapper = adapter.wrap_optimizer(inner, loss_scale, axis_name, **kwargs)
        else:
            wrapper = adapter.wrap_optimizer(inner, loss_scale, axis_name)
        if followed and not made_with and isinstance(loss_scale, NoLossScale):
            adapter.follow_policies(wrapper, followed)  # refuses what the scaling wrapper refuses
        if warned and hasattr(wrapper, "__dict__"):
            wrapper.__dict__["_mixedpolicy_warned_unscaled"] = True  # (Keras's compile says it once)
        return wrapper

    @staticmethod
    def from_config(config: Mapping[str, Any], custom_objects: Any = None) -> Any:
        """Rebuilds a wrapper from its ``get_config()``, or from Keras's own LossScaleOptimizer's.

        Raises:
          TypeError: `config` is not a dict.
          ValueError: no imported framework reads this config.
        """
        if not isinstance(config, Mapping):
            raise TypeError(f"Received config of type {type(config).__name__}; expected the "
                            f"dict from a LossScaleOptimizer's get_config().")
        return _registry.optimizer_from_config(dict(config), custom_objects)
