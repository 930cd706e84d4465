"""Policies on torch ``nn.Module`` trees, through autocast regions.

How a policy reaches a module tree:

- every module's policy is resolved from the `PolicyMap` (by its ``named_modules()``
  path without the wrappers' segments, paths.py; its class; the built-in rules);
- a module gets a *region* only where its policy differs from its parent's (the
  root always has one): its ``forward`` is wrapped, so a whole ``mixed_bfloat16``
  model costs one ``torch.autocast`` region, exactly what hand-written AMP does;
- a region computing in half precision over float32 variables runs under
  ``torch.autocast(dtype=compute)``; a float32 root needs no region and runs as
  plain PyTorch; any other region (a layer overridden to float32, a pure
  ``bfloat16`` model) turns autocast off and casts its floating inputs to the
  compute dtype;
- a batch, instance, layer or group norm with affine parameters that the
  built-in rule gives float32 statistics inside a half-precision autocast region needs no region either:
  PyTorch's kernels for these layers, handed half-precision inputs and float32
  parameters, compute in float32 and round the result once to the input's dtype,
  which is the rule's policy (float32 compute, half output) without two casts and
  a float32 copy of the activations (see docs/torch.md for what it saves);
- floating outputs leave a region in its output dtype; under a mixed policy whose
  output dtype is its compute dtype, outputs are left as autocast makes them (half
  for matmul-like ops, float32 for autocast's float32 ops and for layers overridden
  to float32), as in hand-written AMP;
- every other module with weights inside a region gets an *entry* (regions.py), so that calling it
  directly (``model.encoder(x)``, timm's ``forward_features``) computes as its region
  does; called from within the region, an entry costs one thread-local read;
- parameters (and floating buffers) are stored in the variable dtype; a transformers model's
  own declarations are kept as its half-precision load keeps them (declared.py);

`remove_policy` undoes all of it: forwards and parameter dtypes are restored.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch

from mixedpolicy._adapter import ModelAdapter
from mixedpolicy.backends.torch.arrays import NAMES as _NAMES, PARAMETER_POLICY, TORCH_DTYPES as _TORCH_DTYPES
from mixedpolicy.table import LayerPolicy
from mixedpolicy.policy import Policy
from mixedpolicy.layer_plan import dotted_chains, join, plan
from mixedpolicy.policy_map import (EMBEDDING, HEAD, LOSS, NO_FLOAT8, NORMALIZATION, SMALL_MATMUL, LayerInfo,
                                    Resolution)
from mixedpolicy.backends.torch import declared, float8
from mixedpolicy.layer_kinds import MODEL_KEPT
from mixedpolicy.backends.torch.paths import named_layers, stored_at, unwrap
from mixedpolicy.backends.torch.regions import STATE as _STATE, _autocasts, install, uninstall, unplaced
from mixedpolicy.backends.torch.sharded import fsdp_units, refuse_sharded_changes

_FLOAT32 = Policy("float32")

# Norms whose PyTorch kernels compute in float32 from half inputs and float32 parameters.
_FLOAT32_KERNEL_NORMS = (torch.nn.modules.batchnorm._NormBase, torch.nn.LayerNorm, torch.nn.GroupNorm)
_NORM_TYPES = _FLOAT32_KERNEL_NORMS + tuple(
    t for t in (getattr(torch.nn, "RMSNorm", None), torch.nn.LocalResponseNorm) if t is not None)


def _kind(module: torch.nn.Module, head: torch.nn.Module | None) -> str | None:
    """The layer's kind for the built-in rules; `head` is the model's last Linear."""
    if isinstance(module, _NORM_TYPES):
        return NORMALIZATION
    if isinstance(module, torch.nn.modules.loss._Loss):
        return LOSS
    if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
        return EMBEDDING
    if float8.eligible(module):
        if module is head:
            return HEAD
        return SMALL_MATMUL if module.in_features % 16 or module.out_features % 16 else None
    if next(module.parameters(recurse=False), None) is not None:
        return NO_FLOAT8  # weights and no fp8 path (convolutions, attention's own projections)
    return None


def _matmul(module: torch.nn.Module) -> tuple | None:
    return (module.in_features, module.out_features) if float8.eligible(module) else None


def _head(model: torch.nn.Module) -> torch.nn.Module | None:
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return linears[-1] if linears else None


class TorchModels(ModelAdapter):
    runs_float8 = True  # fp8 matmuls on the framework's own path (see float8.py beside)

    # -- models ---------------------------------------------------------------
    def is_model(self, obj: Any) -> bool:
        return isinstance(obj, torch.nn.Module)

    def apply_policy(self, model: torch.nn.Module, policy_map: Any) -> torch.nn.Module:
        _refuse_torchscript(model)
        if _is_ddp(model):  # the policy goes on the wrapped module; the reduce dtypes to DDP's hook
            from mixedpolicy.backends.torch.reduce import apply_to_ddp

            return apply_to_ddp(model, lambda inner: self.apply_policy(inner, policy_map), remove_policy)
        if unwrap(model) is not model:  # torch.compile's module, a checkpoint wrapper: the model inside
            self.apply_policy(unwrap(model), policy_map)
            return model
        for unit in fsdp_units(model):  # its sharded parameters registered, in the dtype they are kept in
            unit.reshard()
        if any(getattr(m, _STATE, None) is not None for m in model.modules()):
            # a policy is on: the new one is checked before the old comes off (with the dtypes
            # the old one found), so a refused one leaves the model as it was
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (its warnings come once, from the plan below)
                _planned(model, policy_map, _before_policy)
        remove_policy(model)
        real, steps = _planned(model, policy_map, _own_parameters)
        unsaved = declared.unsaved_buffers(model)
        # fp8 layers become torchao's Float8Linear (same parameters) before anything else changes
        swapped = float8.convert(model, [(real[step.path], step.policy.float8_recipe) for step in steps
                                         if step.policy.float8_recipe is not None and float8.eligible(step.layer)])
        changed: dict = {}
        regions: dict = {}  # path -> the policy of the region it computes in
        for step in steps:
            module, policy, resolution, path = step.layer, step.policy, step.resolution, step.path
            if real[path] in swapped:
                module = model.get_submodule(real[path])
            state = _LayerState(policy=policy, source=resolution.source, dtypes={})
            target = _TORCH_DTYPES[policy.variable_dtype]
            # A narrowing cast keeps the original values, so remove_policy can give back
            # every value that was not changed since (see remove_policy).
            for name, p in module.named_parameters(recurse=False):
                p.__dict__[PARAMETER_POLICY] = policy  # what LossScaleOptimizer(opt) follows
                state.marked.append(p)
                if p.is_floating_point() and p.dtype != target and not _kept_frozen(p, policy):
                    state["dtypes"][name] = p.dtype
                    state.setdefault("originals", {})[name] = p.data
                    p.data = p.data.to(target)
            for name, b in module.named_buffers(recurse=False):  # fp8 scales stay float32
                if (b is not None and b.is_floating_point() and b.dtype != target and real[path] not in swapped
                        and id(b) not in unsaved):
                    state["dtypes"][name] = b.dtype
                    state.setdefault("originals", {})[name] = b
                    setattr(module, name, b.to(target))
            parent = regions.get(path.rpartition(".")[0]) if path else None
            if _gets_region(step, module, parent is not None):
                state["forward"] = install(module, policy, region=True)
                regions[path] = policy
            elif parent is not None:
                regions[path] = parent
                # an entry, for calls from outside the region; a module without weights (an
                # activation, dropout) is left to the autocast state it is called in, at no cost
                if next(module.parameters(), None) is not None:
                    state["entry"] = install(module, parent, region=False)
            if real[path] in swapped:
                state["float8_original"] = swapped[real[path]]
            changed[real[path]] = state
        for path, state in changed.items():
            setattr(model.get_submodule(path), _STATE, state)
        return model

    def remove_policy(self, model: torch.nn.Module) -> torch.nn.Module:
        if isinstance(model, torch.jit.ScriptModule):
            return model  # (never under a policy: apply_policy refuses it)
        if _is_ddp(model):
            from mixedpolicy.backends.torch.reduce import remove_from_ddp

            return remove_from_ddp(model, remove_policy)
        if unwrap(model) is not model:
            self.remove_policy(unwrap(model))
            return model
        return remove_policy(model)

    def range_stats(self, model: torch.nn.Module, loss_fn: Any, batches: list, scales: tuple,
                    activations: bool) -> dict:
        from mixedpolicy.backends.torch.ranges import range_stats

        return range_stats(model, loss_fn, batches, scales, activations)

    def describe(self, model: torch.nn.Module) -> list:
        _refuse_torchscript(model)
        if unwrap(model) is not model:
            return self.describe(unwrap(model))
        if _is_ddp(model):  # the wrapped module's own paths: the keys apply_policy(ddp, ...) matches
            return self.describe(model.module)
        rows, placed = [], {}
        for path, _, module in named_layers(model):
            state = getattr(module, _STATE, None)
            if state is not None:
                policy, source = state["policy"], state["source"]
                placed[path] = policy
            else:
                policy, source = unplaced(module, path, placed)
            # fp8 runs where a layer was swapped for an fp8 one, not in its container or a dropout
            rows.append(LayerPolicy(path, type(module).__name__, policy, source,
                                    runs_float8=state is not None and "float8_original" in state))
        return rows


def _refuse_torchscript(model: Any) -> None:
    if isinstance(model, torch.jit.ScriptModule):
        raise TypeError(
            f"Received a TorchScript module ({type(model).__name__}): its code is compiled already, so a "
            f"policy can neither change nor read what its layers compute. Apply the policy to the "
            f"nn.Module, then trace it (torch.jit.trace records the casts) or compile it with "
            f"torch.compile; torch.jit.script cannot compile a module under a policy.")


def _is_ddp(model: Any) -> bool:
    parallel = getattr(getattr(torch, "nn", None), "parallel", None)
    return parallel is not None and isinstance(model, parallel.DistributedDataParallel)


def _follow_attention(module: torch.nn.Module, chain: Any, resolution: Resolution, parent: Any) -> Resolution:
    """torch's attention reads ``out_proj.weight`` itself and never calls out_proj's forward,
    so a policy of its own would be reported but never computed: it follows its parent."""
    if parent is None or not isinstance(parent.layer, torch.nn.MultiheadAttention) \
            or resolution.policy == parent.policy:
        return resolution
    where = parent.path or "the root"
    warnings.warn(
        f"The override {resolution.source!r} reaches {chain[-1].path!r}, which cannot take a policy "
        f"of its own: torch.nn.MultiheadAttention reads its weight directly and never calls its "
        f"forward. It follows {where!r} ({parent.policy}); to change it, put the override on the "
        f"MultiheadAttention module itself.", stacklevel=5)
    return Resolution(parent.policy, f"follows its MultiheadAttention {parent.path!r}", "inherited")


def _planned(model: torch.nn.Module, policy_map: Any, variables: Any) -> tuple:
    """(the user's paths -> named_modules()'s, the plan's steps) for `model`: checked, nothing changed."""
    head = _head(model)
    kept = declared.kept_float32(model)
    real = {}  # the user's path -> named_modules()'s (wrappers inside the model left out)
    listed = []
    for path, named, module in named_layers(model):
        real[path] = named
        kind = kept.get(id(module)) or _kind(module, head)
        listed.append((path, module, LayerInfo(path, type(module), kind, matmul=_matmul(module))))
    steps = plan(policy_map, dotted_chains(listed), variables=variables, fix="Call model.float()",
                 adjust=_follow_attention)
    refuse_sharded_changes(model, steps, variables, lambda step, inside: _gets_region(step, step.layer, inside))
    return real, steps


def _own_parameters(module: torch.nn.Module, path: str) -> list:
    """(path, dtype name) of the parameters `module` trains: a frozen one (``requires_grad=False``,
    the base of a LoRA model) is no master weight, whatever its dtype (its dtype None here)."""
    return [(join(path, name), _NAMES.get(p.dtype) if p.requires_grad else None)
            for name, p in module.named_parameters(recurse=False)]


def _before_policy(module: torch.nn.Module, path: str) -> list:
    """`_own_parameters` as they were before the policy on `module` (what `remove_policy` restores)."""
    before = (getattr(module, _STATE, None) or {}).get("dtypes", {})
    return [(join(path, name), _NAMES.get(before.get(name, p.dtype)) if p.requires_grad else None)
            for name, p in module.named_parameters(recurse=False)]


def _kept_frozen(p: torch.Tensor, policy: Policy) -> bool:
    """A frozen half-precision parameter under a policy that computes in half precision over
    float32 variables stays as it is (no float32 copy: a LoRA model's half base weights, which
    autocast casts per op as it casts them under Lightning's or the Hugging Face Trainer's own
    mixed precision); where the layer computes in float32 it is widened, as any other."""
    return (not p.requires_grad and p.dtype in (torch.float16, torch.bfloat16)
            and policy.variable_dtype == "float32" and policy.compute_dtype in ("float16", "bfloat16"))


class _LayerState(dict):
    """What `apply_policy` put on one module (kept in the module, read by `remove_policy` and
    `describe`), and the parameters it marked with the policy. ``copy.deepcopy(model)`` copies
    the module with this state but not the marks (``Parameter.__deepcopy__`` keeps only the data
    and ``requires_grad``): a copy marks the copied parameters as the originals were, so a
    `LossScaleOptimizer` over a deep-copied model follows its policy as over the original."""

    def __init__(self, **fields: Any) -> None:
        super().__init__(**fields)
        self.marked: list = []  # the module's own parameters when they were marked

    def __deepcopy__(self, memo: dict) -> _LayerState:
        copied = _LayerState()
        memo[id(self)] = copied
        copied.update({key: copy.deepcopy(value, memo) for key, value in self.items()})
        # the copies the model's copy holds (one memo for the whole deepcopy)
        copied.marked = copy.deepcopy(self.marked, memo)
        for p in copied.marked:
            p.__dict__[PARAMETER_POLICY] = copied["policy"]
        return copied


def _gets_region(step: Any, module: torch.nn.Module, inside_region: bool) -> bool:
    """Whether `step`'s layer gets a region of its own: where its policy changes, but for a
    plain float32 root (plain PyTorch; a loss or norm root still casts its half-precision
    inputs), a layer the model keeps in float32 (it computes as its own code does with float32
    weights) and a norm PyTorch's kernel computes in float32 inside its parent's autocast."""
    info, resolution = step.info, step.resolution
    plain_root = step.parent_policy is None and step.policy == _FLOAT32 and info.kind not in (NORMALIZATION, LOSS)
    own_code = info.kind in MODEL_KEPT and resolution.origin == "rule" and inside_region
    return (step.changes_policy and not plain_root and not own_code
            and not _kernel_norm(module, resolution, step.parent_policy))


def _kernel_norm(module: torch.nn.Module, resolution: Any, parent_policy: Policy | None) -> bool:
    """Whether a norm's float32 rule is met by PyTorch's kernel inside its parent's autocast."""
    policy = resolution.policy
    # Without float32 affine parameters the kernels compute in the input's dtype.
    return (isinstance(module, _FLOAT32_KERNEL_NORMS) and getattr(module, "weight", None) is not None
            and resolution.origin == "rule"
            and parent_policy is not None and _autocasts(parent_policy)
            and policy.compute_dtype == policy.variable_dtype == "float32"
            and policy.output_dtype == parent_policy.compute_dtype)


def remove_policy(model: torch.nn.Module) -> torch.nn.Module:
    """Undoes `apply_policy` on a module tree: forwards, parameter dtypes and the layers fp8
    replaced are restored."""
    for path, module in list(model.named_modules()):
        state = module.__dict__.pop(_STATE, None)
        if state is None:
            continue
        if "float8_original" in state:
            float8.restore(model, path, state["float8_original"])
        for p in module.parameters(recurse=False):
            p.__dict__.pop(PARAMETER_POLICY, None)
        for key in ("forward", "entry"):
            if key in state:
                uninstall(module, state[key])
        originals = state.get("originals", {})
        for name, dtype in state["dtypes"].items():
            for owner, attr in stored_at(module, name):  # (pruned or parametrized since: what it is made from)
                tensor = getattr(owner, attr)
                value = _restored(tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor,
                                  originals.get(name), dtype)
                if isinstance(tensor, torch.nn.Parameter):
                    tensor.data = value
                else:
                    setattr(owner, attr, value)
    return model


def _restored(current: torch.Tensor, original: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """`current` back in `dtype`: the original value wherever it was not changed since the cast.

    A value trained under the policy is kept (widened); one still equal to the
    rounded original gets its original, unrounded value back.
    """
    wide = current.to(dtype)
    if original is None or original.shape != current.shape or original.device != current.device:
        return wide
    try:  # (a tensor subclass put there since, torchao's quantized weights, has no original values left)
        return torch.where(current == original.to(current.dtype), original.to(dtype), wide)
    except (NotImplementedError, RuntimeError, TypeError):
        return wide
