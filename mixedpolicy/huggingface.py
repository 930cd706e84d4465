"""Hugging Face: ``mixedpolicy.huggingface.Trainer`` (``transformers.Trainer`` under a policy),
``Seq2SeqTrainer``, ``trainer_class(base)`` for any other Trainer subclass (TRL's ``SFTTrainer``,
one's own), and ``mixedpolicy.huggingface.Accelerator`` (``accelerate.Accelerator`` under a policy).

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
    from mixedpolicy.backends.torch.huggingface import PolicyTrainer as Seq2SeqTrainer
    from mixedpolicy.backends.torch.huggingface import PolicyTrainer as Trainer

_TRANSFORMERS = ("transformers", "transformers accelerate")
_PACKAGES = {"Trainer": _TRANSFORMERS, "Seq2SeqTrainer": _TRANSFORMERS, "Accelerator": ("accelerate", "accelerate")}


def _package(name: str) -> Any:
    package, install = _PACKAGES[name]
    try:
        return importlib.import_module(package)
    except ModuleNotFoundError as err:
        raise ImportError(f"mixedpolicy.huggingface.{name} needs {package}, which is not installed; "
                          f"install it with pip install {install}.") from err


def trainer_class(base: Any) -> type:
    """``base``, a subclass of ``transformers.Trainer`` (``Seq2SeqTrainer``, TRL's ``SFTTrainer``,
    a Trainer of one's own), under a policy: it takes ``policy``, ``overrides`` and
    ``scale_settings`` as `mixedpolicy.huggingface.Trainer` does and trains as ``base`` does.

    ``SFTTrainer = mixedpolicy.huggingface.trainer_class(trl.SFTTrainer)``

    Raises:
      TypeError: `base` is no subclass of ``transformers.Trainer``.
    """
    from mixedpolicy.backends.torch import huggingface

    return huggingface.trainer_class(_package("Trainer"), base)


def __getattr__(name: str) -> Any:
    if name in _PACKAGES:
        module = _package(name)
        from mixedpolicy.backends.torch import huggingface

        if name == "Accelerator":
            return huggingface.accelerator_class(module)
        return huggingface.trainer_class(module, getattr(module, name))
    raise AttributeError(f"module 'mixedpolicy.huggingface' has no attribute {name!r}")


__all__ = ["Accelerator", "Seq2SeqTrainer", "Trainer", "trainer_class"]
