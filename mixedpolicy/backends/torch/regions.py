"""Regions: the forwards `apply_policy` installs on a torch module tree (see modules.py).

A *region* (`_Region`) is where the policy changes: its forward runs under the policy's
autocast state (or casts its inputs, for a pure or a float32 policy). An *entry*
(`_Entry`) sits on every other module with weights inside a region, so that a module called
directly - ``model.encoder(x)``, timm's ``model.forward_features(x)`` (which calls the
stages), a Hugging Face ``model.bert(...)`` - computes as `describe` says, as a
Keras layer or a Flax module called on its own does. Inside its region an entry is
one thread-local read; it steps in only where no region is running in this thread
and no autocast is on: a user's own ``torch.autocast`` block, and the autocast a
checkpointed recompute restores, are left as they are.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from mixedpolicy.backends.torch import declared
from mixedpolicy.backends.torch.fastpath import fastpath_off_around, has_fastpath, holds_fastpath, set_fastpath_off
from mixedpolicy.backends.torch.arrays import NAMES as _NAMES, TORCH_DTYPES as _TORCH_DTYPES
from mixedpolicy.policy import Policy
from mixedpolicy.table import unapplied_source

STATE = "_mixedpolicy"  # attribute holding what apply_policy changed on a module

# How many regions this thread is inside (an entry called from within one does nothing).
_running = threading.local()


_PLAIN = (torch.Tensor, int, float, bool, str, type(None))


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """`tree` with its floating tensors in `dtype`. A tensor, or a tuple, list or dict of
    tensors and plain values (a forward's usual arguments and outputs), is cast without
    torch's pytree flatten and unflatten, which cost tens of microseconds on each call."""
    def leaf(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x
    kind = type(tree)
    if kind is torch.Tensor or kind in _PLAIN[1:]:
        return leaf(tree)
    if kind in (tuple, list) and all(isinstance(v, _PLAIN) for v in tree):
        return kind(leaf(v) for v in tree)
    if kind is dict and all(isinstance(v, _PLAIN) for v in tree.values()):
        return {k: leaf(v) for k, v in tree.items()}
    return pytree.tree_map(leaf, tree)


def device_type(args: tuple, kwargs: dict, module: torch.nn.Module) -> str:
    """The device type a call of `module` with these arguments runs on: its first tensor's, else
    its first parameter's, else the CPU."""
    for value in args:
        if isinstance(value, torch.Tensor):
            return value.device.type
    for value in kwargs.values():
        if isinstance(value, torch.Tensor):
            return value.device.type
    for p in module.parameters():
        return p.device.type
    return "cpu"


def region_context(model: torch.nn.Module, device: str) -> Any:
    """The autocast state that `model`'s own forward sets for the modules it calls: what a
    call into a submodule that does not go through that forward needs (a LightningModule's
    ``training_step`` calling ``self.net(x)``). Regions inside set their own state as usual;
    a pure (half-precision variables) policy also needs its inputs cast (`cast_inputs`).

    The autocast keeps no cast copies of the weights (``cache_enabled=False``, as Lightning's
    own plugin): a step can update them in place and run a forward again within it (manual
    optimization), which would otherwise compute on the copies made before the update."""
    state = getattr(model, STATE, None)
    if state is None or "forward" not in state:  # no policy, or a plain float32 root
        return contextlib.nullcontext()
    autocast = policy_autocast(state["policy"], device)
    if state["policy"].compute_dtype in ("bfloat16", "float16") and holds_fastpath(model):
        return fastpath_off_around(autocast)  # (a submodule called directly runs no region of its own)
    return autocast


def policy_autocast(policy: Policy, device: str) -> Any:
    """The autocast a region of `policy` runs its forward under on `device` (no cache, as above)."""
    if _autocasts(policy):
        return torch.autocast(device, dtype=_TORCH_DTYPES[policy.compute_dtype], cache_enabled=False)
    return torch.autocast(device, enabled=False)


def cast_inputs(model: torch.nn.Module, data: Any) -> Any:
    """`data` with its floating tensors in the compute dtype of `model`'s region where that
    region casts its inputs (a pure policy), as its forward would; otherwise `data` itself."""
    state = getattr(model, STATE, None)
    if state is None or "forward" not in state or _autocasts(state["policy"]):
        return data
    return cast_floating(data, _TORCH_DTYPES[state["policy"].compute_dtype])


class _Region:
    """A module's forward run under a policy: what `apply_policy` puts on ``module.forward``.

    An object rather than a closure, so the model pickles (``torch.save(model)``) and
    ``copy.deepcopy`` gives a copy whose region runs the copy's own forward on the
    copy's weights (the module is an attribute, which deepcopy and pickle remap).
    """

    def __init__(self, module: torch.nn.Module, policy: Policy, inner: Callable | None = None):
        self.module, self.policy, self.inner = module, policy, inner
        self._prepare()

    def _prepare(self) -> None:
        policy = self.policy
        self._compute = _TORCH_DTYPES[policy.compute_dtype]
        self._output = _TORCH_DTYPES[policy.output_dtype]
        self._autocast = _autocasts(policy)
        # Under autocast with output == compute, outputs are left as autocast makes them
        # (half for matmul-like ops, float32 for float32 ops and float32 sub-regions).
        self._cast_out = not (self._autocast and policy.output_dtype == policy.compute_dtype)
        self._no_fastpath: bool | None = None  # (on the first call: a module being unpickled is half made)

    def __getstate__(self) -> dict:
        return {"module": self.module, "policy": self.policy, "inner": self.inner}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._prepare()

    @property
    def __wrapped__(self) -> Callable:
        return self.inner if self.inner is not None else type(self.module).forward.__get__(self.module)

    @property
    def __code__(self) -> Any:  # what torch.export reads of a forward (its argument names)
        return self.__wrapped__.__code__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # (one Python frame between the module's call and its forward where it can: on a CPU a
        # small model's forward spends as much time in Python as in its kernels)
        if self._no_fastpath is None:
            self._no_fastpath = self._compute != torch.float32 and has_fastpath(self.module)
        if self._no_fastpath and not torch.compiler.is_compiling():
            set_fastpath_off(True)
            try:
                return self._run(args, kwargs)
            finally:
                set_fastpath_off(False)
        return self._run(args, kwargs)

    def _run(self, args: tuple, kwargs: dict) -> Any:
        _running.depth = getattr(_running, "depth", 0) + 1
        try:
            if self._autocast:
                try:
                    with torch.autocast(device_type(args, kwargs, self.module), dtype=self._compute):
                        out = (type(self.module).forward(self.module, *args, **kwargs) if self.inner is None
                               else self.inner(*args, **kwargs))
                except RuntimeError as err:
                    raise _weights_in_another_dtype(err, self.module, self.policy) or err
            else:
                out = self._cast_and_run(args, kwargs)
        finally:
            _running.depth -= 1
        return declared.cast_output(out, self._output, cast_floating) if self._cast_out else out

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        """The forward this one wraps: the instance's earlier one, else the class's, called with
        the module as its first argument. (Not ``type(module).forward.__get__(module)``: where
        the forward breaks torch.compile's graph, dynamo rebuilds such a bound method as
        ``module.forward``, which is this region, and recursed without end.)"""
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def _cast_and_run(self, args: tuple, kwargs: dict) -> Any:
        """A region that is no autocast: its floating inputs cast to the compute dtype, and
        autocast off where the caller's is on."""
        args, kwargs = cast_floating(args, self._compute), cast_floating(kwargs, self._compute)
        device = device_type(args, kwargs, self.module)
        try:
            if torch.is_autocast_enabled(device):
                with torch.autocast(device, enabled=False):
                    return self._forward(*args, **kwargs)
            return self._forward(*args, **kwargs)
        except RuntimeError as err:
            raise _weights_in_another_dtype(err, self.module, self.policy) or err


def _autocasts(policy: Policy) -> bool:
    return policy.compute_dtype in ("float16", "bfloat16") and policy.variable_dtype != policy.compute_dtype


class _Entry(_Region):
    """The forward of a module that has no region of its own: its region's policy, applied
    only when the module is called from outside every region with autocast off."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(_running, "depth", 0) or torch.is_autocast_enabled(device_type(args, kwargs, self.module)):
            if self.inner is None:  # (_forward's body: a frame less on every call inside a region)
                return type(self.module).forward(self.module, *args, **kwargs)
            return self.inner(*args, **kwargs)
        return _Region.__call__(self, *args, **kwargs)


def install(module: torch.nn.Module, policy: Policy, region: bool) -> Any:
    """Puts a region (or, with ``region=False``, an entry of `policy`'s region) on
    ``module.forward``; returns what the instance had there before (``None`` for the
    class's own forward), for `uninstall`."""
    before = module.__dict__.get("forward")
    module.forward = (_Region if region else _Entry)(module, policy, before)
    return before


def uninstall(module: torch.nn.Module, before: Any) -> None:
    if before is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = before


class RegionDtypeError(RuntimeError):
    """A region's account of a dtype error, with the fix (`_weights_in_another_dtype`)."""


def _weights_in_another_dtype(err: RuntimeError, module: torch.nn.Module, policy: Policy) -> Exception | None:
    """Where a region that casts its inputs failed on dtypes, the error that says why and the fix:
    a weight of its layers in another dtype than the policy put it in (FSDP2's mp_policy gathered
    it so, or the module was cast after apply_policy), else the layer that failed on activations
    that left the compute dtype inside the forward; None where the error is not about dtypes or
    neither is found (torch's error stands)."""
    if isinstance(err, RegionDtypeError) or not any(words in str(err) for words in ("dtype", "scalar type")):
        return None  # (an inner region's diagnosis goes out as it is)
    moved = _weight_off_its_policy(module)
    if moved is not None:
        how = (f"keeps its weights in {policy.variable_dtype} and computes in {policy.compute_dtype} through "
               f"torch.autocast under its policy ({policy})" if _autocasts(policy) else
               f"computes in {policy.compute_dtype} under its policy ({policy}), which casts its inputs to "
               f"{policy.compute_dtype}")
        return RegionDtypeError(
            f"A layer of type {type(module).__name__} {how}, but its weight {moved[0]!r} is "
            f"{str(moved[1]).removeprefix('torch.')} at this call (FSDP2 gathers weights in its mp_policy's "
            f"param_dtype; a cast after apply_policy, model.half() or model.float(), changes them too, as does "
            f"load_state_dict(..., assign=True) of tensors in another dtype) ({err}). Under FSDP2, "
            f"shard this layer as a unit of its own with mp_policy=mp.Policy({policy.name!r}).to_fsdp() (or "
            f"without mp_policy); otherwise " + (
                f"cast the weights back (model.to({policy.variable_dtype})): autocast computes in "
                f"{policy.compute_dtype} by itself." if _autocasts(policy) else
                "apply the policy again after the cast."))
    failed = _failing_layer(err, module) if policy.compute_dtype in ("bfloat16", "float16") and not _autocasts(
        policy) else None  # (autocast takes activations of any dtype)
    if failed is None:
        return None
    path, layer = failed
    held = sorted({str(p.dtype).removeprefix("torch.") for p in layer.parameters(recurse=False)
                   if p.is_floating_point()})
    return RegionDtypeError(
        f"The layer {path or '(root)'!r} ({type(layer).__name__}) of a {type(module).__name__} under the policy "
        f"{policy}, its weights in {' and '.join(held) or 'no dtype'} as the policy puts them, failed on "
        f"activations in another dtype ({err}). The region casts its inputs to {policy.compute_dtype} once, "
        f"at its entry; a floating tensor made inside the forward in float32 (torch.arange, torch.ones or "
        f"torch.tensor without a dtype) turned the activations into float32 on the way, as it would under "
        f"model.to({policy.compute_dtype}). Make such tensors in the activations' dtype (dtype=x.dtype), or "
        f"use a mixed policy ('mixed_{policy.compute_dtype}'), whose autocast takes inputs of any dtype.")


def _weight_off_its_policy(module: torch.nn.Module) -> tuple | None:
    """(path, dtype) of the first floating weight under `module` not in the variable dtype its
    layer's policy gave it; None where every one is."""
    for path, sub in module.named_modules():
        state = getattr(sub, STATE, None)
        if state is None:
            continue
        stored = _TORCH_DTYPES[state["policy"].variable_dtype]
        for name, p in sub.named_parameters(recurse=False):
            if p.is_floating_point() and p.dtype != stored:
                return (f"{path}.{name}" if path else name), p.dtype
    return None


def _failing_layer(err: BaseException, module: torch.nn.Module) -> tuple | None:
    """(path, layer): the innermost layer under `module` whose forward the traceback of `err`
    passes through, else None."""
    layers = {id(m): (path, m) for path, m in module.named_modules()}
    found, tb = None, err.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, torch.nn.Module) and id(owner) in layers:
            found = layers[id(owner)]
        tb = tb.tb_next
    return found


def unplaced(module: torch.nn.Module, path: str, placed: dict) -> tuple[Policy, str]:
    """`describe`'s (policy, source) for a module that has no policy of its own, given `placed`,
    the policies of the modules before it by path: its parameters' dtype, computing so, except
    under an enclosing module whose region autocasts (a layer added after `apply_policy`, such as
    PEFT's LoRA layers put on a model under a policy), where it computes in that autocast's dtype."""
    dtypes = {_NAMES.get(p.dtype) for p in module.parameters(recurse=False)} - {None}
    own = dtypes.pop() if len(dtypes) == 1 else "float32"
    enclosing = max((p for p in placed if p == "" or path.startswith(p + ".")), key=len, default=None)
    if enclosing is not None and _autocasts(placed[enclosing]):
        outer = placed[enclosing]
        return (Policy(outer.compute_dtype, outer.output_dtype, variable_dtype=own),
                f"added after apply_policy: runs under the autocast of {enclosing or '(root)'!r}; apply the "
                f"policy again for one of its own")
    policy = Policy(own)
    return policy, unapplied_source(policy, "its parameters' dtype")  # (a model.half(), say)
