"""What NNX and linen modules share under a policy: a layer's kind, its dotted path, the cast of
a layer's outputs."""

from __future__ import annotations

from typing import Any

import jax

from mixedpolicy.backends.jax.arrays import cast_leaf
from mixedpolicy.policy_map import NORMALIZATION

NORM_NAMES = ("LayerNorm", "BatchNorm", "RMSNorm", "GroupNorm", "InstanceNorm", "SpectralNorm",
              "WeightNorm")


def layer_kind(cls: type, namespace: Any) -> str | None:
    """A normalization layer of `namespace` (``flax.nnx`` or ``flax.linen``), else None."""
    norms = tuple(getattr(namespace, n) for n in NORM_NAMES if hasattr(namespace, n))
    return NORMALIZATION if issubclass(cls, norms) else None


def dotted_path(keys: tuple) -> str:
    """A module path as the policy map's keys spell it: ``("blocks", 0, "linear")`` -> ``"blocks.0.linear"``."""
    return ".".join(str(k) for k in keys)


def cast_tree(tree: Any, dtype: str) -> Any:
    """The floating leaves of `tree` cast to `dtype`."""
    return jax.tree_util.tree_map(lambda x: cast_leaf(x, dtype), tree)
