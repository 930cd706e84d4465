"""Closures under a LossScaleOptimizer: the step of an optimizer that re-evaluates its closure
(LBFGS), under a wrapper that scales nothing (loss scaling cannot follow the re-evaluations, but
the skip of a non-finite step can be made before the optimizer moves anything), and a closure
called once under scaling whose backward is not scaled (Lightning's own loop: `scaled_backward`)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch

from mixedpolicy.backends.torch.found_inf import any_gradient
from mixedpolicy.loss_scale import LossScale, NoLossScale, is_pass_through, summary


class SkipStep(Exception):
    """Raised from a checked closure to leave an optimizer's step before it moves anything."""


def reevaluates_closure(opt: torch.optim.Optimizer) -> bool:
    """Does `opt.step(closure)` evaluate the closure more than once (LBFGS)?"""
    return isinstance(opt, torch.optim.LBFGS)


def check_closure_optimizers(inners: list, loss_scale: LossScale) -> None:
    """Refuses a closure-re-evaluating optimizer under a scale, or among several optimizers."""
    for opt in inners:
        if not reevaluates_closure(opt):
            continue
        if len(inners) > 1:
            raise TypeError(f"Received {type(opt).__name__} among several optimizers: it re-evaluates "
                            f"the loss inside its own step(closure), which cannot be shared with the "
                            f"others. Wrap it alone.")
        if not isinstance(loss_scale, NoLossScale):
            raise TypeError(
                f"Received torch.optim.{type(opt).__name__} under {summary(loss_scale)}: it "
                f"re-evaluates the loss inside step(closure), and loss scaling cannot follow "
                f"those re-evaluations (torch.amp.GradScaler refuses it too). Under a bfloat16 "
                f"or float32 policy the wrapper scales nothing and takes it; with float16 "
                f"compute use a first-order optimizer such as torch.optim.AdamW.")


def closure_step(wrapper: Any, optimizer: torch.optim.Optimizer, closure: Any) -> Any:
    """A step of an optimizer that re-evaluates `closure` (LBFGS), under a wrapper that
    scales nothing: the closure as it is, or (skipping non-finite steps) checked at its
    first evaluation, before the optimizer has moved anything."""
    if is_pass_through(wrapper._scale_settings):
        result = optimizer.step(closure)
        wrapper._after_step()
        return result
    scale = wrapper._ensure_scale(wrapper._first_device())
    found: list = []  # the first evaluation's flag (the closure's zero_grad() clears the wrapper's)

    def checked() -> Any:
        loss = closure()
        if not found:
            found.append(wrapper._unscale_and_check(None, scale))  # (it scales nothing: checks only)
            if found[0].item():
                raise SkipStep
        return loss

    result = None
    try:
        result = optimizer.step(checked)
    except SkipStep:
        pass
    wrapper._update_scale(found[0])
    wrapper._after_step()
    return result


@contextlib.contextmanager
def scaled_backward(wrapper: Any, stepped: list) -> Iterator[None]:
    """While a scaling wrapper's ``step(closure)`` calls a closure that backpropagates a loss it
    did not scale (Lightning's own loop calls ``loss.backward()`` inside the closure it passes),
    the closure's first backward of a scalar loss, in this thread, onto gradients the closure has
    just cleared, runs on ``wrapper.scale_loss(loss)`` and is unscaled at once, so that what the
    closure does next (Lightning clips there) sees true gradients and the step skips or applies
    as after ``scale_loss(...).backward()``. A closure that scales its loss itself, a backward
    with an explicit gradient, and gradients accumulated before (micro-batches backpropagated
    outside the step) are left as they are: such a step is then refused as unscaled, as before."""
    original = torch.Tensor.backward
    owner = threading.get_ident()

    def backward(tensor: torch.Tensor, gradient: Any = None, *args: Any, **kwargs: Any) -> Any:
        if (threading.get_ident() != owner or wrapper._loss_scaled or gradient is not None
                or tensor.numel() != 1 or any_gradient(stepped)):
            return original(tensor, gradient, *args, **kwargs)
        result = original(wrapper.scale_loss(tensor), None, *args, **kwargs)
        wrapper.unscale_()
        return result

    torch.Tensor.backward = backward  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.backward = original  # type: ignore[method-assign]
