"""Checks and conversions of the torch LossScaleOptimizer: what it refuses up front, and the
scale a ``torch.amp.GradScaler`` state dict describes.
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Any

import torch

from mixedpolicy._warnings import user_stacklevel
from mixedpolicy.loss_scale import DynamicLossScale, LossScale, NoLossScale

_log = logging.getLogger("mixedpolicy")


def _capturable_devices() -> list:
    try:
        from torch.optim.optimizer import _get_capturable_supported_devices

        return list(_get_capturable_supported_devices())
    except ImportError:  # a torch that moved the private helper
        return ["cuda", "xpu", "hpu", "xla"]


def check_capturable(opt: torch.optim.Optimizer) -> None:
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


def check_half_master_weights(group: dict, loss_scale: LossScale, variable_dtypes: Any = None) -> None:
    """Refuses half-precision master weights, unless a policy the wrapper follows
    (`variable_dtypes`, theirs) stores variables in that dtype (a pure policy: under
    ``"float16"`` the wrapper scales float16 weights' gradients, as the optax and Keras wrappers
    do); never under a `NoLossScale` given by hand."""
    if isinstance(loss_scale, NoLossScale) and variable_dtypes is None:
        return
    for p in group["params"]:
        if p.dtype not in (torch.float16, torch.bfloat16) or not p.requires_grad:
            continue  # (a frozen one is no master weight; unfrozen later, its half gradients are refused at step)
        name = str(p.dtype).rpartition(".")[2]
        if variable_dtypes is not None and name in variable_dtypes:
            continue
        if isinstance(loss_scale, NoLossScale):
            raise ValueError(
                f"Received an optimizer whose parameters (one of shape {tuple(p.shape)}) are {name} "
                f"master weights, under a policy that stores variables in "
                f"{' or '.join(sorted(variable_dtypes))}: updates to half-precision weights are "
                f"lost to rounding, and the same loop under a float16 policy would be refused. "
                f"Keep the weights in float32 (drop .half()/.to({name}); apply_policy computes in "
                f"half precision), train under a pure policy that stores them in {name} "
                f"(mp.apply_policy(model, {name!r})), or wrap with loss_scale=mp.NoLossScale() "
                f"if intended.")
        raise ValueError(
            f"Received an optimizer whose parameters are {p.dtype} master weights. "
            f"Loss scaling protects float16 gradients, but updates to half-precision "
            f"weights are lost to rounding. Keep the weights in float32 (apply a "
            f"mixed policy such as 'mixed_float16', which stores variables in "
            f"float32), or wrap with loss_scale=mp.NoLossScale() if intended.")


def config_from_scaler_state(cfg: LossScale, state: Any, follows_policy: bool = False) -> tuple:
    """(the loss scale `state` describes, skip count or None), `cfg` giving the kind; changes nothing.

    A wrapper that scales nothing because its policy needs no scale (`follows_policy`), or a
    pass-through (`NoLossScale(skip_nonfinite=False)`), takes any state and keeps scaling
    nothing, whatever the run that saved the state used; a static scale keeps its own (as the
    optax wrapper's ``adopt_state``); what either drops is logged.
    """
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
    scale = state["scale"]
    if isinstance(cfg, DynamicLossScale) and state.get("growth_factor") == 1.0 == state.get("backoff_factor"):
        # written by a wrapper whose scale never moves (static, none, a pass-through): it
        # holds a scale but no dynamics; keep this wrapper's, from that scale (a scale of
        # 1, which never scaled, leaves this wrapper's own initial scale)
        start = float(cfg.loss_scale) if float(scale) == 1.0 else scale
        cfg = DynamicLossScale(loss_scale=start, dynamic_growth_steps=cfg.dynamic_growth_steps,
                               growth_factor=cfg.growth_factor, backoff_factor=cfg.backoff_factor,
                               min_scale=min(cfg.min_scale, float(start)),
                               max_scale=max(cfg.max_scale, float(start)))
    elif isinstance(cfg, DynamicLossScale):
        cfg = DynamicLossScale(
            loss_scale=scale, counter=int(state["_growth_tracker"]),
            dynamic_growth_steps=int(state.get("growth_interval", cfg.dynamic_growth_steps)),
            growth_factor=state.get("growth_factor", cfg.growth_factor),
            backoff_factor=state.get("backoff_factor", cfg.backoff_factor),
            min_scale=state.get("min_scale") or min(cfg.min_scale, scale),
            max_scale=state.get("max_scale") or max(cfg.max_scale, scale))
    elif isinstance(cfg, NoLossScale):
        if float(scale) != 1.0 and (follows_policy or not cfg.skip_nonfinite):
            _log.warning(
                "Loaded a checkpoint whose loss scale is %g (growth counter %s) into a "
                "LossScaleOptimizer that scales nothing (%s): the scale is dropped; the inner "
                "optimizer's state and the skip count are kept. Pass policy='mixed_float16' (or "
                "initial_scale=...) to go on scaling.", float(scale), int(state["_growth_tracker"]),
                "its policy computes in no float16" if follows_policy else "skip_nonfinite=False")
        elif float(scale) != 1.0:
            raise ValueError(
                f"Received a scaler state with scale={scale} for a LossScaleOptimizer made with "
                f"NoLossScale(), which never scales. Load it into a wrapper made with a "
                f"DynamicLossScale or StaticLossScale, or drop the 'loss_scale' entry.")
    elif float(scale) != float(cfg.loss_scale) and not (  # static: keeps its own, as optax's adopt_state;
            float(scale) == 1.0 and state.get("growth_factor") == 1.0 == state.get("backoff_factor")):  # said
        # unless the saved wrapper never scaled (a scale of 1 that never moves: nothing is dropped)
        _log.warning(
            "Loaded a checkpoint whose loss scale is %g (growth counter %s) into a LossScaleOptimizer "
            "with a static scale of %g: the saved scale is dropped; the inner optimizer's state and "
            "the skip count are kept.", float(scale), int(state["_growth_tracker"]), float(cfg.loss_scale))
    return cfg, state.get("num_skipped_steps")


def unscaled_step_error(what: str, scale: float) -> RuntimeError:
    """The refusal of a step (or unscale) whose gradients did not come from a scaled loss (or
    came from a ``torch.amp.GradScaler``'s, which is stepping this wrapper: both scale)."""
    if _driven_by_grad_scaler():
        return RuntimeError(
            f"{what} was called by a torch.amp.GradScaler (scaler.step(opt)) on a LossScaleOptimizer, "
            f"and both scale the loss: the gradients were scaled and unscaled by GradScaler, and this "
            f"wrapper would divide them by its own scale ({scale:g}) again. Use one of the two: "
            f"opt.scale_loss(loss).backward(); opt.step() without the GradScaler, or give the "
            f"GradScaler the plain inner optimizer (opt.inner_optimizer).")
    return RuntimeError(
        f"{what} was called, but no loss was scaled since the last step: the gradients came "
        f"from loss.backward(), not from opt.scale_loss(loss).backward(), and dividing them by "
        f"the loss scale ({scale:g}) would make the update that many times too small, or this is "
        f"a second step on gradients a step already took (torch.amp.GradScaler stops at either). "
        f"Call opt.scale_loss(loss).backward() before each step. In "
        f"Lightning, let the Trainer scale: Trainer(plugins=[mixedpolicy.lightning."
        f"Precision(policy)]) with the plain optimizer from configure_optimizers; for the "
        f"Hugging Face Trainer, mixedpolicy.huggingface.Trainer(..., policy=policy) scales "
        f"through Accelerate (pass the plain optimizer).")


def _driven_by_grad_scaler() -> bool:
    """Whether a ``torch.amp.GradScaler`` method is among the callers (read on a refusal only)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.replace("\\", "/").endswith("torch/amp/grad_scaler.py"):
            return True
        frame = frame.f_back
    return False


# Device types where reading the found-inf flag on the host (a non-fused optimizer's skip)
# stalls the device's queue: GPT-2 small in eager mode on an H100 took 13% longer a step with
# the check than without it (docs/benchmarks.md); on a CPU the read costs nothing.
_SYNC_COSTLY = {"cuda", "xpu", "mps", "hpu"}
_WITH_FUSED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)  # fused on those devices too


def check_inner(opt: Any, loss_scale: LossScale, wrapper_type: type, variable_dtypes: Any = None) -> None:
    """Refuses, for a wrapper of type `wrapper_type`, an inner optimizer it cannot take: a wrapper
    already, half-precision master weights under scaling (but those `variable_dtypes`, of the
    policies the wrapper follows, store), a capturable one on the wrong device."""
    if isinstance(opt, wrapper_type):
        raise TypeError(
            "Received a mixedpolicy LossScaleOptimizer to wrap; it already scales the loss, "
            "and wrapping it again would divide the gradients by two scales. Wrap the "
            "torch optimizer once (use .inner_optimizers to get at the optimizers inside).")
    for group in opt.param_groups:
        check_half_master_weights(group, loss_scale, variable_dtypes)
    check_capturable(opt)
    warn_vanishing_eps(opt, opt.param_groups)


def warn_vanishing_eps(opt: Any, groups: list) -> None:
    """Warns where an optimizer's ``eps`` is 0 in float16 and it updates float16 weights: Adam,
    RMSprop and Adagrad divide by a root of their second moment plus eps, in the weights'
    dtype, and a moment that underflows to 0 there (any gradient under about 2.4e-4 squared)
    makes the update inf or NaN from finite gradients, which no check of the gradients sees.
    `groups`: those of ``opt.param_groups`` to look at (a group just added, or all)."""
    for group in groups:
        eps = group.get("eps")
        if (isinstance(eps, float) and eps > 0 and float(torch.tensor(eps, dtype=torch.float16)) == 0
                and any(p.dtype == torch.float16 for p in group["params"])):
            warnings.warn(
                f"{type(opt).__name__} has eps={eps}, which is 0 in float16, and updates float16 weights: "
                f"it computes in their dtype, where a small gradient's squared moment underflows to 0, "
                f"so its update divides by 0 and the weights become inf or NaN from finite gradients "
                f"(as {type(opt).__name__} alone does on float16 weights). Give eps=1e-4 (at least 6e-8), "
                f"or keep the weights in float32 with a mixed policy ('mixed_float16').",
                UserWarning, stacklevel=user_stacklevel())
            return


def take_fused_kernels(optimizers: list) -> bool:
    """Calls `take_fused_kernel` on each; returns True (done)."""
    for opt in optimizers:
        take_fused_kernel(opt)
    return True


def take_fused_kernel(opt: torch.optim.Optimizer) -> None:
    """Before its first step, a torch SGD, Adam or AdamW that left the choice of implementation
    to torch (``fused=None, foreach=None``) takes its fused kernel where the parameters live on a
    device that a host read stalls: that kernel unscales and skips on the device, as it does under
    ``GradScaler``, so the step needs no host sync. A choice the user made is kept."""
    if type(opt) not in _WITH_FUSED or getattr(opt, "_step_supports_amp_scaling", False):
        return
    if opt.param_groups and all(g.get("fused") is True for g in opt.param_groups):
        opt._step_supports_amp_scaling = True  # fused by a loaded state dict (its groups say so)
        return
    if opt.state:
        return  # its state was made for the implementation it has
    params = [p for g in opt.param_groups for p in g["params"]]
    if not params or any(g.get("fused") is not None or g.get("foreach") is not None or g.get("differentiable")
                         or torch.is_tensor(g.get("lr")) for g in opt.param_groups):  # (a tensor lr: kept)
        return
    if any(p.device.type not in _SYNC_COSTLY or not p.is_floating_point() or type(p.data) is not torch.Tensor
           or (p.grad is not None and p.grad.is_sparse) for p in params):
        return  # (a tensor subclass, FSDP2's DTensor say, keeps the implementation torch chose)
    for group in opt.param_groups:
        group["fused"] = True
    opt._step_supports_amp_scaling = True  # as torch's constructor marks a fused optimizer


def unscales_itself(opt: Any) -> bool:
    """Does `opt` take the scale and the flag as GradScaler hands them to a fused optimizer (its
    ``_step_supports_amp_scaling``, and ``grad_scale`` / ``found_inf`` set on it for the step)?
    Not an optimizer whose step takes GradScaler's older ``grad_scaler`` keyword instead: given no
    GradScaler it would step on gradients still scaled, so the wrapper unscales them for it."""
    if not getattr(opt, "_step_supports_amp_scaling", False):
        return False
    kind = type(opt)
    known = _UNSCALES_ITSELF.get(kind)
    if known is None:
        import inspect

        try:
            known = "grad_scaler" not in inspect.signature(kind.step).parameters
        except (TypeError, ValueError):  # a step without a signature to read: taken at its word
            known = True
        _UNSCALES_ITSELF[kind] = known
    return known


_UNSCALES_ITSELF: dict = {}  # by optimizer class


def is_own_optimizer(wrapper: Any, optimizer: Any, what: str = "unscale_") -> bool:
    """Is `optimizer` (GradScaler's ``unscale_(optimizer)`` / ``step(optimizer)`` argument) the
    wrapper or its one inner optimizer? False for None or step's closure; an optimizer it does not
    wrap is refused (one of several is taken before this: one_by_one.py)."""
    if optimizer is None or (what == "step" and callable(optimizer)):
        return False  # nothing, or step's closure (every step: nothing else looked at)
    inners = wrapper.inner_optimizers
    if optimizer is wrapper or (len(inners) == 1 and optimizer is inners[0]):
        return True
    raise ValueError(
        f"Received {what}({type(optimizer).__name__}), an optimizer that this LossScaleOptimizer over "
        f"{[type(o).__name__ for o in inners]} does not wrap: name one of its inner_optimizers (as "
        f"GradScaler's {what}(optimizer) does), or call opt.{what}() for all of them.")
