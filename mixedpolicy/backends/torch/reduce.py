"""Reducing DDP gradients in a policy's ``reduce_dtype``: one DDP communication hook.

`register(ddp_model, policy)` gives every parameter the reduce dtype of its module's
policy and registers one hook with ``DistributedDataParallel.register_comm_hook``; DDP
and its process group do the communication. For each bucket the hook sends:

- a bucket whose parameters all reduce in float32: DDP's own ``allreduce_hook``
  (the same result as DDP without a hook);
- all in bfloat16 / float16: torch's own ``bf16_compress_hook`` / ``fp16_compress_hook``;
- otherwise (8-bit, table-N, or parameters with different reduce dtypes in one bucket):
  each group of the bucket in its own codec (`mixedpolicy.codecs`), 8-bit tensors and
  packed table codes through ``all_gather`` with their scales or tables, summed in float32
  after the exchange; a float16 group is divided by the world size before its cast.

The result is the mean over ranks, as DDP's. `ReduceState.bytes_sent` counts the bytes
this rank handed to the process group (tensors as exchanged, scales included).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from mixedpolicy.backends.torch.arrays import ARRAY_NAMESPACE, PARAMETER_POLICY, TORCH_DTYPES
from mixedpolicy.backends.torch.paths import named_layers
from mixedpolicy.codecs import (float8_scale, is_float8, pack_codes, table_bits, table_codes, table_quantiles,
                                table_values, unpack_codes, wire_bytes)
from mixedpolicy.policy import as_policy
from mixedpolicy.layer_plan import layer_chain
from mixedpolicy.policy_map import PolicyMap
from mixedpolicy.scope import global_policy

_TORCH = {**TORCH_DTYPES, "float8_e5m2": torch.float8_e5m2, "float8_e4m3fn": torch.float8_e4m3fn}
_STATE = "_mixedpolicy_reduce"  # the ReduceState of a DDP model's hook, on the DDP module
_TORCH_HOOKS = {"bfloat16": default_hooks.bf16_compress_hook, "float16": default_hooks.fp16_compress_hook}


class ReduceState:
    """What the hook knows: the process group, each parameter's reduce dtype, and counts.

    Attributes:
      reduce_dtypes: parameter name -> reduce dtype.
      bytes_sent: bytes this rank handed to the process group since registration.
      buckets: buckets reduced since registration.
      error_feedback: whether what a codec drops is added to the next step's gradient.
    """

    def __init__(self, process_group: Any, module: torch.nn.Module, names: dict, error_feedback: bool = False):
        self.process_group = process_group
        self.update(module, names)  # reduce_dtypes, and by parameter identity for the hook
        self.bytes_sent = 0
        self.buckets = 0
        self.error_feedback = error_feedback
        self.residuals: dict = {}  # id(parameter) -> what its codec dropped at the last step

    def residual(self, p: torch.Tensor) -> torch.Tensor:
        found = self.residuals.get(id(p))
        return found if found is not None else torch.zeros(p.shape, dtype=torch.float32, device=p.device)

    def __getstate__(self) -> dict:  # DDP may pickle its hook state; the group stays behind
        return {k: v for k, v in self.__dict__.items() if k != "process_group"} | {"process_group": None}

    def dtype_of(self, p: torch.Tensor) -> str:
        return self._by_param.get(id(p), "float32")

    def update(self, module: torch.nn.Module, names: dict) -> None:
        """New reduce dtypes (parameter name -> dtype) for the parameters of `module`."""
        params = dict(module.named_parameters())
        self._by_param = {id(params[n]): d for n, d in names.items() if n in params}
        self.reduce_dtypes = dict(names)


def _per_parameter(model: torch.nn.Module, policy: Any) -> dict[str, str]:
    """parameter name -> reduce dtype: `policy` (a Policy, a name, a PolicyMap by module
    path or class, or by parameter path: ``"*.bias"``), else the policy apply_policy put on
    each parameter's module, else the global."""
    out = {}
    layers = list(named_layers(model))  # the user's paths (torch.compile's and checkpointing's wrappers left out)
    types = {path: type(module) for path, _, module in layers}
    for path, named, module in layers:
        for name, p in module.named_parameters(recurse=False):
            full = f"{named}.{name}" if named else name
            if isinstance(policy, PolicyMap):  # keys by path, glob or class; "*.bias" names the parameter
                chain = layer_chain(f"{path}.{name}" if path else name, type(p), type_at=types.get)
                out[full] = policy.resolve(chain).policy.reduce_dtype
            elif policy is not None:
                out[full] = as_policy(policy).reduce_dtype
            else:
                out[full] = p.__dict__.get(PARAMETER_POLICY, global_policy()).reduce_dtype
    return out


