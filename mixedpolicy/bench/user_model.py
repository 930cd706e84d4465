"""A user's own model for the command line: ``MODULE:FACTORY``.

MODULE is an importable module path (``mypackage.models``) or a ``.py`` file
(``models.py``, ``path/to/models.py``); FACTORY is the name of a callable in it that takes no
arguments and returns the model (a torch.nn.Module, a Flax NNX module, a Keras 3 model, a
tf.Module): the framework is inferred from what it returns.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any, Callable


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
        raise ValueError(f"Received {target!r}, but {module_name} has no callable {factory!r}; its "
                         f"callables: {', '.join(names[:12]) or 'none'}.")
    return found
