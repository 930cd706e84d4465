"""What a torch model declares of its own dtypes, read from its attributes (nothing imported).

transformers models name the layers they keep in float32 when loaded in half precision
(``_keep_in_fp32_modules``: in float16; ``_keep_in_fp32_modules_strict``: in float16 and
bfloat16; mixture-of-experts routers, T5's ``wo``, rotary embeddings...), and
``from_pretrained(dtype=...)`` stores only the weights of their checkpoint in that dtype: buffers
they do not save (non-persistent: rotary frequencies) keep the float32 their code makes. A
policy whose variables are half precision does the same to such a model, so it computes as the
model's own half-precision load does (layer_kinds.py, modules.py). And the loss a transformers
model computes in its forward (``outputs.loss``, float32 under its own half-precision load) leaves
a region in float32, as a loss does (the built-in rule for losses), while its logits and hidden
states leave it in the region's output dtype.
"""

from __future__ import annotations

import itertools
import re
from typing import Any

import torch

from mixedpolicy.layer_kinds import KEEP_FLOAT32, KEEP_FLOAT32_OVER_FLOAT16

# strict first: a layer both lists name is kept under bfloat16 too
_LISTS = (("_keep_in_fp32_modules_strict", KEEP_FLOAT32), ("_keep_in_fp32_modules", KEEP_FLOAT32_OVER_FLOAT16))


def is_transformers_model(module: torch.nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` (a subclass of it, wherever defined)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
               for c in type(module).__mro__)


def _pattern(patterns: Any) -> Any:
    """transformers' match of a name list: any name found anywhere in a parameter's or buffer's
    dotted name, ``*`` standing for any characters (its ``from_pretrained`` dtype plan)."""
    try:
        return re.compile("|".join(f"(?:{p.replace('*', '.*')})" for p in sorted(patterns)))
    except (re.error, AttributeError, TypeError):  # not transformers' strings: nothing is declared
        return None


def kept_float32(model: torch.nn.Module) -> dict:
    """id(layer) -> its kind, for each layer of `model` whose own parameters or buffers a
    transformers model inside it declares it keeps in float32."""
    kinds: dict = {}
    for owner in model.modules():
        if not is_transformers_model(owner):
            continue
        for attribute, kind in _LISTS:
            names = getattr(owner, attribute, None)
            found = _pattern(names) if isinstance(names, (list, tuple, set, frozenset)) and names else None
            if found is None:
                continue
            for path, module in owner.named_modules():
                own = itertools.chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False))
                if any(found.search(f"{path}.{name}" if path else name) for name, _ in own):
                    kinds.setdefault(id(module), kind)
    return kinds


def unsaved_buffers(model: torch.nn.Module) -> set:
    """id(buffer) of the buffers that transformers models inside `model` do not save (which
    their half-precision load leaves in the dtype their code made them in)."""
    return {id(buffer) for owner in model.modules() if is_transformers_model(owner)
            for module in owner.modules() for name, buffer in module.named_buffers(recurse=False)
            if buffer is not None and name in module._non_persistent_buffers_set}


_LOSS_OUTPUTS: dict = {}  # type -> whether it is a transformers ModelOutput (read once per type)


def _is_model_output(out: Any) -> bool:
    kind = type(out)
    found = _LOSS_OUTPUTS.get(kind)
    if found is None:
        found = _LOSS_OUTPUTS[kind] = any(c.__name__ == "ModelOutput" and c.__module__.startswith("transformers.")
                                          for c in kind.__mro__)
    return found


def cast_output(out: Any, dtype: torch.dtype, cast: Any) -> Any:
    """``cast(out, dtype)``, but a transformers output's ``loss`` as the model computed it."""
    if not _is_model_output(out) or out.get("loss") is None:
        return cast(out, dtype)
    loss = out["loss"]
    cast_out = cast(out, dtype)
    cast_out["loss"] = loss
    return cast_out