def register(ddp_model: Any, policy: Any = None, *, error_feedback: bool = False) -> ReduceState:
    """Registers the reduce-dtype hook on a ``DistributedDataParallel`` model.

    Args:
      ddp_model: the DDP-wrapped model (before its first backward).
      policy: a `Policy`, a name, or a `PolicyMap` resolved by module path inside the
        wrapped module; None reads the policies `apply_policy` put on its modules.
      error_feedback: add what each parameter's codec dropped (the rounding of its
        8-bit, table or half-precision values) to its next gradient (off by default;
        every bucket then goes through mixedpolicy's own path).

    Returns:
      The hook's `ReduceState` (``bytes_sent``, ``reduce_dtypes``).

    Raises:
      TypeError: `ddp_model` is not a DistributedDataParallel module.
      RuntimeError: DDP already has a communication hook of another library (DDP allows
        one; registering again here updates mixedpolicy's own).
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            f"Received {type(ddp_model).__name__}; expected a torch.nn.parallel."
            f"DistributedDataParallel module. Wrap the model first: "
            f"ddp = DistributedDataParallel(model); mp.distributed.register(ddp, policy).")
    names = _per_parameter(ddp_model.module, policy)
    state = ddp_model.__dict__.get(_STATE)
    if state is not None:  # registered before (DDP takes one hook): new dtypes for it
        state.update(ddp_model.module, names)
        state.error_feedback = error_feedback
        return state
    state = ReduceState(ddp_model.process_group, ddp_model.module, names, error_feedback)
    ddp_model.register_comm_hook(state, _hook)
    ddp_model.__dict__[_STATE] = state
    return state


def bytes_per_step(model: Any, policy: Any = None) -> int:
    """Bytes one rank sends to reduce `model`'s gradients once under DDP with this `policy`
    (each parameter that takes a gradient, in its reduce dtype, resolved as `register` resolves
    it; a DDP model's own module). Counted per parameter: DDP's buckets carry an 8-bit float's
    scale and a table codec's table once per bucket, so the hook's ``bytes_sent`` is a little
    lower for those."""
    from mixedpolicy.codecs import wire_bytes

    if isinstance(model, DistributedDataParallel):
        model = model.module
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"Received {type(model).__name__}; expected a torch.nn.Module (or its "
                        f"DistributedDataParallel wrapper), whose gradients DDP would reduce.")
    dtypes = _per_parameter(model, policy)
    return sum(wire_bytes(p.numel(), dtypes[name]) for name, p in model.named_parameters()
               if p.requires_grad and p.is_floating_point())


def apply_to_ddp(ddp_model: Any, apply: Any, remove: Any) -> Any:
    """`apply` (the policy) on the wrapped module, then its reduce dtypes into DDP's hook
    (`remove` undoes `apply` where the policy cannot stay).

    The hook is registered once, where a reduce dtype is not float32 (DDP allows one
    hook; a later apply_policy updates its dtypes). A policy that would change the
    parameters' dtypes is refused: DDP laid out its buckets for the dtypes it saw.

    Raises:
      ValueError: the policy changes a parameter's dtype; nothing is applied.
    """
    before = {n: p.dtype for n, p in ddp_model.module.named_parameters()}
    apply(ddp_model.module)
    changed = {n: (before[n], p.dtype) for n, p in ddp_model.module.named_parameters() if p.dtype != before[n]}
    if changed:
        remove(ddp_model.module)
        name, (was, now) = next(iter(changed.items()))
        raise ValueError(
            f"Received a policy that stores the parameters of a DistributedDataParallel model in "
            f"another dtype ({name}: {was} -> {now}); DDP laid out its gradient buckets for "
            f"{was} when it was created. Apply the policy to the model before wrapping it in "
            f"DDP, or use a mixed policy (float32 variables). Nothing was applied.")
    names = _per_parameter(ddp_model.module, None)
    state = ddp_model.__dict__.get(_STATE)
    if state is not None:
        state.update(ddp_model.module, names)
    elif any(d != "float32" for d in names.values()):
        register(ddp_model, None)
    return ddp_model


def remove_from_ddp(ddp_model: Any, remove: Any) -> Any:
    """Removes the policy from the wrapped module; DDP's hook (which DDP cannot drop)
    goes back to float32, plain DDP's result."""
    remove(ddp_model.module)
    state = ddp_model.__dict__.get(_STATE)
    if state is not None:
        state.update(ddp_model.module, {n: "float32" for n, _ in ddp_model.module.named_parameters()})
    return ddp_model


def _hook(state: ReduceState, bucket):  # noqa: ANN (DDP checks the annotations; none passes)
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    dtypes = [state.dtype_of(p) for p in bucket.parameters()]
    state.buckets += 1
    uniform = dtypes[0] if dtypes and all(d == dtypes[0] for d in dtypes) else None
    delegate = ("float32",) if state.error_feedback else ("float32", *_TORCH_HOOKS)
    if uniform in delegate and buffer.dtype == torch.float32:
        state.bytes_sent += wire_bytes(buffer.numel(), uniform)
        if uniform == "float32":
            return default_hooks.allreduce_hook(group, bucket)
        return _TORCH_HOOKS[uniform](group, bucket)
    world = group.size()
    slices, offset = [], 0
    for g in bucket.gradients():
        slices.append(buffer[offset:offset + g.numel()])
        offset += g.numel()
    for dtype in sorted(set(dtypes)):
        members = [s for s, d in zip(slices, dtypes) if d == dtype]
        flat = torch.cat([s.reshape(-1) for s in members])
        owners = [p for p, d in zip(bucket.parameters(), dtypes) if d == dtype]
        if state.error_feedback:  # what the codec dropped last step goes out with this one
            flat = flat.float() + torch.cat([state.residual(p).reshape(-1) for p in owners])
        reduced, local = _reduce(flat, dtype, group, world)
        if state.error_feedback:
            dropped, start = flat - local, 0
            for p in owners:
                state.residuals[id(p)] = dropped[start:start + p.numel()].view_as(p).clone()
                start += p.numel()
        state.bytes_sent += wire_bytes(flat.numel(), dtype)
        start = 0
        for s in members:
            s.copy_(reduced[start:start + s.numel()].view_as(s))
            start += s.numel()
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buffer)
    return fut


