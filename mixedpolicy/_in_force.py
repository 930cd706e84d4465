"""The policy in force, kept below `policy` so that ``Policy()`` can read it: the innermost
`policy_scope`'s (a ``contextvars.ContextVar``, per thread and task), else the global one
(one value for every thread). `mixedpolicy.scope` sets both; None means the default,
float32."""

from __future__ import annotations

import contextvars
from typing import Any

scoped: contextvars.ContextVar[Any] = contextvars.ContextVar("mixedpolicy_policy_scope", default=None)
global_policy: list = [None]  # the Policy set_global_policy set, None for the default


def current() -> Any:
    """The scope's policy, else the global one; None where neither was set."""
    chosen = scoped.get()
    return global_policy[0] if chosen is None else chosen
