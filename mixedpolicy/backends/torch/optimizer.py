"""A ``torch.optim.Optimizer`` that scales the loss, skips overflowing steps, and bounds the scale.

Used like the optimizer it wraps::

    opt = mp.LossScaleOptimizer(torch.optim.AdamW(model.parameters()))
    opt.scale_loss(loss).backward()
    opt.unscale_()                      # optional, before gradient clipping
    opt.step()                          # unscale, skip or apply, update the scale
    opt.zero_grad()

The scale lives on the device; at most one host sync a step (``GradScaler``'s), none with fused
optimizers, whose kernel unscales and skips. It moves by ``GradScaler``'s kernel and a clamp to
``[min_scale, max_scale]``: exactly `DynamicLossScale.adjust`."""

from __future__ import annotations

import contextlib
import functools
from collections import OrderedDict
from typing import Any

import torch
from torch.optim import optimizer as _torch_optimizer

from mixedpolicy._adapter import OptimizerAdapter
from mixedpolicy.backends.torch.arrays import PARAMETER_POLICY
from mixedpolicy.backends.torch.checks import (check_inner, is_own_optimizer, take_fused_kernels, unscaled_step_error,
                                               unscales_itself)
from mixedpolicy.backends.torch.closure import (check_closure_optimizers, closure_step, reevaluates_closure,
                                                scaled_backward)
from mixedpolicy.backends.torch.found_inf import FoundInf, all_zero, any_gradient
from mixedpolicy.backends.torch.inner import InnerView
from mixedpolicy.backends.torch.one_by_one import OneByOne
from mixedpolicy.backends.torch.updates import TorchUpdates
from mixedpolicy.backends.torch.state import Checkpoints
from mixedpolicy.scope import global_policy
from mixedpolicy.loss_scale import DynamicLossScale, LossScale, NoLossScale, is_pass_through


def _global_hooks() -> bool:
    """Are process-wide optimizer step hooks registered (torch.optim.register_optimizer_step_*)?"""
    return bool(_torch_optimizer._global_optimizer_pre_hooks or _torch_optimizer._global_optimizer_post_hooks)


