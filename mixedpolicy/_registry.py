"""The one table of frameworks, and the lookups that find a framework from an object's type.

Each row (`Entry`) names a framework's import gate and where its `ArrayOps`,
`ModelAdapter` and `OptimizerAdapter` live (``"module:Class"``, each optional). A
framework is never imported just to check: a row is only asked about an object once
its gate module is already in ``sys.modules`` (if it were not, the object could not
be one of its types). The answer is cached per type. Adding a framework is one folder
under ``mixedpolicy/backends/`` and one row here (docs/contributing.md).
"""

from __future__ import annotations

import importlib
import sys
import threading
import weakref
from typing import Any, NamedTuple

from mixedpolicy._adapter import ArrayOps, ModelAdapter, OptimizerAdapter
from mixedpolicy._import_hook import when_imported


class Entry(NamedTuple):
    name: str                 # what users and errors see
    gate: str                 # the top-level module that must be imported first
    arrays: str = ""          # "module:Class" of its ArrayOps
    models: str = ""          # ... of its ModelAdapter
    optimizers: str = ""      # ... of its OptimizerAdapter
    wrapper: str = ""         # "module:Class" its LossScaleOptimizer returns (isinstance)
    model_words: str = ""     # words for errors: the models it accepts
    optimizer_words: str = ""  # ... and the optimizers
    global_policy: str = ""   # "module:function" mirroring mixedpolicy's global policy
    on_import: tuple = ()     # modules to load right after the gate is imported
    pytree_ranges: str = ""   # "module:function": gradient ranges of a pytree of parameters
    conversions: str = ""     # the module with its policy conversions (to_keras, to_jmp, to_fsdp)
    float8_function: str = ""  # "module:function" calling a plain function with fp8 matmuls

_B = "mixedpolicy.backends"

# Order matters: the first row that claims an object wins. Keras comes before torch and
# tensorflow because a Keras 3 layer on the torch backend is also a torch.nn.Module.
# numpy comes last: other frameworks accept numpy leaves too.
ENTRIES: list[Entry] = [
    Entry("keras", "keras", models=f"{_B}.keras.layers:KerasModels",
          optimizers=f"{_B}.keras.optimizer:KerasOptimizers",
          wrapper=f"{_B}.keras.optimizer:LossScaleOptimizer",
          model_words="a Keras 3 layer or model",
          optimizer_words="a Keras 3 optimizer (any backend; TensorFlow's optimizers are Keras's)",
          global_policy=f"{_B}.keras.layers:sync_global_policy", conversions=f"{_B}.keras.layers",
          # the Keras LossScaleOptimizer is registered (a saved model loads after `import
          # mixedpolicy`) and Keras's global policies are tracked from the start
          on_import=(f"{_B}.keras.optimizer", f"{_B}.keras.layers")),
    Entry("torch", "torch", arrays=f"{_B}.torch.arrays:TorchArrays",
          models=f"{_B}.torch.modules:TorchModels", optimizers=f"{_B}.torch.optimizer:TorchOptimizers",
          wrapper=f"{_B}.torch.optimizer:TorchLossScaleOptimizer", conversions=f"{_B}.torch.reduce",
          on_import=(f"{_B}.torch.serialization",),
          model_words="a torch.nn.Module", optimizer_words="a torch.optim.Optimizer (or a list of them)"),
    Entry("tensorflow", "tensorflow", arrays=f"{_B}.tensorflow.arrays:TensorFlowArrays",
          models=f"{_B}.tensorflow.modules:TensorFlowModules", model_words="a tf.Module"),
    Entry("flax", "flax", models=f"{_B}.jax.flax:FlaxModels", model_words="a Flax NNX or linen module"),
    Entry("equinox", "equinox", models=f"{_B}.jax.equinox:EquinoxModels",
          model_words="an Equinox module"),
    Entry("optax", "optax", optimizers=f"{_B}.jax.optax:OptaxOptimizers",
          wrapper=f"{_B}.jax.optax:LossScaleTransformation",
          optimizer_words="an optax GradientTransformation"),
    Entry("jax", "jax", arrays=f"{_B}.jax.arrays:JaxArrays",
          # the loss scales become JAX pytrees (as jmp's are) as soon as JAX is imported
          on_import=(f"{_B}.jax.pytrees",), pytree_ranges=f"{_B}.jax.ranges:pytree_stats",
          conversions=f"{_B}.jax.arrays", float8_function=f"{_B}.jax.float8_function:call"),
    Entry("numpy", "numpy", arrays=f"{_B}.numpy.arrays:NumpyArrays"),
]

#: Lightning's two packages (their Callback classes differ), and what builds our callback for one
LIGHTNING_CALLBACKS = (("pytorch_lightning", f"{_B}.torch.lightning_callback:callback_class"),
                       ("lightning.pytorch", f"{_B}.torch.lightning_callback:callback_class"))

