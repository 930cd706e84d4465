"""Lightning's precision plugin and callback, built on the torch `LossScaleOptimizer`.

`precision_class(*pls)` and `callback_class(*pls)` subclass the ``Precision`` plugin and the
``Callback`` of the Lightning packages in use (``pytorch_lightning``, ``lightning.pytorch``, or
both where a process imports both: each Trainer accepts only its own); `mixedpolicy.lightning`
hands out those of the packages imported.

In a Trainer, in the order Lightning's own ``MixedPrecision`` keeps: ``convert_module`` puts the
policy (or `PolicyMap`) on the LightningModule before the optimizers are made; ``connect`` wraps
them in one `LossScaleOptimizer` (one scale, as one ``GradScaler``); ``pre_backward`` scales the
loss; ``optimizer_step`` runs the closure, unscales (clipping and ``on_before_optimizer_step``
see true gradients), then steps, skipping a non-finite step; the scale goes into the checkpoint.
Under Fabric, which never calls ``connect`` and hands over each optimizer only at its step:
``backward`` scales, ``unscale_gradients`` and ``optimizer_step`` adopt the optimizer into the one
wrapper and act on it alone; ``fabric.save(path, {..., "precision": plugin})`` carries the scale.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from mixedpolicy.backends.torch.regions import (cast_floating, cast_inputs, device_type, policy_autocast,
                                                region_context)
from mixedpolicy.backends.torch.found_inf import any_gradient
from mixedpolicy.backends.torch.lightning_fsdp import ShardedPlugin, fsdp_precision
from mixedpolicy.backends.torch.optimizer import TorchLossScaleOptimizer
from mixedpolicy.backends.torch.scaler_view import GRADSCALER_INITIAL_SCALE, GradScalerView
from mixedpolicy.loss_scale import DynamicLossScale, LossScale, NoLossScale, summary
from mixedpolicy.policy_map import PolicyMap, as_policy_map
from mixedpolicy.scope import global_policy

#: a policy's (variable, compute) dtypes -> the precision string Lightning reports for it
#: (``trainer.precision``, which its model summary reads), whatever else the policy says
_LIGHTNING_NAMES = {("float32", "float16"): "16-mixed", ("float32", "bfloat16"): "bf16-mixed",
                    ("float32", "float32"): "32-true", ("float16", "float16"): "16-true",
                    ("bfloat16", "bfloat16"): "bf16-true", ("float64", "float64"): "64-true"}
_built: dict = {}


def _loss_scale_for(policy_map: PolicyMap, settings: dict, loss_scale: LossScale | None) -> LossScale:
    """The scale `settings` or `loss_scale` describe; else a bounded dynamic scale from
    GradScaler's start (Lightning's own ``16-mixed`` starts there) where a policy computes in
    float16 over float32 variables; otherwise no scaling, non-finite steps skipped
    (under a pure float16 policy too, as Lightning's "16-true" has no scaler; a
    LossScaleOptimizer the user makes under that policy scales, as the optax and Keras ones do)."""
    from mixedpolicy.optimizer import scale_from_settings, trainer_scale_settings

    if loss_scale is None:  # (a loss_scale given with settings is refused naming only those given)
        settings = trainer_scale_settings(settings, GRADSCALER_INITIAL_SCALE)
    chosen = scale_from_settings(settings, loss_scale)
    if chosen is not None:
        return chosen
    policies = (policy_map.default, *(p for _, p in policy_map.overrides))
    mixed16 = any(p is not None and p.compute_dtype == "float16" and p.variable_dtype != "float16"
                  for p in policies)
    return DynamicLossScale(loss_scale=GRADSCALER_INITIAL_SCALE) if mixed16 else NoLossScale()


def _unwrap(optimizer: Any) -> Any:
    return getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer holds the torch one


class PolicyPrecision(ShardedPlugin):
    """A Lightning precision plugin that trains under a mixedpolicy policy or `PolicyMap`.

    ``Trainer(plugins=[mixedpolicy.lightning.Precision("mixed_float16", {"head": "float32"})])``:
    the policy with its overrides goes on the LightningModule (per-layer autocast regions,
    norms in float32), the loss is scaled where a layer computes in float16 over float32
    weights, gradients are unscaled before clipping, a step whose gradients are not all
    finite is skipped and counted under every policy, and the scale with its counters is
    saved in and restored from the Trainer's checkpoint. Return plain torch optimizers from
    ``configure_optimizers``: the plugin wraps them. In Lightning Fabric
    (``Fabric(plugins=[...])``) it does the same for a hand-written loop: set up plain optimizers,
    and put the plugin in the state ``fabric.save`` writes to keep the scale.

    Args:
      policy: a `Policy`, its name (Lightning's ``"16-mixed"``, ``"bf16-mixed"`` too) or a
        `PolicyMap`; None takes the global policy.
      overrides: per-layer overrides, as for `PolicyMap` (not with a `PolicyMap`).
      initial_scale, dynamic_growth_steps, growth_factor, backoff_factor, min_scale,
        max_scale: settings of the dynamic scale, as `LossScaleOptimizer` takes them; the
        scale starts where Lightning's own ``16-mixed`` (a ``GradScaler``) starts, at 2**16.
      loss_scale: a ready `LossScale`, used as it is.

    Raises:
      ValueError, TypeError: a bad policy or setting, named with what is valid.
    """

    def __init__(self, policy: Any = None, overrides: Any = None, *, initial_scale: Any = None,
                 dynamic_growth_steps: Any = None, growth_factor: Any = None, backoff_factor: Any = None,
                 min_scale: Any = None, max_scale: Any = None, loss_scale: LossScale | None = None):
        self.policy_map = as_policy_map(policy, overrides)
        if self.policy_map.default is None:  # the global policy now, as a script would read it
            self.policy_map = self.policy_map.with_default(global_policy())
        settings = dict(initial_scale=initial_scale, dynamic_growth_steps=dynamic_growth_steps,
                        growth_factor=growth_factor, backoff_factor=backoff_factor, min_scale=min_scale,
                        max_scale=max_scale)
        self._loss_scale = _loss_scale_for(self.policy_map, settings, loss_scale)
        default = self.policy_map.default
        self.precision = _LIGHTNING_NAMES.get((default.variable_dtype, default.compute_dtype), default.name)
        self.optimizer: TorchLossScaleOptimizer | None = None  # the Trainer's optimizers, once connected
        self._pending_state: dict | None = None
        self._module: torch.nn.Module | None = None  # the LightningModule, once converted
        self._in_trainer = False  # a Trainer connected its optimizers; else Fabric runs the plugin
        self._unscaled: list = []  # under Fabric: (optimizer, found-inf flag) clipped, before their steps

    @property
    def loss_scaling(self) -> str:
        """What the plugin does to each step (dynamic scaling, or none with the skip)."""
        return summary(self._loss_scale)

    @property
    def scaler(self) -> Any:
        """GradScaler's interface to the scale (``get_scale()``, ``state_dict()``...), as
        Lightning's ``MixedPrecision`` has it: None where nothing is scaled (its bf16-mixed)."""
        if self.optimizer is None or not self.optimizer.is_enabled():
            return None
        return GradScalerView(self.optimizer)

    # -- the module ---------------------------------------------------------------
    @contextlib.contextmanager
    def tensor_init_context(self) -> Iterator[None]:
        # a pure policy (half-precision weights): tensors made here, and modules made in
        # ``trainer.init_module()`` / ``fabric.init_module()``, in its dtype from the start, as
        # Lightning's own "bf16-true" makes them (no float32 copy at twice the memory first);
        # convert_module then keeps in float32 what the policy keeps there (norms, overrides)
        dtype, before = self.policy_map.default.variable_dtype, torch.get_default_dtype()
        torch.set_default_dtype(getattr(torch, dtype) if dtype in ("float16", "bfloat16") else before)
        try:
            yield
        finally:
            torch.set_default_dtype(before)

    def module_init_context(self) -> Any:
        return self.tensor_init_context()

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        from mixedpolicy.api import apply_policy

        # Made where both Lightning packages are imported, the plugin subclasses both (each
        # Trainer takes only its own); it becomes the plugin of the module's package alone, whose
        # inherited methods agree with its Trainer (the two packages' enums differ: clipping
        # by the other's GradClipAlgorithmType would clip nothing).
        packages = getattr(type(self), "lightning_packages", ())
        for pl in packages if len(packages) > 1 else ():
            if isinstance(module, pl.LightningModule):
                self.__class__ = precision_class(pl)
                break
        self._module = apply_policy(module, self.policy_map)
        self._check_sharding(self._module)  # under FSDPStrategy: before it wraps the module
        return self._module

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        # the steps run in the module's region, as Lightning's own plugins run them in theirs: a
        # training_step calling self.net(x), not self(x), computes as describe says (the regions
        # inside set their own state); a pure policy's steps make tensors in its dtype (bf16-true's)
        with self.tensor_init_context():
            with contextlib.nullcontext() if self._module is None else self.autocast_context_manager():
                yield

    def autocast_context_manager(self) -> Any:
        """The autocast the steps run under (Lightning's ``MixedPrecision`` has this method): the
        module's own policy once the plugin has it, on the module's device, else the plugin's
        default policy, on the GPU where torch has one; no cache of cast weights, as Lightning's."""
        if self._module is not None:
            return region_context(self._module, device_type((), {}, self._module))
        return policy_autocast(self.policy_map.default, "cuda" if torch.cuda.is_available() else "cpu")

    def convert_input(self, data: Any) -> Any:
        # a pure (half-precision variables) policy: the batch's floating tensors in its compute
        # dtype, as Lightning's own "bf16-true" casts them
        return self._plain().convert_input(self, data if self._module is None else cast_inputs(self._module, data))

    def convert_output(self, data: Any) -> Any:
        # Fabric: the loss is computed outside the model, where no region runs; the model's
        # floating outputs come back in torch's default dtype, as Fabric's own plugins give them
        if self._in_trainer:
            return self._plain().convert_output(self, data)
        return cast_floating(data, torch.get_default_dtype())

    def connect(self, model: Any, optimizers: list, lr_schedulers: list) -> tuple:
        self._in_trainer = True
        inners = [_unwrap(o) for o in optimizers]
        for opt in inners:
            if isinstance(opt, TorchLossScaleOptimizer):
                raise TypeError(
                    "Received a mixedpolicy LossScaleOptimizer from configure_optimizers together "
                    "with mixedpolicy.lightning.Precision, which scales the loss itself: the "
                    "gradients would be scaled twice. Return the plain torch optimizer "
                    "(opt.inner_optimizer); pass the scale settings to Precision(...).")
        if inners:
            self._wrap(inners)
        return self._plain().connect(self, model, optimizers, lr_schedulers)

    def _policies(self) -> tuple:
        return (self.policy_map.default, *(p for _, p in self.policy_map.overrides))

    def _wrap(self, inners: list) -> TorchLossScaleOptimizer:
        """The one wrapper over `inners` (a Trainer's optimizers; none yet under Fabric)."""
        self._with_updates(inners)
        # the plugin's policies say which half-precision weights are their own (a pure policy's),
        # whatever the scale: refused elsewhere, under a scale set by hand too
        dtypes = frozenset(p.variable_dtype for p in self._policies())
        wrapper = TorchLossScaleOptimizer(inners, self._loss_scale, dtypes)
        self.optimizer = wrapper
        if self._pending_state is not None:
            wrapper.load_scaler_state_dict(self._pending_state)
            self._pending_state = None
        return wrapper

    def _with_updates(self, inners: list) -> None:
        self._check_sharded_optimizers(inners)
        if inners:  # an update recipe (stochastic rounding, a state dtype): the optimizers carry it out
            from mixedpolicy.backends.torch.optimizer import TorchOptimizers
            from mixedpolicy.optimizer import _with_updates

            _with_updates(TorchOptimizers(), inners, self._policies())

    def _fabric_wrapper(self, optimizer: Any = None) -> TorchLossScaleOptimizer:
        """Under Fabric: the one wrapper, made at the first backward or step, adopting `optimizer`
        (the raw one a ``_FabricOptimizer`` steps) the first time it is seen."""
        wrapper = self.optimizer if self.optimizer is not None else self._wrap([])
        inner = _unwrap(optimizer)
        if inner is not None and not any(inner is o for o in wrapper._inners):
            if isinstance(inner, TorchLossScaleOptimizer):
                raise TypeError(
                    "Received a mixedpolicy LossScaleOptimizer in fabric.setup together with "
                    "mixedpolicy.lightning.Precision, which scales the loss itself: the gradients "
                    "would be scaled twice. Set up the plain torch optimizer (opt.inner_optimizer); "
                    "pass the scale settings to Precision(...).")
            self._with_updates([inner])
            wrapper._adopt(inner)
        return wrapper

    # -- backward and step --------------------------------------------------------
    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        if not self._in_trainer:  # Fabric: no Trainer hooks, and it drops what this returns
            return tensor
        if self.optimizer is not None:
            tensor = self.optimizer.scale_loss(tensor)
        return self._plain().pre_backward(self, tensor, module)

    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        if self._in_trainer:
            return self._plain().backward(self, tensor, model, *args, **kwargs)
        self._fabric_wrapper().scale_loss(tensor).backward(*args, **kwargs)

    def post_backward(self, tensor: torch.Tensor, module: Any) -> Any:
        return self._plain().post_backward(self, tensor, module) if self._in_trainer else tensor.detach()

    def unscale_gradients(self, optimizer: Any) -> None:
        """Fabric's ``clip_gradients``: the gradients of `optimizer` unscaled, once a step. Under
        Fabric several optimizers' may wait unscaled for their steps, each with its own found-inf
        flag (GradScaler's ``update()`` after the first step unscales the others' a second time)."""
        wrapper = self.optimizer if self._in_trainer else self._fabric_wrapper(optimizer)
        inner = _unwrap(optimizer)
        if wrapper is None or any(o is inner for o, _ in self._unscaled) or (self._in_trainer and wrapper._unscaled):
            return
        with wrapper.acting_on(inner):
            wrapper.unscale_()
            if not self._in_trainer:  # its flag kept aside, for its step
                found = wrapper._found_inf
                self._unscaled.append((inner, None if found is None else found.clone()))
                wrapper._unscaled, wrapper._found_inf = False, None
                wrapper._checks.clean.clear()  # the device's flag holds this answer: zeroed next time

    def optimizer_step(self, optimizer: Any, model: Any = None, closure: Callable[[], Any] | None = None,
                       **kwargs: Any) -> Any:
        if not self._in_trainer:  # Fabric: optimizer.step(closure=None) of a _FabricOptimizer
            wrapper, inner = self._fabric_wrapper(optimizer), _unwrap(optimizer)
            waiting = next((i for i, (o, _) in enumerate(self._unscaled) if o is inner), None)
            with wrapper.acting_on(inner):
                if waiting is not None:  # clipped: unscaled already, with its own flag
                    wrapper._unscaled, wrapper._found_inf = True, self._unscaled.pop(waiting)[1]
                try:
                    return wrapper.step(closure, **kwargs)
                finally:
                    if waiting is not None:  # the device's flag may hold another's answer
                        wrapper._checks.clean.clear()
        if self.optimizer is None:
            return self._plain().optimizer_step(self, optimizer, model=model, closure=closure, **kwargs)
        inner = _unwrap(optimizer)
        if isinstance(inner, torch.optim.LBFGS):
            raise TypeError("Received torch.optim.LBFGS with mixedpolicy.lightning.Precision: it "
                            "re-evaluates the closure inside its step, which the plugin's check of "
                            "the gradients cannot follow. Use a first-order optimizer.")
        closure_result = closure()
        automatic = getattr(model, "automatic_optimization", True)
        # automatic optimization whose training_step returned None: no backward, no step
        skip_backward = closure_result is None and automatic
        if automatic and not skip_backward and not self.optimizer._unscaled and not any_gradient([inner]):
            # a backward the loop skipped itself (StochasticWeightAveraging's last epoch, which only
            # updates the batch norms' statistics): nothing to unscale or check; the inner step, a
            # no-op on parameters without gradients, as under Lightning's own bf16-mixed (its
            # 16-mixed fails there: "No inf checks were recorded")
            self._after_closure(model, optimizer)
            inner.step(**kwargs)
            return closure_result
        with self.optimizer.acting_on(inner):
            if not skip_backward and not self.optimizer._unscaled:
                self.optimizer.unscale_()  # clipping and on_before_optimizer_step see true gradients
            self._after_closure(model, optimizer)
            if skip_backward:
                self.optimizer._after_step()
                return closure_result
            self.optimizer.step(**kwargs)
        return closure_result

    def clip_gradients(self, optimizer: Any, clip_val: Any = 0.0, gradient_clip_algorithm: Any = None) -> None:
        # (no gradient: a training_step that returned None, whose batch is skipped; nothing to clip)
        if self.optimizer is not None and clip_val and clip_val > 0 and not self.optimizer._unscaled \
                and any_gradient([_unwrap(optimizer)]):
            with self.optimizer.acting_on(_unwrap(optimizer)):
                self.optimizer.unscale_()  # manual optimization: clip true gradients, not scaled ones
        kwargs = {} if gradient_clip_algorithm is None else {"gradient_clip_algorithm": gradient_clip_algorithm}
        self._plain().clip_gradients(self, optimizer, clip_val=clip_val, **kwargs)

    # -- checkpoints ----------------------------------------------------------------
    def state_dict(self) -> dict:
        if self.optimizer is None:
            return {}
        return self.optimizer.state_dict()["loss_scale"]

    def load_state_dict(self, state_dict: dict) -> None:
        if not state_dict:
            return
        if self.optimizer is None:  # restored before the optimizers are connected
            self._pending_state = dict(state_dict)
            return
        self.optimizer.load_scaler_state_dict(state_dict)


def precision_class(*pls: Any) -> type:
    """The ``Precision`` plugin subclass for the Lightning packages `pls` (built once): `PolicyPrecision`
    over each package's ``FSDPPrecision`` and its Fabric's (each a ``Precision``, and the only
    plugin the package's ``FSDPStrategy`` takes), so that a Trainer or Fabric of either accepts it
    under every strategy."""
    key = ("precision", *(pl.__name__ for pl in pls))
    if key not in _built:
        plain = [pl.plugins.precision.Precision for pl in pls]
        fabric = [next(c for c in base.__mro__[1:] if c.__name__ == "Precision") for base in plain]
        bases = [fsdp_precision(base) for base in plain + fabric]
        _built[key] = type("Precision", (PolicyPrecision, *bases),
                           {"__module__": "mixedpolicy.lightning", "__qualname__": "Precision",
                            "__doc__": PolicyPrecision.__doc__, "lightning_packages": pls})
    return _built[key]
