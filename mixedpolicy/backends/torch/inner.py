"""What a torch LossScaleOptimizer shows of the optimizers it wraps: their parameter groups and
state (shared, so LR schedulers work on the wrapper), new groups checked as the constructor
checks them, and the one optimizer a step acts on when a trainer steps them one by one.

A mixin of `TorchLossScaleOptimizer`, which keeps ``_inners``, ``_scale_settings``,
``_variable_dtypes`` and ``_acting_on``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from mixedpolicy.backends.torch.checks import check_half_master_weights, warn_vanishing_eps


class InnerView:
    """The inner optimizers' view; the class it is mixed into keeps them in ``_inners``."""

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
        if not isinstance(param_group, dict) or "params" not in param_group:
            raise TypeError(f"Received {param_group!r:.80} as a parameter group; expected a dict with "
                            f"'params' (a tensor or a list of them) and optionally the group's options, "
                            f"e.g. add_param_group({{'params': model.head.parameters(), 'lr': 1e-3}}).")
        params = param_group["params"]
        if not isinstance(params, (torch.Tensor, set)):  # a generator (model.parameters()) is read once:
            param_group = dict(param_group, params=list(params))  # the inner optimizer gets the list
        listed = [params] if isinstance(params, torch.Tensor) else list(param_group["params"])
        check_half_master_weights({"params": listed}, self._scale_settings, self._variable_dtypes)
        self._inners[0].add_param_group(param_group)
        warn_vanishing_eps(self._inners[0], self._inners[0].param_groups[-1:])  # its options filled in now

    def __getattr__(self, name: str) -> Any:
        """A public attribute of the one inner optimizer that the wrapper has not of its own, read
        through it as through no wrapper: schedule-free optimizers' ``train()`` / ``eval()`` (which
        the Hugging Face Trainer and Accelerate call where the optimizer has them), an
        optimizer's own settings. Private names and a wrapper of several optimizers answer
        AttributeError, as for any attribute it lacks."""
        inners = self.__dict__.get("_inners") if not name.startswith("_") else None
        if inners and len(inners) == 1:
            try:
                return getattr(inners[0], name)
            except AttributeError:
                pass
        held = "" if not inners else f", nor has its inner {' or '.join(type(o).__name__ for o in inners)}"
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}{held}"
                             + (" (several optimizers: read it from wrapper.inner_optimizers[i])"
                                if inners and len(inners) > 1 else ""))

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
        # what an unscale_() since the last step found was about the gradients just cleared: the
        # next step checks the ones a new backward makes (it stepped on inf ones before)
        self._unscaled, self._found_inf = False, None

    @contextlib.contextmanager
    def acting_on(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """Within it, `unscale_` and `step` act on `optimizer` alone (one of `inner_optimizers`),
        with the shared scale: how a trainer that steps its optimizers one by one (Lightning)
        keeps one scale for all, as one ``torch.amp.GradScaler`` does."""
        if not any(optimizer is o for o in self._inners):
            raise ValueError(f"Received a {type(optimizer).__name__} that this LossScaleOptimizer "
                             f"does not wrap; expected one of inner_optimizers.")
        self._acting_on = optimizer
        try:
            yield
        finally:
            self._acting_on = None
