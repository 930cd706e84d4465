"""Delayed-scaling fp8 on torch: Keras's float8 algorithm around torch's own fp8 matmul.

torchao removed delayed scaling, so for the ``"delayed"`` recipe the adapter writes the
quantize / dequantize itself around ``torch._scaled_mm`` (no kernel of its own), with the
meaning Keras's float8 layers give it: each operand (input, weight, output gradient) has a
scale and an amax history; a step quantizes with the current scale (``x / scale``,
saturated), and, in training, the next scale is ``amax_max / fp8_max * 2**margin`` from the
history *before* this step's amax, which then enters the history (rolled, at index 0).
The scales and histories are buffers: ``state_dict`` saves them, DDP broadcasts them with
the other buffers.

Across replicas (``torch.distributed`` initialized with more than one rank: DDP, FSDP2) the
amax of the input and of the output gradient that enters the history is the largest over all
ranks (one ``all_reduce(MAX)`` of a scalar each, in training), as Transformer Engine reduces
its amaxes: every rank keeps the same histories and scales, so the replicas quantize alike.
The weight's needs none: every rank computes with the same full weight. Each rank must run
the same training forwards and backwards, as DDP and FSDP require anyway.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mixedpolicy.float8 import Float8Recipe

_OPERANDS = ("input", "weight", "grad")


def _next_scale(history: torch.Tensor, scale: torch.Tensor, top: float, margin: int) -> torch.Tensor:
    amax = history.max()
    factor = top / amax / (2.0 ** margin)
    usable = (amax > 0) & torch.isfinite(amax)
    return torch.where(usable, 1.0 / factor, scale)


def _replicated() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _update(x: torch.Tensor, scale: torch.Tensor, history: torch.Tensor, fmt: torch.dtype, margin: int,
            across_replicas: bool = False) -> None:
    """Keras's order: the next scale from the history so far, then this amax into the history
    (`across_replicas`: the largest over the ranks, see the module docstring)."""
    top = torch.finfo(fmt).max
    with torch.no_grad():
        amax = x.detach().abs().max().float()
        if across_replicas and _replicated():
            dist.all_reduce(amax, op=dist.ReduceOp.MAX)
        scale.copy_(_next_scale(history, scale, top, margin))
        history.copy_(torch.roll(history, -1))
        history[0] = amax


def _quantize(x: torch.Tensor, scale: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    top = torch.finfo(fmt).max
    return (x.float() / scale).clamp(-top, top).to(fmt)


def _column_major(x: torch.Tensor) -> torch.Tensor:
    return x.t().contiguous().t()


class _Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, layer: "DelayedFloat8Linear",
                out_dtype: torch.dtype) -> torch.Tensor:
        fwd, margin = layer.forward_format, layer.recipe.margin
        xs, ws = layer.input_scale.clone(), layer.weight_scale.clone()  # this step's scales
        xq, wq = _quantize(x, xs, fwd), _quantize(weight, ws, fwd)
        if layer.training:
            _update(x, layer.input_scale, layer.input_amax_history, fwd, margin, across_replicas=True)
            _update(weight, layer.weight_scale, layer.weight_amax_history, fwd, margin)
        ctx.save_for_backward(xq, wq, xs, ws)
        ctx.layer, ctx.dtypes = layer, (x.dtype, weight.dtype)
        return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=out_dtype)  # wq.t(): column-major

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        xq, wq, xs, ws = ctx.saved_tensors
        layer = ctx.layer
        bwd = layer.backward_format
        gs = layer.grad_scale.clone()
        gq = _quantize(grad, gs, bwd)
        if layer.training:
            _update(grad, layer.grad_scale, layer.grad_amax_history, bwd, layer.recipe.margin, across_replicas=True)
        x_dtype, w_dtype = ctx.dtypes
        dx = torch._scaled_mm(gq, _column_major(wq), scale_a=gs, scale_b=ws, out_dtype=x_dtype)
        dw = torch._scaled_mm(gq.t().contiguous(), _column_major(xq), scale_a=gs, scale_b=xs, out_dtype=w_dtype)
        return dx, dw, None, None


class DelayedFloat8Linear(torch.nn.Linear):
    """An ``nn.Linear`` whose matmul runs in fp8 with delayed scaling (see the module docstring).

    Made by `apply_policy` from a plain ``nn.Linear``, sharing its weight and bias; the
    scales start at 1 and the histories at 0, as Keras's do.
    """

    recipe: Float8Recipe

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, recipe: Float8Recipe) -> "DelayedFloat8Linear":
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight, layer.bias = linear.weight, linear.bias
        layer.recipe = recipe
        layer.forward_format = getattr(torch, recipe.forward_dtype)
        layer.backward_format = getattr(torch, recipe.backward_dtype)
        device = linear.weight.device
        for name in _OPERANDS:
            layer.register_buffer(f"{name}_scale", torch.ones((), device=device))
            layer.register_buffer(f"{name}_amax_history", torch.zeros(recipe.amax_history_len, device=device))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        flat = x.reshape(-1, self.in_features)
        out = _Matmul.apply(flat, self.weight, self, out_dtype).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe!r}"
