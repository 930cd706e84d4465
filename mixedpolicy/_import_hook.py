"""Runs code right after a framework is imported, without importing it.

Two users: a framework with a global dtype policy of its own (Keras) is kept in
step when it is imported after `set_global_policy`: a finder on ``sys.meta_path``
waits for ``import keras`` and, right after the module has run, hands it the global
policy in force then. And the loss scales register as JAX pytrees as soon as JAX
is imported (`when_imported`), so they pass through ``jax.jit`` as jmp's do.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
import warnings
from typing import Any

_lock = threading.Lock()


class _Finder(importlib.abc.MetaPathFinder):
    """Finds `module_name` through the other finders and wraps its loader."""

    def __init__(self, module_name: str):
        self.module_name = module_name
        self.callbacks: list = []

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.module_name:
            return None
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, self)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    """Runs the real loader, then removes the finder and passes on the global policy."""

    def __init__(self, loader: Any, finder: _Finder):
        self._loader, self._finder = loader, finder

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        with _lock:
            if self._finder in sys.meta_path:
                sys.meta_path.remove(self._finder)
        for callback in self._finder.callbacks:
            try:
                callback(module)
            except Exception as err:  # noqa: BLE001 - never break the user's own import
                warnings.warn(f"mixedpolicy could not prepare {self._finder.module_name} after its "
                              f"import ({type(err).__name__}: {err}); mixedpolicy's support for it "
                              f"may be incomplete. Please report this with your versions.",
                              RuntimeWarning, stacklevel=2)


def when_imported(module_name: str, callback: Any) -> None:
    """Calls ``callback(module)`` once `module_name` is imported: now if it already is, else right after."""
    with _lock:
        module = sys.modules.get(module_name)
        if module is None:
            finder = next((f for f in sys.meta_path
                           if isinstance(f, _Finder) and f.module_name == module_name), None)
            if finder is None:
                finder = _Finder(module_name)
                sys.meta_path.insert(0, finder)
            if callback not in finder.callbacks:
                finder.callbacks.append(callback)
            return
    callback(module)
