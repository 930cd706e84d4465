"""GradScaler's loop over several optimizers, on a torch `LossScaleOptimizer` of several.

``torch.amp.GradScaler``'s documented loop for several models and optimizers unscales and steps
each optimizer by name, then updates the scale once::

    scaler.scale(loss0).backward(retain_graph=True)
    scaler.scale(loss1).backward()
    scaler.unscale_(optimizer0)                 # optional, before clipping optimizer0's gradients
    scaler.step(optimizer0)
    scaler.step(optimizer1)
    scaler.update()

With the wrapper of both in the scaler's place (``opt = mp.LossScaleOptimizer([optimizer0,
optimizer1])``) this loop runs as written and as GradScaler runs it: each optimizer's gradients
are checked on their own, an optimizer whose gradients are not all finite skips its step while
the others take theirs, and ``update()`` moves the scale once for the iteration (backing off if
any of them found inf or NaN) and counts the iteration as skipped where one skipped. ``step()``
without an argument still steps them all together, skipping all on one overflow.

A mixin of `TorchLossScaleOptimizer`: it keeps the optimizers unscaled and waiting for their step
(each with its found-inf flag), the flags of those stepped since the last ``update()``, and
whether a step defers its scale update.
"""

from __future__ import annotations

from typing import Any

import torch


class OneByOne:
    """Unscale and step one of several optimizers by name; the scale moves at ``update()``."""

    def _one_of_several(self, optimizer: Any) -> bool:
        """Is `optimizer` one of this wrapper's several inner optimizers (GradScaler's way of
        naming which to unscale or step)?"""
        return len(self._inners) > 1 and any(optimizer is o for o in self._inners)

    def _state_of_loop(self) -> dict:
        state = self.__dict__.get("_one_by_one")
        if state is None:
            state = self.__dict__["_one_by_one"] = {"waiting": [], "stepped": [], "found": None}
        return state

    def _unscale_one(self, inner: torch.optim.Optimizer) -> None:
        loop = self._state_of_loop()
        if any(o is inner for o, _ in loop["waiting"]) or any(o is inner for o in loop["stepped"]):
            raise RuntimeError(f"unscale_({type(inner).__name__}) was already called for this optimizer since "
                               f"the last update(), as GradScaler refuses it: each optimizer's gradients "
                               f"are unscaled once an iteration. Call step(optimizer) and then update().")
        with self.acting_on(inner):
            self.unscale_()
            found = self._found_inf  # (None under a pass-through, which checks at the step)
            loop["waiting"].append((inner, None if found is None else found.clone()))
            self._unscaled, self._found_inf = False, None
            self._checks.clean.clear()  # the device's flag holds this answer: zeroed at the next check

    def _step_one(self, inner: torch.optim.Optimizer) -> Any:
        loop = self._state_of_loop()
        if any(o is inner for o in loop["stepped"]):
            raise RuntimeError(f"step({type(inner).__name__}) was already called for this optimizer since the "
                               f"last update(), as GradScaler refuses it. Call update() once the "
                               f"iteration's optimizers have stepped.")
        waiting = next((i for i, (o, _) in enumerate(loop["waiting"]) if o is inner), None)
        with self.acting_on(inner):
            if waiting is not None:  # unscaled already, with its own flag
                found = loop["waiting"].pop(waiting)[1]
                self._unscaled, self._found_inf = True, found
            self._defer_scale = True
            try:
                result = self.step()
            finally:
                self._defer_scale = False
                if waiting is not None:
                    self._checks.clean.clear()
        loop["stepped"].append(inner)
        return result

    def _deferred(self, found_inf: torch.Tensor, skipped: bool | None) -> None:
        """A step of one of several: its found-inf flag kept for ``update()``."""
        loop = self._state_of_loop()
        flag = torch.full((), float(skipped), device=found_inf.device) if skipped is not None \
            else found_inf.clamp(max=1)
        loop["found"] = flag if loop["found"] is None else torch.maximum(loop["found"], flag.to(loop["found"].device))

    def _update_deferred(self) -> None:
        """``update()`` after GradScaler's loop: the scale moves once, for the whole iteration."""
        loop = self.__dict__.get("_one_by_one")
        if not loop or not loop["stepped"]:
            if loop:
                loop["waiting"].clear()
            return
        found, loop["found"] = loop["found"], None
        loop["waiting"].clear()
        loop["stepped"].clear()
        self._loss_scaled = False
        if found is not None:
            self._update_scale(found)
