"""A ``torch.optim.Optimizer`` that scales the loss, skips overflowing steps, and bounds the scale.

Used like the optimizer it wraps::

    opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters()))
    opt.scale_loss(loss).backward()
    opt.unscale_()                      # optional, before gradient clipping
    opt.step()                          # unscale, skip or apply, update the scale
    opt.zero_grad()

The scale lives on the device. Per step there is at most one host sync, the one
``torch.amp.GradScaler`` makes to decide the skip; with fused optimizers
(``fused=True``) there is none: the fused kernel unscales and skips on the device.
The update of the scale is ``GradScaler``'s own kernel followed by a clamp into
``[min_scale, max_scale]``, which is exactly `DynamicLossScale.adjust`.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from typing import Any

import torch

from mixedpolicy.loss_scale import DynamicLossScale, LossScale, NoLossScale, StaticLossScale


def _capturable_devices() -> list:
    try:
        from torch.optim.optimizer import _get_capturable_supported_devices

        return list(_get_capturable_supported_devices())
    except ImportError:  # a torch that moved the private helper
        return ["cuda", "xpu", "hpu", "xla"]


def _check_capturable(opt: torch.optim.Optimizer) -> None:
    """Refuses ``capturable=True`` (a CUDA-graph setting) on parameters of a device without it."""
    supported = None
    for group in opt.param_groups:
        if not group.get("capturable"):
            continue
        supported = supported or _capturable_devices()
        for p in group["params"]:
            if p.device.type not in supported:
                raise ValueError(
                    f"Received {type(opt).__name__}(capturable=True) whose parameters (one of shape "
                    f"{tuple(p.shape)}) are on {p.device}. capturable=True keeps the optimizer step "
                    f"on the device for CUDA-graph capture and works only on {supported}; on "
                    f"{p.device.type} torch would stop at the first step. Create the optimizer with "
                    f"capturable=False (the default), or move the model to the GPU before creating it.")


def _check_master_weights(group: dict, loss_scale: LossScale) -> None:
    if isinstance(loss_scale, NoLossScale):
        return
    for p in group["params"]:
        if p.dtype in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"Received an optimizer whose parameters are {p.dtype} master weights. "
                f"Loss scaling protects float16 gradients, but updates to half-precision "
                f"weights are lost to rounding. Keep the weights in float32 (apply a "
                f"mixed policy such as 'mixed_float16', which stores variables in "
                f"float32), or wrap with loss_scale=mp.NoLossScale() if intended.")


class TorchLossScaleOptimizer(torch.optim.Optimizer):
    """Wraps one or several ``torch.optim.Optimizer`` with one shared loss scale.

    With several optimizers, one overflow anywhere skips every one of them.
    ``param_groups`` and ``state`` are the inner optimizer's own objects, so LR
    schedulers work on the wrapper unchanged.
    """

    def __init__(self, inner: Any, loss_scale: LossScale):  # noqa: D107 (Optimizer.__init__ not called on purpose)
        inners = list(inner) if isinstance(inner, (list, tuple)) else [inner]
        for opt in inners:
            if isinstance(opt, TorchLossScaleOptimizer):
                raise TypeError(
                    "Received a mixedpolicy LossScaleOptimizer to wrap; it already scales the loss, "
                    "and wrapping it again would divide the gradients by two scales. Wrap the "
                    "torch optimizer once (use .inner_optimizers to get at the optimizers inside).")
            if isinstance(opt, torch.optim.LBFGS):
                raise TypeError(
                    "Received torch.optim.LBFGS, which re-evaluates the loss inside step(closure); "
                    "loss scaling cannot follow those re-evaluations. Use LBFGS without a "
                    "LossScaleOptimizer, under a bfloat16 or float32 policy (they need no loss scale).")
            for group in opt.param_groups:
                _check_master_weights(group, loss_scale)
            _check_capturable(opt)
        self._inners = inners
        self._config = loss_scale
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        self._found_inf: torch.Tensor | None = None  # of the current step, once checked
        self._unscaled = False
        self._skipped: torch.Tensor | None = None
        self._last_skipped: torch.Tensor | None = None
        self._optimizer_step_pre_hooks: dict = OrderedDict()
        self._optimizer_step_post_hooks: dict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: dict = OrderedDict()
        self._optimizer_state_dict_post_hooks: dict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: dict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: dict = OrderedDict()
        self.defaults = inners[0].defaults

    def __getstate__(self) -> dict:  # torch.optim.Optimizer keeps only defaults/state/groups
        return dict(self.__dict__)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def add_param_group(self, param_group: dict) -> None:
        """Adds a parameter group to the inner optimizer (with one inner optimizer only).

        Raises:
          TypeError: the wrapper holds several optimizers (add the group to one of them).
          ValueError: the group's parameters are half-precision master weights.
        """
        if len(self._inners) != 1:
            raise TypeError(
                f"Received add_param_group on a LossScaleOptimizer over {len(self._inners)} "
                f"optimizers; it cannot tell which one should own the group. Call it on that "
                f"optimizer: wrapper.inner_optimizers[i].add_param_group(group).")
        if isinstance(param_group, dict):
            params = param_group.get("params")
            params = [params] if isinstance(params, torch.Tensor) else list(params or [])
            _check_master_weights({"params": params}, self._config)
        self._inners[0].add_param_group(param_group)
    # -- the inner optimizer's view -------------------------------------------
    @property
    def inner_optimizers(self) -> list:
        return list(self._inners)

    @property
    def inner_optimizer(self) -> torch.optim.Optimizer:
        return self._inners[0]

    @property
    def param_groups(self) -> list:
        if len(self._inners) == 1:
            return self._inners[0].param_groups
        return [g for opt in self._inners for g in opt.param_groups]

    @property
    def state(self) -> Any:
        if len(self._inners) == 1:
            return self._inners[0].state
        merged: dict = {}
        for opt in self._inners:
            merged.update(opt.state)
        return merged

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self._inners:
            opt.zero_grad(set_to_none=set_to_none)

    # -- scale ----------------------------------------------------------------
    def _ensure_scale(self, device: torch.device) -> torch.Tensor:
        if self._scale is None:
            cfg = self._config
            self._scale = torch.tensor(float(cfg.loss_scale), dtype=torch.float32, device=device)
            counter = int(cfg.counter) if isinstance(cfg, DynamicLossScale) else 0
            self._growth_tracker = torch.tensor(counter, dtype=torch.int32, device=device)
            self._skipped = torch.zeros((), dtype=torch.int64, device=device)
            self._last_skipped = torch.zeros((), dtype=torch.bool, device=device)
        return self._scale

    def _first_device(self) -> torch.device:
        for group in self.param_groups:
            for p in group["params"]:
                return p.device
        return torch.device("cpu")

    @property
    def loss_scale(self) -> torch.Tensor:
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

    def scale_loss(self, loss: Any) -> Any:
        """Returns ``loss * loss_scale`` in float32; call ``.backward()`` on it.

        A list or tuple of losses (as ``GradScaler.scale`` takes) gives one of scaled losses.

        Raises:
          TypeError: `loss` is not a tensor (a Python number has no graph to backpropagate).
        """
        if isinstance(loss, (list, tuple)):
            return type(loss)(self.scale_loss(x) for x in loss)
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"Received a loss of type {type(loss).__name__} ({loss!r:.60}); "
                            f"expected the loss tensor of this step (or a list of them), whose "
                            f".backward() computes the gradients.")
        if isinstance(self._config, NoLossScale):
            return loss
        scale = self._ensure_scale(loss.device)
        return loss.float() * scale.to(loss.device, non_blocking=True)

    # -- unscale and step -----------------------------------------------------
    def _grads_by_device_and_dtype(self) -> dict:
        groups: dict = defaultdict(list)
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                if p.dtype == torch.float16 and not isinstance(self._config, NoLossScale):
                    raise ValueError(
                        "Attempting to unscale float16 gradients of float16 parameters (as "
                        "torch.amp.GradScaler refuses to): the model was made half precision "
                        "(.half()) after the optimizer was wrapped, so its master weights are "
                        "float16 and updates are lost to rounding. Keep parameters in float32 and "
                        "compute in float16 with apply_policy(model, 'mixed_float16').")
                if g.is_sparse:
                    g = g.coalesce()._values() if g.dtype == torch.float16 else g._values()
                groups[(g.device, g.dtype)].append(g)
        return groups

    def _check(self, inv_scale: torch.Tensor) -> torch.Tensor:
        """Multiplies every gradient by `inv_scale` and returns one found-inf flag (no sync)."""
        scale = self._ensure_scale(self._first_device())
        per_device: dict = {}
        for (device, _), grads in self._grads_by_device_and_dtype().items():
            found = per_device.setdefault(device, torch.zeros((), dtype=torch.float32, device=device))
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale.to(device))
        if not per_device:
            raise RuntimeError(
                "step() found no gradients in any parameter: nothing was backpropagated since "
                "the last zero_grad(), so there is no finiteness to check and the step would "
                "count towards growing the scale (torch.amp.GradScaler stops here too: 'No inf "
                "checks were recorded'). Call opt.scale_loss(loss).backward() before opt.step().")
        return sum(f.to(scale.device, non_blocking=True) for f in per_device.values())

    def unscale_(self) -> None:
        """Divides the gradients by the scale in place (call before clipping them).

        Raises:
          RuntimeError: `unscale_` was already called since the last `step`.
        """
        if self._unscaled:
            raise RuntimeError("unscale_() was already called since the last step(); the "
                               "gradients are unscaled once per step. Call step() next.")
        scale = self._ensure_scale(self._first_device())
        self._found_inf = self._check(scale.double().reciprocal().float())
        self._unscaled = True

    def step(self, closure: Any = None) -> Any:
        """Unscales (unless `unscale_` ran), skips or applies the update, updates the scale.

        Raises:
          TypeError: a closure was given (closure optimizers such as LBFGS re-evaluate
            the loss, which loss scaling cannot follow).
        """
        if closure is not None:
            raise TypeError("LossScaleOptimizer.step() takes no closure: an optimizer that "
                            "re-evaluates the loss (LBFGS) cannot be loss-scaled. Use it without "
                            "a LossScaleOptimizer and a bfloat16 or float32 policy.")
        # NoLossScale too: its scale is 1, and a non-finite step is still skipped
        scale = self._ensure_scale(self._first_device())
        fused = all(getattr(opt, "_step_supports_amp_scaling", False) for opt in self._inners)
        if fused:
            if self._found_inf is None:  # the fused kernel unscales; only check here
                self._found_inf = self._check(torch.ones((), dtype=torch.float32, device=scale.device))
            for opt in self._inners:
                opt.grad_scale = None if self._unscaled else scale
                opt.found_inf = self._found_inf
                try:
                    opt.step()
                finally:
                    del opt.grad_scale, opt.found_inf
        else:
            if not self._unscaled:
                self.unscale_()
            if not self._found_inf.item():  # the one host sync GradScaler makes too
                for opt in self._inners:
                    opt.step()
        self._update_scale(self._found_inf)
        self._found_inf = None
        self._unscaled = False
        return None

    step = torch.optim.Optimizer.profile_hook_step(step)  # runs the step pre/post hooks
    step.hooked = True

    def _update_scale(self, found_inf: torch.Tensor) -> None:
        skipped = found_inf.reshape(()) > 0
        self._last_skipped.copy_(skipped)
        self._skipped.add_(skipped.to(torch.int64))
        cfg = self._config
        if not isinstance(cfg, DynamicLossScale):
            return
        torch._amp_update_scale_(self._scale, self._growth_tracker, found_inf,
                                 cfg.growth_factor, cfg.backoff_factor, cfg.dynamic_growth_steps)
        self._scale.clamp_(cfg.min_scale, cfg.max_scale)

    # -- checkpoints ----------------------------------------------------------
    def scaler_state_dict(self) -> dict:
        """The scale in ``torch.amp.GradScaler.state_dict()`` format."""
        self._ensure_scale(self._first_device())
        cfg = self._config
        dynamic = isinstance(cfg, DynamicLossScale)
        return {
            "scale": float(self._scale),
            "growth_factor": cfg.growth_factor if dynamic else 1.0,
            "backoff_factor": cfg.backoff_factor if dynamic else 1.0,
            "growth_interval": cfg.dynamic_growth_steps if dynamic else 2**31 - 1,
            "_growth_tracker": int(self._growth_tracker),
        }

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
        if not isinstance(state, dict):
            raise TypeError(f"Received a scaler state of type {type(state).__name__}; expected the "
                            f"dict from torch.amp.GradScaler.state_dict() or scaler_state_dict().")
        if not state:
            raise ValueError(
                "Received an empty scaler state dict. That is what a disabled torch.amp.GradScaler "
                "saves: GradScaler('cuda') on a machine without CUDA disables itself (with only a "
                "warning), as does enabled=False, so its loss scaling never ran and there is no "
                "scale to load. On CPU create it as GradScaler('cpu'); or skip this load and keep "
                "this optimizer's own scale.")
        missing = [k for k in ("scale", "_growth_tracker") if k not in state]
        if missing:
            raise ValueError(f"Received a scaler state dict without {missing}; expected the "
                             f"dict from torch.amp.GradScaler.state_dict() or scaler_state_dict().")
        cfg, scale = self._config, state["scale"]
        if isinstance(cfg, DynamicLossScale):
            cfg = DynamicLossScale(
                loss_scale=scale, counter=int(state["_growth_tracker"]),
                dynamic_growth_steps=int(state.get("growth_interval", cfg.dynamic_growth_steps)),
                growth_factor=state.get("growth_factor", cfg.growth_factor),
                backoff_factor=state.get("backoff_factor", cfg.backoff_factor),
                min_scale=state.get("min_scale") or min(cfg.min_scale, scale),
                max_scale=state.get("max_scale") or max(cfg.max_scale, scale))
        elif isinstance(cfg, NoLossScale):
            if float(scale) != 1.0:
                raise ValueError(
                    f"Received a scaler state with scale={scale} for a LossScaleOptimizer made with "
                    f"NoLossScale(), which never scales. Load it into a wrapper made with a "
                    f"DynamicLossScale or StaticLossScale, or drop the 'loss_scale' entry.")
        else:
            cfg = StaticLossScale(scale)
        return cfg, state.get("num_skipped_steps")

    def _set_scale_state(self, cfg: LossScale, skipped: int | None) -> None:
        if skipped is None:
            skipped = self.num_skipped_steps
        self._config, self._scale = cfg, None
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
        out["loss_scale"] = dict(self.scaler_state_dict(), min_scale=getattr(self._config, "min_scale", None),
                                 max_scale=getattr(self._config, "max_scale", None),
                                 num_skipped_steps=self.num_skipped_steps)
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, out)
            if result is not None:
                out = result
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores what `state_dict` saved: inner state, scale, growth counter, skip count.

        Everything is checked before anything loads: a refused dict changes nothing.

        Raises:
          TypeError: `state_dict` is not a dict.
          ValueError: it was saved by a wrapper over another number of optimizers, or its
            scale part is not a scaler state.
        """
        if not isinstance(state_dict, dict):
            raise TypeError(f"Received a state of type {type(state_dict).__name__}; expected the "
                            f"dict from LossScaleOptimizer.state_dict().")
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
        if count != len(self._inners) or (len(self._inners) > 1 and saved is None):
            raise ValueError(
                f"Received the state of a LossScaleOptimizer over {count} optimizer(s), but this "
                f"one wraps {len(self._inners)}; nothing was loaded. Build the wrapper over the "
                f"same optimizers, in the same order, as the one that saved the state.")
        if len(self._inners) == 1:
            self._inners[0].load_state_dict(state_dict)
        else:
            for opt, sd in zip(self._inners, saved, strict=True):
                opt.load_state_dict(sd)
        if scale is not None:
            self._set_scale_state(*scale)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def __repr__(self) -> str:
        inner = ", ".join(type(o).__name__ for o in self._inners)
        return f"LossScaleOptimizer({inner}, {self._config!r})"
