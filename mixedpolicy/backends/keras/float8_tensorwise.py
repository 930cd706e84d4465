"""Current-scaling ("tensorwise") fp8 on Keras, written in ``keras.ops`` (every backend).

Keras's own float8 layers scale from an amax history ("delayed"). For ``"tensorwise"``, the
recipe torch (torchao) and Flax NNX run, the adapter gives a ``Dense`` or ``EinsumDense`` layer
a class of its own whose call quantizes the input and the kernel with this step's scale
(``fp8_max / amax`` of the tensor, saturated, in the forward format), runs the layer's own
matmul on the dequantized float32 operands, and quantizes the output gradient the same way in
the gradient format; the backward matmuls take the quantized operands and the quantization
passes gradients straight through, as torchao's and the NNX hook's do. This is how Keras's own
float8 layers are written too (quantize-dequantize around the matmul, which XLA fuses into an
fp8 matmul on GPUs that have one).

No state: the layer's variables are its own, and a saved model keeps the recipe in the layer's
config (``mixedpolicy>Float8TensorwiseDense``; loading needs mixedpolicy imported, which
registers these classes). `remove_policy` gives the layer its Keras class back.
"""

from __future__ import annotations

from typing import Any

import keras
import ml_dtypes
from keras import ops

from mixedpolicy.float8 import Float8Recipe

_EPS = 1e-12  # torchao's floor on amax (and the NNX hook's)


def _fake_quantize(x: Any, fmt: str) -> Any:
    """float32 `x` through `fmt` at this tensor's own scale, back in float32."""
    top = float(ml_dtypes.finfo(fmt).max)
    scale = top / ops.maximum(ops.max(ops.abs(x)), _EPS)
    quantized = ops.cast(ops.clip(x * scale, -top, top), fmt)
    return ops.cast(quantized, "float32") / scale


def _upstream(args: tuple, upstream: Any) -> Any:
    return args[0] if upstream is None else upstream  # (keras.ops.custom_gradient's two call forms)


def quantize_operand(x: Any, fmt: str) -> Any:
    """`x` (cast to float32) quantized to `fmt`; its gradient passes straight through."""
    @ops.custom_gradient
    def operand(value: Any) -> Any:
        def grad(*args: Any, upstream: Any = None) -> Any:
            return _upstream(args, upstream)
        return _fake_quantize(value, fmt), grad

    return operand(ops.cast(x, "float32"))


def quantize_gradient(y: Any, fmt: str) -> Any:
    """`y` as it is; the gradient that reaches it is quantized to `fmt` at its own scale."""
    @ops.custom_gradient
    def output(value: Any) -> Any:
        def grad(*args: Any, upstream: Any = None) -> Any:
            return _fake_quantize(ops.cast(_upstream(args, upstream), "float32"), fmt)
        return value, grad  # no op in the forward

    return output(y)


class _Tensorwise:
    """What both classes share: the recipe in the config, the operands and the output."""

    _mixedpolicy_float8: Float8Recipe

    def get_config(self) -> dict:
        return {**super().get_config(), "float8_recipe": self._mixedpolicy_float8.get_config()}  # type: ignore[misc]

    @classmethod
    def from_config(cls, config: dict) -> Any:
        config = dict(config)
        recipe = Float8Recipe.from_config(config.pop("float8_recipe", {"recipe": "tensorwise"}))
        if recipe.recipe != "tensorwise":
            raise ValueError(f"Received {recipe!r} in the config of a {cls.__name__}, which runs "
                             f"Float8Recipe('tensorwise') only (Keras's own float8 layers run 'delayed'). "
                             f"Save the model again from mixedpolicy, or give this layer a tensorwise recipe.")
        layer = super().from_config(config)  # type: ignore[misc]
        object.__setattr__(layer, "_mixedpolicy_float8", recipe)
        return layer

    def _operands(self, inputs: Any) -> tuple:
        fmt = self._mixedpolicy_float8.forward_dtype
        return quantize_operand(inputs, fmt), quantize_operand(self.kernel, fmt)  # type: ignore[attr-defined]

    def _finish(self, x: Any) -> Any:
        x = ops.cast(quantize_gradient(x, self._mixedpolicy_float8.backward_dtype), self.compute_dtype)  # type: ignore[attr-defined]
        if self.bias is not None:  # type: ignore[attr-defined]
            x = ops.add(x, self.bias)  # type: ignore[attr-defined]
        return x if self.activation is None else self.activation(x)  # type: ignore[attr-defined]


@keras.saving.register_keras_serializable(package="mixedpolicy")
class Float8TensorwiseDense(_Tensorwise, keras.layers.Dense):
    """A Keras ``Dense`` whose matmul runs in fp8 with current scaling (see the module docstring)."""

    def call(self, inputs: Any, training: Any = None) -> Any:
        return self._finish(ops.matmul(*self._operands(inputs)))


@keras.saving.register_keras_serializable(package="mixedpolicy")
class Float8TensorwiseEinsumDense(_Tensorwise, keras.layers.EinsumDense):
    """A Keras ``EinsumDense`` whose einsum runs in fp8 with current scaling."""

    def call(self, inputs: Any, training: Any = None) -> Any:
        return self._finish(ops.einsum(self.equation, *self._operands(inputs)))


CLASSES = {keras.layers.Dense: Float8TensorwiseDense, keras.layers.EinsumDense: Float8TensorwiseEinsumDense}


def make_tensorwise(layer: Any, recipe: Float8Recipe) -> None:
    """Gives `layer` (exactly a Dense or EinsumDense) its tensorwise class and `recipe`."""
    object.__setattr__(layer, "_mixedpolicy_float8", recipe)
    layer.__class__ = CLASSES[type(layer)]
