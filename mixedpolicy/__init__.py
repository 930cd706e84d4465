"""mixedpolicy: one mixed-precision vocabulary for JAX, PyTorch, TensorFlow and Keras 3.

Importing mixedpolicy imports no framework; an adapter loads on first use, chosen
by the type of the object it is given.

>>> import mixedpolicy as mp
>>> mp.Policy("mixed_float16").needs_loss_scaling
True
"""

from mixedpolicy.adaprec import AdaPrec
from mixedpolicy.api import LossScaleOptimizer, apply_policy, describe, remove_policy
from mixedpolicy.table import LayerPolicy, PolicyTable
from mixedpolicy.function import PolicyFunction
from mixedpolicy.scope import global_policy, policy_scope, set_global_policy
from mixedpolicy.loss_scale import DynamicLossScale, LossScale, NoLossScale, StaticLossScale, all_finite
from mixedpolicy.policy import Policy
from mixedpolicy.policy_map import LayerInfo, PolicyMap, Resolution
from mixedpolicy.ranges import GradientReport, RangeStats, Recommendation, inspect_gradients

__version__ = "0.1.0"


def __getattr__(name: str):
    # mp.distributed, mp.jax and mp.tensorflow load on first use (mp.jax imports JAX,
    # mp.tensorflow TensorFlow)
    if name in ("distributed", "jax", "tensorflow", "codecs"):
        import importlib

        return importlib.import_module(f"mixedpolicy.{name}")
    raise AttributeError(f"module 'mixedpolicy' has no attribute {name!r}")

__all__ = [
    "AdaPrec",
    "DynamicLossScale",
    "GradientReport",
    "LayerInfo",
    "LayerPolicy",
    "LossScale",
    "LossScaleOptimizer",
    "NoLossScale",
    "Policy",
    "PolicyFunction",
    "PolicyMap",
    "PolicyTable",
    "RangeStats",
    "Recommendation",
    "Resolution",
    "StaticLossScale",
    "all_finite",
    "inspect_gradients",
    "apply_policy",
    "remove_policy",
    "describe",
    "global_policy",
    "policy_scope",
    "set_global_policy",
]
