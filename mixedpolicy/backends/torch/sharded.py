"""Policies on a model FSDP2 (``fully_shard``) has sharded: what can change after it and what
must be applied before."""

from __future__ import annotations

from typing import Any, Callable

import torch

from mixedpolicy.backends.torch.arrays import TORCH_DTYPES
from mixedpolicy.backends.torch.found_inf import FSDP1_SHARD
from mixedpolicy.backends.torch.regions import _autocasts


def fsdp_units(model: torch.nn.Module) -> list:
    """The modules of `model` that FSDP2's ``fully_shard`` made units of (none where torch has no FSDP2)."""
    fsdp = getattr(getattr(torch.distributed, "fsdp", None), "FSDPModule", None)
    return [] if fsdp is None else [m for m in model.modules() if isinstance(m, fsdp)]


def _wrapped_by_fsdp1(model: torch.nn.Module) -> bool:
    """Whether FSDP's ``FullyShardedDataParallel`` flattened parameters of `model` (its flat
    parameters, or the original ones with ``use_orig_params=True``, carry its mark; the model
    given may be the module inside the wrapper)."""
    return any(getattr(p, FSDP1_SHARD, False) for p in model.parameters())


def _gathered_in(model: torch.nn.Module) -> dict:
    """id(parameter) -> the dtype its FSDP2 unit gathers it in for the forward (its
    ``mp_policy.param_dtype``), where one is set: the nearest unit's (a unit's parameters include
    those of the units inside it, which ``modules()`` lists after it)."""
    found = {}
    for unit in fsdp_units(model):
        state = getattr(unit, "_get_fsdp_state", None)  # (FSDP2 keeps its mp_policy there)
        dtype = getattr(getattr(state() if state else None, "_mp_policy", None), "param_dtype", None)
        found.update(dict.fromkeys(map(id, unit.parameters()), dtype))
    return {key: dtype for key, dtype in found.items() if dtype is not None}


def _refuse_casts_of_gathered(steps: list, gathered: dict, gets_region: Callable) -> None:
    """A region that casts its inputs (a float32 override, a pure policy) computes with the
    weights FSDP2 gathered: in another dtype than the inputs, torch fails at its first matmul.
    Refused up front, naming the layer, the weights and the fixes."""
    regions: dict = {}  # path -> whether it computes in a region
    for step in steps:
        inside = regions.get(step.path.rpartition(".")[0], False) if step.path else False
        own = gets_region(step, inside)
        regions[step.path] = own or inside
        if not own or _autocasts(step.policy):
            continue
        compute = TORCH_DTYPES[step.policy.compute_dtype]
        prefix = f"{step.path}." if step.path else ""  # (the root's layers: every other path)
        autocast_below = {id(p) for s in steps if s is not step and s.path.startswith(prefix)
                          and s.changes_policy and _autocasts(s.policy) for p in s.layer.parameters()}
        bad = [(name, gathered[id(p)]) for name, p in step.layer.named_parameters()
               if id(p) not in autocast_below and gathered.get(id(p), compute) != compute]
        if bad:
            name, dtype = bad[0]
            where = f"{step.path}.{name}" if step.path else name
            raise ValueError(
                f"Received a model sharded by FSDP2 whose mp_policy gathers {where} in "
                f"{str(dtype).removeprefix('torch.')}, and a policy under which layer {step.path or '(root)'!r} "
                f"computes in {step.policy.compute_dtype} ({step.policy}): its inputs would be "
                f"{step.policy.compute_dtype} and its weights not, and torch would fail at its first matmul. "
                f"Shard that layer as a unit of its own with mp_policy=mp.Policy("
                f"{step.policy.name!r}).to_fsdp(), or shard without mp_policy and let the policy cast; "
                f"nothing was changed.")


def refuse_sharded_changes(model: torch.nn.Module, steps: list, variables: Any, gets_region: Callable) -> None:
    """FSDP2 (``fully_shard``) gathers each parameter in the dtype it had when it was sharded,
    so a policy that stores a parameter in another dtype, or swaps a layer for fp8, after it
    could not take effect: refused before anything changes, as is a region that would cast its
    inputs to another dtype than its unit gathers its weights in. A mixed policy (float32
    variables, a compute region) works on a sharded model as on any other."""
    fsdp2 = bool(fsdp_units(model))
    if not fsdp2 and not _wrapped_by_fsdp1(model):
        return
    for step in steps:
        changed = [where for where, dtype in variables(step.layer, step.path)
                   if dtype is not None and dtype != step.policy.variable_dtype]
        if changed or step.policy.float8_recipe is not None:
            what = (f"stores {', '.join(changed)} in {step.policy.variable_dtype}" if changed
                    else f"computes in fp8 ({step.policy.float8_recipe})")
            if fsdp2:
                raise ValueError(
                    f"Received a model sharded by FSDP2 (fully_shard) and a policy under which layer {step.path!r} "
                    f"{what} ({step.policy}): FSDP2 gathers parameters in the dtype they had when they were "
                    f"sharded, so this cannot take effect after it. Apply the policy before fully_shard "
                    f"(mp.apply_policy(model, ...), then fully_shard each block), or keep float32 variables and "
                    f"pass mp_policy=policy.to_fsdp() to fully_shard; nothing was changed.")
            raise ValueError(
                f"Received a model wrapped in FSDP's FullyShardedDataParallel and a policy under which layer "
                f"{step.path!r} {what} ({step.policy}): FSDP flattened its parameters into shards in the dtype "
                f"they had when it wrapped them, so this cannot take effect after it. Apply the policy before "
                f"wrapping (FSDP flattens each unit's parameters into one tensor of one dtype: wrap the layers "
                f"the policy keeps in another dtype, such as norms, as units of their own), or keep float32 "
                f"variables under a mixed policy, whose regions compute around FSDP's parameters; nothing "
                f"was changed.")
    gathered = _gathered_in(model)
    if gathered:
        _refuse_casts_of_gathered(steps, gathered, gets_region)
