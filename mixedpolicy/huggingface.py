"""Hugging Face: ``mixedpolicy.huggingface.Trainer`` (``transformers.Trainer`` under a policy)
and ``mixedpolicy.huggingface.Accelerator`` (``accelerate.Accelerator`` under a policy).

``Trainer(model, TrainingArguments(...), train_dataset=..., policy="mixed_float16",
overrides={"lm_head": "float32"})`` trains as ``transformers.Trainer`` does, the policy setting
the dtypes per layer and loss scaling following it; ``Accelerator(policy="mixed_float16")``
does the same for a loop written with Accelerate. Reading ``Trainer`` imports transformers,
reading ``Accelerator`` imports accelerate.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the API reference and type checkers read; at run time, __getattr__ below
    from mixedpolicy.backends.torch.huggingface import PolicyAccelerator as Accelerator
    from mixedpolicy.backends.torch.huggingface import PolicyTrainer as Trainer

_PACKAGES = {"Trainer": ("transformers", "transformers accelerate"), "Accelerator": ("accelerate", "accelerate")}


def __getattr__(name: str) -> Any:
    if name in _PACKAGES:
        package, install = _PACKAGES[name]
        try:
            module = importlib.import_module(package)
        except ModuleNotFoundError as err:
            raise ImportError(f"mixedpolicy.huggingface.{name} needs {package}, which is not installed; "
                              f"install it with pip install {install}.") from err
        from mixedpolicy.backends.torch import huggingface

        return huggingface.trainer_class(module) if name == "Trainer" else huggingface.accelerator_class(module)
    raise AttributeError(f"module 'mixedpolicy.huggingface' has no attribute {name!r}")


__all__ = ["Accelerator", "Trainer"]