_lock = threading.Lock()
_loaded: dict[str, Any] = {}
# Weak keys: classes made per object (torch.fx GraphModule) are not kept alive.
_by_type: "weakref.WeakKeyDictionary[type, tuple[Any, str | None, str | None]]" = weakref.WeakKeyDictionary()
# Containers are judged by their contents, so their answer is never cached per type.
_UNCACHED = (list, tuple, dict)


def _load(target: str) -> Any:
    """The adapter object `target` ("module:Class") names, made once."""
    found = _loaded.get(target)
    if found is None:
        with _lock:
            found = _loaded.get(target)
            if found is None:
                module_name, _, cls_name = target.partition(":")
                found = getattr(importlib.import_module(module_name), cls_name)()
                _loaded[target] = found
    return found


def _live() -> list[Entry]:
    """The rows whose framework is already imported, in priority order."""
    return [e for e in ENTRIES if e.gate in sys.modules]


def array_backends() -> list[str]:
    """The names of every framework with arrays of its own, installed or not."""
    return [e.name for e in ENTRIES if e.arrays]


def entry(name: str) -> Entry:
    """The row of the given name.

    Raises:
      ValueError: no row has that name.
    """
    for e in ENTRIES:
        if e.name == name:
            return e
    raise ValueError(f"Received backend name {name!r}; expected one of {[e.name for e in ENTRIES]}.")


def array_ops(name: str) -> ArrayOps:
    """The array operations of the framework of the given name (importing it).

    Raises:
      ValueError: no framework of that name has arrays of its own.
    """
    e = entry(name)
    if not e.arrays:
        raise ValueError(f"Received backend name {name!r}, which computes on other frameworks' "
                         f"arrays; expected one of {array_backends()}.")
    return _load(e.arrays)


def _classify(obj: Any) -> tuple[Any, str | None, str | None]:
    """(adapter, role, the claiming entry's name) of `obj`; Nones where no entry claims it."""
    cls = type(obj)
    hit = None if isinstance(obj, _UNCACHED) else _by_type.get(cls)
    if hit is None:
        hit = (None, None, None)
        for e in _live():
            if e.arrays and _load(e.arrays).is_array(obj):
                hit = (_load(e.arrays), "array", e.name)
            elif e.models and _load(e.models).is_model(obj):
                hit = (_load(e.models), "model", e.name)
            elif e.optimizers and _load(e.optimizers).is_optimizer(obj):
                hit = (_load(e.optimizers), "optimizer", e.name)
            else:
                continue
            break
        if not isinstance(obj, _UNCACHED):
            try:
                _by_type[cls] = hit
            except TypeError:  # a class that takes no weak reference: not cached
                pass
    return hit


def array_ops_for(x: Any) -> ArrayOps:
    """The array operations `x` belongs to; Python numbers are numpy's."""
    ops, role, _ = _classify(x)
    return ops if role == "array" else array_ops("numpy")


def _tree_entry(tree: Any) -> Entry:
    """The framework's row with arrays among the leaves of `tree` (numpy's when none has).

    Raises:
      TypeError: arrays of two frameworks (a torch tensor among JAX arrays): one framework's
        casts would pass the other's arrays in their own precision without a word.
    """
    found = [e for e in _live() if e.arrays and e.name != "numpy"
             and any(map(_load(e.arrays).is_array, _load(e.arrays).leaves(tree)))]
    if len(found) > 1:
        raise TypeError(
            f"Received arrays of {' and '.join(e.name for e in found)} in one call; a policy casts "
            f"one framework's arrays, and would pass the others in their own precision. Convert them "
            f"to one framework first (jnp.asarray(t.numpy()), torch.from_numpy(np.asarray(a))...).")
    return found[0] if found else entry("numpy")


def imported_array_ops() -> list[ArrayOps]:
    """The array operations of every framework with arrays of its own that is imported now."""
    return [_load(e.arrays) for e in _live() if e.arrays]


def array_ops_for_tree(tree: Any) -> ArrayOps:
    """The first framework's (in priority order) with an array among the leaves of `tree`."""
    return _load(_tree_entry(tree).arrays)


def model_adapter(obj: Any) -> ModelAdapter | None:
    """The adapter that puts policies on `obj`, or None."""
    adapter, role, _ = _classify(obj)
    return adapter if role == "model" else None


def framework_of(obj: Any) -> str | None:
    """The name of the table's row that claims `obj` (its array, model or optimizer), or None:
    what callers show, instead of guessing a framework from class or module names."""
    return _classify(obj)[2]


def conversion(name: str, function: str) -> Any:
    """The policy conversion `function` of the framework `name` (its row's `conversions`
    module, imported now: the caller converts to that framework's objects)."""
    return _function(f"{entry(name).conversions}:{function}")


def pytree_range_stats() -> Any:
    """(name, function) of the first imported framework that takes gradient ranges of a pytree
    of parameters (JAX's), or None."""
    for e in _live():
        if e.pytree_ranges:
            return e.name, _function(e.pytree_ranges)
    return None


def optimizer_adapter(obj: Any) -> OptimizerAdapter | None:
    """The adapter that wraps `obj` with a loss scale, or None."""
    adapter, role, _ = _classify(obj)
    return adapter if role == "optimizer" else None


