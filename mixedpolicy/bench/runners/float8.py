"""Each framework's own fp8 set-up, as its users write it: the native side of the bench's fp8 rows."""

from __future__ import annotations

from typing import Any


def torchao_float8(net: Any, recipe: str, auto_filter: bool = False) -> Any:
    """torchao's own fp8 set-up, as its users write it: every nn.Linear but the output head and
    those whose dimensions are not multiples of 16 (torchao's and torchtitan's filter); with
    ``auto_filter``, also only those large enough to gain (`mixedpolicy.float8.too_small_to_gain`,
    the sizes of ``float8_auto_filter``, given to torchao as its module filter: the same layers on
    both sides, so the bench's overhead ratio compares like with like)."""
    import torch
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from mixedpolicy.float8 import too_small_to_gain

    linears = [name for name, m in net.named_modules() if isinstance(m, torch.nn.Linear)]
    head = linears[-1] if linears else None

    def keep(module: Any, fqn: str) -> bool:
        shaped = fqn != head and not (module.in_features % 16 or module.out_features % 16)
        return shaped and not (auto_filter and too_small_to_gain(recipe, module.in_features, module.out_features))

    return convert_to_float8_training(net, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=keep)


def keras_float8(model: Any) -> None:
    """Keras's own fp8 set-up, as its users write it: ``model.quantize("float8")`` on every Dense
    but the output head and those whose dimensions are not multiples of 16."""
    import keras

    dense = [layer for layer in model._flatten_layers() if type(layer) in (keras.layers.Dense, keras.layers.EinsumDense)]
    chosen = {id(layer) for layer in dense[:-1]
              if all(isinstance(d, int) and d % 16 == 0 for d in layer._kernel.shape)}
    model.quantize("float8", filters=lambda layer: id(layer) in chosen)


def nnx_tensorwise(net: Any) -> Any:
    """Flax NNX users' fp8 set-up, written by hand (NNX has no fp8 layer; Flax's fp8 ops are
    linen modules): every ``nnx.Linear`` but the output head and those whose dimensions are not
    multiples of 16 given a ``dot_general`` that scales each operand by fp8_max / amax, casts it
    to e4m3 (the output gradient to e5m2) and multiplies in fp8 with float32 accumulation."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from mixedpolicy.backends.jax.float8 import head

    def scaled(t: Any, fmt: Any) -> tuple:
        top = float(jnp.finfo(fmt).max)
        s = top / jnp.maximum(jnp.abs(t).max().astype(jnp.float32), 1e-12)
        return jnp.clip(t.astype(jnp.float32) * s, -top, top).astype(fmt), s

    @jax.custom_vjp
    def fp8_matmul(x: Any, w: Any) -> Any:
        return forward(x, w)[0]

    def forward(x: Any, w: Any) -> tuple:
        (xq, sx), (wq, sw) = scaled(x, jnp.float8_e4m3fn), scaled(w, jnp.float8_e4m3fn)
        y = jnp.dot(xq, wq, preferred_element_type=jnp.float32) / (sx * sw)
        return y.astype(x.dtype), (xq, sx, wq, sw, jnp.zeros(0, x.dtype), jnp.zeros(0, w.dtype))

    def backward(saved: tuple, g: Any) -> tuple:
        xq, sx, wq, sw, x_like, w_like = saved
        gq, sg = scaled(g, jnp.float8_e5m2)
        dx = jnp.dot(gq, wq.T, preferred_element_type=jnp.float32) / (sg * sw)
        dw = jnp.dot(xq.T, gq, preferred_element_type=jnp.float32) / (sx * sg)
        return dx.astype(x_like.dtype), dw.astype(w_like.dtype)

    fp8_matmul.defvjp(forward, backward)

    def dot_general(lhs: Any, rhs: Any, dimension_numbers: Any, precision: Any = None,
                    preferred_element_type: Any = None, **_: Any) -> Any:
        out = fp8_matmul(lhs.reshape(-1, lhs.shape[-1]), rhs)
        return out.reshape(*lhs.shape[:-1], rhs.shape[-1])

    last = head(net)
    for _, module in nnx.iter_graph(net):
        if type(module) is nnx.Linear and module is not last and not (module.in_features % 16 or module.out_features % 16):
            module.dot_general = dot_general
    return net
