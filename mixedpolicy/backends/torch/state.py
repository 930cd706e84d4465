"""What a torch LossScaleOptimizer saves and restores: its state dict, in GradScaler's terms.

A mixin of `TorchLossScaleOptimizer`: the inner optimizers' state plus ``"loss_scale"``
(``torch.amp.GradScaler.state_dict()`` format, with the bounds and the skip count).
"""

from __future__ import annotations

import logging
from typing import Any

from mixedpolicy.backends.torch.checks import config_from_scaler_state
from mixedpolicy.backends.torch.updates import reconcile, state_kinds
from mixedpolicy._scale_checks import check_scale
from mixedpolicy.loss_scale import DynamicLossScale, LossScale, NoLossScale, summary

_log = logging.getLogger("mixedpolicy")
_EMPTY = " (an empty dict is what a disabled GradScaler saves: it holds no scale to load)"


class Checkpoints:
    """The scale's state as read and saved; the class this is mixed into keeps the scale and the
    inner optimizers."""

    @property
    def loss_scale(self) -> Any:
        """The current scale, a float32 tensor on the device (reading it does not sync)."""
        return self._ensure_scale(self._first_device())

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last `step` was skipped (reading it syncs with the device)."""
        self._ensure_scale(self._first_device())
        return bool(self._last_skipped)

    @property
    def num_skipped_steps(self) -> int:
        """How many steps were skipped so far (reading it syncs with the device)."""
        self._ensure_scale(self._first_device())
        return int(self._skipped)

    @property
    def loss_scaling(self) -> str:
        """What this wrapper does to a step: dynamic, static, none, or a pass-through."""
        return summary(self._scale_settings)

    def scaler_state_dict(self) -> dict:
        """The scale in ``torch.amp.GradScaler.state_dict()`` format."""
        self._ensure_scale(self._first_device())
        cfg = self._scale_settings
        dynamic = isinstance(cfg, DynamicLossScale)
        return {
            "scale": float(self._scale),
            "growth_factor": cfg.growth_factor if dynamic else 1.0,
            "backoff_factor": cfg.backoff_factor if dynamic else 1.0,
            "growth_interval": cfg.dynamic_growth_steps if dynamic else 2**31 - 1,
            "_growth_tracker": int(self._growth_tracker),
        }

    # GradScaler's reading API, for code and loggers written against it (Lightning's, Accelerate's)
    def get_scale(self) -> float:
        """The current scale as a Python float (syncs with the device), 1.0 where this wrapper
        scales nothing, as a disabled ``GradScaler`` answers."""
        return float(self.loss_scale) if self.is_enabled() else 1.0

    def is_enabled(self) -> bool:
        """Whether this wrapper scales the loss (``GradScaler.is_enabled``); a pass-through
        still skips a non-finite step."""
        self._ensure_scale(self._first_device())
        return not isinstance(self._scale_settings, NoLossScale)

    def get_growth_factor(self) -> float:
        return self.scaler_state_dict()["growth_factor"]

    def get_backoff_factor(self) -> float:
        return self.scaler_state_dict()["backoff_factor"]

    def get_growth_interval(self) -> int:
        return self.scaler_state_dict()["growth_interval"]

    def set_growth_factor(self, new_factor: float) -> None:
        """GradScaler's setter: the factor the scale grows by from now on (a no-op where nothing
        is scaled, as on a disabled ``GradScaler``)."""
        self._set_setting("growth_factor", new_factor)

    def set_backoff_factor(self, new_factor: float) -> None:
        """GradScaler's setter: the factor the scale backs off by from now on."""
        self._set_setting("backoff_factor", new_factor)

    def set_growth_interval(self, new_interval: int) -> None:
        """GradScaler's setter: the finite steps in a row before the scale grows, from now on."""
        self._set_setting("growth_interval", new_interval)

    def _set_setting(self, key: str, value: Any) -> None:
        if isinstance(self._scale_settings, NoLossScale):
            return
        if not isinstance(self._scale_settings, DynamicLossScale):
            raise ValueError(f"Received set_{key}({value!r:.40}) for a LossScaleOptimizer with a static scale "
                             f"({self.loss_scaling}), which never grows or backs off; use a dynamic one "
                             f"(initial_scale=..., or loss_scale=mp.DynamicLossScale(...)).")
        cfg = self._scale_settings  # checked as the constructor checks it, before anything changes
        try:
            DynamicLossScale(loss_scale=cfg.loss_scale, min_scale=cfg.min_scale, max_scale=cfg.max_scale,
                             **{"dynamic_growth_steps" if key == "growth_interval" else key: value})
        except (TypeError, ValueError) as err:
            raise type(err)(f"In set_{key}({value!r:.40}): {err}") from None
        self.load_scaler_state_dict({**self.scaler_state_dict(), key: value})

    def update(self, new_scale: Any = None) -> None:
        """GradScaler's ``update``. The scale already moved in `step`, so a call without argument
        does nothing (a loop written for GradScaler, ``step`` then ``update``, runs as it is),
        except after steps of several optimizers named one by one (``step(optimizer0)``,
        ``step(optimizer1)``), whose scale moves here, once, as GradScaler's does;
        ``new_scale`` (a number or a one-element tensor) sets the scale, as GradScaler's does,
        the counters kept. A wrapper that scales nothing (a float32 or bfloat16 policy) checks
        the value and sets nothing, as a disabled GradScaler ignores it: the loop that runs
        under mixed_float16 runs under every policy (logged once).

        Raises:
          ValueError: `new_scale` is not a finite number > 0.
        """
        self._update_deferred()  # after GradScaler's loop over several optimizers (one_by_one.py)
        if new_scale is None:
            return
        value = float(check_scale(new_scale.detach().cpu() if hasattr(new_scale, "detach") else new_scale,
                                  "new_scale"))
        if not self.is_enabled():
            if not getattr(self, "_logged_update_ignored", False):
                self._logged_update_ignored = True
                _log.info("LossScaleOptimizer.update(new_scale=%s) ignored: this wrapper scales nothing (%s), "
                          "as a disabled GradScaler ignores it", value, self.loss_scaling)
            return
        self.load_scaler_state_dict({**self.scaler_state_dict(), "scale": value})

    def load_scaler_state_dict(self, state: dict) -> None:
        """Loads a ``torch.amp.GradScaler.state_dict()`` (or `scaler_state_dict`) into the scale.

        Bounds and the skip count are read from the dict when it has them (this
        wrapper's own `state_dict`); otherwise the bounds widen to hold the loaded
        scale and the skip count is kept.

        Raises:
          TypeError: `state` is not a dict.
          ValueError: the dict is empty (a disabled GradScaler's) or lacks GradScaler's keys.
        """
        self._set_scale_state(*self._scale_state_from(state))

    def _scale_state_from(self, state: Any) -> tuple:
        """(loss-scale config, skip count or None) from a scaler state dict; changes nothing."""
        return config_from_scaler_state(self._scale_settings, state, self._variable_dtypes is not None)

    def _set_scale_state(self, cfg: LossScale, skipped: int | None) -> None:
        if skipped is None:
            skipped = self.num_skipped_steps
        self._scale_settings, self._scale = cfg, None
        self._ensure_scale(self._first_device())
        self._skipped.fill_(int(skipped))

    def state_dict(self) -> dict:
        """The inner optimizer's state dict plus ``"loss_scale"`` (GradScaler format) and counters.

        With several optimizers, their state dicts are the list under ``"inner"``. The
        hooks of ``register_state_dict_pre_hook`` / ``_post_hook`` run as in torch.
        """
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        if len(self._inners) == 1:
            out = dict(self._inners[0].state_dict())
        else:
            out = {"inner": [opt.state_dict() for opt in self._inners]}
        out["loss_scale"] = dict(self.scaler_state_dict(), min_scale=getattr(self._scale_settings, "min_scale", None),
                                 max_scale=getattr(self._scale_settings, "max_scale", None),
                                 num_skipped_steps=self.num_skipped_steps)
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, out)
            if result is not None:
                out = result
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores what `state_dict` saved: inner state, scale, growth counter, skip count.

        A ``torch.amp.GradScaler.state_dict()`` loads as the scale alone (`load_scaler_state_dict`,
        logged), so a GradScaler loop's ``scaler.load_state_dict(...)`` resumes with the wrapper
        in the scaler's place. Everything is checked before anything loads: a refused dict
        changes nothing.

        Raises:
          TypeError: `state_dict` is not a dict.
          ValueError: it was saved by a wrapper over another number of optimizers, or its
            scale part is not a scaler state.
        """
        if not isinstance(state_dict, dict):
            raise TypeError(f"Received a state of type {type(state_dict).__name__}; expected the "
                            f"dict from LossScaleOptimizer.state_dict().")
        if _is_gradscaler_state(state_dict):  # a GradScaler loop's `scaler.load_state_dict(ckpt["scaler"])`
            _log.info("LossScaleOptimizer.load_state_dict: received a torch.amp.GradScaler state (scale %s); "
                      "loaded it as this wrapper's scale (load_scaler_state_dict); the optimizer state is "
                      "unchanged", state_dict["scale"])
            self.load_scaler_state_dict(state_dict)
            return
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        state_dict = dict(state_dict)
        scale_state = state_dict.pop("loss_scale", None)
        # A bad scale part is refused before the inner state changes.
        scale = self._scale_state_from(scale_state) if scale_state is not None else None
        saved = state_dict.get("inner")
        count = len(saved) if isinstance(saved, (list, tuple)) else 1
        if count != len(self._inners):
            raise ValueError(
                f"Received the state of a LossScaleOptimizer over {count} optimizer(s), but this "
                f"one wraps {len(self._inners)}; nothing was loaded. Build the wrapper over the "
                f"same optimizers, in the same order, as the one that saved the state.")
        inner_dicts = [state_dict] if len(self._inners) == 1 else list(saved)
        for sd in inner_dicts:
            missing = [k for k in ("state", "param_groups") if not isinstance(sd, dict) or k not in sd]
            if missing:
                raise ValueError(
                    f"Received an optimizer state without {missing} (keys: "
                    f"{sorted(sd) if isinstance(sd, dict) else type(sd).__name__}); expected the dict "
                    f"from LossScaleOptimizer.state_dict() (or the torch optimizer's own "
                    f"state_dict(), or GradScaler's){_EMPTY if sd == {} else ''}; nothing was loaded.")
        for opt, sd in zip(self._inners, inner_dicts, strict=True):
            was = state_kinds(sd)
            opt.load_state_dict(sd)
            kept = reconcile(opt, sd)
            if was and kept and was != kept:  # converted, and said once, never silently
                _log.warning("LossScaleOptimizer.load_state_dict: the optimizer state was saved in %s; %s "
                             "keeps it in %s, so it was converted (to a float dtype: rounded to nearest; "
                             "to 8 bits: block-quantized)", "/".join(sorted(was)), type(opt).__name__,
                             "/".join(sorted(kept)))
        if scale is not None:
            self._set_scale_state(*scale)
        elif self.is_enabled():  # the optimizer's state alone: the scale is not in it, said once
            _log.warning("LossScaleOptimizer.load_state_dict: the state holds no loss scale (a torch "
                         "optimizer's own state_dict(), or what torch.distributed.checkpoint's get_state_dict "
                         "keeps: 'state' and 'param_groups'); the optimizer state was loaded and the scale "
                         "stays at %s. To resume the scale, save opt.scaler_state_dict() beside it and load "
                         "it with opt.load_scaler_state_dict(...)", self.get_scale())
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)


def _is_gradscaler_state(state: dict) -> bool:
    """A ``torch.amp.GradScaler.state_dict()`` (its keys, no optimizer's), not a wrapper's state."""
    return {"scale", "_growth_tracker"} <= set(state) and not {"state", "param_groups", "inner"} & set(state)
