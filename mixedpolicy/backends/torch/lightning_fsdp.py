"""The Lightning plugin under Lightning's ``FSDPStrategy`` (torch's ``FullyShardedDataParallel``),
and the ``MixedPrecision`` Accelerate's FSDP plugin gets under a policy (`accelerate_mixed_precision`).

The strategy takes only a subclass of Lightning's ``FSDPPrecision``, and reads from it the
``MixedPrecision`` it wraps the model with; it calls ``convert_module`` on the bare
LightningModule before wrapping it, so the policy's regions are in place around the parameters
FSDP then flattens and gathers. Here: what that ``MixedPrecision`` is for a policy (parameters
gathered as they are stored, the regions cast for compute; gradients reduce-scattered in the
policy's reduce dtype), what FSDP cannot carry out (several reduce dtypes in one model, the 8-bit
codecs, a pure policy whose float32 layers share a unit with its half-precision ones), refused
before the model is wrapped, and clipping by norm over the shards (FSDP's own
``clip_grad_norm_`` on the root, where ``torch.nn.utils.clip_grad_norm_`` would clip each rank's
shard by its own norm).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from mixedpolicy.backends.torch.arrays import PARAMETER_POLICY
from mixedpolicy.backends.torch.found_inf import FSDP1_SHARD
from mixedpolicy.policy_map import PolicyMap

_CARRIED = ("float32", "bfloat16", "float16")  # reduce dtypes FSDP's reduce-scatter carries
# the checkpoint keys of Lightning's own plugins (their GradScaler's state): MixedPrecision's, FSDPPrecision's
_THEIRS = ("MixedPrecision", "FSDPPrecision")
_log = logging.getLogger("mixedpolicy")


def fsdp_strategy(module: Any, packages: tuple) -> Any:
    """The strategy of `module`'s Trainer if it is the ``FSDPStrategy`` of one of the Lightning
    `packages` (the plugin's own), else None."""
    strategy = getattr(getattr(module, "_trainer", None), "strategy", None)
    kinds = tuple(pl.strategies.FSDPStrategy for pl in packages)
    return strategy if strategy is not None and isinstance(strategy, kinds) else None


def reduce_dtype(policy_map: PolicyMap) -> str:
    """The one dtype FSDP reduce-scatters every gradient in, as the policy says it.

    Raises:
      ValueError: an 8-bit reduce dtype, or overrides that reduce in another dtype than the
        default's (FSDP wraps every unit with one ``MixedPrecision``).
    """
    default = policy_map.default
    chosen = default.reduce_dtype
    if chosen not in _CARRIED:
        raise ValueError(
            f"Received the policy {default.name!r} with reduce_dtype={chosen!r} under Lightning's "
            f"FSDPStrategy, whose reduce-scatter carries only {list(_CARRIED)}. Use DDPStrategy for the "
            "8-bit codecs (its communication hook carries them), or a reduce dtype FSDP carries.")
    others = sorted({(key if isinstance(key, str) else getattr(key, "__name__", str(key)), p.reduce_dtype)
                     for key, p in policy_map.overrides if p is not None and p.reduce_dtype != chosen},
                    key=str)
    if others:
        raise ValueError(
            f"Received a PolicyMap whose default reduces gradients in {chosen} and whose overrides "
            f"reduce in other dtypes ({', '.join(f'{k!r}: {d}' for k, d in others)}), under Lightning's "
            f"FSDPStrategy, which reduce-scatters every unit in one dtype. Give the overrides "
            f"reduce_dtype={chosen!r} (e.g. mp.Policy('float32', reduce_dtype={chosen!r})), or shard "
            "with FSDP2's fully_shard per block with each policy's to_fsdp().")
    return chosen


def mixed_precision(policy_map: PolicyMap) -> Any:
    """torch FSDP's ``MixedPrecision`` for the policy: parameters gathered in the dtype they are
    stored in (the policy's regions cast them for compute, per layer), gradients reduced in the
    policy's reduce dtype where it is not the one they are stored in (else each in its own, as a
    pure policy's float32 norms need). Never None: Lightning's throughput monitor reads it."""
    from torch.distributed.fsdp import MixedPrecision

    dtype = reduce_dtype(policy_map)
    return MixedPrecision(reduce_dtype=None if dtype == policy_map.default.variable_dtype else getattr(torch, dtype))


def check_before_wrapping(module: torch.nn.Module, policy_map: PolicyMap, strategy: Any) -> None:
    """Refuses, before FSDP wraps `module` (under `policy_map`, applied), what FSDP would refuse
    deep inside its wrapping or carry out otherwise than the policy says.

    Raises:
      ValueError: see `reduce_dtype`; parameters of several dtypes (a pure policy's half-precision
        weights beside the float32 norms it keeps) while the strategy wraps the whole model as one
        unit, which FSDP flattens into one dtype.
    """
    reduce_dtype(policy_map)
    if (getattr(strategy, "kwargs", {}) or {}).get("auto_wrap_policy") is None:
        refuse_one_unit_of_several_dtypes(
            module, f"the policy {policy_map.default.name!r} under Lightning's FSDPStrategy",
            "Give FSDPStrategy an auto_wrap_policy that makes those layers units of their own, e.g. "
            "ModuleWrapPolicy({torch.nn.LayerNorm, ...}) with the blocks")


def refuse_one_unit_of_several_dtypes(module: torch.nn.Module, received: str, fix: str) -> None:
    """Refuses to let FSDP wrap `module` as one unit where its parameters are of several dtypes
    (layers a policy keeps in float32, such as norms, or frozen half-precision weights beside
    trained float32 ones): FSDP flattens a unit into one dtype.

    Raises:
      ValueError: naming `received` (what was given, and where) and `fix` (how to split the units).
    """
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in module.parameters() if p.is_floating_point()})
    if len(dtypes) > 1:
        raise ValueError(
            f"Received {received}, the model's parameters {dtypes} (layers the policy keeps in float32, "
            "such as norms, or frozen half-precision weights beside trained float32 ones), and no "
            f"auto_wrap_policy: FSDP flattens one unit into one dtype. {fix}, or keep every weight in one "
            "dtype (a mixed policy such as 'bf16-mixed' over float32 weights).")


