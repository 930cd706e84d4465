"""fp8 matmuls on torch: torchao's ``Float8Linear``, chosen layer by layer by the plan.

(The ``"delayed"`` recipe, which torchao no longer has, runs as `DelayedFloat8Linear`:
Keras's delayed algorithm around ``torch._scaled_mm``, see float8_delayed.py.)

`apply_policy` hands the ``nn.Linear`` layers whose policy has a `Float8Recipe` to
torchao's own ``convert_to_float8_training``, one call per recipe, with a
``module_filter_fn`` built from the plan (the layers the built-in rules keep in the source
precision never reach it). torchao's ``Float8Linear`` keeps the same weight and bias
parameters, so an optimizer built before or after sees the same tensors; `remove_policy`
puts the original modules back. No kernel of our own: torchao's casts and
``torch._scaled_mm`` (emulated in float32 on a CPU without fp8 units).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mixedpolicy.float8 import Float8Recipe

#: torchao's recipes (``Float8LinearConfig.from_recipe_name``) by our recipe name
_TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def eligible(module: torch.nn.Module) -> bool:
    """A layer torchao's Float8Linear replaces: a plain ``nn.Linear`` (a subclass may read its
    weight elsewhere, as MultiheadAttention's out_proj does)."""
    return type(module) is torch.nn.Linear


def check(recipe: Float8Recipe, path: str) -> None:
    """Refuses, before anything changes, a recipe torch has no path for here."""
    if recipe.recipe in _TORCHAO_RECIPES or recipe.recipe == "delayed":
        return
    fix = ("torchao 0.18 trains MX formats only inside its MoE grouped matmuls "
           "(MXFP8TrainingOpConfig), not on nn.Linear: use 'tensorwise' or 'rowwise' on torch")
    raise ValueError(f"Received the fp8 recipe {recipe.recipe!r} for torch layer {path or '(root)'!r}: "
                     f"{fix}. Nothing was applied.")


def _config(recipe: Float8Recipe) -> Any:
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe.recipe)
    dtype = getattr(torch, recipe.backward_dtype)
    if config.cast_config_grad_output.target_dtype != dtype:  # tensorwise with e4m3 gradients
        config = dataclasses.replace(config, cast_config_grad_output=dataclasses.replace(
            config.cast_config_grad_output, target_dtype=dtype))
    return config


def _import_torchao() -> None:
    try:
        import torchao.float8  # noqa: F401
    except ImportError as err:
        raise ImportError("fp8 matmuls on torch run through torchao's Float8Linear, and torchao is "
                          "not installed: pip install \"mixedpolicy[torch]\" (it pins torchao), or "
                          "pip install torchao. Nothing was applied.") from err


def convert(model: torch.nn.Module, layers: list[tuple[str, Float8Recipe]]) -> dict[str, torch.nn.Module]:
    """Swaps each (path, recipe) layer for torchao's Float8Linear; returns {path: original module}."""
    if not layers:
        return {}
    for path, recipe in layers:
        check(recipe, path)
        if not path:
            raise ValueError("Received an fp8 policy for a model that is itself one nn.Linear: fp8 "
                             "replaces the layer, which apply_policy cannot do to the object you hold. "
                             "Put it in a container (torch.nn.Sequential(linear)). Nothing was applied.")
    originals = {path: model.get_submodule(path) for path, _ in layers}
    by_recipe: dict[Float8Recipe, set[str]] = {}
    for path, recipe in layers:
        by_recipe.setdefault(recipe, set()).add(path)
    if any(r.recipe != "delayed" for r in by_recipe):
        _import_torchao()  # before anything changes
    for recipe, paths in by_recipe.items():
        if recipe.recipe == "delayed":  # torchao has none: Keras's algorithm around _scaled_mm
            from mixedpolicy.backends.torch.float8_delayed import DelayedFloat8Linear

            for path in paths:
                parent, _, name = path.rpartition(".")
                setattr(model.get_submodule(parent), name, DelayedFloat8Linear.from_linear(originals[path], recipe))
            continue
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, config=_config(recipe),
                                   module_filter_fn=lambda _module, fqn, paths=paths: fqn in paths)
        if recipe.recipe == "rowwise_with_gw_hp":
            for path in paths:
                model.get_submodule(path).register_forward_pre_hook(_autocast_input_off_cuda)
    return originals


def _autocast_input_off_cuda(module: torch.nn.Module, args: tuple) -> tuple | None:
    """What torchao's Float8Linear does under CUDA's autocast (casts its input to the autocast
    dtype), under another device's: without it, ``rowwise_with_gw_hp``'s high-precision weight
    gradient multiplies a bfloat16 output gradient by a float32 input and fails on a CPU."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or x.device.type == "cuda" or not torch.is_autocast_enabled(x.device.type):
        return None
    return (x.to(torch.get_autocast_dtype(x.device.type)), *args[1:])


def restore(model: torch.nn.Module, path: str, original: torch.nn.Module) -> None:
    """Puts `original` back at `path` (its parameters are the ones the Float8Linear held)."""
    parent_path, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent_path), name, original)
