"""Framework adapters and the registry that finds one from an object's type.

An adapter is chosen by the type of the object it is given. A framework is never
imported just to check: an adapter is only asked about an object once its
framework's top-level module is already in ``sys.modules`` (if it were not, the
object could not be one of its types). The answer is cached per type.
"""

from __future__ import annotations

import importlib
import sys
import threading
import weakref
from typing import Any, NamedTuple

from mixedpolicy.backends.base import Adapter


class _Entry(NamedTuple):
    name: str          # adapter name
    module: str        # top-level module that gates it
    target: str        # "package.module:Class"
    models: str = ""   # words for errors: the models it accepts
    optimizers: str = ""  # ... and the optimizers


# Order matters: the first adapter that claims an object wins. Keras comes before
# torch and tensorflow because a Keras 3 layer on the torch backend is also a
# torch.nn.Module. numpy comes last: other frameworks accept numpy leaves too.
_ENTRIES: list[_Entry] = [
    _Entry("keras", "keras", "mixedpolicy.backends.keras_backend:KerasAdapter",
           models="a Keras 3 layer or model",
           optimizers="a Keras 3 optimizer (any backend; TensorFlow's optimizers are Keras's)"),
    _Entry("torch", "torch", "mixedpolicy.backends.torch_backend:TorchAdapter",
           models="a torch.nn.Module", optimizers="a torch.optim.Optimizer (or a list of them)"),
    _Entry("tensorflow", "tensorflow", "mixedpolicy.backends.tf_backend:TensorFlowAdapter",
           models="a tf.Module"),
    _Entry("jax", "jax", "mixedpolicy.backends.jax_backend:JaxAdapter",
           models="a Flax NNX or linen module",
           optimizers="an optax GradientTransformation"),
    _Entry("numpy", "numpy", "mixedpolicy.backends.numpy_backend:NumpyAdapter"),
]

# Frameworks with a global dtype policy of their own, kept in step with mixedpolicy's.
_GLOBAL_POLICY_MODULES = ("keras",)

# The classes each framework's LossScaleOptimizer returns: an object can only be one
# once its module is loaded, so `isinstance` reads them from sys.modules (no import).
_WRAPPER_TYPES = (
    ("mixedpolicy.backends.torch_optimizer", "TorchLossScaleOptimizer"),
    ("mixedpolicy.backends.jax_optimizer", "LossScaleTransformation"),
    ("mixedpolicy.backends.keras_optimizer", "LossScaleOptimizer"),
)

_lock = threading.Lock()
_loaded: dict[str, Adapter] = {}
# Weak keys: classes made per object (torch.fx GraphModule) are not kept alive.
_by_type: "weakref.WeakKeyDictionary[type, tuple[Adapter | None, str | None]]" = weakref.WeakKeyDictionary()
# Containers are judged by their contents, so their answer is never cached per type.
_UNCACHED = (list, tuple, dict)


def _load(entry: _Entry) -> Adapter:
    adapter = _loaded.get(entry.name)
    if adapter is None:
        with _lock:
            adapter = _loaded.get(entry.name)
            if adapter is None:
                module_name, _, cls_name = entry.target.partition(":")
                adapter = getattr(importlib.import_module(module_name), cls_name)()
                _loaded[entry.name] = adapter
    return adapter


def _live_adapters() -> list[Adapter]:
    """The adapters whose framework is already imported, in priority order."""
    return [_load(e) for e in _ENTRIES if e.module in sys.modules]


def get_adapter(name: str) -> Adapter:
    """The adapter of the given name (importing its framework).

    Raises:
      ValueError: no adapter has that name.
    """
    for entry in _ENTRIES:
        if entry.name == name:
            return _load(entry)
    raise ValueError(f"Received backend name {name!r}; expected one of "
                     f"{[e.name for e in _ENTRIES]}.")


def adapter_names() -> list[str]:
    """The names of every adapter mixedpolicy ships, installed or not."""
    return [e.name for e in _ENTRIES]


def loss_scale_wrapper_types() -> tuple:
    """The wrapper classes of the frameworks whose wrapper module is loaded. Imports nothing."""
    return tuple(getattr(sys.modules[m], c) for m, c in _WRAPPER_TYPES if m in sys.modules)


