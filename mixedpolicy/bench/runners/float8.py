"""Each framework's own fp8 set-up, as its users write it: the native side of the bench's fp8 rows."""

from __future__ import annotations

from typing import Any


def torchao_float8(net: Any, recipe: str, auto_filter: bool = False) -> Any:
    """torchao's own fp8 set-up, as its users write it: every nn.Linear but the output head and
    those whose dimensions are not multiples of 16 (torchao's and torchtitan's filter); with
    ``auto_filter``, also only those torchao's size-aware ``_auto_filter_for_recipe`` passes."""
    import torch
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    linears = [name for name, m in net.named_modules() if isinstance(m, torch.nn.Linear)]
    head = linears[-1] if linears else None

    sized = None
    if auto_filter:
        from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

        sized = _auto_filter_for_recipe(recipe, filter_fqns=[])

    def keep(module: Any, fqn: str) -> bool:
        shaped = fqn != head and not (module.in_features % 16 or module.out_features % 16)
        return shaped and (sized is None or sized(module, fqn))

    return convert_to_float8_training(net, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=keep)


def keras_float8(model: Any) -> None:
    """Keras's own fp8 set-up, as its users write it: ``model.quantize("float8")`` on every Dense
    but the output head and those whose dimensions are not multiples of 16."""
    import keras

    dense = [layer for layer in model._flatten_layers() if type(layer) in (keras.layers.Dense, keras.layers.EinsumDense)]
    chosen = {id(layer) for layer in dense[:-1]
              if all(isinstance(d, int) and d % 16 == 0 for d in layer._kernel.shape)}
    model.quantize("float8", filters=lambda layer: id(layer) in chosen)
