"""Per-class subclasses whose ``__call__`` runs under a policy, for frameworks without a hook.

Where a framework gives no per-call hook (Flax NNX, ``tf.Module``), an adapter swaps
one module's class for a subclass with the same name and module, so ``isinstance``,
``repr`` and serialisation by class name behave as before, and undoes the swap by
restoring ``__class__``. One subclass is made per (adapter, class) and reused.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

_lock = threading.Lock()
_made: dict[tuple[str, type], type] = {}

#: call(module, call_super, args, kwargs) -> outputs
Call = Callable[[Any, Callable[..., Any], tuple, dict], Any]


def policy_subclass(owner: str, cls: type, call: Call) -> type:
    """The subclass of `cls` (made once per `owner`) whose ``__call__`` is `call`."""
    with _lock:
        sub = _made.get((owner, cls))
        if sub is None:
            def __call__(self, *args, **kwargs):
                return call(self, super(sub, self).__call__, args, kwargs)

            sub = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                              "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
            _made[(owner, cls)] = sub
    return sub
