"""Keras's ``DTypePolicyMap``: per-layer policies that survive a save of a keras-hub model.

A keras-hub ``Backbone`` keeps one ``dtype`` in its config and makes its layers again from it
when a model loads (its transformer blocks build their sublayers themselves): a policy set on
one of those layers would be gone after ``keras.saving.load_model``. Keras's answer, which
keras-hub uses for quantized layers, is a ``DTypePolicyMap`` as the backbone's policy: the
layers look their own path up in it as they are made again. `keep_through_save` gives each
backbone such a map of its layers' policies; a layer that holds a map (a loaded model's) is
given its own policy by `set_policy` without writing into the map its siblings share.
"""

from __future__ import annotations

import re
from typing import Any

import keras
from keras.dtype_policies import DTypePolicyMap


def holds_map(layer: Any) -> bool:
    return isinstance(layer._dtype_policy, DTypePolicyMap)


def own_policy(layer: Any) -> Any:
    """The layer's policy, looked up by its path where it holds a map."""
    policy = layer._dtype_policy
    if isinstance(policy, DTypePolicyMap):
        return policy[layer.path] if layer.path else policy.default_policy
    return policy


def set_policy(layer: Any, value: Any) -> None:
    """Sets `layer`'s policy to `value` (a policy, a name or a map to hold as it is)."""
    if isinstance(value, DTypePolicyMap):
        layer._dtype_policy = value
        return
    if holds_map(layer):  # Keras's setter would write into the map the layer shares with its siblings
        layer._dtype_policy = own_policy(layer)
    layer.dtype_policy = value


def _keras_hub(layer: Any, name: str) -> bool:
    return any(c.__name__ == name and c.__module__.startswith("keras_hub") for c in type(layer).__mro__)


def _key(path: str, paths: list) -> str:
    """The map's key for `path`: Keras numbers a layer it names itself by a count of the
    process (``softmax_3``), which another process (or a second load) counts differently, so
    the last part's number may differ where that still matches one layer only."""
    parent, _, name = path.rpartition("/")
    tolerant = (re.escape(parent) + "/" if parent else "") + re.escape(re.sub(r"_\d+$", "", name)) + r"(?:_\d+)?"
    return tolerant if sum(re.fullmatch(tolerant, p) is not None for p in paths) == 1 else re.escape(path)


def keep_through_save(layers: list) -> None:
    """Gives each keras-hub backbone among `layers` a map of the policies its layers hold where
    they differ from its own, so that they load with them; a keras-hub task's map (on its
    backbone, whose policy the task makes its head layers with) covers the head too."""
    serialize = keras.dtype_policies.serialize
    tasks = [task for task in layers if _keras_hub(task, "Task") and _keras_hub(getattr(task, "backbone", None), "Backbone")]
    done = {id(task.backbone) for task in tasks}
    owners = [(task.backbone, task) for task in tasks] + [
        (layer, layer) for layer in layers if _keras_hub(layer, "Backbone") and id(layer) not in done]
    for backbone, owner in owners:
        if holds_map(backbone):
            continue
        own = serialize(backbone.dtype_policy)
        inside = [layer for layer in owner._flatten_layers(include_self=False) if layer.path and layer is not backbone]
        paths = [layer.path for layer in inside]
        entries = {_key(layer.path, paths): layer.dtype_policy for layer in inside
                   if not holds_map(layer) and serialize(layer.dtype_policy) != own}
        if entries:
            backbone._dtype_policy = DTypePolicyMap(backbone.dtype_policy, entries)


def policies_in(dtype_policy: Any) -> list:
    """The Keras policies a global policy applies: a map's default and its entries, else itself."""
    if isinstance(dtype_policy, DTypePolicyMap):
        return [dtype_policy.default_policy, *dtype_policy.values()]
    return [dtype_policy]
