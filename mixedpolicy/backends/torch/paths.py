"""The paths a user reads and writes for a torch model's layers: wrappers left out.

``torch.compile`` (an ``OptimizedModule`` holding ``_orig_mod``), activation
checkpointing (``checkpoint_wrapper``: ``_checkpoint_wrapped_module``), FSDP1
(``_fsdp_wrapped_module``) and Lightning Fabric (``_FabricModule``: ``_forward_module``) put a module of their own between a layer and its parent
(``torch.nn.DataParallel``, like DDP, around the root: ``module``),
so ``named_modules()`` reads ``_orig_mod.head`` or ``layers.0._checkpoint_wrapped_module.attn``
where the user wrote ``head`` and ``layers.0.attn``. PyTorch's own state-dict helpers
drop these segments (``clean_tensor_name``); so do `describe`, the `PolicyMap` keys,
the range report and the reduce dtypes: the path a user writes for the bare model names
the same layer once it is compiled or wrapped, and every path printed pastes back.
"""

from __future__ import annotations

from typing import Iterator

import torch

#: the attribute under which each wrapper holds the module it wraps
WRAPPED = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_forward_module")


def _wrapped(module: torch.nn.Module) -> torch.nn.Module | None:
    if isinstance(module, torch.nn.DataParallel):  # its ``module``: too common a name to drop from paths
        return module.module
    for name in WRAPPED:
        inner = module._modules.get(name)
        if inner is not None:
            return inner
    return None


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module a root wrapper (``torch.compile``, a checkpoint, FSDP1 or Fabric wrapper) runs, or `model`."""
    inner = _wrapped(model)
    while inner is not None:
        model, inner = inner, _wrapped(inner)
    return model


def clean(path: str) -> str:
    """`path` without the wrappers' segments: ``"_orig_mod.layers.0._checkpoint_wrapped_module"``
    -> ``"layers.0"``."""
    return ".".join(part for part in path.split(".") if part and part not in WRAPPED)


def named_layers(model: torch.nn.Module) -> Iterator[tuple[str, str, torch.nn.Module]]:
    """(user's path, ``named_modules()`` path, module) for every module of `model`, parents
    first, except the wrappers themselves: each wrapped module stands at its wrapper's path."""
    for path, module in model.named_modules():
        if _wrapped(module) is None:
            yield clean(path), path, module


def stored_at(module: torch.nn.Module, name: str) -> list[tuple[torch.nn.Module, str]]:
    """Where the tensor `module` held as `name` when a policy was applied is kept now: itself, or,
    where torch reparametrized it since, the tensors it is computed from (``torch.nn.utils.prune``'s
    ``<name>_orig``; ``torch.nn.utils.parametrize``'s ``original``, or ``original0``, ``original1``...
    of weight_norm, with its parametrizations' floating buffers); each as (owner, attribute)."""
    if name in module._parameters or name in module._buffers:
        return [(module, name)]
    if f"{name}_orig" in module._parameters:
        return [(module, f"{name}_orig")]
    parametrizations = module._modules.get("parametrizations")
    chain = parametrizations._modules.get(name) if parametrizations is not None else None
    if chain is not None:  # and the floating state its parametrizations keep (spectral_norm's vectors)
        return [(chain, attr) for attr in chain._parameters if attr.startswith("original")] + [
            (step, attr) for step in chain.children() for attr, buffer in step._buffers.items()
            if buffer is not None and buffer.is_floating_point()]
    return [(module, name)]
