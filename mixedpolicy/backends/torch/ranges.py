"""`inspect_gradients` on PyTorch: per-module ranges, computed on the device.

Weights' gradients come from ``loss.backward()``; activations and their gradients from
forward hooks on the leaf modules (a tensor hook on each output for its gradient). Every
tensor's stats vector (`mixedpolicy.ranges.layout`) is computed with torch ops and the
framework's own float16/bfloat16 casts; one vector per (module, kind) moves to the host.
"""

from __future__ import annotations

from typing import Any

import torch

from mixedpolicy.backends.torch.paths import named_layers
from mixedpolicy.ranges import BINS, EMIN, ROW_BINS, rows

_DTYPES = (torch.float16, torch.bfloat16)


def stats(x: torch.Tensor, scales: tuple) -> torch.Tensor:
    """The stats vector of `x` (its rows along its last axis), as a float64 tensor on its device."""
    shape = tuple(x.shape)
    a = x.detach().abs().float().reshape(-1)
    finite = torch.isfinite(a)
    a = torch.where(finite, a, torch.zeros((), dtype=a.dtype, device=a.device))
    nz = a > 0
    _, e = torch.frexp(a)
    bins = (e.long() - 1 - EMIN).clamp(0, BINS - 1)
    hist = torch.bincount(bins[nz], minlength=BINS).double()
    amax = a.max() if a.numel() else torch.zeros((), device=a.device)
    head = torch.stack([torch.tensor(float(a.numel()), device=a.device, dtype=torch.float64),
                        (~nz & finite).sum().double(), (~finite).sum().double(), amax.double()])
    parts = [head, hist]
    for s in scales:
        y = a * s
        for dt in _DTYPES:
            r = y.to(dt)
            tiny = torch.finfo(dt).tiny
            parts.append(torch.stack([(torch.isinf(r) & nz).sum(), ((r != 0) & (r.abs() < tiny)).sum(),
                                      ((r == 0) & nz).sum()]).double())
    by_row = a.reshape(rows(shape))
    top = by_row.amax(dim=1, keepdim=True) if by_row.numel() else by_row
    _, e = torch.frexp(torch.where(by_row > 0, by_row / torch.where(top > 0, top, 1.0), 0.0).reshape(-1))
    parts.append(torch.bincount((-e.long()).clamp(0, ROW_BINS - 1)[nz], minlength=ROW_BINS).double())
    return torch.cat(parts)


def by_output(p: torch.Tensor) -> torch.Tensor:
    """A torch weight (out, in, ...) as rows over what each output multiplies (its input dims)."""
    return p.reshape(p.shape[0], -1) if p.dim() > 1 else p


def merged(tensors: list, scales: tuple) -> torch.Tensor:
    """One stats vector of several tensors, each scaled by rows of its own."""
    total = None
    for t in tensors:
        v = stats(t, scales)
        total = v if total is None else _merge_device(total, v)
    return total


def range_stats(model: torch.nn.Module, loss_fn: Any, batches: list, scales: tuple, activations: bool) -> dict:
    totals: dict = {}

    def add(key: tuple, vector: torch.Tensor) -> None:
        totals[key] = vector if key not in totals else _merge_device(totals[key], vector)

    handles = []
    if activations:
        for path, _, module in named_layers(model):
            if next(module.children(), None) is not None:
                continue  # leaf modules: a container's output is its last child's

            def hook(module, args, output, path=path):
                if isinstance(output, torch.Tensor) and output.is_floating_point():
                    add((path, "activation"), stats(output, scales))
                    if output.requires_grad:
                        output.register_hook(lambda g, path=path: add((path, "activation_grad"), stats(g, scales)))

            handles.append(module.register_forward_hook(hook))
    for path, _, module in named_layers(model):  # the weights as they are (no step is taken)
        own = [by_output(p.detach()) for p in module.parameters(recurse=False) if p.is_floating_point()]
        if own:
            add((path, "weight"), merged(own, scales))
    saved = {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}
    try:
        for batch in batches:
            model.zero_grad(set_to_none=True)
            loss = loss_fn(model, batch)
            loss.backward()
            for path, _, module in named_layers(model):
                grads = [by_output(p.grad) for p in module.parameters(recurse=False) if p.grad is not None]
                if grads:
                    add((path, "weight_grad"), merged(grads, scales))
    finally:
        for h in handles:
            h.remove()
        for n, p in model.named_parameters():  # the user's gradients as they were
            p.grad = saved[n]
    order = {path: i for i, (path, _, _) in enumerate(named_layers(model))}
    kinds = ("weight", "activation", "activation_grad", "weight_grad")
    keys = sorted(totals, key=lambda k: (order.get(k[0], len(order)), kinds.index(k[1])))
    return {key: totals[key].cpu().numpy() for key in keys}  # one transfer per (layer, kind)


def _merge_device(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = a + b
    out[3] = torch.maximum(a[3], b[3])
    return out
