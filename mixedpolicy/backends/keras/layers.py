"""Policies on Keras 3 layers (per-layer ``DTypePolicy``s), and Keras's global policy.

Keras tensors are their backend's arrays (jax, torch, tensorflow), whose own array
operations serve them; the loss-scale optimizer is `mixedpolicy.backends.keras.optimizer`.

- `sync_global_policy` mirrors mixedpolicy's global policy into
  ``keras.config.set_dtype_policy`` (`mixedpolicy._import_hook` does it when
  Keras is imported after ``set_global_policy``, without importing Keras otherwise);
- `apply_policy` resolves each layer's policy by its ``layer.path``, a glob or its
  class and sets ``layer.dtype_policy``: before the model is built, or after it
  (mixed and float32 policies keep float32 variables, so no variable changes);
- normalisation layers under a half-precision policy keep float32 variables and hand
  on the surrounding compute dtype (``mixed_<compute>``): Keras's own batch, layer and
  group norms already compute their statistics in float32 and cast the result to the
  compute dtype, so ``x + norm(x)`` stays in half precision on every backend;
- a ``dtype=`` the user wrote on a layer wins over the map's default, an enclosing
  override and the built-in rules; only a key that names the layer itself (its path,
  its ``layer.name``, a glob or its class) replaces it;
- `describe` reads each layer's ``dtype_policy`` back, so it shows what Keras runs.
- Keras keeps its global policy per thread; once mixedpolicy has set one, a thread
  that never set its own sees mixedpolicy's (the documented "visible to every thread"),
  through the wrapper of Keras's ``dtype_policy()`` in `mixedpolicy.backends.keras.patches`.

Keras layers output their compute dtype; a policy with another output dtype
(jmp-style ``o=f32``) has no Keras equivalent and is refused with the fix.
"""

from __future__ import annotations

import warnings
from typing import Any

import keras
from keras.src.backend.common import global_state

from mixedpolicy._adapter import ModelAdapter
from mixedpolicy._dtypes import HALF_DTYPES
from mixedpolicy.table import LayerPolicy, unapplied_source
from mixedpolicy.policy import Policy
from mixedpolicy.backends.keras import float8, patches
from mixedpolicy.backends.keras.quantized import refuse_float8, restored, source_name, weight_mode, with_source
from mixedpolicy.backends.keras.policy_maps import keep_through_save, own_policy, set_policy
from mixedpolicy.backends.keras.compile import (carry_updates_in_compile, compile_with_loss_scale,
                                                use_bounded_loss_scale_in_compile)
from mixedpolicy.backends.keras.reduce import reduce_engine
from mixedpolicy.layer_plan import plan
from mixedpolicy.policy_map import NORMALIZATION, LayerInfo

_STATE = "_mixedpolicy"
_NORM_NAMES = ("BatchNormalization", "LayerNormalization", "GroupNormalization",
               "RMSNormalization", "UnitNormalization", "SpectralNormalization")
_NORM_TYPES = tuple(getattr(keras.layers, n) for n in _NORM_NAMES if hasattr(keras.layers, n))
# Norms whose Keras kernels compute their statistics in float32 whatever the compute dtype.
_FLOAT32_STAT_NORMS = tuple(getattr(keras.layers, n) for n in
                            ("BatchNormalization", "LayerNormalization", "GroupNormalization")
                            if hasattr(keras.layers, n))

def _original_policy(layer: Any) -> Any:
    """The layer's dtype policy before mixedpolicy set one."""
    state = layer.__dict__.get(_STATE)
    return state[0] if state is not None else layer._dtype_policy


def _explicit_dtype(layer: Any, parent: Any) -> Any:
    """The DTypePolicy the user wrote on `layer` (``dtype=...``), or None if it follows another.

    A layer follows the global policy when it holds a global policy object, and its
    parent when it holds the parent's very object (Keras layers such as
    MultiHeadAttention build their sublayers with ``dtype=self.dtype_policy``).
    """
    policy = _original_policy(layer)
    if policy is None or patches.seen_globals.get(id(policy)) is policy or isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        return None
    if parent is not None and _original_policy(parent) is policy:
        return None
    return policy


def keras_name(policy: Policy) -> str | None:
    """The Keras DTypePolicy name with the same variable and compute dtypes, or None."""
    v, c = policy.variable_dtype, policy.compute_dtype
    if v == c:
        return c
    if v == "float32" and c in ("float16", "bfloat16"):
        return f"mixed_{c}"
    return None


def _keras_policy(policy: Policy, path: str) -> str:
    name = keras_name(policy)
    if name is None or policy.output_dtype != policy.compute_dtype:
        raise ValueError(
            f"Received the policy {policy.name} for Keras layer {path!r}: Keras layers output "
            f"their compute dtype and keep variables in float32 or in their compute dtype, so "
            f"this policy has no Keras equivalent. Use one of float32, float16, bfloat16, "
            f"mixed_float16, mixed_bfloat16 (add a float32 layer where you need float32 outputs).")
    return name


