"""A user's own model for the command line: ``MODULE:FACTORY``.

MODULE is an importable module path (``mypackage.models``) or a ``.py`` file
(``models.py``, ``path/to/models.py``); FACTORY is the name of a callable in it that takes no
arguments and returns the model (a torch.nn.Module, a Flax NNX module, a Keras 3 model): the
framework is inferred from what it returns. The model takes digits' 64 features to 10 logits;
or the factory returns a dict that brings the model with its own data and loss (`unpack`).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import itertools
import sys
from collections.abc import Iterable, Mapping
from typing import Any, Callable, NamedTuple


def load_factory(target: str) -> Callable[[], Any]:
    """The factory `target` names.

    Raises:
      ValueError: `target` is not MODULE:FACTORY, or FACTORY is not a callable of MODULE.
      ImportError: MODULE cannot be imported (its own error, with what was asked).
    """
    module_name, sep, factory = target.rpartition(":")
    if not sep or not module_name or not factory.isidentifier():
        raise ValueError(f"Received {target!r}; expected MODULE:FACTORY, e.g. mypackage.models:make_model "
                         f"or models.py:make_model (a callable that takes no arguments and returns the model).")
    if module_name.endswith(".py"):
        if not os.path.isfile(module_name):
            raise ValueError(f"Received {target!r}, but {module_name!r} is not a file.")
        spec = importlib.util.spec_from_file_location(os.path.basename(module_name)[:-3], module_name)
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, os.path.dirname(os.path.abspath(module_name)))
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.pop(0)
    else:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            raise ImportError(f"Received {target!r}, but {module_name!r} cannot be imported ({err}); "
                              f"give an importable module path or a .py file.") from None
    found = getattr(module, factory, None)
    if not callable(found):
        names = sorted(n for n in vars(module) if callable(vars(module)[n]) and not n.startswith("_"))
        more = f" and {len(names) - 12} more" if len(names) > 12 else ""
        raise ValueError(f"Received {target!r}, but {module_name} has no callable {factory!r}; its "
                         f"callables: {', '.join(names[:12]) or 'none'}{more}.")
    required = _required_arguments(found)
    if required:
        raise ValueError(f"Received {target!r}, whose {factory} requires the arguments "
                         f"{', '.join(required)}; expected a factory that takes no arguments and returns "
                         f"the model. Wrap it: def make(): return {factory}(...), and name that.")
    return found


def _required_arguments(factory: Callable) -> list[str]:
    """The names of the arguments `factory` cannot be called without (none where its signature
    cannot be read: a builtin's; calling it says what is missing)."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


#: The keys a factory's dict may hold (see `unpack`).
KEYS = ("model", "batch", "batches", "loss")
#: A factory's `batches` are read up to this many (an endless generator included).
MAX_BATCHES = 256


class UserSetup(NamedTuple):
    """What a user's factory gave: the model, and where it brings its own data the batches
    ((inputs, targets) pairs, cycled through in order) and the loss (None: cross entropy of
    the logits on class targets). `batches` None is the digits contract."""

    model: Any
    batches: list | None = None
    loss: Callable | None = None


def unpack(built: Any, target: str, named: str | None = None) -> UserSetup:
    """`built`, what the factory of `target` returned, as a `UserSetup`; `named`: how errors
    name the target (default ``--model TARGET``, the bench's and inspect's option).

    Raises:
      ValueError: a dict that breaks the contract: unknown or missing keys, both or neither of
        `batch` and `batches`, a batch that is not an (inputs, targets) pair, no batches, a
        `loss` that is not callable.
    """
    if not isinstance(built, Mapping):
        return UserSetup(built)
    where = f"Received {named or '--model ' + target}, whose factory returns a dict"
    unknown = [k for k in built if k not in KEYS]
    if unknown:
        raise ValueError(f"{where} with the keys {', '.join(map(repr, unknown))}; expected only "
                         f"{', '.join(map(repr, KEYS))} (see docs/benchmarks.md, 'Your own model').")
    if "model" not in built:
        raise ValueError(f"{where} without 'model'; give the model under 'model', and one (inputs, "
                         f"targets) pair under 'batch' or an iterable of them under 'batches'.")
    if ("batch" in built) == ("batches" in built):
        raise ValueError(f"{where} with {'both' if 'batch' in built else 'neither of'} 'batch' and "
                         f"'batches'; give one: 'batch': (inputs, targets), or 'batches': an iterable "
                         f"of such pairs (the bench cycles through them).")
    raw = [built["batch"]] if "batch" in built else built["batches"]
    if isinstance(raw, (str, bytes, Mapping)) or not isinstance(raw, Iterable) or hasattr(raw, "shape"):
        raise ValueError(f"{where} whose 'batches' is a {type(raw).__name__}; expected an iterable "
                         f"(a list, a generator, a DataLoader) of (inputs, targets) pairs.")
    batches = list(itertools.islice(raw, MAX_BATCHES))
    if not batches:
        raise ValueError(f"{where} whose 'batches' gave no batch; give at least one (inputs, targets) pair.")
    for i, pair in enumerate(batches):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            what = f"a {type(pair).__name__}" + (f" of length {len(pair)}" if isinstance(pair, (tuple, list)) else "")
            raise ValueError(f"{where} whose batch {i} is {what}; expected an (inputs, targets) pair: "
                             f"inputs as the model takes them (an array, a tuple of arrays passed "
                             f"positionally, a dict of arrays passed by name), targets as the loss takes them.")
    batches = [tuple(pair) for pair in batches]
    loss = built.get("loss")
    if loss is not None and not callable(loss):
        raise ValueError(f"{where} whose 'loss' is a {type(loss).__name__}; expected a callable "
                         f"loss(outputs, targets) returning a scalar, or no 'loss' (cross entropy of the "
                         f"logits on class targets).")
    return UserSetup(built["model"], batches, loss)


def build(target: str, **kwargs: Any) -> UserSetup:
    """Calls the factory of `target` (with `kwargs`, Flax's dtype arguments) and unpacks it."""
    return unpack(load_factory(target)(**kwargs), target)


def tree_map(fn: Callable, tree: Any) -> Any:
    """`fn` on every leaf of a batch's inputs or targets (dicts, tuples and lists walked)."""
    if isinstance(tree, Mapping):
        return {k: tree_map(fn, v) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        mapped = [tree_map(fn, v) for v in tree]
        return type(tree)(*mapped) if hasattr(tree, "_fields") else type(tree)(mapped)  # a namedtuple too
    return fn(tree)


def leaves(tree: Any) -> list:
    found: list = []
    tree_map(found.append, tree)
    return found


def call(model: Callable, inputs: Any, **kwargs: Any) -> Any:
    """A torch or Flax model on a batch's inputs: a dict by name, a tuple positionally, else as
    one argument. (A Keras model takes any structure as its one argument, as Keras calls it.)"""
    if isinstance(inputs, Mapping):
        return model(**inputs, **kwargs)
    if isinstance(inputs, tuple):
        return model(*inputs, **kwargs)
    return model(inputs, **kwargs)


def logits_of(outputs: Any) -> Any:
    """The logits in a model's outputs: an array itself, else an output object's or dict's
    ``logits`` (Hugging Face's), else a tuple's first item.

    Raises:
      ValueError: none of these.
    """
    if hasattr(outputs, "shape") and hasattr(outputs, "dtype"):
        return outputs
    found = outputs.get("logits") if isinstance(outputs, Mapping) else getattr(outputs, "logits", None)
    if found is None and isinstance(outputs, (tuple, list)) and outputs:
        found = outputs[0]
    if found is None or not hasattr(found, "shape"):
        raise ValueError(f"the model returns a {type(outputs).__name__}, with no logits the default loss "
                         f"(cross entropy on class targets) can read (an array, .logits, ['logits'] or a "
                         f"tuple's first item); give the factory's dict a 'loss': loss(outputs, targets).")
    return found


def tokens(inputs: Any) -> int | None:
    """Tokens in a batch whose inputs are one array of integer ids, (batch, length) or more
    dimensions (a language model's); None for any other inputs."""
    found = list(leaves(inputs))
    if len(found) != 1:
        return None
    dtype, shape = getattr(found[0], "dtype", None), getattr(found[0], "shape", None)
    kind = getattr(dtype, "kind", None) or ("i" if "int" in str(dtype) else None)
    return int(math.prod(shape)) if kind in ("i", "u") and shape is not None and len(shape) >= 2 else None


def batch_size(inputs: Any) -> int:
    """Samples in a batch: the leading dimension of its first input array."""
    for leaf in leaves(inputs):
        shape = getattr(leaf, "shape", None)
        if shape:
            return int(shape[0])
    return 1


def is_linen(model: Any) -> bool:
    """A Flax linen module (flax.linen imported already: nothing else is)."""
    linen = sys.modules.get("flax.linen")
    return linen is not None and isinstance(model, linen.Module)


def init_linen(model: Any, setup: UserSetup, target: str) -> None:
    """One ``init`` of a linen module (through the policy put on it) on the inputs of its
    factory's first batch: linen builds its layers only when called, so describe has nothing to
    list before."""
    if not setup.batches:
        raise ValueError(f"Received {target}, whose factory returns a Flax linen module: linen builds its "
                         f"layers at its first call, and describe has no inputs to call it on. Return "
                         f"{{'model': module, 'batch': (inputs, targets)}} from the factory: describe runs "
                         f"one init on the inputs.")
    import jax

    call(lambda *a, **k: model.init(jax.random.key(0), *a, **k), setup.batches[0][0])
