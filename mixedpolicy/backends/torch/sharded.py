"""Policies on a model FSDP2 (``fully_shard``) has sharded: what can change after it and what
must be applied before."""

from __future__ import annotations

from typing import Any

import torch


def fsdp_units(model: torch.nn.Module) -> list:
    """The modules of `model` that FSDP2's ``fully_shard`` made units of (none where torch has no FSDP2)."""
    fsdp = getattr(getattr(torch.distributed, "fsdp", None), "FSDPModule", None)
    return [] if fsdp is None else [m for m in model.modules() if isinstance(m, fsdp)]


def refuse_sharded_changes(model: torch.nn.Module, steps: list, variables: Any) -> None:
    """FSDP2 (``fully_shard``) gathers each parameter in the dtype it had when it was sharded,
    so a policy that stores a parameter in another dtype, or swaps a layer for fp8, after it
    could not take effect: refused before anything changes. A mixed policy (float32 variables,
    a compute region) works on a sharded model as on any other."""
    if not fsdp_units(model):
        return
    for step in steps:
        changed = [where for where, dtype in variables(step.layer, step.path)
                   if dtype is not None and dtype != step.policy.variable_dtype]
        if changed or step.policy.float8_recipe is not None:
            what = (f"stores {', '.join(changed)} in {step.policy.variable_dtype}" if changed
                    else f"computes in fp8 ({step.policy.float8_recipe})")
            raise ValueError(
                f"Received a model sharded by FSDP2 (fully_shard) and a policy under which layer {step.path!r} "
                f"{what} ({step.policy}): FSDP2 gathers parameters in the dtype they had when they were "
                f"sharded, so this cannot take effect after it. Apply the policy before fully_shard "
                f"(mp.apply_policy(model, ...), then fully_shard each block), or keep float32 variables and "
                f"pass mp_policy=policy.to_fsdp() to fully_shard; nothing was changed.")
