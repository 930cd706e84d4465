"""The found-inf check of a torch wrapper's gradients: one flag per device, no host sync.

A step gathers the gradients by (device, dtype), as torch's foreach kernels take them, and runs
torch's AMP kernel over each set: it multiplies by the inverse scale (or by 1, to check only)
and sets the device's flag to 1 where any value is inf or NaN, as ``GradScaler`` does. The
flags are kept from step to step, and one that the last step read as 0 needs no zeroing.

The parameters' partition by (device, dtype) is kept while the groups stay the same (a
gradient has its parameter's device and dtype), so a step only reads each ``p.grad``; a model
whose parameters are all on one device in one dtype (most) takes a path of a few Python
operations: a step of a small model spends more in Python than in the kernel.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

# (device type, dtype) pairs whose gradients torch's AMP kernel cannot unscale: CUDA's
# `_amp_foreach_non_finite_check_and_unscale_` takes float64/32/16 only, so a pure bfloat16
# model's gradients there go through `_unscale_and_check_by_norm`; a pair another device
# refuses is learned the first time it is refused.
_AMP_KERNEL_LACKS: set = {("cuda", torch.bfloat16)}
_ONES: dict = {}
FSDP1_SHARD = "_fsdp_flattened"  # the mark FSDP (FullyShardedDataParallel) puts on the parameters it shards


def sharded_across_ranks(param_groups: list) -> bool:
    """Whether each rank holds only its own shard of some of these parameters' gradients, as under
    FSDP's ``FullyShardedDataParallel`` (its flat parameters, or the original ones with
    ``use_orig_params=True``) in a process group of several ranks: an overflow lands in one rank's
    shard, and every rank must hear of it to skip with the others (``ShardedGradScaler``'s
    all-reduce). FSDP2's DTensor gradients reduce their flags themselves; DDP's are whole."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return False
    return any(getattr(p, FSDP1_SHARD, False) for group in param_groups for p in group["params"])


def reduce_across_ranks_(found_inf: torch.Tensor) -> None:
    """Sums `found_inf` over every rank in place (asynchronously on the GPU: no host sync), so that
    a flag one rank raised is every rank's; through the accelerator where NCCL carries it and
    the flag is on the CPU (FSDP's CPU offload)."""
    import torch.distributed as dist

    if found_inf.device.type == "cpu" and dist.get_backend() == "nccl":
        on_device = found_inf.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(on_device)
        found_inf.copy_(on_device)
    else:
        dist.all_reduce(found_inf)


