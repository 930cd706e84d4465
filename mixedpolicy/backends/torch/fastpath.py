"""torch's fused inference kernels for attention, turned off where a policy's region runs.

The "fastpath" of ``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer`` and
``nn.TransformerEncoder``'s nested tensors, taken in eval mode without gradients, hands every
weight of a layer to one kernel in the input's dtype. It fails where a region computes in half
precision around float32 weights (the norms the built-in rule keeps in float32, a mixed policy's
variables), and torch's own test for an autocast sees CUDA's alone (pytorch/pytorch#132613:
"expected scalar type Float but found BFloat16" under a CPU autocast). A region around such
layers runs with the fastpath off (regions.py), as it runs in training: module by module.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterator

import torch

FASTPATH_MODULES = (torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer, torch.nn.TransformerEncoder)

_lock = threading.Lock()
_off = {"regions": 0, "found": True}  # regions running with it off (any thread), the setting found
_models: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


def has_fastpath(module: torch.nn.Module) -> bool:
    """Does `module` hold a layer torch may run through the fastpath?"""
    return any(isinstance(m, FASTPATH_MODULES) for m in module.modules())


def holds_fastpath(model: torch.nn.Module) -> bool:
    """`has_fastpath` of a model whose steps run in its region, found once (a walk of GPT-2's
    164 modules costs 145 us, on every step of a trainer)."""
    found = _models.get(model)
    if found is None:
        found = _models[model] = has_fastpath(model)
    return found


def set_fastpath_off(off: bool) -> None:
    """Counts a region in (`off`) or out; the first in turns torch's fastpath off, the last out
    puts back the setting it found (regions in several threads share the one global switch)."""
    from torch.backends import mha

    with _lock:
        if off:
            if _off["regions"] == 0:
                _off["found"] = mha.get_fastpath_enabled()
                mha.set_fastpath_enabled(False)
            _off["regions"] += 1
        else:
            _off["regions"] -= 1
            if _off["regions"] == 0:
                mha.set_fastpath_enabled(_off["found"])


@contextlib.contextmanager
def fastpath_off_around(context: Any) -> Iterator[None]:
    """`context` with the fastpath off while it lasts."""
    set_fastpath_off(True)
    try:
        with context:
            yield
    finally:
        set_fastpath_off(False)
