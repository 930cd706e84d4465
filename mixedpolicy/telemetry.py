"""Loss-scale telemetry for the tools people log to: `metrics`, and framework callbacks.

`metrics(optimizer_or_state)` reads a `LossScaleOptimizer` (torch, Keras) or an optax
wrapper's state (``LossScaleState``, or an ``nnx.Optimizer`` holding one) into a plain dict
of Python numbers: ``loss_scale``, ``skipped_steps``, ``last_step_skipped``. Reading them
syncs with the device: call it at logging intervals, not every step of a fast loop.

`LightningLossScaleCallback` is a Lightning-style callback for loops that only call its hooks
(duck-typed: Lightning need not be installed to import it): at the end of every
`every_n_steps`-th training batch it logs the metrics of each of the module's optimizers through
``pl_module.log_dict``. In a Lightning ``Trainer``, use `mixedpolicy.lightning.LossScaleCallback`,
a subclass of Lightning's ``Callback``. The Keras callback is `mixedpolicy.keras.LossScaleCallback`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger("mixedpolicy")


def _host(value: Any) -> Any:
    item = getattr(value, "item", None)
    return item() if callable(item) else value


def metrics(source: Any, prefix: str = "") -> dict:
    """``{"loss_scale", "skipped_steps", "last_step_skipped"}`` as Python numbers.

    Args:
      source: a mixedpolicy LossScaleOptimizer (torch, Keras), an optax ``LossScaleState``
        (or a state holding one: an ``optax.chain``'s, ``MultiSteps``'), or an
        ``nnx.Optimizer`` / anything whose ``opt_state`` is one.
      prefix: put before each key (``"train/"``).

    Raises:
      TypeError: `source` carries no loss-scale state.
    """
    state = _scale_state(getattr(source, "opt_state", source))
    if state is None:
        raise TypeError(f"Received {type(source).__name__}; expected a mixedpolicy LossScaleOptimizer "
                        f"(torch, Keras), an optax LossScaleState (or a state holding one: a chain's, "
                        f"MultiSteps'), or an optimizer whose opt_state is one.")
    scale = state.loss_scale
    scale = getattr(scale, "get_value", lambda: scale)() if not isinstance(scale, (int, float)) else scale
    out = {"loss_scale": float(_host(scale)), "skipped_steps": int(_host(state.num_skipped_steps)),
           "last_step_skipped": bool(_host(state.last_step_skipped))}
    return {prefix + k: v for k, v in out.items()}


_FIELDS = ("loss_scale", "num_skipped_steps", "last_step_skipped")


def _scale_state(obj: Any, depth: int = 0) -> Any:
    """`obj` where it carries the loss-scale fields, else the first state inside it that does
    (an optax chain's tuple, ``MultiSteps``' state, a dict of states); None where none does."""
    if all(hasattr(obj, name) for name in _FIELDS):
        return obj
    children = obj.values() if isinstance(obj, Mapping) else obj if isinstance(obj, (tuple, list)) else ()
    for child in children if depth < 8 else ():
        found = _scale_state(child, depth + 1)
        if found is not None:
            return found
    return None


class LightningLossScaleCallback:
    """Logs `metrics` of the module's optimizers every `every_n_steps` training batches.

    Pass it to ``Trainer(callbacks=[...])``: where Lightning is imported, the object made is
    `mixedpolicy.lightning.LossScaleCallback` (a subclass of this class and of Lightning's
    ``Callback``); elsewhere it uses only ``trainer.optimizers`` and ``pl_module.log_dict``,
    so it fits Lightning-like loops that call
    ``on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)``.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is LightningLossScaleCallback:  # in a process that runs Lightning: its real Callback
            from mixedpolicy._registry import lightning_callback_class

            cls = lightning_callback_class() or cls
        return super().__new__(cls)

    def __init__(self, every_n_steps: int = 50, prefix: str = "loss_scale/"):
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"Received every_n_steps={every_n_steps!r}; expected a whole number >= 1.")
        self.every_n_steps, self.prefix = every_n_steps, prefix

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx % self.every_n_steps:
            return
        values: dict = {}
        optimizers = list(getattr(trainer, "optimizers", []) or [])
        for i, opt in enumerate(optimizers):
            try:
                found = metrics(opt, self.prefix if len(optimizers) == 1 else f"{self.prefix}{i}/")
            except TypeError:
                continue  # not one of ours: nothing to log
            values.update({k: float(v) for k, v in found.items()})
        if values:
            pl_module.log_dict(values)