def is_loss_scale_wrapper(obj: Any) -> bool:
    """Is `obj` what some framework's LossScaleOptimizer returned? Imports nothing."""
    return isinstance(obj, loss_scale_wrapper_types())


def _classify(obj: Any) -> tuple[Adapter | None, str | None]:
    cls = type(obj)
    hit = None if isinstance(obj, _UNCACHED) else _by_type.get(cls)
    if hit is None:
        hit = (None, None)
        for adapter in _live_adapters():
            if adapter.is_array(obj):
                hit = (adapter, "array")
                break
            role = adapter.role_of(obj)
            if role is not None:
                hit = (adapter, role)
                break
        if not isinstance(obj, _UNCACHED):
            try:
                _by_type[cls] = hit
            except TypeError:  # a class that takes no weak reference: not cached
                pass
    return hit


def adapter_for_array(x: Any) -> Adapter:
    """The adapter whose arrays `x` is; Python numbers are held by numpy."""
    adapter, role = _classify(x)
    if role == "array":
        return adapter
    return get_adapter("numpy")


def adapter_for_tree(tree: Any) -> Adapter:
    """The adapter of the first framework (in priority order) with an array among the leaves."""
    for adapter in _live_adapters():
        if any(adapter.is_array(leaf) for leaf in adapter.leaves(tree)):
            return adapter
    return get_adapter("numpy")


def adapter_for(obj: Any, role: str) -> Adapter | None:
    """The adapter that owns `obj` as a ``"model"`` or an ``"optimizer"``, or None."""
    adapter, found = _classify(obj)
    return adapter if found == role else None


def supported(role: str) -> str:
    """Words for an error message: the kinds of object mixedpolicy accepts in a role."""
    words = [e.models if role == "model" else e.optimizers for e in _ENTRIES]
    return "; ".join(w for w in words if w) or "none yet"


def optimizer_from_config(config: dict, custom_objects: Any = None) -> Any:
    """The LossScaleOptimizer an imported framework rebuilds from `config`.

    Raises:
      ValueError: no imported framework's adapter reads it.
    """
    for adapter in _live_adapters():
        wrapper = adapter.optimizer_from_config(config, custom_objects)
        if wrapper is not None:
            return wrapper
    raise ValueError(
        f"Received a config with keys {sorted(config)}, which no imported framework reads as a "
        f"LossScaleOptimizer config. Expected the get_config() of a Keras LossScaleOptimizer "
        f"(keys name, inner_optimizer, initial_scale, dynamic_growth_steps); import keras "
        f"first. torch wrappers restore with load_state_dict, optax ones from their state.")


def _register_keras_classes(keras: Any) -> None:
    """Right after `import keras`: registers the Keras LossScaleOptimizer (a saved model loads
    after `import mixedpolicy`) and loads the adapter, which tracks Keras's global policies."""
    importlib.import_module("mixedpolicy.backends.keras_optimizer")
    importlib.import_module("mixedpolicy.backends.keras_backend")


def cast_tree(tree: Any, dtype: str) -> Any:
    """Casts the floating leaves of `tree` to `dtype`; other leaves pass unchanged."""
    from mixedpolicy._dtypes import canonical_dtype

    dtype = canonical_dtype(dtype)
    return adapter_for_tree(tree).cast_tree(tree, dtype)


def global_policy_changed(policy: Any) -> None:
    """Tells every framework with a global dtype policy of its own, now or when it is imported."""
    from mixedpolicy.backends.import_hook import when_imported

    for adapter in _live_adapters():
        adapter.sync_global_policy(policy)
    for module in _GLOBAL_POLICY_MODULES:
        if module not in sys.modules:
            when_imported(module, _sync_imported)


def _sync_imported(module: Any) -> None:
    """Hands a framework imported after `set_global_policy` the global policy in force then."""
    # the global policy itself, not a policy_scope of the importing thread
    policy = sys.modules["mixedpolicy.scope"]._global
    for adapter in _live_adapters():
        adapter.sync_global_policy(policy)


def _install_import_hooks() -> None:
    from mixedpolicy.backends.import_hook import when_imported

    when_imported("keras", _register_keras_classes)


_install_import_hooks()
