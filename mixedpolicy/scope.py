"""The global policy and `policy_scope`.

The global policy is one value shared by every thread: `set_global_policy` in the
main thread is seen by data-loader and worker threads alike. `policy_scope`
overrides it for the current context only (a `contextvars.ContextVar`), so two
threads or two asyncio tasks can each hold a different scope without seeing the
other's.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

from mixedpolicy import _in_force
from mixedpolicy._registry import global_policy_changed
from mixedpolicy.policy import Policy, as_policy

_DEFAULT = Policy("float32")
_lock = threading.Lock()


def set_global_policy(policy: Any) -> None:
    """Sets the policy that layers and models built from now on follow.

    Frameworks with a global dtype policy of their own (Keras) are kept in step,
    whether they are imported before or after this call.

    Args:
      policy: a `Policy`, a policy name such as ``"mixed_float16"``, a config dict,
        a Keras or jmp policy; ``None`` restores the default, ``"float32"``.

    Raises:
      TypeError, ValueError: the policy is not one mixedpolicy understands.

    >>> set_global_policy("mixed_bfloat16")
    >>> global_policy()
    Policy('mixed_bfloat16')
    >>> set_global_policy(None)
    """
    new = _DEFAULT if policy is None else as_policy(policy)
    with _lock:
        _in_force.global_policy[0] = new
    global_policy_changed(new)


def global_policy() -> Policy:
    """Returns the policy in force here: the innermost `policy_scope`, else the global one."""
    return _in_force.current() or _DEFAULT


@contextlib.contextmanager
def policy_scope(policy: Any) -> Iterator[Policy]:
    """Makes `policy` the one `global_policy()` returns inside a ``with`` block.

    The scope belongs to the current thread or task; the global policy is left as
    it was and is in force again when the block exits, even on an exception.

    >>> with policy_scope("bf16-mixed") as p:
    ...     global_policy() is p
    True
    >>> global_policy()
    Policy('float32')
    """
    new = as_policy(policy)
    token = _in_force.scoped.set(new)
    try:
        yield new
    finally:
        _in_force.scoped.reset(token)
