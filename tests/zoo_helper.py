"""timm for the tests, from where ``make setup`` puts it: ``.venv/zoo``, beside the venv's
packages rather than among them.

Why apart: timm imports torchvision at import time, and the registry's torchvision for Linux is a
CUDA build. Beside the CPU-only torch its C++ operators do not load; torchvision is written to live
with that (an operator raises when it is called), except that 0.28 registers fake kernels for two
of them, ``nms`` and ``qnms``, whether they loaded or not, and ``import torchvision`` fails on the
first. transformers imports torchvision whenever it finds it, so in the venv proper it would stop
every Hugging Face test. Here, only where torchvision's own import fails that way, the two
operators' schemas are declared first; timm's classification models call neither.

On a machine where timm imports as it is (a CUDA torch, or a CPU torchvision), nothing is changed.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

ZOO = Path(sys.prefix) / "zoo"
_declared: list = []  # the torch.library fragment, kept alive (its definitions go with it)


def _import_torchvision() -> None:
    try:
        importlib.import_module("torchvision")
    except RuntimeError as err:
        if "torchvision::nms" not in str(err):
            raise
        import torch

        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        fragment = torch.library.Library("torchvision", "FRAGMENT")
        for op in ("nms", "qnms"):
            fragment.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _declared.append(fragment)
        importlib.import_module("torchvision")


def import_timm():
    """The timm module; ImportError (saying where make puts it) where it is installed nowhere."""
    if importlib.util.find_spec("timm") is None and ZOO.is_dir() and str(ZOO) not in sys.path:
        sys.path.append(str(ZOO))
    if importlib.util.find_spec("timm") is None:
        raise ImportError(f"timm is not installed here nor in {ZOO} (`make setup` installs it there)")
    _import_torchvision()
    return importlib.import_module("timm")