class TorchLossScaleOptimizer(Checkpoints, InnerView, OneByOne, torch.optim.Optimizer):
    """Wraps one or several ``torch.optim.Optimizer`` with one shared loss scale.

    With several optimizers, one overflow anywhere skips every one of them.
    ``param_groups`` and ``state`` are the inner optimizer's own objects, so LR
    schedulers work on the wrapper unchanged.
    """

    def __init__(self, inner: Any, loss_scale: LossScale,  # noqa: D107 (Optimizer.__init__ not called on purpose)
                 variable_dtypes: frozenset | None = None):
        inners = list(inner) if isinstance(inner, (list, tuple)) else [inner]
        check_closure_optimizers(inners, loss_scale)
        for opt in inners:
            check_inner(opt, loss_scale, TorchLossScaleOptimizer, variable_dtypes)
        self._inners = inners
        self._scale_settings = loss_scale
        self._variable_dtypes = variable_dtypes  # those of the policies the wrapper follows, if it does
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        self._found_inf: torch.Tensor | None = None  # of the current step, once checked
        self._checks = FoundInf()  # the flags per device, the parameters' partition
        self._unscaled = self._kernels_chosen = False
        self._acting_on: torch.optim.Optimizer | None = None
        self._loss_scaled = False  # scale_loss ran since the last step (GradScaler's check, per step)
        self._skipped: torch.Tensor | None = None
        self._last_skipped: torch.Tensor | bool | None = None  # a device flag, or the host's answer
        for kind in ("step_pre", "step_post", "state_dict_pre", "state_dict_post",
                     "load_state_dict_pre", "load_state_dict_post"):  # torch.optim's hook tables
            setattr(self, f"_optimizer_{kind}_hooks", OrderedDict())
        self.defaults = inners[0].defaults if inners else {}  # (none: Fabric's plugin adopts them)

    def _adopt(self, opt: torch.optim.Optimizer) -> None:
        """Takes `opt` in beside the optimizers wrapped, with the shared scale and the checks the
        constructor makes (a trainer that hands over each optimizer only at its first step)."""
        check_closure_optimizers([*self._inners, opt], self._scale_settings)
        check_inner(opt, self._scale_settings, TorchLossScaleOptimizer)
        self._inners.append(opt)
        self._checks.forget_partition()
        self._kernels_chosen = False
        if len(self._inners) == 1:
            self.defaults = opt.defaults

    def __getstate__(self) -> dict:  # torch.optim.Optimizer keeps only defaults/state/groups
        return dict(self.__dict__, _checks=FoundInf())  # (its flags and partition: caches)

    def __setstate__(self, state: dict) -> None:
        for old in ("_found_flags", "_clean_flags", "_partition", "_per_device_flags"):
            state.pop(old, None)  # a wrapper pickled before they moved to FoundInf
        self.__dict__.update(state)
        for key, value in (("_checks", FoundInf()), ("_kernels_chosen", True)):  # (or before these existed)
            self.__dict__.setdefault(key, value)

    # -- scale ----------------------------------------------------------------
    def _ensure_scale(self, device: torch.device) -> torch.Tensor:
        if self._scale is None:
            cfg = self._scale_settings
            self._scale = torch.tensor(float(cfg.loss_scale), dtype=torch.float32, device=device)
            counter = int(cfg.counter) if isinstance(cfg, DynamicLossScale) else 0
            self._growth_tracker = torch.tensor(counter, dtype=torch.int32, device=device)
            self._skipped = torch.zeros((), dtype=torch.float64, device=device)  # exact to 2**53
            self._last_skipped = torch.zeros((), dtype=torch.float32, device=device)  # the last found-inf
        return self._scale

    def _first_device(self) -> torch.device:
        return next((p.device for group in self.param_groups for p in group["params"]), torch.device("cpu"))

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
        self._loss_scaled = True
        if isinstance(self._scale_settings, NoLossScale):
            return loss
        scale = self._ensure_scale(loss.device)
        return loss.float() * scale.to(loss.device, non_blocking=True)

    def _check_loss_was_scaled(self, what: str) -> None:
        if self._loss_scaled or isinstance(self._scale_settings, NoLossScale):
            return
        if not any_gradient(self._inners):
            return  # no backward at all: refused below as a step without gradients
        if all_zero(self._inners):  # zero_grad(set_to_none=False) and no backward: scaled or not
            return  # alike (zero), the step is the inner optimizer's as under a pass-through
        raise unscaled_step_error(what, float(self.loss_scale))

    # -- unscale and step -----------------------------------------------------
    def _inverse(self, scale: torch.Tensor) -> torch.Tensor | None:
        if isinstance(self._scale_settings, NoLossScale):
            return None  # its scale is 1: the check alone, no reciprocal to compute
        return scale.double().reciprocal().float()

    def _unscale_and_check(self, inv_scale: Any, scale: torch.Tensor, what: str = "step()") -> torch.Tensor:
        """Multiplies every gradient by `inv_scale` (None: only checks); one found-inf flag, no sync."""
        groups = self.param_groups if self._acting_on is None else self._acting_on.param_groups
        # float16 weights' gradients are taken where a followed policy stores float16 weights, or where
        # the wrapper follows none and scales nothing (NoLossScale by hand): under a policy, the same
        # misuse (a weight made half, or unfrozen half, after wrapping) is refused whether it scales or not
        half_allowed = ("float16" in self._variable_dtypes if self._variable_dtypes is not None
                        else isinstance(self._scale_settings, NoLossScale))
        return self._checks.check(groups, half_allowed, inv_scale, scale, what)

    def unscale_(self, optimizer: Any = None) -> None:
        """Divides the gradients by the scale in place (call before clipping them); `optimizer`, as
        ``GradScaler.unscale_`` takes it, may be this wrapper or its one inner one.

        Raises:
          RuntimeError: `unscale_` was already called since the last `step`.
        """
        if self._one_of_several(optimizer):  # GradScaler's loop over several optimizers (one_by_one.py)
            return self._unscale_one(optimizer)
        is_own_optimizer(self, optimizer)  # refuses another optimizer
        if self._unscaled:
            raise RuntimeError("unscale_() was already called since the last step(); the "
                               "gradients are unscaled once per step. Call step() next.")
        if is_pass_through(self._scale_settings):
            self._unscaled = True  # nothing was scaled; the misuse above is refused all the same
            return
        self._check_loss_was_scaled("unscale_()")
        scale = self._ensure_scale(self._first_device())
        self._found_inf = self._unscale_and_check(self._inverse(scale), scale, "unscale_()")
        self._unscaled = True

    def step(self, closure: Any = None) -> Any:
        """Unscales (unless `unscale_` ran), skips or applies the update, updates the scale.

        The step pre/post hooks run and the profiler sees the step as torch's optimizers do;
        without either, nothing is spent on them (~40 us a step on a CPU).

        Args:
          closure: as torch's optimizers take it (Lightning passes one): called once, with
            gradients enabled, before the gradients are checked; its result is returned. A
            closure that returns None and leaves no gradient (Lightning's ``training_step``
            returning None to skip a batch) makes no step and changes no scale. An
            optimizer that re-evaluates it (LBFGS) gets it as it is under a pass-through. An
            optimizer in its place is GradScaler's ``step(optimizer)``, as `unscale_` takes it.

        Raises:
          RuntimeError: under loss scaling, no loss was scaled since the last step (the
            gradients are not the scaled ones), or no parameter has a gradient.
        """
        if self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks or _global_hooks() \
                or torch.autograd._profiler_enabled():
            return self._hooked_step(closure)
        return self._step(closure)

    def _step(self, closure: Any = None) -> Any:
        # (the common case, no closure and one optimizer, in as few Python operations as it
        # takes: on a CPU a small model's step spends more time in Python than in the check)
        if closure is None and self._acting_on is None and not self._unscaled:
            found = self._checks.armed_check()  # a check-only step, its groups as at the last one:
            if found is not None:  # the rest inline (on a CPU each call here costs ~2 us in a loop)
                skipped = self._last_skipped = bool(found.item())
                if skipped:
                    self._skipped.add_(1)
                else:
                    self._inners[0].step()
                self._loss_scaled = False
                return None
        if closure is not None and self._one_of_several(closure):  # GradScaler's step(optimizer) of several
            return self._step_one(closure)
        if closure is not None and is_own_optimizer(self, closure, "step"):
            closure = None
        pass_through = is_pass_through(self._scale_settings)
        stepped = self._inners if self._acting_on is None else [self._acting_on]
        if closure is not None and any(reevaluates_closure(o) for o in stepped):
            return closure_step(self, stepped[0], closure)
        result = None
        if closure is not None:
            scaling = not pass_through and not isinstance(self._scale_settings, NoLossScale)
            with torch.enable_grad(), (scaled_backward(self, stepped) if scaling else contextlib.nullcontext()):
                result = closure()
            if result is None and not pass_through and not self._unscaled and not any_gradient(stepped):
                # the closure backpropagated nothing (Lightning's training_step returned None
                # to skip the batch): no step, as torch's optimizers and Lightning's own
                # mixed-precision plugin do; the scale and the skip count are left as they are
                # (a pass-through calls the inner step below, a no-op there, as it always does)
                self._after_step()
                return None
        if pass_through:  # the inner step, nothing added
            for opt in stepped:
                opt.step()
            self._after_step()
            return result
        if not (self._unscaled or self._loss_scaled):
            self._check_loss_was_scaled("step()")
        # NoLossScale too: its scale is 1, and a non-finite step is still skipped
        scale = self._scale if self._scale is not None else self._ensure_scale(self._first_device())
        if not self._kernels_chosen:  # once, before the first step
            self._kernels_chosen = take_fused_kernels(self._inners)
        if all([unscales_itself(opt) for opt in stepped]):  # fused
            if self._found_inf is None:  # the fused kernel unscales; only check here
                self._found_inf = self._unscale_and_check(None, scale)
            for opt in stepped:
                opt.grad_scale = None if self._unscaled else scale
                opt.found_inf = self._found_inf
                try:
                    opt.step()
                finally:
                    del opt.grad_scale, opt.found_inf
        else:
            if not self._unscaled:  # unscale_()'s work; its checks were made above
                self._found_inf = self._unscale_and_check(self._inverse(scale), scale)
                if type(self._scale_settings) is NoLossScale and len(stepped) == 1 and self._acting_on is None:
                    self._checks.arm(stepped[0])  # the next steps: `armed_check`, while nothing changes
            skipped = bool(self._found_inf.item())  # the one host sync GradScaler makes too
            if not skipped:
                for opt in stepped:
                    opt.step()
                self._checks.read_as_zero()  # no zeroing next time
            self._update_scale(self._found_inf, skipped)
            self._after_step()
            return result
        self._update_scale(self._found_inf)
        self._after_step()
        return result

    def _after_step(self) -> None:
        self._found_inf = None
        self._unscaled = False
        if self._acting_on is None:  # one backward may serve several optimizers stepped one by one
            self._loss_scaled = False

    _hooked_step = torch.optim.Optimizer.profile_hook_step(_step)  # the step pre/post hooks, a profiler label
    step.hooked = True  # (torch's marker: not to be wrapped again)

    def _update_scale(self, found_inf: torch.Tensor, skipped: bool | None = None) -> None:
        # found_inf is this step's flag (1 where skipped; a sum over devices may say 2), kept for
        # the next check, which zeroes it; `skipped`, where the step read it on the host already:
        # then the last step's answer and the count need no op
        if self.__dict__.get("_defer_scale"):  # one of several stepped by name: at update()
            return self._deferred(found_inf, skipped)
        if skipped is None:
            self._last_skipped = found_inf.clone()  # stays this step's after the flag is reused
            self._skipped.add_(found_inf.clamp(max=1) if self._checks.several else found_inf)
        else:
            self._last_skipped = skipped
            if skipped:
                self._skipped.add_(1)
        cfg = self._scale_settings
        if not isinstance(cfg, DynamicLossScale):
            return
        torch._amp_update_scale_(self._scale, self._growth_tracker, found_inf,
                                 cfg.growth_factor, cfg.backoff_factor, cfg.dynamic_growth_steps)
        self._scale.clamp_(cfg.min_scale, cfg.max_scale)

    def __repr__(self) -> str:
        inner = ", ".join(type(o).__name__ for o in self._inners)
        return f"LossScaleOptimizer({inner}, {self._scale_settings!r})"


