"""torch's array operations: tensors and torch's own pytrees."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch.utils import _pytree as pytree

from mixedpolicy._adapter import ArrayOps
from mixedpolicy._dtypes import FLOATING_DTYPES, finite_groups, host_leaves_finite

TORCH_DTYPES = {name: getattr(torch, name) for name in FLOATING_DTYPES}
TORCH_DTYPES.update(bool=torch.bool, int32=torch.int32, int64=torch.int64)
NAMES = {v: k for k, v in TORCH_DTYPES.items() if k in FLOATING_DTYPES}
#: the attribute of a parameter that holds the policy apply_policy gave its module (read by
#: LossScaleOptimizer to choose its scaling, and by DDP's reduce hook for the reduce dtype)
PARAMETER_POLICY = "_mixedpolicy_policy"


class _ArrayNamespace:
    """torch as an array namespace for the core's codec kernels (mixedpolicy/codecs.py): torch's
    functions, with the two the kernels use that torch spells otherwise, `astype` and `pad`."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def astype(x: torch.Tensor, dtype: str) -> torch.Tensor:
        return x.to(getattr(torch, dtype))

    @staticmethod
    def pad(x: torch.Tensor, width: tuple[int, int]) -> torch.Tensor:
        return torch.nn.functional.pad(x, width)


ARRAY_NAMESPACE = _ArrayNamespace()


def _group_of(x: torch.Tensor) -> Any:
    """What tensors checked together share: a device and a dtype (a sparse tensor goes alone)."""
    return (x.device, x.dtype) if x.layout == torch.strided else id(x)


def _group_finite(group: list) -> torch.Tensor:
    """Are all values of `group` (one device and dtype, none empty) finite? Read off the smallest
    and the largest value, found in one pass (NaN shows in both, inf and -inf in one; unlike a
    sum's, no overflow of finite values reads as inf): on a CPU about a third of the time of
    ``isfinite(...).all()``, which makes a full-size mask in four kernels (26k float32 values,
    one thread: 25 against 65-87 us)."""
    first = group[0]
    if first.layout != torch.strided:  # a sparse tensor, alone in its group: its stored values
        values = (first.coalesce() if first.layout == torch.sparse_coo else first).values().reshape(-1)
        if not values.numel():
            return torch.tensor(True, device=first.device)
    else:
        values = torch.cat([x.reshape(-1) for x in group]) if len(group) > 1 else first.reshape(-1)
    return torch.isfinite(torch.stack(torch.aminmax(values))).all()


class TorchArrays(ArrayOps):
    name = "torch"

    def is_array(self, x: Any) -> bool:
        return isinstance(x, torch.Tensor)

    def leaves(self, tree: Any) -> Iterable[Any]:
        return pytree.tree_leaves(tree)

    def tree_map(self, fn: Callable[[Any], Any], tree: Any) -> Any:
        return pytree.tree_map(fn, tree)

    def structure(self, tree: Any) -> Any:
        return pytree.tree_structure(tree)

    def asarray(self, value: Any, dtype: str, like: Any = None) -> Any:
        device = like.device if isinstance(like, torch.Tensor) else None
        if isinstance(value, torch.Tensor):
            return value.to(device=device or value.device, dtype=TORCH_DTYPES[dtype])
        return torch.as_tensor(value, dtype=TORCH_DTYPES[dtype], device=device)

    def floating_dtype(self, x: Any) -> str | None:
        return NAMES.get(x.dtype) if isinstance(x, torch.Tensor) else None

    def cast(self, x: Any, dtype: str) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.to(TORCH_DTYPES[dtype])
        return x

    def complex_parts(self, x: Any) -> tuple | None:
        return (x.real, x.imag, torch.complex) if isinstance(x, torch.Tensor) and x.is_complex() else None

    def all_finite(self, tree: Any) -> Any:
        leaves = pytree.tree_leaves(tree)
        # a complex tensor is checked as its float view (no copy unless a lazy conjugate): inf or
        # NaN in either part
        tensors = [torch.view_as_real(x.resolve_conj()) if x.is_complex() else x for x in leaves
                   if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())]
        device = tensors[0].device if tensors else None
        if not host_leaves_finite(leaves, torch.is_tensor):  # a Python float or numpy array among the tensors
            return torch.tensor(False, device=device)
        # a group of tensors (one device, one dtype) at a time, as on JAX: a few ops a group, not two a tensor
        with torch.no_grad():
            flags = [_group_finite(group) for group in
                     finite_groups([x for x in tensors if x.numel()], torch.Tensor.numel, _group_of)]
        if len(flags) < 2:
            return flags[0] if flags else torch.tensor(True, device=device)
        return torch.stack([f.to(device, non_blocking=True) for f in flags]).all()

    def where(self, cond: Any, a: Any, b: Any) -> Any:
        return torch.where(cond, a, b)

    def zeros_like(self, x: Any) -> Any:
        return torch.zeros_like(x)

    def full_like(self, x: Any, value: float) -> Any:
        return torch.full_like(x, value)