class ShardedPlugin:
    """What the plugin adds for Lightning's ``FSDPStrategy`` (it is also a subclass of Lightning's
    ``FSDPPrecision``, the only plugin that strategy takes; elsewhere these do what Lightning's
    base plugin does), and the checkpoint keys of Lightning's own plugins. Needs ``policy_map``,
    ``_module`` (the LightningModule, once converted), ``optimizer`` and ``load_state_dict``."""

    policy_map: PolicyMap
    _module: Any
    optimizer: Any
    lightning_packages: tuple  # set on the class `precision_class` builds

    def _plain(self) -> Any:
        """Lightning's base ``Precision`` (of the first package): what the plugin's methods hand
        on to, where ``super()`` would reach ``FSDPPrecision``'s, which need its own state (its
        precision string, its scaler). Nor does ``__init__`` call ``super().__init__()``."""
        return self.lightning_packages[0].plugins.precision.Precision

    @property
    def mixed_precision_config(self) -> Any:
        """The ``MixedPrecision`` Lightning's FSDPStrategy wraps the model with (see `mixed_precision`);
        its throughput monitor reads it under every strategy, so what FSDP cannot carry is refused
        elsewhere (`_check_sharding`, `_check_sharded_optimizers`), never here."""
        try:
            return mixed_precision(self.policy_map)
        except ValueError:
            from torch.distributed.fsdp import MixedPrecision

            return MixedPrecision()

    def _check_sharded_optimizers(self, optimizers: list) -> None:
        """Optimizers of FSDP's parameters (under Fabric, the first place the plugin sees FSDP):
        refuses a policy whose reduce dtypes FSDP cannot carry, before any step (see `reduce_dtype`)."""
        if any(getattr(p, FSDP1_SHARD, False) for opt in optimizers for g in opt.param_groups for p in g["params"]):
            reduce_dtype(self.policy_map)

    def _check_sharding(self, module: torch.nn.Module) -> None:
        """Under FSDPStrategy, what FSDP cannot carry out, refused with the policy taken off again
        (the module as it was given: a pure policy gives back its unrounded values)."""
        strategy = fsdp_strategy(module, self.lightning_packages)
        if strategy is None:
            return
        try:
            check_before_wrapping(module, self.policy_map, strategy)
        except ValueError:
            from mixedpolicy.api import remove_policy

            remove_policy(module)
            raise

    def clip_grad_by_norm(self, optimizer: Any, clip_val: Any) -> None:
        """Under FSDP, by the norm over every rank's shards with FSDP's own ``clip_grad_norm_`` on
        the root (on every rank, as Lightning calls it; Lightning's ``FSDPPrecision`` refuses norm
        clipping); elsewhere ``torch.nn.utils.clip_grad_norm_``, as Lightning's base plugin."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        strategy = fsdp_strategy(self._module, self.lightning_packages)
        if strategy is None:
            torch.nn.utils.clip_grad_norm_(self.main_params(optimizer), clip_val)  # type: ignore[attr-defined]
        elif isinstance(strategy.model, FullyShardedDataParallel):
            strategy.model.clip_grad_norm_(clip_val)
        else:  # submodules wrapped by hand (configure_sharded_model): no root knows every shard
            raise ValueError(
                f"Received gradient_clip_algorithm='norm' under Lightning's FSDPStrategy with a root "
                f"module of type {type(strategy.model).__name__}, not FullyShardedDataParallel: each rank "
                f"would clip its shards by their own norm. Let the strategy wrap the root (an "
                f"auto_wrap_policy in place of wrapping by hand), or clip by value "
                f"(gradient_clip_algorithm='value').")

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        # the scale also where Lightning's own 16-mixed keeps it, in GradScaler's format (under
        # FSDPStrategy, where its FSDPPrecision keeps it): a run resumed with Lightning's own
        # Trainer(precision="16-mixed") goes on from it
        if self.optimizer is not None and self.optimizer.is_enabled():
            sharded = fsdp_strategy(self._module, self.lightning_packages) is not None
            checkpoint[_THEIRS[sharded]] = self.optimizer.scaler_state_dict()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # a checkpoint of Lightning's own 16-mixed (no state of ours): its GradScaler's scale
        key = next((key for key in _THEIRS if checkpoint.get(key)), None)
        if key is not None and type(self).__qualname__ not in checkpoint:
            _log.info("Reading the loss scale Lightning's %s saved in the checkpoint (%s)", key,
                      checkpoint[key].get("scale"))
            self.load_state_dict(checkpoint[key])


def accelerate_mixed_precision(model: torch.nn.Module, plugin: Any) -> Any:
    """What Accelerate's ``FullyShardedDataParallelPlugin`` wraps `model` with under the
    policies on its parameters: FSDP's ``MixedPrecision`` (``fsdp_version=1``) or FSDP2's
    ``MixedPrecisionPolicy``, parameters gathered as stored (the policy's regions cast them for
    compute), gradients reduce-scattered in the policies' reduce dtype (each in its own dtype
    where every policy reduces in its variable dtype, as a pure policy's float32 norms need).
    The plugin's own policy is returned where no policy is on the model.

    Raises:
      ValueError: a ``mixed_precision_policy`` on the plugin that casts the parameters or reduces
        otherwise; reduce dtypes FSDP cannot carry (8-bit) or several of them; parameters of
        several dtypes with no ``auto_wrap_policy`` (FSDP flattens a unit into one dtype).
    """
    trained = [p for p in model.parameters() if p.requires_grad]
    policies = {p.__dict__[PARAMETER_POLICY] for p in trained if PARAMETER_POLICY in p.__dict__}
    if not policies:
        return plugin.mixed_precision_policy
    where = "Accelerate's FSDP plugin"
    dtypes = sorted({p.reduce_dtype for p in policies})
    if not set(dtypes) <= set(_CARRIED) or (len(dtypes) > 1 and any(p.reduce_dtype != p.variable_dtype
                                                                     for p in policies)):
        raise ValueError(
            f"Received a model whose policies reduce gradients in {dtypes} under {where}, whose "
            f"reduce-scatter carries one dtype of {list(_CARRIED)} for the whole model. Give every "
            "policy one reduce dtype FSDP carries (e.g. mp.Policy('mixed_bfloat16', reduce_dtype='bfloat16')); "
            "the 8-bit codecs go through DDP (mp.torch.register(ddp_model, policy) puts them in its communication hook).")
    each_own = all(p.reduce_dtype == p.variable_dtype for p in policies)
    reduce = None if each_own else getattr(torch, dtypes[0])
    given = plugin.mixed_precision_policy
    same = {None, reduce} | ({getattr(torch, dtypes[0])} if len(dtypes) == 1 else set())  # (said outright)
    if given is not None and (getattr(given, "param_dtype", None) is not None
                              or getattr(given, "reduce_dtype", None) not in same):
        raise ValueError(
            f"Received {where} with mixed_precision_policy={given!r} for a model under a mixedpolicy "
            f"policy: FSDP would cast the parameters (or reduce in another dtype) beside the policy's "
            f"own regions. Leave mixed_precision_policy unset: the policy says the compute dtype per "
            f"layer and the reduce dtype ({dtypes[0] if reduce is not None else 'each parameter its own'}).")
    if plugin.auto_wrap_policy is None:  # (Accelerate reads "NO_WRAP" as None)
        refuse_one_unit_of_several_dtypes(
            model, f"a model under a policy and {where}",
            "Give the plugin auto_wrap_policy='transformer_based_wrap' (or a policy that makes those "
            "layers units of their own)")
    if plugin.fsdp_version == 2:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(reduce_dtype=reduce)
    from torch.distributed.fsdp import MixedPrecision

    return MixedPrecision(reduce_dtype=reduce)


def fsdp_precision(precision: type) -> type:
    """The ``FSDPPrecision`` beside the ``Precision`` class `precision` (its own module's package)."""
    import importlib

    return importlib.import_module(precision.__module__.rsplit(".", 1)[0]).FSDPPrecision