def _eager_under_dynamo(method: Any) -> Any:
    """`method` run eagerly inside a torch.compile'd step (dynamo takes the wrapper for one of
    torch's Optimizers and lost its bookkeeping across the step's graph break); called eagerly,
    the method itself: torch.compiler.disable's frame handling cost ~2 us a call."""
    disabled = torch.compiler.disable(method)

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # (dynamo reads this as True while it traces)
            return disabled(self, *args, **kwargs)
        return method(self, *args, **kwargs)
    return call


for _name in ("scale_loss", "unscale_", "step"):
    setattr(TorchLossScaleOptimizer, _name, _eager_under_dynamo(getattr(TorchLossScaleOptimizer, _name)))
TorchLossScaleOptimizer.scale = TorchLossScaleOptimizer.scale_loss  # GradScaler's name: its loops run as written


class TorchOptimizers(TorchUpdates, OptimizerAdapter):
    def is_optimizer(self, obj: Any) -> bool:
        if isinstance(obj, (list, tuple)):
            return bool(obj) and all(isinstance(o, torch.optim.Optimizer) for o in obj)
        return isinstance(obj, torch.optim.Optimizer)

    takes_followed_policies = True  # its half-precision check reads the variable dtypes they store

    def wrap_optimizer(self, optimizer: Any, loss_scale: Any, axis_name: Any = None, followed: tuple = ()) -> Any:
        if axis_name is not None:
            raise TypeError(
                f"Received axis_name={axis_name!r} for a torch optimizer; axis_name names a JAX "
                f"replica axis. Under DistributedDataParallel every rank already skips "
                f"together: the gradients are all-reduced before the step checks them.")
        dtypes = frozenset(p.variable_dtype for p in followed) if followed else None
        return TorchLossScaleOptimizer(optimizer, loss_scale, dtypes)

    def policies_of(self, optimizer: Any) -> tuple[Any, str] | None:
        inners = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
        found = {p.__dict__[PARAMETER_POLICY] for opt in inners for group in opt.param_groups
                 for p in group["params"] if PARAMETER_POLICY in p.__dict__}
        if found:
            return tuple(found), "the policies apply_policy put on its parameters' modules"
        # a model of its own without a policy: a float16 model elsewhere is not this one
        return (global_policy(),), "the global policy (no policy applied to its parameters)"