def _layers(model: Any) -> list[tuple[Any, list[LayerInfo]]]:
    """(layer, chain of LayerInfo from the root) for every layer, parents first."""
    out = []

    def visit(layer: Any, chain: list[LayerInfo]) -> None:
        if isinstance(layer, keras.layers.InputLayer):
            return
        kind = NORMALIZATION if isinstance(layer, _NORM_TYPES) else float8.kind(layer)
        # Keras assigns paths when a model is built; before that, the same path
        # from the layer names (parent's path / name).
        path = layer.path or (f"{chain[-1].path}/{layer.name}" if chain else layer.name)
        aliases = (layer.name,) if layer.name != path else ()
        chain = chain + [LayerInfo(path, type(layer), kind, aliases, float8.matmul(layer))]
        out.append((layer, chain))
        for child in layer._flatten_layers(include_self=False, recursive=False):
            visit(child, chain)

    visit(model, [])
    float8.mark_head(out)
    return out


class KerasModels(ModelAdapter):
    runs_float8 = True  # fp8 matmuls on the framework's own path (see float8.py beside)

    def is_model(self, obj: Any) -> bool:
        return isinstance(obj, keras.Layer)

    def apply_policy(self, model: Any, policy_map: Any) -> Any:
        patches.note_global()
        steps = plan(policy_map, _layers(model), reduce_engine=reduce_engine())
        by_path = {step.path: step.layer for step in steps}
        planned, kept = [], []
        for step in steps:
            layer, chain, resolution = step.layer, step.chain, step.resolution
            policy, source = resolution.policy, resolution.source
            explicit = _explicit_dtype(layer, by_path.get(chain[-2].path) if len(chain) > 1 else None)
            quantized = weight_mode(own_policy(layer))  # (Keras made it: not a dtype= of the user's)
            if explicit is not None and quantized is None and resolution.origin != "key" and layer is not model:
                planned.append((layer, explicit.name, f"the layer's own dtype={explicit.name!r}", None))
                continue
            if resolution.origin == "rule" and chain[-1].kind == NORMALIZATION:
                # float32 variables; Keras's own kernels compute the statistics in float32
                # and output the surrounding compute dtype (policy.output_dtype here)
                surrounding = policy.output_dtype
                policy = Policy(f"mixed_{surrounding}") if surrounding in ("float16", "bfloat16") else policy
                if not isinstance(layer, _FLOAT32_STAT_NORMS):
                    source += f" (float32 variables; {type(layer).__name__} computes in {surrounding})"
            name = _keras_policy(policy, chain[-1].path)
            own_variables = layer._trainable_variables + layer._non_trainable_variables
            built_dtype = own_policy(layer).variable_dtype
            if (own_variables and resolution.origin == "rule" and chain[-1].kind == NORMALIZATION
                    and built_dtype == resolution.policy.output_dtype != keras.DTypePolicy(name).variable_dtype):
                # Built under a pure global policy (a functional model's layers are built as it
                # is defined): its half variables cannot become float32, so it stays as Keras
                # built it (Keras's norms compute their statistics in float32 all the same).
                name = own_policy(layer).name
                source += f" (kept {built_dtype}: built before the policy was applied)"
                kept.append(chain[-1].path)
            elif own_variables and keras.DTypePolicy(name).variable_dtype != built_dtype:
                raise ValueError(
                    f"Received the policy {name} for the built layer {chain[-1].path!r}, whose "
                    f"variables are {own_policy(layer).variable_dtype}: Keras cannot change the "
                    f"dtype of existing variables. Apply the policy before the model is built "
                    f"(a subclassed model: before its first call or model.build); a functional "
                    f"model or a keras-hub backbone is built as it is made, so make it after "
                    f"mp.set_global_policy({name!r}) or with dtype={name!r}; or choose a policy "
                    f"with {own_policy(layer).variable_dtype} variables. Nothing was applied.")
            recipe = policy.float8_recipe if float8.eligible(layer) else None
            if quantized is not None:  # its integer weights stay; the policy becomes their source
                if recipe is not None:
                    raise refuse_float8(own_policy(layer), policy.name, chain[-1].path)
                planned.append((layer, with_source(own_policy(layer), name, chain[-1].path), source, None))
                continue
            if recipe is not None:
                float8.check(recipe, chain[-1].path, policy.reduce_dtype)
            planned.append((layer, name if recipe is None else float8.dtype_policy(name, recipe), source, recipe))
        if kept:
            warnings.warn(
                f"{len(kept)} normalization layer(s) ({', '.join(kept[:3])}{', ...' if len(kept) > 3 else ''}) "
                f"were built with half-precision variables, which Keras cannot make "
                f"float32: they keep them (as Keras's own pure policy does). For float32 norm variables "
                f"under a pure policy, apply the policy before the layers are built (a subclassed model "
                f"before its first call), or give those layers dtype='float32'.", stacklevel=3)
        remove_policy(model)
        for layer, name, source, recipe in planned:
            object.__setattr__(layer, _STATE, (layer._dtype_policy, source, type(layer)))
            set_policy(layer, keras.DTypePolicy(name) if isinstance(name, str) else name)  # delayed: Keras quantizes
            if recipe is not None and recipe.recipe == "tensorwise":
                float8.make_tensorwise(layer, recipe)
        keep_through_save([layer for layer, *_ in planned])
        scaled = any((keras.DTypePolicy(name) if isinstance(name, str) else name).compute_dtype == "float16"
                     for _, name, _, _ in planned)
        # a reduce dtype other than the variables' is carried by our optimizer (tf.distribute)
        reduced = any(step.policy.reduce_dtype != step.policy.variable_dtype for step in steps)
        updates = next((step.policy for step in steps if not step.policy.updates_as_the_optimizer_does), None)
        if isinstance(model, keras.Model) and (reduced or scaled or updates is not None):
            # this model's compile wraps in our optimizer itself (Keras's own compile wraps only
            # when the model is mixed_float16, and in its unbounded one): float16 layers anywhere
            # need the loss scale, and a reduce dtype our optimizer
            from mixedpolicy.backends.keras.reduce import by_layer_path

            object.__setattr__(model, "compile", compile_with_loss_scale(
                model, scaled, by_layer_path(policy_map, steps) if reduced else None, updates))
        return model

    def remove_policy(self, model: Any) -> Any:
        return remove_policy(model)

    def range_stats(self, model: Any, loss_fn: Any, batches: list, scales: tuple, activations: bool) -> dict:
        from mixedpolicy.backends.keras.ranges import range_stats

        return range_stats(model, loss_fn, batches, scales)

    def describe(self, model: Any) -> list:
        rows = []
        for layer, chain in _layers(model):
            state = layer.__dict__.get(_STATE)
            dtype_policy = own_policy(layer)
            quantized = weight_mode(dtype_policy)
            if quantized is not None:  # integer weights (model.quantize): the policy they compute in
                policy = Policy(source_name(dtype_policy))
            elif getattr(dtype_policy, "quantization_mode", None) == "float8":
                policy = Policy.from_keras(dtype_policy)
            else:
                policy = Policy(dtype_policy.name, float8_recipe=float8.tensorwise_recipe(layer))
            # a layer apply_policy left alone computes in its Keras dtype policy (the global one when
            # it was built, or its dtype=)
            source = state[1] if state is not None else unapplied_source(policy, "Keras dtype policy")
            rows.append(LayerPolicy(chain[-1].path, type(layer).__name__, policy, source, quantized=quantized))
        return rows