def supported(role: str) -> str:
    """Words for an error message: the kinds of object mixedpolicy accepts in a role."""
    words = [e.model_words if role == "model" else e.optimizer_words for e in ENTRIES]
    return "; ".join(w for w in words if w) or "none yet"


#: Frameworks' objects mixedpolicy does not take, told by their class's module, and the fix.
UNSUPPORTED_MODULES = ((("tf_keras", "tensorflow.python.keras", "keras.src.legacy", "tensorflow.keras."),
                        "a Keras 2 object ({where}); mixedpolicy supports Keras 3 (`import keras` with "
                        "keras>=3). Build the {role} with Keras 3, or use tf_keras's own mixed_precision "
                        "API with Keras 2."),)


def unsupported(cls: type, role: str) -> str | None:
    """Words for an error message where `cls` comes from a framework mixedpolicy does not take."""
    for prefixes, words in UNSUPPORTED_MODULES:
        if cls.__module__.startswith(prefixes):
            return words.format(where=f"{cls.__module__}.{cls.__qualname__}", role=role)
    return None


def loss_scale_wrapper_types() -> tuple:
    """The wrapper classes of the frameworks whose wrapper module is loaded. Imports nothing."""
    found = []
    for e in ENTRIES:
        module, _, cls = e.wrapper.partition(":")
        if module in sys.modules:
            found.append(getattr(sys.modules[module], cls))
    return tuple(found)


def is_loss_scale_wrapper(obj: Any) -> bool:
    """Is `obj` what some framework's LossScaleOptimizer returned? Imports nothing."""
    return isinstance(obj, loss_scale_wrapper_types())


def optimizer_from_config(config: dict, custom_objects: Any = None) -> Any:
    """The LossScaleOptimizer an imported framework rebuilds from `config`.

    Raises:
      ValueError: no imported framework reads it.
    """
    for e in _live():
        if e.optimizers:
            wrapper = _load(e.optimizers).optimizer_from_config(config, custom_objects)
            if wrapper is not None:
                return wrapper
    raise ValueError(
        f"Received a config with keys {sorted(config)}, which no imported framework reads as a "
        f"LossScaleOptimizer config. Expected the get_config() of a Keras LossScaleOptimizer "
        f"(keys name, inner_optimizer, initial_scale, dynamic_growth_steps); import keras "
        f"first. torch wrappers restore with load_state_dict, optax ones from their state.")


def float8_function(tree: Any) -> tuple[str, Any]:
    """(framework name, its function calling a plain function with fp8 matmuls, or None) of
    the first framework (in priority order) with an array among the leaves of `tree`."""
    e = _tree_entry(tree)
    return e.name, (_function(e.float8_function) if e.float8_function else None)


def float8_function_frameworks() -> list[str]:
    """The frameworks that run a plain function's matmuls in fp8, installed or not."""
    return [e.name for e in ENTRIES if e.float8_function]


def cast_tree(tree: Any, dtype: str) -> Any:
    """Casts the floating leaves of `tree` to `dtype`; other leaves pass unchanged."""
    from mixedpolicy._dtypes import canonical_dtype

    return array_ops_for_tree(tree).cast_tree(tree, canonical_dtype(dtype))


def _function(target: str) -> Any:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def lightning_callback_class() -> Any:
    """The loss-scale callback class of the Lightning packages already imported (a Callback of
    each), or None."""
    imported = [(gate, target) for gate, target in LIGHTNING_CALLBACKS if gate in sys.modules]
    if not imported:
        return None
    return _function(imported[0][1])(*(sys.modules[gate] for gate, _ in imported))


#: the global policy `set_global_policy` last told the table of (None: never set, the default)
_global_policy: Any = None


def global_policy_changed(policy: Any) -> None:
    """Tells every framework with a global dtype policy of its own, now or when it is imported."""
    global _global_policy
    _global_policy = policy
    for e in ENTRIES:
        if e.global_policy:
            if e.gate in sys.modules:
                _function(e.global_policy)(policy)
            else:
                when_imported(e.gate, _sync_imported)


def _sync_imported(module: Any) -> None:
    """Hands a framework imported after `set_global_policy` the global policy set then (the
    global one itself, not a policy_scope of the importing thread)."""
    for e in _live():
        if e.global_policy:
            _function(e.global_policy)(_global_policy)


def _load_on_import(module: Any) -> None:
    for e in ENTRIES:
        if e.gate == module.__name__:
            for name in e.on_import:
                importlib.import_module(name)


def install_import_hooks() -> None:
    """Loads each row's `on_import` modules when its framework is imported (at once where it
    already is). Called at the end of ``import mixedpolicy``, once the core those modules
    import exists: a framework imported before mixedpolicy would otherwise load them midway."""
    for e in ENTRIES:
        if e.on_import:
            when_imported(e.gate, _load_on_import)
    from mixedpolicy._dtypes import _teach_yaml

    when_imported("yaml", _teach_yaml)  # a policy's dtypes written as the strings they are
