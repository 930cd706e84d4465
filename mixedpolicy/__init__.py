"""mixedpolicy: one mixed-precision vocabulary for JAX, PyTorch, TensorFlow and Keras 3.

Importing mixedpolicy imports no framework; an adapter loads on first use, chosen
by the type of the object it is given.

>>> import mixedpolicy as mp
>>> mp.Policy("mixed_float16").needs_loss_scaling
True
"""

from mixedpolicy.adaprec import AdaPrec
from mixedpolicy.api import apply_policy, describe, remove_policy
from mixedpolicy.optimizer import LossScaleOptimizer
from mixedpolicy.table import LayerPolicy, PolicyTable
from mixedpolicy.function import PolicyFunction
from mixedpolicy.scope import global_policy, policy_scope, set_global_policy
from mixedpolicy.loss_scale import DynamicLossScale, LossScale, NoLossScale, StaticLossScale
from mixedpolicy.trees import all_finite, cast_to_full, cast_to_half, half_dtype, select_tree
from mixedpolicy.float8 import Float8Recipe
from mixedpolicy.policy import Policy
from mixedpolicy.policy_map import LayerInfo, PolicyMap, Resolution
from mixedpolicy.gradient_report import GradientReport, Recommendation, inspect_gradients
from mixedpolicy.ranges import RangeStats
from mixedpolicy.telemetry import LightningLossScaleCallback, metrics

import logging as _logging

from mixedpolicy import _registry

_logging.getLogger("mixedpolicy").addHandler(_logging.NullHandler())  # the application decides
_registry.install_import_hooks()  # after the core: the modules it loads import the core

__version__ = "0.1.0"


#: the extra that installs each framework a lazily loaded module needs
_EXTRAS = {"torch": "torch", "jax": "jax", "jaxlib": "jax", "optax": "jax", "flax": "jax",
           "ml_dtypes": "jax", "jmp": "jax", "tensorflow": "tensorflow", "keras": "keras"}


#: the submodules that load on first use as attributes (mp.jax...): the facades that import
#: a framework, and the codecs
_LAZY_MODULES = ("distributed", "torch", "jax", "tensorflow", "keras", "codecs", "lightning", "huggingface")


def __getattr__(name: str):
    # each loads on first use (the facades import their framework); a missing framework is
    # said with the extra that installs it
    if name in _LAZY_MODULES:
        import importlib

        try:
            return importlib.import_module(f"mixedpolicy.{name}")
        except ModuleNotFoundError as err:
            extra = _EXTRAS.get((err.name or "").split(".")[0])
            if extra is None:
                raise
            raise ImportError(f"mp.{name} needs {err.name}, which is not installed; install it with "
                              f"pip install \"mixedpolicy[{extra}]\".") from err
    raise AttributeError(f"module 'mixedpolicy' has no attribute {name!r}")

__all__ = [
    "AdaPrec",
    "DynamicLossScale",
    "Float8Recipe",
    "GradientReport",
    "LayerInfo",
    "LayerPolicy",
    "LightningLossScaleCallback",
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
    "select_tree",
    "cast_to_full",
    "cast_to_half",
    "half_dtype",
    "inspect_gradients",
    "metrics",
    "apply_policy",
    "remove_policy",
    "describe",
    "global_policy",
    "policy_scope",
    "set_global_policy",
]
