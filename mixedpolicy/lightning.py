"""Lightning: ``mixedpolicy.lightning.Precision``, a precision plugin, and ``LossScaleCallback``.

``Trainer(plugins=[mixedpolicy.lightning.Precision("16-mixed", {"head": "float32"})],
callbacks=[mixedpolicy.lightning.LossScaleCallback()])``. Both are subclasses of the Lightning
package in use: ``pytorch_lightning`` or ``lightning.pytorch``, whichever is imported already
(of both, where a process imports both, so that a Trainer of either takes them), else the
first of the two that is installed. Importing this module imports torch; reading
``Precision`` or ``LossScaleCallback`` imports Lightning.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

from mixedpolicy._registry import LIGHTNING_CALLBACKS

if TYPE_CHECKING:  # what the API reference and type checkers read; at run time, __getattr__ below
    from mixedpolicy.backends.torch.lightning_callback import PolicyLossScaleCallback as LossScaleCallback
    from mixedpolicy.backends.torch.lightning import PolicyPrecision as Precision

_PACKAGES = tuple(gate for gate, _ in LIGHTNING_CALLBACKS)


def imported_package() -> Any:
    """The Lightning package already imported in this process, or None."""
    for name in _PACKAGES:
        if name in sys.modules:
            return sys.modules[name]
    return None


def lightning_package() -> Any:
    """The Lightning package the plugin and the callback subclass (see the module docstring).

    Raises:
      ImportError: neither ``pytorch_lightning`` nor ``lightning`` is installed.
    """
    imported = imported_package()
    if imported is not None:
        return imported
    for name in _PACKAGES:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    raise ImportError("mixedpolicy.lightning needs Lightning, which is not installed; install it "
                      "with pip install pytorch-lightning (or lightning).")


def _packages() -> list:
    """Every Lightning package imported (the plugin and the callback subclass each one's base, so
    that either Trainer takes them), else the one `lightning_package` imports."""
    return [sys.modules[name] for name in _PACKAGES if name in sys.modules] or [lightning_package()]


def __getattr__(name: str) -> Any:
    if name == "Precision":
        from mixedpolicy.backends.torch.lightning import precision_class

        return precision_class(*_packages())
    if name == "LossScaleCallback":
        from mixedpolicy.backends.torch.lightning_callback import callback_class

        return callback_class(*_packages())
    raise AttributeError(f"module 'mixedpolicy.lightning' has no attribute {name!r}")


__all__ = ["LossScaleCallback", "Precision", "imported_package", "lightning_package"]