def _reduce(flat: torch.Tensor, dtype: str, group: Any, world: int) -> tuple:
    """(the mean over ranks of `flat`, sent in `dtype` (synchronously); what this rank's
    own sent values decode to, in float32, for error feedback)."""
    bits = table_bits(dtype)
    if bits is not None:
        total, local = _table_sum(flat.float(), bits, group, world)
        return (total / world).to(flat.dtype), local
    if is_float8(dtype):
        wide = flat.float()
        amax = wide.abs().max() if wide.numel() else torch.zeros((), device=flat.device)
        scale = float8_scale(ARRAY_NAMESPACE, amax, dtype)
        q = (wide * scale).to(_TORCH[dtype])
        qs = [torch.empty_like(q.view(torch.uint8)) for _ in range(world)]
        scales = [torch.empty_like(scale) for _ in range(world)]
        dist.all_gather(qs, q.view(torch.uint8), group=group)
        dist.all_gather(scales, scale.reshape(()), group=group)
        total = sum(x.view(_TORCH[dtype]).float() / s for x, s in zip(qs, scales))
        return (total / world).to(flat.dtype), q.float() / scale
    if dtype == "float16":  # divided before the cast: the sum cannot overflow
        sent = flat.float().div(world).to(torch.float16)
        local = sent.float() * world
        dist.all_reduce(sent, group=group)
        return sent.to(flat.dtype), local
    sent = flat.to(_TORCH[dtype])
    local = sent.float()
    dist.all_reduce(sent, group=group)
    return sent.to(flat.dtype).div_(world), local


def _percentiles(a: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """numpy's linear-interpolation percentiles of a 1-D tensor (no 16M-element limit)."""
    if a.numel() == 0:
        return torch.zeros_like(q)
    ordered = a.sort().values
    pos = q / 100 * (a.numel() - 1)
    lo = pos.floor().long()
    hi = pos.ceil().long()
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _table_sum(flat: torch.Tensor, bits: int, group: Any, world: int) -> tuple:
    """(the float32 sum over ranks of `flat`, each rank's sent as table-N codes packed 8/N
    to a byte with its float32 table (`mixedpolicy.codecs` has the rules); what this rank's
    codes decode to)."""
    a = flat.abs()
    finite = torch.isfinite(flat).all()
    q = torch.as_tensor(table_quantiles(bits), dtype=torch.float32, device=flat.device)
    table = _percentiles(torch.where(torch.isfinite(a), a, torch.zeros_like(a)), q)
    table = torch.where(finite, table, torch.full_like(table, float("nan")))  # NaN: every rank skips
    codes, _ = table_codes(ARRAY_NAMESPACE, flat.contiguous(), table.contiguous(), bits)
    packed = pack_codes(ARRAY_NAMESPACE, codes, bits)
    all_packed = [torch.empty_like(packed) for _ in range(world)]
    all_tables = [torch.empty_like(table) for _ in range(world)]
    dist.all_gather(all_packed, packed, group=group)
    dist.all_gather(all_tables, table, group=group)
    total = sum(table_values(ARRAY_NAMESPACE, unpack_codes(ARRAY_NAMESPACE, got, bits, flat.numel()), tab, bits)
                for got, tab in zip(all_packed, all_tables))
    return total, table_values(ARRAY_NAMESPACE, codes, table, bits)


def to_fsdp(policy: Any) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for a policy whose reduce dtype FSDP2 can carry
    (`Policy.to_fsdp` checks it): parameters all-gathered and computed in the compute dtype,
    gradients reduce-scattered in the reduce dtype, outputs cast where they differ."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(
        param_dtype=None if policy.compute_dtype == policy.variable_dtype else _TORCH[policy.compute_dtype],
        reduce_dtype=_TORCH[policy.reduce_dtype],
        output_dtype=None if policy.output_dtype == policy.compute_dtype else _TORCH[policy.output_dtype])
