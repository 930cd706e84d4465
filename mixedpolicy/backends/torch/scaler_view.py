"""GradScaler's interface over a torch `LossScaleOptimizer`, for code written against GradScaler."""

from __future__ import annotations

from typing import Any

import torch

from mixedpolicy.backends.torch.optimizer import TorchLossScaleOptimizer

#: the scale ``torch.amp.GradScaler()`` starts from: where a trainer's own float16 path is a
#: GradScaler with its defaults (Lightning's ``16-mixed``, the Hugging Face Trainer's and
#: Accelerate's ``fp16``), the plugin standing in for it starts there too, so that the same run
#: skips the same steps and reads the same scale (the wrapper itself starts from Keras's 2**15)
GRADSCALER_INITIAL_SCALE = 2.0 ** 16


class GradScalerView:
    """``torch.amp.GradScaler``'s interface answered by a torch `LossScaleOptimizer`: what
    Accelerate asks of its ``scaler``, and what code written for Lightning's ``MixedPrecision``
    reads from ``trainer.precision_plugin.scaler`` (``get_scale()``, ``state_dict()`` in
    GradScaler's format)."""

    def __init__(self, optimizer: TorchLossScaleOptimizer):
        self.optimizer = optimizer
        self._stepped = optimizer  # the wrapper `update` follows: the one stepped last

    def _wrapper(self, optimizer: Any) -> TorchLossScaleOptimizer:
        """The wrapper a call is about: `optimizer` where it is one (several pass-through
        wrappers may share a view), else this view's own."""
        return optimizer if isinstance(optimizer, TorchLossScaleOptimizer) else self.optimizer

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.optimizer.scale_loss(loss)

    def unscale_(self, optimizer: Any = None) -> None:
        wrapper = self._wrapper(optimizer)
        if not wrapper._unscaled:
            wrapper.unscale_()

    def step(self, optimizer: Any, closure: Any = None) -> Any:
        """Steps through `optimizer.step` (Accelerate's patched one, which records that a step
        was taken) only when the step is applied; a skipped step goes round it."""
        wrapper = self._stepped = self._wrapper(optimizer)
        self.unscale_(wrapper)
        found_inf = wrapper._found_inf
        if found_inf is not None and bool(found_inf):  # GradScaler reads this flag here too
            return type(wrapper).step(wrapper)  # skipped: counted, the scale backs off
        return optimizer.step(closure) if closure is not None else optimizer.step()

    def update(self, new_scale: Any = None) -> None:
        self._stepped.update(new_scale)

    def get_scale(self) -> float:
        return self.optimizer.get_scale()

    def is_enabled(self) -> bool:
        return self.optimizer.is_enabled()

    def state_dict(self) -> dict:
        return self.optimizer.scaler_state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_scaler_state_dict(state)


def _delegate(name: str) -> Any:
    def method(self: GradScalerView, *args: Any) -> Any:
        return getattr(self.optimizer, name)(*args)
    method.__name__ = name
    method.__doc__ = f"GradScaler's ``{name}``, answered by the wrapper."
    return method


for _name in ("get_growth_factor", "get_backoff_factor", "get_growth_interval", "set_growth_factor",
              "set_backoff_factor", "set_growth_interval"):
    setattr(GradScalerView, _name, _delegate(_name))
