"""Hugging Face: ``mixedpolicy.huggingface.Trainer``, ``transformers.Trainer`` under a policy.

``Trainer(model, TrainingArguments(...), train_dataset=..., policy="mixed_float16",
overrides={"lm_head": "float32"})`` trains as ``transformers.Trainer`` does, the policy setting
the dtypes per layer and loss scaling following it. Reading ``Trainer`` imports transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the API reference and type checkers read; at run time, __getattr__ below
    from mixedpolicy.backends.torch.huggingface import PolicyTrainer as Trainer


def __getattr__(name: str) -> Any:
    if name == "Trainer":
        try:
            transformers = importlib.import_module("transformers")
        except ModuleNotFoundError as err:
            raise ImportError("mixedpolicy.huggingface needs transformers, which is not installed; "
                              "install it with pip install transformers accelerate.") from err
        from mixedpolicy.backends.torch.huggingface import trainer_class

        return trainer_class(transformers)
    raise AttributeError(f"module 'mixedpolicy.huggingface' has no attribute {name!r}")


__all__ = ["Trainer"]
