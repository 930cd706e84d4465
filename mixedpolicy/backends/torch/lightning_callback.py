"""Lightning's callback that logs the loss scale, a subclass of each Lightning package's own
``Callback`` (built by `callback_class`, as the precision plugin is in lightning.py)."""

from __future__ import annotations

from typing import Any

from mixedpolicy.backends.torch.optimizer import TorchLossScaleOptimizer
from mixedpolicy.telemetry import LightningLossScaleCallback, metrics

_built: dict = {}


class PolicyLossScaleCallback(LightningLossScaleCallback):
    """Logs the loss scale, the skipped steps and whether the last step was skipped through
    ``pl_module.log_dict`` every `every_n_steps` training batches: of the mixedpolicy
    `Precision` plugin, else of each mixedpolicy `LossScaleOptimizer` among the Trainer's
    optimizers (reading them syncs with the device once per log). A Lightning ``Callback``:
    ``Trainer(callbacks=[mixedpolicy.lightning.LossScaleCallback(every_n_steps=50)])``.

    Args:
      every_n_steps: log every this many training batches.
      prefix: put before each metric's name.
    """

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        plugin = getattr(getattr(trainer, "strategy", None), "precision_plugin", None)
        if not isinstance(getattr(plugin, "optimizer", None), TorchLossScaleOptimizer):
            # no mixedpolicy plugin: each LossScaleOptimizer among the Trainer's optimizers
            return LightningLossScaleCallback.on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx)
        if batch_idx % self.every_n_steps == 0:
            pl_module.log_dict({k: float(v) for k, v in metrics(plugin.optimizer, self.prefix).items()})


def callback_class(*pls: Any) -> type:
    """The ``Callback`` subclass for the Lightning packages `pls` (built once): `PolicyLossScaleCallback`
    over each package's own ``Callback``."""
    key = ("callback", *(pl.__name__ for pl in pls))
    if key not in _built:
        _built[key] = type("LossScaleCallback", (PolicyLossScaleCallback, *(pl.Callback for pl in pls)),
                           {"__module__": "mixedpolicy.lightning", "__qualname__": "LossScaleCallback",
                            "__doc__": PolicyLossScaleCallback.__doc__})
    return _built[key]