def unscale_and_check_(grads: list, found_inf: torch.Tensor, inv_scale: torch.Tensor | None) -> None:
    """Multiplies `grads` (one device, one dtype) by `inv_scale` in place (None: checks only) and
    sets `found_inf` to 1 if any value was inf or NaN, without a host sync: torch's AMP kernel
    where it takes the dtype, the same arithmetic from foreach kernels where it does not."""
    key = (grads[0].device.type, grads[0].dtype)
    if key not in _AMP_KERNEL_LACKS:
        try:
            if inv_scale is None:  # a 1 kept per device (the kernel always multiplies)
                inv_scale = _ONES.get(found_inf.device)
                if inv_scale is None:
                    inv_scale = _ONES[found_inf.device] = torch.ones((), device=found_inf.device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
            return
        except NotImplementedError:  # refused at dispatch, before any gradient was touched
            _AMP_KERNEL_LACKS.add(key)
    _unscale_and_check_by_norm(grads, found_inf, inv_scale)


def _unscale_and_check_by_norm(grads: list, found_inf: torch.Tensor, inv_scale: torch.Tensor | None) -> None:
    # the largest magnitude of each gradient: inf where one holds inf, NaN where one holds NaN
    # (the max propagates NaN on every device), a finite number otherwise; no copy of a gradient
    grads = [g for g in grads if g.numel()]  # (an empty tensor has no largest magnitude)
    if not grads:
        return
    largest = torch.stack(torch._foreach_norm(grads, float("inf")))
    # set to 1 as the AMP kernel sets it (not added: a device's other dtypes share the flag)
    torch.maximum(found_inf, (~torch.isfinite(largest)).any().to(found_inf.dtype), out=found_inf)
    if inv_scale is not None:
        torch._foreach_mul_(grads, inv_scale)


def params_by_device_and_dtype(param_groups: list, half_allowed: bool) -> dict | None:
    """The groups' parameters by (device, dtype), where a step may gather their gradients so;
    None where each step must look at every gradient (`grads_by_device_and_dtype`): a float16
    parameter whose gradient is to be refused."""
    found: dict = defaultdict(list)
    for group in param_groups:
        for p in group["params"]:
            if p.dtype == torch.float16 and not half_allowed:
                return None
            found[(p.device, p.dtype)].append(p)
    return dict(found)


def grads_by_device_and_dtype(param_groups: list, half_allowed: bool) -> dict:
    """The gradients of the groups, by (device, dtype), as torch's foreach kernels take them.

    Raises:
      ValueError: a float16 parameter has a gradient (and `half_allowed` is false).
    """
    groups: dict = defaultdict(list)
    for group in param_groups:
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            if p.dtype == torch.float16 and not half_allowed:
                raise ValueError(
                    "Attempting to unscale float16 gradients of float16 parameters (as "
                    "torch.amp.GradScaler refuses to): the model was made half precision "
                    "(.half()), or a frozen float16 weight was unfrozen, after the optimizer was "
                    "wrapped, so its master weights are float16 and updates are lost to rounding. "
                    "Keep trained parameters in float32 and compute in half precision with "
                    "apply_policy(model, 'mixed_float16'), or train under the pure policy 'float16'.")
            if g.is_sparse:
                g = g.coalesce()._values() if g.dtype == torch.float16 else g._values()
            groups[(g.device, g.dtype)].append(g)
    return groups


def _no_gradients(what: str) -> RuntimeError:
    return RuntimeError(
        f"{what} found no gradients in any parameter: nothing was backpropagated since "
        "the last zero_grad(), so there is no finiteness to check and the step would "
        "count towards growing the scale (torch.amp.GradScaler stops here too: 'No inf "
        "checks were recorded'). Call opt.scale_loss(loss).backward() before opt.step().")


class FoundInf:
    """A wrapper's found-inf flags and the partition of its parameters they are computed over."""

    def __init__(self) -> None:
        self.flags: dict = {}  # a flag per device, zeroed at each check ...
        self.clean: set = set()  # ... unless the last step read it as 0 (the devices here)
        self.several = False  # the last check's flag sums several devices' (it may exceed 1)
        self._checked: tuple = ()  # the devices the last check set a flag of
        self._key: tuple | None = None  # the groups the partition below was made from
        self._by_params: dict | None = None
        self._single: tuple | None = None  # (parameters, device, flag, a 1) where all share one pair
        self._armed: tuple | None = None  # (optimizer, its groups, their lists, `_single`): `armed_check`
        self._across_ranks = False  # the partition holds FSDP shards: each flag is summed over the ranks

    def forget_partition(self) -> None:
        self._key = self._armed = None

    def arm(self, opt: torch.optim.Optimizer) -> None:
        """Lets `armed_check` check `opt`'s gradients while its groups stay as they are now (the
        wrapper arms it where a step is only a check: no scale, one optimizer, its own step)."""
        if self._single is not None:
            groups = opt.param_groups
            self._armed = (opt, groups, [(g["params"], len(g["params"])) for g in groups], self._single)

    def armed_check(self) -> torch.Tensor | None:
        """`check` with nothing to unscale, in the fewest Python operations (a small model's step
        on a CPU spends more time in the wrapper's Python than in the kernel): the flag, or None
        where it is not armed or the groups changed since (then `check` decides)."""
        if self._armed is None:
            return None
        opt, groups, lists, (params, device, found, ones) = self._armed
        if opt.param_groups is not groups or len(groups) != len(lists) or any(
                g["params"] is not ps or len(ps) != n for g, (ps, n) in zip(groups, lists)):
            self._armed = None
            return None
        grads = [g for p in params if (g := p.grad) is not None]
        if not grads:
            return None  # (refused by `check`)
        if device in self.clean:
            self.clean.discard(device)
        else:
            found.zero_()
        try:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, ones)
        except NotImplementedError:  # (a sparse gradient now): `check`'s general path
            self._armed = self._single = None
            return None
        self.several, self._checked = False, (device,)
        if self._across_ranks:
            reduce_across_ranks_(found)
            self.several = True
        return found

    def read_as_zero(self) -> None:
        """The step read the last check's flags as 0 on the host: they need no zeroing next time."""
        self.clean.update(self._checked)

    def _partition(self, groups: list, half_allowed: bool) -> None:
        key = (half_allowed, *[(id(g["params"]), len(g["params"])) for g in groups])
        if key == self._key:
            return
        self._key, self._by_params, self._single = key, params_by_device_and_dtype(groups, half_allowed), None
        self._armed, self._across_ranks = None, sharded_across_ranks(groups)
        if self._by_params is not None and len(self._by_params) == 1:
            ((device, dtype), params), = self._by_params.items()
            if (device.type, dtype) not in _AMP_KERNEL_LACKS:
                ones = _ONES.get(device)
                if ones is None:
                    ones = _ONES[device] = torch.ones((), device=device)
                self._single = (params, device, self._flag(device), ones)
                self.clean.add(device)  # (just made or zeroed: the check to come needs no zeroing)

    def _flag(self, device: torch.device) -> torch.Tensor:
        found = self.flags.get(device)
        if found is None:
            found = self.flags[device] = torch.zeros((), dtype=torch.float32, device=device)
        elif device not in self.clean:  # a flag the last step read as 0 needs no zeroing
            found.zero_()
        self.clean.discard(device)
        return found

    def check(self, groups: list, half_allowed: bool, inv_scale: torch.Tensor | None, scale: torch.Tensor,
              what: str) -> torch.Tensor:
        """Multiplies every gradient of `groups` by `inv_scale` (None: only checks); returns the
        found-inf flag on the scale's device (1 or more where a value was not finite).

        Raises:
          RuntimeError: no parameter has a gradient.
          ValueError: a float16 parameter has a gradient and `half_allowed` is false.
        """
        self._partition(groups, half_allowed)
        if not half_allowed and self._by_params is not None and any(
                p.dtype == torch.float16 for ps in self._by_params.values() for p in ps):
            self._key = None  # a parameter turned float16 since (model.half()): refused below, as
            self._partition(groups, half_allowed)  # GradScaler refuses it at every unscale
        if self._single is not None:  # one device, one dtype (most models): a few Python operations
            params, device, found, ones = self._single
            grads = [g for p in params if (g := p.grad) is not None]
            if grads and (inv_scale is None or inv_scale.device == device):
                if device in self.clean:
                    self.clean.discard(device)
                else:
                    found.zero_()
                try:
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, ones if inv_scale is None else inv_scale)
                except NotImplementedError:  # refused at dispatch (a sparse gradient, a dtype it lacks),
                    self._single = None  # before any gradient was touched: the general path below
                else:
                    self.several, self._checked = False, (device,)
                    return self._agreed(found if device == scale.device else found.to(scale.device, non_blocking=True))
        per_device: dict = {}
        for (device, _), grads in self._gathered(groups, half_allowed).items():
            found = per_device.get(device)
            if found is None:  # one flag per device
                found = per_device[device] = self._flag(device)
            unscale_and_check_(grads, found, inv_scale if inv_scale is None or inv_scale.device == device
                               else inv_scale.to(device))
        self.several, self._checked = len(per_device) > 1, tuple(per_device)
        if not per_device:
            raise _no_gradients(what)
        if len(per_device) == 1:
            (flag,) = per_device.values()
            return self._agreed(flag if flag.device == scale.device else flag.to(scale.device, non_blocking=True))
        return self._agreed(sum(f.to(scale.device, non_blocking=True) for f in per_device.values()))

    def _agreed(self, flag: torch.Tensor) -> torch.Tensor:
        """`flag`, summed over the ranks where they hold shards of the gradients (a sum may exceed 1)."""
        if self._across_ranks:
            reduce_across_ranks_(flag)
            self.several = True
        return flag

    def _gathered(self, groups: list, half_allowed: bool) -> dict:
        if self._by_params is not None:
            found, sparse = {}, False
            for where, params in self._by_params.items():
                grads = [g for p in params if (g := p.grad) is not None]
                if grads:
                    found[where] = grads
                    sparse = sparse or any([g.is_sparse for g in grads])
            if not sparse:
                return found
        return grads_by_device_and_dtype(groups, half_allowed=half_allowed)


def all_zero(optimizers: list) -> bool:
    """Whether every gradient of these optimizers is zero (a host read: only on the way to a refusal)."""
    return all(p.grad is None or not bool((p.grad.coalesce().values() if p.grad.is_sparse else p.grad).any())
               for opt in optimizers for group in opt.param_groups for p in group["params"])


def any_gradient(optimizers: list) -> bool:
    """Whether any parameter of these optimizers has a gradient (stops at the first that has)."""
    return any(p.grad is not None for opt in optimizers for group in opt.param_groups for p in group["params"])