def remove_policy(model: Any) -> Any:
    model.__dict__.pop("compile", None)
    for layer, _ in _layers(model):
        state = layer.__dict__.pop(_STATE, None)
        if state is not None:
            set_policy(layer, restored(own_policy(layer), state[0], layer.path))
            if type(layer) is not state[2]:  # a tensorwise fp8 class: Keras's own back
                layer.__dict__.pop("_mixedpolicy_float8", None)
                layer.__class__ = state[2]
    return model


def sync_global_policy(policy: Policy) -> None:
    """Makes `policy` Keras's global dtype policy (the nearest one Keras can express)."""
    name = keras_name(policy)
    if name is None:
        warnings.warn(f"The global policy {policy.name} has no Keras equivalent; Keras layers "
                      f"built from now on keep Keras's policy {keras.config.dtype_policy().name}.",
                      UserWarning, stacklevel=4)
        return
    if policy.float8_recipe is not None:
        warnings.warn(f"The global policy {policy.name} runs matmuls in fp8; Keras has no global fp8 "
                      f"policy, so Keras layers built from now on follow {name}, and apply_policy puts "
                      f"fp8 on their matmuls.", UserWarning, stacklevel=4)
    elif policy.output_dtype != policy.compute_dtype:
        warnings.warn(f"The global policy {policy.name} asks for {policy.output_dtype} outputs; "
                      f"Keras layers output their compute dtype, so Keras follows {name}.",
                      UserWarning, stacklevel=4)
    patches.install()
    keras.config.set_dtype_policy(name)
    patches.note_global()
    # Keras keeps the policy per thread: a thread that set none sees this one.
    patches.process_policy[0] = global_state.get_global_attribute("dtype_policy")
    use_bounded_loss_scale_in_compile(name in ("float16", "mixed_float16"))
    # (also under half-precision variables: compile then warns of an optimizer that cannot train there)
    carry_updates_in_compile(not policy.updates_as_the_optimizer_does or policy.variable_dtype in HALF_DTYPES)


def to_keras(name: str, amax_history_len: int | None = None) -> Any:
    """The ``keras.DTypePolicy`` of a Keras policy name (`Policy.to_keras` checks the name); a
    ``float8_from_<source>`` name gives Keras's ``QuantizedFloat8DTypePolicy``."""
    if name.startswith("float8_from_"):
        return keras.dtype_policies.QuantizedFloat8DTypePolicy(
            "float8", name[len("float8_from_"):], amax_history_length=amax_history_len or 1024)
    return keras.DTypePolicy(name)


patches.install()  # when Keras is imported with mixedpolicy loaded (the import hook loads this module)
